"""A remote server goes away under a running store, then comes back.

Each test gets servers of its own (the shared session servers are not touched). A hung server
(SIGSTOP) and a dead one (killed) must cost a `get` at most its timeout and a `put` nothing;
errors and timeouts are counted; once the server is back the tier resumes without a reopen.
The time bounds below are generous upper limits on "does not hang", not performance targets.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid

import pytest
import torch
from support import TEST_BUCKET, raw_s3_client, start_server

from kvstore import KVLayout, KVStore, StoreConfig
from kvstore.testing.servers import DevServer, RedisClusterServer, RedisServer, SeaweedFSServer

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

        # The tier resumes on its own: new writes land and a fresh reader finds them. Writes made while
        # the tier's circuit breaker is still open (until its probe) are dropped, not retried: each try
        # puts new chunks.
        attempt = iter(range(1000))
        after: list[str] = []

        async def landed() -> bool:
            nonlocal after
            after = keys_for(writer, seed=1000 + next(attempt))
            for i, key in enumerate(after):
                assert await writer.put(key, chunk(20 + i))
            await writer.flush()
            return await reader.lookup(after) == 3

        if not await wait_for(landed, 60):
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


async def test_breaker_skips_a_frozen_redis_above_s3_and_a_probe_closes_it(
    request, seaweedfs_server, monkeypatch, caplog
):
    """Redis frozen (SIGSTOP) above S3: once its breaker is open, chunks S3 holds are served without
    waiting for Redis's timeout (the count of Redis timeouts stops growing); resumed, a probe closes it.

    The reader's breaker runs on a clock the test moves, so whether a probe happens never depends on timing.
    """
    redis = start_server(RedisServer())
    request.addfinalizer(redis.close)
    for name, value in seaweedfs_server.credentials_env().items():
        monkeypatch.setenv(name, value)
    config = StoreConfig(
        dram={"capacity": LAYOUT.chunk_nbytes * 16},
        disk={"enabled": False},
        redis={"enabled": True, "url": redis.url, "connect_timeout": 0.5},
        s3={"enabled": True, "bucket": TEST_BUCKET, "max_attempts": 1, "connect_timeout": 0.5},
        timeouts={"get": 4.0, "put": 5.0, "close": 5.0},  # S3 must answer within them on a busy machine
        breaker={
            "failures": 1,
            "backoff": 0.2,
            "backoff_max": 0.4,
        },  # one timeout opens it (the count: test_breaker.py)
    )
    namespace = f"breaker-{uuid.uuid4().hex[:8]}"
    async with KVStore(config, LAYOUT, namespace) as writer:
        keys = keys_for(writer, seed=7, count=8)
        for i, key in enumerate(keys):
            assert await writer.put(key, chunk(i))
        await writer.flush()
        assert (writer.stats()["redis"]["writes"], writer.stats()["s3"]["writes"]) == (8, 8), writer.stats()

    now = [0.0]
    async with KVStore(config, LAYOUT, namespace) as reader:
        redis_tier = reader.tiers[0]
        assert [tier.name for tier in reader.tiers] == ["redis", "s3"]
        redis_tier.breaker.clock = lambda: now[0]
        redis.pause()
        try:
            # This call waits on the frozen Redis; its one deadline (timeouts.get) is spent there, so
            # S3 is left no time: a miss, never wrong data.
            first = await reader.get(keys[0])
            assert first is None or same(first, chunk(0))
            stats = reader.stats()["redis"]
            assert stats["breaker"]["state"] == "open" and stats["breaker"]["opens"] == 1, stats
            timeouts = stats["timeouts"]

            # Open: S3 serves without a wait on Redis, whatever the call.
            for i in (1, 2):
                assert same(await reader.get(keys[i]), chunk(i))
            assert await reader.lookup(keys) == 8
            assert all(same(kv, chunk(3 + i)) for i, kv in enumerate(await reader.get_many(keys[3:5])))
            async with reader.prefetch(keys[5:6]) as stream:
                async for layer, kv in stream:
                    assert torch.equal(kv.view(torch.int16), chunk(5)[layer].view(torch.int16))
            await reader.flush()
            stats = reader.stats()["redis"]
            assert stats["timeouts"] == timeouts, "an open breaker must not wait for the frozen server"
            assert stats["breaker"]["skipped_reads"] >= 4 and stats["breaker"]["skipped_writes"] >= 3, stats

            # After the back-off, exactly one caller probes (and waits: its deadline is spent on the
            # frozen Redis, a miss); the other skips Redis at once and S3 serves it.
            now[0] += 0.2
            got = await asyncio.gather(reader.get(keys[6]), reader.get(keys[7]))
            assert all(kv is None or same(kv, chunk(i)) for kv, i in zip(got, (6, 7), strict=True)), reader.stats()
            assert sum(kv is not None for kv in got) >= 1, reader.stats()
            await reader.flush()
            stats = reader.stats()["redis"]
            assert stats["timeouts"] == timeouts + 1 and stats["breaker"]["state"] == "open", stats
        finally:
            redis.resume()
        opened = [r for r in caplog.records if "circuit breaker open" in r.getMessage()]
        assert len(opened) == 1, "one log line when the breaker opens, none per skipped call or failed probe"

        async def closed() -> bool:
            now[0] += 1.0  # past any back-off: the next call to Redis is a probe
            await reader.lookup(keys_for(reader, seed=8, count=1))  # a chunk no tier holds: Redis is asked
            return reader.stats()["redis"]["breaker"]["state"] == "closed"

        assert await wait_for(closed), f"the probe did not close the breaker: {reader.stats()['redis']}"
        assert sum("circuit breaker closed" in r.getMessage() for r in caplog.records) == 1
        written = reader.stats()["redis"]["writes"]
        assert await reader.put(keys_for(reader, seed=9, count=1)[0], chunk(9))
        await reader.flush()
        assert reader.stats()["redis"]["writes"] == written + 1  # writes reach Redis again


async def test_a_killed_redis_logs_one_line_per_state_change_not_one_per_socket_write(request, caplog):
    """Puts of many-layer chunks (one socket write per layer) to a Redis that was killed: the tier
    says once that it is unreachable and the breaker once that it opened; asyncio's transport never
    warns of writes to a lost connection."""
    caplog.set_level(logging.INFO)
    server = start_server(RedisServer())
    request.addfinalizer(server.close)
    layout = KVLayout(num_layers=32, num_kv_heads=1, head_dim=16, chunk_tokens=16, dtype=torch.bfloat16)
    redis = {"enabled": True, "url": server.url, "codec": "identity", "connect_timeout": 0.5}
    config = StoreConfig(
        dram={"capacity": layout.chunk_nbytes * 64},
        disk={"enabled": False},
        timeouts={"get": GET_TIMEOUT, "put": 2.0, "close": 3.0},
        redis=redis,
    )
    async with KVStore(config, layout, f"faults-{uuid.uuid4().hex[:8]}") as store:
        keys = store.chunk_keys(list(range(16 * layout.chunk_tokens)))
        kv = torch.zeros(layout.chunk_shape, dtype=layout.dtype)
        for key in keys[:4]:
            assert await store.put(key, kv)
        await store.flush()
        assert store.stats()["redis"]["writes"] == 4  # the pooled connections are open
        server.stop()
        caplog.clear()
        for key in keys[4:]:
            assert await store.put(key, kv)  # DRAM at once; the Redis writes fail in the background
        await asyncio.wait_for(store.flush(), HANG_BOUND * 2)
        assert store.stats()["redis"]["errors"] >= 1
    messages = [record.getMessage() for record in caplog.records]
    assert not [m for m in messages if "socket.send() raised exception" in m], len(messages)
    assert sum("is unreachable" in m for m in messages) == 1, messages
    assert sum("circuit breaker open" in m for m in messages) <= 1, messages
