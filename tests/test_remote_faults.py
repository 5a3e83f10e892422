"""A remote server goes away under a running store, then comes back.

Each test gets servers of its own (the shared session servers are not touched). A hung server
(SIGSTOP) and a dead one (killed) must cost a `get` at most its timeout and a `put` nothing;
errors and timeouts are counted; once the server is back the tier resumes without a reopen.
The time bounds below are generous upper limits on "does not hang", not performance targets.
"""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest
import torch
from support import TEST_BUCKET, raw_s3_client, start_server

from kvstore import KVLayout, KVStore, StoreConfig
from kvstore.devtools.servers import DevServer, RedisClusterServer, RedisServer, SeaweedFSServer

LAYOUT = KVLayout(num_layers=4, num_kv_heads=2, head_dim=32, chunk_tokens=64, dtype=torch.bfloat16)
GET_TIMEOUT = 1.0
HANG_BOUND = 8.0  # seconds: far above the 1 s timeout, far below a hang


def chunk(i: int) -> torch.Tensor:
    return torch.randn(LAYOUT.chunk_shape, generator=torch.Generator().manual_seed(i)).to(LAYOUT.dtype)


def same(a: torch.Tensor | None, b: torch.Tensor) -> bool:
    return a is not None and torch.equal(a.view(torch.int16), b.view(torch.int16))


@pytest.fixture(params=["s3-seaweedfs", "redis", "redis-cluster"])
def remote(request, monkeypatch) -> tuple[str, DevServer, dict]:
    """A private server and the config section that points a store at it."""
    kind = request.param
    if kind == "s3-seaweedfs":
        server = start_server(SeaweedFSServer())
        raw_s3_client(server).create_bucket(Bucket=TEST_BUCKET)
        for name, value in server.credentials_env().items():
            monkeypatch.setenv(name, value)
        section = {"s3": {"enabled": True, "bucket": TEST_BUCKET, "max_attempts": 1, "connect_timeout": 0.5}}
    else:
        server = start_server(RedisClusterServer() if kind == "redis-cluster" else RedisServer())
        section = {"redis": {"enabled": True, "url": server.url, "cluster": kind == "redis-cluster"}}
        section["redis"]["connect_timeout"] = 0.5
    request.addfinalizer(server.close)
    return kind.split("-")[0], server, section


def config_for(section: dict) -> StoreConfig:
    return StoreConfig(
        dram={"capacity": LAYOUT.chunk_nbytes * 16},
        disk={"enabled": False},
        timeouts={"get": GET_TIMEOUT, "put": 2.0, "close": 3.0},
        **section,
    )


def keys_for(store: KVStore, seed: int, count: int = 3) -> list[str]:
    tokens = torch.randint(0, 30_000, (count * LAYOUT.chunk_tokens,), generator=torch.Generator().manual_seed(seed))
    return store.chunk_keys(tokens.tolist())


async def wait_for(condition, seconds: float = 30.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if await condition():
            return True
        await asyncio.sleep(0.2)
    return False


@pytest.mark.parametrize("fault", ["paused", "killed"])
async def test_server_lost_and_back(remote, fault: str):
    tier, server, section = remote
    namespace = f"faults-{uuid.uuid4().hex[:8]}"
    config = config_for(section)
    async with KVStore(config, LAYOUT, namespace) as writer, KVStore(config, LAYOUT, namespace) as reader:
        before = keys_for(writer, seed=1)
        for i, key in enumerate(before):
            assert await writer.put(key, chunk(i))
        await writer.flush()
        assert writer.stats()[tier]["writes"] == 3

        server.pause() if fault == "paused" else server.stop()
        try:
            # get: a miss within its timeout (the reader's DRAM is empty, so it must ask the server)
            started = time.monotonic()
            assert await reader.get(before[0]) is None
            assert time.monotonic() - started < HANG_BOUND
            assert await reader.lookup(before) == 0
            stats = reader.stats()[tier]
            assert stats["errors"] + stats["timeouts"] >= 1, stats

            # put: returns at once (DRAM only); the tier's write fails in the background, counted
            during = keys_for(writer, seed=2)
            started = time.monotonic()
            for i, key in enumerate(during):
                assert await writer.put(key, chunk(10 + i))
            assert time.monotonic() - started < HANG_BOUND
            await asyncio.wait_for(writer.flush(), HANG_BOUND * 2)
            stats = writer.stats()[tier]
            assert stats["errors"] + stats["timeouts"] >= 1, stats
            # and DRAM still serves what the writer put
            assert same(await writer.get(during[0]), chunk(10))
        finally:
            server.resume() if fault == "paused" else server.start()

        # The tier resumes on its own: new writes land and a fresh reader finds them.
        after = keys_for(writer, seed=3)
        for i, key in enumerate(after):
            assert await writer.put(key, chunk(20 + i))

        async def landed() -> bool:
            await writer.flush()
            return await reader.lookup(after) == 3

        if not await wait_for(landed):
            pytest.fail(f"{tier} tier did not resume: {writer.stats()[tier]}")

        async def served() -> bool:  # a server just back may still time out a read or two: a miss, never wrong
            got = await reader.get_many(after)
            assert all(kv is None or same(kv, chunk(20 + i)) for i, kv in enumerate(got))
            return all(kv is not None for kv in got)

        assert await wait_for(served), f"{tier} tier did not serve reads again: {reader.stats()[tier]}"
        if fault == "paused" or tier == "s3":  # data that survives the outage is still served
            assert same(await reader.get(before[1]), chunk(1))


async def test_store_starts_while_the_server_is_down(remote):
    """An engine must boot even if its archive is unreachable; the tier joins when it comes up."""
    tier, server, section = remote
    server.stop()
    config = config_for(section)
    try:
        started = time.monotonic()
        store = await asyncio.wait_for(KVStore(config, LAYOUT, f"boot-{uuid.uuid4().hex[:8]}").open(), HANG_BOUND)
        assert time.monotonic() - started < HANG_BOUND
    finally:
        server.start()
    try:
        attempt = iter(range(1000))

        async def landed() -> bool:  # writes that failed are not retried: each try puts a new chunk
            i = next(attempt)
            assert await store.put(keys_for(store, seed=100 + i, count=1)[0], chunk(30 + i))
            await store.flush()
            return store.stats()[tier]["writes"] >= 1

        if not await wait_for(landed, 60):
            pytest.fail(f"{tier} tier never joined: {store.stats()[tier]}")
    finally:
        started = time.monotonic()
        await store.close()
        assert time.monotonic() - started < HANG_BOUND
