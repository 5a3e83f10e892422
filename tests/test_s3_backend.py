"""S3-specific behaviour of S3Backend against real servers: moto (server mode) and SeaweedFS.

Put/get/exists/delete/list conformance is shared by every backend elsewhere; this module covers
multipart uploads, range reads, the log-time prefix lookup, addressing, credentials, retries
and timeouts. Faults come from a small aiohttp reverse proxy (real HTTP on 127.0.0.1) in front
of moto. A server that cannot start fails the tests that need it (no skips).
"""

from __future__ import annotations

import asyncio
import math
import os
import time
import traceback
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from botocore.exceptions import BotoCoreError, ClientError, ReadTimeoutError

from kvstore.backends import make_backend
from kvstore.backends.s3 import S3Backend
from kvstore.config import S3Config, TimeoutConfig
from kvstore.errors import S3BackendError
from kvstore.testing import listed_keys
from kvstore.testing.servers import MotoServer, S3Server, SeaweedFSServer

BUCKET = "kvstore-test"
SLOW_DOWN = (
    b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code>'
    b"<Message>Please reduce your request rate.</Message><RequestId>test</RequestId></Error>"
)
HANG_BOUND = 15.0  # generous upper bound for calls that must give up after read_timeout=1


def key(i: int) -> str:
    return f"{i:064x}"


# -- servers and credentials -----------------------------------------------------------------


@pytest.fixture(scope="session")
def moto_server() -> Iterator[MotoServer]:
    with MotoServer() as server:
        yield server


@pytest.fixture(scope="session")
def seaweedfs_server() -> Iterator[SeaweedFSServer]:
    with SeaweedFSServer() as server:
        yield server


@pytest.fixture(params=["moto", "seaweedfs"])
def server(request: pytest.FixtureRequest) -> S3Server:
    return request.getfixturevalue(f"{request.param}_server")


def use_credentials(monkeypatch: pytest.MonkeyPatch, access_key: str, secret_key: str) -> None:
    """Point the standard AWS chain at these keys and nothing else (no ~/.aws, no IMDS, no env endpoint)."""
    for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_REGION"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", access_key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret_key)
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("AWS_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", os.devnull)
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")


@pytest.fixture
def credentials(server: S3Server, monkeypatch: pytest.MonkeyPatch) -> S3Server:
    use_credentials(monkeypatch, server.access_key, server.secret_key)
    return server


@pytest.fixture
async def backend(credentials: S3Server) -> AsyncIterator[S3Backend]:
    """A backend on a fresh prefix of the shared test bucket (created on first use)."""
    store = S3Backend(
        BUCKET, prefix=f"t-{uuid.uuid4().hex[:12]}", endpoint_url=credentials.endpoint_url, create_bucket=True
    )
    await store.open()
    yield store
    await store.close()


# -- a fault-injecting reverse proxy in front of moto -------------------------------------------


class FaultProxy:
    """Forwards to ``upstream``; answers ``fail_next`` requests with 503 SlowDown, stalls while
    ``stall`` is set, rejects requests matching ``reject`` with a 400, and records what it saw."""

    _HOP = {"host", "content-length", "transfer-encoding", "connection", "keep-alive"}

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream
        self.fail_next = 0
        self.failed = 0
        self.stall = False
        self.delay = 0.0
        self.reject: Callable[[web.Request], bool] | None = None
        self.seen: list[tuple[str, str]] = []
        self.in_flight = self.max_in_flight = 0
        self._release = asyncio.Event()
        self._runner: web.AppRunner | None = None
        self._session: aiohttp.ClientSession | None = None
        self.url = ""

    async def start(self) -> FaultProxy:
        self._session = aiohttp.ClientSession(auto_decompress=False)
        app = web.Application(client_max_size=1 << 30)
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        host, port = self._runner.addresses[0][:2]
        self.url = f"http://{host}:{port}"
        return self

    async def stop(self) -> None:
        self._release.set()  # let stalled handlers finish so cleanup does not wait on them
        if self._runner is not None:
            await self._runner.cleanup()
        if self._session is not None:
            await self._session.close()

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        self.seen.append((request.method, request.path_qs))
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            body = await request.read()
            if self.stall:
                await self._release.wait()
                return web.Response(status=500)
            if self.delay:
                await asyncio.sleep(self.delay)
            if self.fail_next > 0:
                self.fail_next -= 1
                self.failed += 1
                return web.Response(status=503, body=SLOW_DOWN, content_type="application/xml")
            if self.reject is not None and self.reject(request):
                error = b"<Error><Code>InvalidArgument</Code><Message>rejected by the test</Message></Error>"
                return web.Response(status=400, body=error, content_type="application/xml")
            assert self._session is not None
            headers = {k: v for k, v in request.headers.items() if k.lower() not in self._HOP}
            async with self._session.request(
                request.method, self.upstream + request.path_qs, headers=headers, data=body
            ) as upstream:
                payload = await upstream.read()
                out = {k: v for k, v in upstream.headers.items() if k.lower() not in self._HOP}
                return web.Response(status=upstream.status, body=payload, headers=out)
        finally:
            self.in_flight -= 1


@pytest.fixture
async def proxy(moto_server: MotoServer, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[FaultProxy]:
    use_credentials(monkeypatch, moto_server.access_key, moto_server.secret_key)
    running = await FaultProxy(moto_server.endpoint_url).start()
    yield running
    await running.stop()


async def proxied_backend(proxy: FaultProxy, **options: Any) -> S3Backend:
    store = S3Backend(
        BUCKET, prefix=f"t-{uuid.uuid4().hex[:12]}", endpoint_url=proxy.url, create_bucket=True, **options
    )
    await store.open()
    return store


# -- multipart and ranges ----------------------------------------------------------------------


async def test_multipart_round_trip_and_ranges(backend: S3Backend) -> None:
    backend.multipart_threshold = 16 << 20  # below the 64 MiB default: 40 MiB goes up in 8 MiB parts
    header, payload = os.urandom(4096), os.urandom(40 << 20)
    data = header + payload
    await backend.set(key(1), [header, memoryview(payload)])
    assert backend.stats()["multipart_uploads"] == 1
    assert await backend.get(key(1)) == data
    start, end = (8 << 20) - 1000, (13 << 20) + 77  # crosses a part boundary
    assert await backend.get(key(1), (start, end)) == data[start:end]
    assert await backend.get(key(1), (len(data) - 10, len(data) + 100)) == data[-10:]
    assert await backend.get(key(1), (len(data) + 5, len(data) + 10)) == b""

    first, second = bytearray(12345), bytearray(len(data) - 12345)
    assert await backend.get_into(key(1), [memoryview(first), memoryview(second)]) == len(data)
    assert first + second == data
    short = bytearray(100)  # smaller buffers: the leading bytes, and the object's size
    assert await backend.get_into(key(1), [memoryview(short)]) == len(data)
    assert short == data[:100]
    assert await backend.get_into(key(2), [memoryview(short)]) is None
    assert await backend.get(key(2)) is None
    assert backend.bytes_uploaded == len(data) and backend.bytes_downloaded >= 2 * len(data)


async def _etag(store: S3Backend, name: str) -> str:
    """The stored object's ETag: a multipart upload's ends in ``-<number of parts>`` (S3's rule)."""
    return str((await store._call("head_object", Bucket=store.bucket, Key=store._name(name)))["ETag"]).strip('"')


async def test_the_multipart_threshold_from_the_config_splits_only_larger_objects(credentials: S3Server) -> None:
    """A Llama-3-8B-sized container (32 MiB) under the default threshold is one PUT; over a lowered one, parts."""
    llama_chunk = os.urandom(4096) + os.urandom(32 << 20)
    stores = []
    for threshold in (None, "20MiB"):  # None: the default (64 MiB)
        section = S3Config(
            bucket=BUCKET,
            prefix=f"t-{uuid.uuid4().hex[:12]}",
            endpoint_url=credentials.endpoint_url,
            create_bucket=True,
            part_size="12MiB",
            **({} if threshold is None else {"multipart_threshold": threshold}),
        )
        store = make_backend(section, TimeoutConfig())
        assert isinstance(store, S3Backend)
        stores.append(store)
        await store.open()
    whole, split = stores
    try:
        assert whole.multipart_threshold == 64 << 20 and split.multipart_threshold == 20 << 20
        for store in stores:
            await store.set(key(7), [llama_chunk[:4096], memoryview(llama_chunk)[4096:]])
            assert await store.get(key(7)) == llama_chunk
            first, rest = bytearray(5000), bytearray(len(llama_chunk) - 5000)
            assert await store.get_into(key(7), [memoryview(first), memoryview(rest)]) == len(llama_chunk)
            assert first + rest == llama_chunk
        assert whole.stats()["multipart_uploads"] == 0 and "-" not in await _etag(whole, key(7))
        assert split.stats()["multipart_uploads"] == 1 and (await _etag(split, key(7))).endswith("-3")  # 12+12+8
    finally:
        for store in stores:
            await store.close()


def test_a_multipart_threshold_out_of_s3_limits_is_refused() -> None:
    for bad in (1 << 20, 6 << 30):
        with pytest.raises(ValueError, match="multipart_threshold must lie within"):
            S3Backend(BUCKET, multipart_threshold=bad)


async def test_small_objects_go_up_in_one_put(backend: S3Backend) -> None:
    await backend.set(key(3), [memoryview(b"only part")])
    await backend.set(key(4), [b"a", bytearray(b"b"), memoryview(b"c")])
    await backend.set(key(5), [])
    assert backend.stats()["multipart_uploads"] == 0
    assert await backend.get(key(3)) == b"only part"
    assert await backend.get(key(4)) == b"abc"
    assert await backend.get(key(5)) == b""


async def test_failed_multipart_upload_is_aborted(proxy: FaultProxy) -> None:
    store = await proxied_backend(proxy, part_size=5 << 20, multipart_threshold=5 << 20)
    try:
        proxy.reject = lambda request: request.method == "PUT" and request.query.get("partNumber") == "2"
        with pytest.raises(ClientError):
            await store.set(key(6), [os.urandom(12 << 20)])
        assert any(method == "DELETE" and "uploadId=" in path for method, path in proxy.seen)
        assert not await store.exists(key(6))
        proxy.reject = None
        assert (await store._call("list_multipart_uploads", Bucket=BUCKET)).get("Uploads", []) == []
    finally:
        await store.close()


# -- prefix lookup -----------------------------------------------------------------------------


async def test_prefix_count_uses_log_requests(backend: S3Backend) -> None:
    keys = [key(1000 + i) for i in range(64)]
    bound = 2 + math.ceil(math.log2(len(keys)))

    async def count(expected: int, most: int) -> None:
        before = backend.requests
        assert await backend.prefix_count(keys) == expected
        assert backend.requests - before <= most

    await count(0, 2)
    assert await backend.prefix_count([]) == 0
    written = 0
    for present in (1, 2, 37, 63, 64):
        await asyncio.gather(*(backend.set(k, [b"x"]) for k in keys[written:present]))
        written = present
        await count(present, 1 if present == len(keys) else bound)
    assert await backend.prefix_count(keys[:1]) == 1
    assert await backend.prefix_count([key(999)]) == 0

    # A hole in the middle (one chunk evicted alone) is not seen: the count is an upper bound.
    await backend.delete(keys[10])
    assert await backend.prefix_count(keys) == 64
    assert await backend.get(keys[10]) is None


# -- addressing, credentials, errors -----------------------------------------------------------


async def test_path_style_addressing_with_an_endpoint(credentials: S3Server, monkeypatch: pytest.MonkeyPatch) -> None:
    urls: list[str] = []
    explicit = S3Backend(BUCKET, endpoint_url=credentials.endpoint_url, create_bucket=True)
    assert explicit.addressing_style == "path"
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", credentials.endpoint_url)  # the standard variable, no argument
    from_env = S3Backend(BUCKET, prefix="/env/", create_bucket=True)
    assert from_env.addressing_style == "path" and from_env.prefix == "env"
    for store in (explicit, from_env):
        await store.open()
        try:
            store._client.meta.events.register("before-send.s3", lambda request, **_: urls.append(request.url))
            await store.set(key(7), [b"path style"])
            assert await store.get(key(7)) == b"path style"
            assert await listed_keys(store) == [key(7)]
            await store.delete(key(7))
        finally:
            await store.close()
    assert urls and all(
        url.split("?")[0].rstrip("/").startswith(f"{credentials.endpoint_url}/{BUCKET}") for url in urls
    ), urls
    monkeypatch.delenv("AWS_ENDPOINT_URL_S3")
    assert S3Backend(BUCKET).addressing_style == "virtual"


async def test_prefixes_separate_and_strip(backend: S3Backend, credentials: S3Server) -> None:
    bare = S3Backend(BUCKET, prefix="", endpoint_url=credentials.endpoint_url)
    await bare.open()
    try:
        await backend.set(key(8), [b"a"])
        await backend.set(key(0xAB9), [b"b"])
        await bare.set(key(9), [b"c"])
        assert sorted(await listed_keys(backend)) == [key(8), key(0xAB9)]
        assert await listed_keys(backend, key(0xAB9)[:62]) == [key(0xAB9)]
        assert key(9) in await listed_keys(bare)  # other prefixes' objects hold a "/": skipped
        assert all("/" not in k for k in await listed_keys(bare))
        await bare.delete(key(9))
    finally:
        await bare.close()


async def test_listing_follows_pages(moto_server: MotoServer, monkeypatch: pytest.MonkeyPatch) -> None:
    use_credentials(monkeypatch, moto_server.access_key, moto_server.secret_key)
    store = S3Backend(BUCKET, prefix=uuid.uuid4().hex, endpoint_url=moto_server.endpoint_url, create_bucket=True)
    await store.open()
    try:
        keys = {key(i) for i in range(1010)}  # ListObjectsV2 pages hold 1000
        await asyncio.gather(*(store.set(k, [b""]) for k in keys))
        before = store.requests
        listed = {item.key async for page in store._scan_namespace("default") for item in page}  # one namespace
        assert listed == keys
        assert store.requests - before == 2
    finally:
        await store.close()


async def test_missing_bucket_is_a_clear_error(credentials: S3Server) -> None:
    store = S3Backend("kvstore-no-such-bucket", endpoint_url=credentials.endpoint_url)
    with pytest.raises(S3BackendError) as caught:
        await store.open()
    message = str(caught.value)
    assert "kvstore-no-such-bucket" in message and credentials.endpoint_url in message and "exist" in message
    assert credentials.secret_key not in message and credentials.secret_key not in repr(store)
    assert credentials.secret_key not in "".join(traceback.format_exception(caught.value))


async def test_wrong_credentials_are_an_error(
    seaweedfs_server: SeaweedFSServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    use_credentials(monkeypatch, seaweedfs_server.access_key, seaweedfs_server.secret_key)
    good = S3Backend(BUCKET, endpoint_url=seaweedfs_server.endpoint_url, create_bucket=True)
    await good.open()
    await good.set(key(10), [b"secret kv"])
    await good.close()

    wrong_secret = "not-the-secret-" + uuid.uuid4().hex
    use_credentials(monkeypatch, seaweedfs_server.access_key, wrong_secret)
    store = S3Backend(BUCKET, endpoint_url=seaweedfs_server.endpoint_url)
    with pytest.raises(S3BackendError) as caught:
        await asyncio.wait_for(store.open(), HANG_BOUND)
    assert "access denied" in str(caught.value) and wrong_secret not in str(caught.value)

    async def skip_check() -> None:
        pass

    monkeypatch.setattr(store, "_check_bucket", skip_check)  # a client with bad keys, past open()
    await store.open()
    try:
        for call in (
            store.get(key(10)),
            store.exists(key(10)),
            store.prefix_count([key(10)]),
            store.set(key(11), [b"x"]),
        ):
            with pytest.raises(ClientError) as failure:
                await asyncio.wait_for(call, HANG_BOUND)
            assert failure.value.response["ResponseMetadata"]["HTTPStatusCode"] == 403
            assert wrong_secret not in str(failure.value)
    finally:
        await store.close()


# -- retries, timeouts, concurrency ------------------------------------------------------------


async def test_throttling_is_retried_with_backoff(proxy: FaultProxy) -> None:
    store = await proxied_backend(proxy, max_attempts=3)
    try:
        proxy.fail_next = 2
        await store.set(key(12), [b"after two 503s"])
        assert proxy.failed == 2 and store.stats()["retries"] == 2
        proxy.fail_next = 2
        assert await store.get(key(12)) == b"after two 503s"
        assert proxy.failed == 4 and store.stats()["retries"] == 4

        proxy.fail_next = 4  # more than max_attempts (total tries, the first included): it surfaces, never None
        with pytest.raises(ClientError) as caught:
            await store.get(key(12))
        assert caught.value.response["Error"]["Code"] == "SlowDown"
        assert proxy.failed == 7 and store.stats()["retries"] == 6 and proxy.fail_next == 1
        proxy.fail_next = 0
        assert await store.get(key(12)) == b"after two 503s"
    finally:
        await store.close()


async def test_a_server_that_never_answers_times_out(proxy: FaultProxy) -> None:
    store = await proxied_backend(proxy, max_attempts=1, read_timeout=1.0)
    try:
        await store.set(key(13), [b"x"])
        proxy.stall = True
        for call in (store.get(key(13)), store.exists(key(13)), store.set(key(14), [b"y"])):
            started = time.monotonic()
            with pytest.raises(ReadTimeoutError):
                await asyncio.wait_for(call, HANG_BOUND)
            assert time.monotonic() - started < HANG_BOUND
    finally:
        started = time.monotonic()
        await store.close()
        assert time.monotonic() - started < 5.0


async def test_open_against_a_silent_server_returns_and_requests_fail(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """An engine must start while its archive is unreachable: open() warns, requests raise (counted above)."""
    use_credentials(monkeypatch, "AKIDEXAMPLE", "very-secret-value")

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read(1 << 20)  # accept, read, never answer

    server = await asyncio.start_server(silent, "127.0.0.1", 0)
    endpoint = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    try:
        store = S3Backend(BUCKET, endpoint_url=endpoint, max_attempts=1, read_timeout=1.0, connect_timeout=0.5)
        await asyncio.wait_for(store.open(), HANG_BOUND)
        try:
            assert "not reachable" in caplog.text and "very-secret-value" not in caplog.text
            with pytest.raises(BotoCoreError):
                await asyncio.wait_for(store.get(key(1)), HANG_BOUND)
        finally:
            await store.close()
    finally:
        server.close()


async def test_requests_are_bounded_by_max_concurrency(proxy: FaultProxy) -> None:
    store = await proxied_backend(proxy, max_concurrency=2)
    try:
        await store.set(key(15), [b"z"])
        proxy.delay, proxy.max_in_flight = 0.05, 0
        assert await asyncio.gather(*(store.get(k) for k in [key(15)] * 12 + [key(16)])) == [b"z"] * 12 + [None]
        assert proxy.max_in_flight == 2
    finally:
        await store.close()
