"""The servers ``kvstore bench --remote`` runs against, each with the raw client that is its baseline.

A :class:`Remote` describes one running server twice: as kvstore's tier (the backend a
``ChunkTier`` wraps, and the ``StoreConfig`` section that makes it a store's one tier) and as the
raw client a user would call without kvstore (:class:`RawRedis`: redis-py ``SET``/``GET``;
:class:`RawS3`: aiobotocore with the S3 tier's client settings and multipart policy). Both sides
get the same connection limit, so a benchmark compares code paths, not settings. :func:`serve`
starts the named dev servers (real processes on this machine, :mod:`kvstore.testing.servers`)
and stops them on exit; the measuring is :mod:`kvstore.bench.remote`'s.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterator, Sequence
from contextlib import AsyncExitStack, ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any

from kvstore.backends.base import Backend
from kvstore.bench.local import parse_names
from kvstore.config import S3Config
from kvstore.testing.servers import MotoServer, RedisServer, S3Server, SeaweedFSServer, environment

REMOTES = ("redis", "moto", "seaweedfs")
BUCKET = "kvstore-bench"
S3_DEFAULTS = S3Config()  # the S3 tier's multipart threshold and part size, as a user gets them
MULTIPART_THRESHOLD, PART_SIZE = int(S3_DEFAULTS.multipart_threshold), int(S3_DEFAULTS.part_size)


class RawRedis:
    """redis-py asyncio as a user would call it: SET / GET of whole values (hiredis parses replies)."""

    label = ("redis-py SET", "redis-py GET")

    def __init__(self, client: Any):
        self.client = client

    async def put(self, name: str, data: bytes) -> None:
        await self.client.set(name, data)

    async def get(self, name: str) -> bytes:
        data: bytes | None = await self.client.get(name)
        if data is None:
            raise RuntimeError(f"raw redis GET lost {name}")
        return data

    async def delete(self, name: str) -> None:
        await self.client.delete(name)


class RawS3:
    """aiobotocore with the S3 tier's client settings and multipart policy, every request under one limit."""

    label = ("aiobotocore put_object", "aiobotocore get_object")

    def __init__(self, client: Any, concurrency: int):
        self.client = client
        self.limit = asyncio.Semaphore(concurrency)

    async def put(self, name: str, data: bytes) -> None:
        if len(data) < MULTIPART_THRESHOLD:
            async with self.limit:
                await self.client.put_object(Bucket=BUCKET, Key=name, Body=data)
            return
        async with self.limit:
            upload_id = (await self.client.create_multipart_upload(Bucket=BUCKET, Key=name))["UploadId"]

        async def part(number: int, start: int) -> dict[str, Any]:
            async with self.limit:
                body = data[start : start + PART_SIZE]  # bytes: botocore wants bytes, slicing copies
                answer = await self.client.upload_part(
                    Bucket=BUCKET, Key=name, UploadId=upload_id, PartNumber=number, Body=body
                )
            return {"PartNumber": number, "ETag": answer["ETag"]}

        parts = await asyncio.gather(*(part(i + 1, s) for i, s in enumerate(range(0, len(data), PART_SIZE))))
        async with self.limit:
            await self.client.complete_multipart_upload(
                Bucket=BUCKET, Key=name, UploadId=upload_id, MultipartUpload={"Parts": list(parts)}
            )

    async def get(self, name: str) -> bytes:
        async with self.limit:
            answer = await self.client.get_object(Bucket=BUCKET, Key=name)
            async with answer["Body"] as body:
                return await body.read()  # type: ignore[no-any-return]

    async def delete(self, name: str) -> None:
        async with self.limit:
            await self.client.delete_object(Bucket=BUCKET, Key=name)


RawClient = RawRedis | RawS3


@dataclass
class Remote:
    """One running server: how to make the tier's backend and the raw client for it."""

    name: str
    make_backend: Callable[[], Backend]
    open_raw: Callable[[AsyncExitStack], Awaitable[RawClient]]
    settings: dict[str, Any]  # StoreConfig keyword arguments enabling this server as the store's one tier


def _redis_remote(server: RedisServer, concurrency: int) -> Remote:
    """A running redis-server as a Remote: RedisBackend, and redis-py for the raw side."""
    from redis.asyncio import Redis

    from kvstore.backends.redis import RedisBackend

    async def open_raw(stack: AsyncExitStack) -> RawClient:
        client = Redis.from_url(server.url, max_connections=concurrency)
        stack.push_async_callback(client.aclose)
        return RawRedis(client)

    settings = {"redis": {"enabled": True, "url": server.url, "prefix": "bench", "max_connections": concurrency}}
    return Remote(
        "redis", lambda: RedisBackend(server.url, prefix="bench", max_connections=concurrency), open_raw, settings
    )


def _s3_remote(server: S3Server, concurrency: int) -> Remote:
    """A running S3 server as a Remote: S3Backend, and aiobotocore with the same settings for the raw side."""
    from aiobotocore.config import AioConfig
    from aiobotocore.session import AioSession

    from kvstore.backends.s3 import S3Backend

    def make_backend() -> Backend:
        return S3Backend(
            BUCKET,
            prefix="bench",
            endpoint_url=server.endpoint_url,
            region=server.region,
            addressing_style="path",
            max_concurrency=concurrency,
            multipart_threshold=MULTIPART_THRESHOLD,
            part_size=PART_SIZE,
            create_bucket=True,
        )

    async def open_raw(stack: AsyncExitStack) -> RawClient:
        config = AioConfig(  # what S3Backend configures: the comparison is of the code paths, not settings
            max_pool_connections=concurrency,
            s3={"addressing_style": "path"},
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
        )
        client = await stack.enter_async_context(
            AioSession().create_client(
                "s3",
                endpoint_url=server.endpoint_url,
                region_name=server.region,
                aws_access_key_id=server.access_key,
                aws_secret_access_key=server.secret_key,
                config=config,
            )
        )
        return RawS3(client, concurrency)

    settings = {
        "s3": {
            "enabled": True,
            "bucket": BUCKET,
            "prefix": "bench",
            "endpoint_url": server.endpoint_url,
            "region": server.region,
            "addressing_style": "path",
            "max_concurrency": concurrency,
            "create_bucket": True,
        }
    }
    return Remote(server.name, make_backend, open_raw, settings)


@contextmanager
def serve(names: Sequence[str], concurrency: int) -> Iterator[list[Remote]]:
    """Start the named dev servers (a ServerError if one cannot start) and describe each as a Remote."""
    with ExitStack() as stack:
        remotes = []
        for name in names:
            if name == "redis":
                remotes.append(_redis_remote(stack.enter_context(RedisServer()), concurrency))
            elif name in ("moto", "seaweedfs"):
                server: S3Server = stack.enter_context(MotoServer() if name == "moto" else SeaweedFSServer())
                remotes.append(_s3_remote(server, concurrency))
            else:
                raise ValueError(f"unknown remote {name!r}; choose from {', '.join(REMOTES)} or all")
        # S3Backend takes credentials only from the AWS chain: point it at the dev servers' (restored after)
        env = {"AWS_ACCESS_KEY_ID": S3Server.access_key, "AWS_SECRET_ACCESS_KEY": S3Server.secret_key}
        stack.enter_context(environment(env))
        yield remotes


def parse_remotes(text: str) -> list[str]:
    """The --remote servers (comma-separated, or ``all``); ValueError naming an unknown one."""
    return parse_names(text, REMOTES, "remote(s)")
