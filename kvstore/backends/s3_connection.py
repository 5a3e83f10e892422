"""The S3 tier's connection: the aiobotocore client, its endpoint and addressing, retries, the request limit.

:class:`S3Connection` is what the tier's data path (:mod:`kvstore.backends.s3`), its multipart
uploads (:mod:`kvstore.backends.s3_multipart`) and its operator side
(:mod:`kvstore.backends.s3_maintenance`) send their requests through. Its contract:

- Works with AWS and with path-style servers (MinIO, SeaweedFS, moto, LocalStack): "auto"
  addressing means path style whenever a custom endpoint is configured (LMCache #3376), as an
  argument or in the standard AWS_ENDPOINT_URL[_S3] variables.
- Credentials come only from the standard AWS chain (environment, ~/.aws, instance roles);
  they never appear in logs, errors or ``repr``.
- Every request runs under one semaphore (``max_concurrency``, also the connection pool size);
  botocore's "standard" retry mode backs off exponentially on throttling and 5xx answers, at
  most ``max_attempts`` tries in all. Requests and botocore's retries are counted.
- ``open()`` checks the bucket (HeadBucket; CreateBucket if ``create_bucket``), so a wrong name or
  key fails at start with a clear error; a server that is unreachable now only earns a warning.
- Objects live at ``<prefix>/<namespace>/<chunk key>``.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
from contextlib import AsyncExitStack
from typing import Any, Literal

from aiobotocore.config import AioConfig
from aiobotocore.session import AioSession
from botocore.exceptions import BotoCoreError, ClientError

from kvstore.errors import BucketMissing, S3BackendError
from kvstore.keys import DEFAULT_NAMESPACE, is_namespace_dir

log = logging.getLogger("kvstore.s3")

CHUNK_KEY = re.compile(r"[0-9a-f]{8,128}")
"""What a chunk key looks like: the last part of a chunk object's name."""
MISSING_CODES = {"NoSuchKey", "404", "NotFound"}
"""The error codes of a request for an absent object."""


class S3Connection:
    """One bucket (and a prefix in it) through one client; see the module docstring."""

    def __init__(
        self,
        bucket: str,
        *,
        prefix: str = "kvstore",
        endpoint_url: str | None = None,
        region: str | None = None,
        addressing_style: Literal["auto", "path", "virtual"] = "auto",
        max_concurrency: int = 16,
        max_attempts: int = 4,
        connect_timeout: float = 2.0,
        read_timeout: float = 30.0,
        create_bucket: bool = False,
        namespace: str = DEFAULT_NAMESPACE,
    ) -> None:
        if max_concurrency < 1 or max_attempts < 1:
            raise ValueError("max_concurrency and max_attempts must be at least 1")
        self.bucket, self.prefix, self.endpoint_url, self.region = bucket, prefix.strip("/"), endpoint_url, region
        self.create_bucket = create_bucket
        self.connect_timeout = connect_timeout
        if addressing_style == "auto":  # custom servers rarely resolve bucket.host names (LMCache #3376)
            addressing_style = "path" if endpoint_url or endpoint_from_environment() else "virtual"
        self.addressing_style = addressing_style
        self._config = AioConfig(
            connect_timeout=connect_timeout,
            read_timeout=read_timeout,
            # Exponential backoff on 5xx and throttling. botocore's own "max_attempts" counts retries
            # only; "total_max_attempts" counts the first try too, as our max_attempts does.
            retries={"total_max_attempts": max_attempts, "mode": "standard"},
            max_pool_connections=max_concurrency,
            s3={"addressing_style": addressing_style},
            # Containers carry per-layer checksums (and SigV4 hashes payloads over plain HTTP), so
            # transport CRCs would only cost CPU; "when_required" also suits servers that lack them.
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
        )
        if not is_namespace_dir(namespace):
            raise ValueError(f"{namespace!r} is not a namespace directory name (see kvstore.keys.namespace_dir)")
        self.namespace = namespace
        self._base = f"{self.prefix}/" if self.prefix else ""  # every namespace's objects are below it
        self._own = f"{self._base}{namespace}/"  # this namespace's objects
        self._limit = asyncio.Semaphore(max_concurrency)
        self._stack: AsyncExitStack | None = None
        self._client: Any = None
        self.requests = self.retries = self.multipart_uploads = 0
        self.bytes_uploaded = self.bytes_downloaded = 0

    # -- lifecycle ---------------------------------------------------------------------------

    async def open(self) -> None:
        session = AioSession()
        region = self.region or os.environ.get("AWS_REGION") or session.get_config_variable("region") or "us-east-1"
        stack = AsyncExitStack()
        try:
            self._client = await stack.enter_async_context(
                session.create_client("s3", region_name=region, endpoint_url=self.endpoint_url, config=self._config)
            )
            self._stack = stack
            await self._check_bucket()
        except BaseException:
            self._stack = None
            await stack.aclose()
            self._client = None
            raise
        log.info("s3 tier: bucket %s at %s, prefix %r", self.bucket, self._endpoint(), self.prefix)

    async def _check_bucket(self) -> None:
        """HeadBucket (creating the bucket if asked), so a wrong name or key fails at start, clearly."""
        where = f"S3 bucket {self.bucket!r} at {self._endpoint()}"
        try:
            async with asyncio.timeout(self.connect_timeout * 3):  # an engine's start is not held hostage
                await self._call("head_bucket", Bucket=self.bucket)
            return
        except ClientError as exc:
            status, code = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode"), error_code(exc)
            if status in (401, 403):
                raise S3BackendError(f"{where}: access denied ({code}); check the AWS credentials") from None
            if status != 404:
                raise S3BackendError(f"{where}: HeadBucket failed ({code}, HTTP {status})") from None
        except (BotoCoreError, OSError, TimeoutError) as exc:
            # Unreachable now: the engine still starts, requests fail (counted) until the server is back.
            log.warning("s3 tier: %s is not reachable yet (%s); will keep trying", where, type(exc).__name__)
            return
        if not self.create_bucket:
            raise BucketMissing(
                f"{where} does not exist: create it, or let the store create it with s3.create_bucket = true "
                "(KVSTORE_S3__CREATE_BUCKET=true)"
            )
        try:
            region = self._client.meta.region_name
            where_to = {} if region == "us-east-1" else {"CreateBucketConfiguration": {"LocationConstraint": region}}
            await self._call("create_bucket", Bucket=self.bucket, **where_to)
            log.info("s3 tier: created bucket %s", self.bucket)
        except ClientError as exc:
            if error_code(exc) not in ("BucketAlreadyOwnedByYou", "BucketAlreadyExists"):
                raise

    async def close(self) -> None:
        stack, self._stack, self._client = self._stack, None, None
        if stack is not None:
            await stack.aclose()

    def _endpoint(self) -> str:
        if self._client is not None:
            return str(self._client.meta.endpoint_url)
        return self.endpoint_url or "(default AWS endpoint)"

    # -- requests ----------------------------------------------------------------------------

    def _name(self, key: str) -> str:
        if not CHUNK_KEY.fullmatch(key):
            raise ValueError(f"s3 keys are 8-128 lowercase hex characters, got {key!r}")
        return self._own + key

    async def _call(self, operation: str, **params: Any) -> dict[str, Any]:
        """One API call under the concurrency limit, counted (with botocore's retries)."""
        async with self._limit:
            return await self._send(operation, **params)

    async def _send(self, operation: str, **params: Any) -> dict[str, Any]:
        if self._client is None:
            raise RuntimeError("S3Backend is not open")
        self.requests += 1
        try:
            response: dict[str, Any] = await getattr(self._client, operation)(**params)
        except ClientError as exc:
            self.retries += exc.response.get("ResponseMetadata", {}).get("RetryAttempts", 0)
            raise
        self.retries += response.get("ResponseMetadata", {}).get("RetryAttempts", 0)
        return response


def error_code(exc: ClientError) -> str | None:
    """The S3 error code of a failed request (``NoSuchKey``, ``InvalidRange``, ...)."""
    return exc.response.get("Error", {}).get("Code")


def endpoint_from_environment() -> bool:
    """Whether botocore will take a custom S3 endpoint from the environment (AWS_ENDPOINT_URL[_S3])."""
    if os.environ.get("AWS_IGNORE_CONFIGURED_ENDPOINT_URLS", "").lower() == "true":
        return False
    return bool(os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL"))
