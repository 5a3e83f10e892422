"""One suite, every secondary tier: disk, S3 on moto and on SeaweedFS, Redis, Redis Cluster.

The suite itself is a product (:mod:`kvstore.testing.conformance`, for third-party backends too);
here each backend runs it against its real server over the network (or a real directory). The
"raw" side of each case reaches under kvstore with the server's own client, to plant corrupt,
truncated or foreign objects exactly where kvstore will look for them. The in-memory backend
runs it too: proof of the suite (and of the Backend defaults), never of a server.
"""

from __future__ import annotations

import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import redis
import redis.cluster
from support import TEST_BUCKET, raw_s3_client

from kvstore.backends.base import Backend
from kvstore.backends.disk import DiskBackend
from kvstore.backends.redis import RedisBackend
from kvstore.backends.s3 import S3Backend
from kvstore.testing import MemoryBackend
from kvstore.testing.conformance import BackendCase, BackendTests, keys_for
from kvstore.testing.servers import S3Server


def unique_prefix() -> str:
    """Each test its own objects on the shared servers."""
    return f"conformance-{uuid.uuid4().hex[:10]}"


class TestDisk(BackendTests):
    @pytest.fixture
    def case(self, tmp_path: Path, executor: ThreadPoolExecutor) -> BackendCase:
        root = tmp_path / "disk"

        def disk_file(key: str) -> Path:
            return root / "default" / key[:2] / key[2:4] / f"{key}.kvc"

        def disk_put(key: str, data: bytes) -> None:
            disk_file(key).parent.mkdir(parents=True, exist_ok=True)
            disk_file(key).write_bytes(data)

        return BackendCase(
            lambda: DiskBackend(root, 1 << 30, executor=executor),
            lambda key: disk_file(key).read_bytes() if disk_file(key).exists() else None,
            disk_put,
        )


def s3_case(server: S3Server, monkeypatch: pytest.MonkeyPatch) -> BackendCase:
    for name, value in server.credentials_env().items():  # the standard AWS chain, as users set it
        monkeypatch.setenv(name, value)
    client, prefix = raw_s3_client(server), unique_prefix()

    def s3_get(key: str) -> bytes | None:
        try:
            return client.get_object(Bucket=TEST_BUCKET, Key=f"{prefix}/default/{key}")["Body"].read()
        except client.exceptions.NoSuchKey:
            return None

    return BackendCase(
        lambda: S3Backend(TEST_BUCKET, prefix=prefix, endpoint_url=server.endpoint_url, read_timeout=10),
        s3_get,
        lambda key, data: client.put_object(Bucket=TEST_BUCKET, Key=f"{prefix}/default/{key}", Body=data),
    )


class TestS3OnMoto(BackendTests):
    @pytest.fixture
    def case(self, moto_server: S3Server, monkeypatch: pytest.MonkeyPatch) -> BackendCase:
        return s3_case(moto_server, monkeypatch)


class TestS3OnSeaweedFS(BackendTests):
    @pytest.fixture
    def case(self, seaweedfs_server: S3Server, monkeypatch: pytest.MonkeyPatch) -> BackendCase:
        return s3_case(seaweedfs_server, monkeypatch)


def redis_case(url: str, cluster: bool, request: pytest.FixtureRequest) -> BackendCase:
    raw = redis.cluster.RedisCluster.from_url(url) if cluster else redis.Redis.from_url(url)
    request.addfinalizer(raw.close)
    prefix = unique_prefix()
    return BackendCase(
        lambda: RedisBackend(url, cluster=cluster, prefix=prefix),
        lambda key: raw.get(f"{prefix}:default:{key}"),
        lambda key, data: raw.set(f"{prefix}:default:{key}", data),
    )


class TestRedis(BackendTests):
    @pytest.fixture
    def case(self, redis_server, request: pytest.FixtureRequest) -> BackendCase:
        return redis_case(redis_server.url, False, request)


class TestRedisCluster(BackendTests):
    @pytest.fixture
    def case(self, redis_cluster, request: pytest.FixtureRequest) -> BackendCase:
        return redis_case(redis_cluster.url, True, request)


class TestMemory(BackendTests):
    """Only the abstract methods, so every Backend default runs the suite."""

    @pytest.fixture
    def case(self) -> BackendCase:
        objects: dict[str, bytes] = {}  # one "server" for every instance the case makes
        return BackendCase(lambda: MemoryBackend(objects), objects.get, objects.__setitem__)

    @pytest.mark.asyncio
    async def test_list_keys(self, backend: Backend) -> None:
        """The operator's tools cannot list it: it says so rather than listing nothing."""
        await backend.set(keys_for(1)[0], [b"x"])
        with pytest.raises(NotImplementedError, match="listed"):
            [page async for page in backend.scan()]
