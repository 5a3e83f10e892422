"""The circuit breaker per tier (kvstore.storage.breaker): its state machine on a fake clock, its config,
and how the store uses it (pure engine logic, on an in-memory backend; a real frozen server is in
test_remote_faults.py)."""

from __future__ import annotations

import asyncio

import pytest
import torch

from kvstore import KVLayout, KVStore, StoreConfig
from kvstore.codecs import make_codec
from kvstore.engine import metrics
from kvstore.errors import ConfigError, TierSkipped, TierTimeout
from kvstore.storage.breaker import CircuitBreaker, unreachable
from kvstore.storage.health import Attempt, TierHealth
from kvstore.storage.tier import ChunkTier
from kvstore.testing.memory import MemoryBackend

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=16, chunk_tokens=32)


class Clock:
    """Time that moves only when the test says so."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def breaker(clock: Clock, failures: int = 3, backoff: float = 1.0, backoff_max: float = 8.0) -> CircuitBreaker:
    return CircuitBreaker("redis", failures, backoff, backoff_max, clock=clock)


def lines(caplog: pytest.LogCaptureFixture, word: str) -> int:
    return sum(f"circuit breaker {word}" in record.getMessage() for record in caplog.records)


def test_opens_after_n_consecutive_failures_and_skips_during_the_backoff(caplog) -> None:
    clock = Clock()
    cb = breaker(clock)
    cb.failure()
    cb.failure()
    cb.success()  # a success (a miss counts as one) resets the count
    cb.failure()
    cb.failure()
    assert cb.state == "closed" and cb.admit()
    cb.failure()
    assert cb.state == "open" and cb.opens == 1
    for _ in range(100):
        assert not cb.admit()
        cb.skip()
    cb.skip(writes=8)
    clock.now += 0.999
    assert not cb.admit()
    assert cb.stats() == {"state": "open", "opens": 1, "skipped_reads": 100, "skipped_writes": 8}
    assert lines(caplog, "open") == 1  # one line when it opens, none per skipped call


def test_one_probe_after_the_backoff_and_its_success_closes(caplog) -> None:
    clock = Clock()
    cb = breaker(clock, failures=1)
    cb.failure()
    clock.now += 1.0
    assert cb.admit()  # this caller is the probe
    assert cb.state == "half-open"
    assert [cb.admit() for _ in range(5)] == [False] * 5  # every other caller still skips the tier
    cb.success()
    assert cb.state == "closed" and cb.admit() and cb.admit()
    assert (lines(caplog, "open"), lines(caplog, "closed")) == (1, 1)


def test_each_failed_probe_doubles_the_backoff_up_to_the_cap(caplog) -> None:
    clock = Clock()
    cb = breaker(clock, failures=1, backoff=1.0, backoff_max=8.0)
    cb.failure()
    waits = []
    for _ in range(6):
        opened_at, wait = clock.now, 0.0
        while not cb.admit():
            clock.now += 0.25
            wait += 0.25
        assert clock.now - opened_at == wait
        waits.append(wait)
        cb.failure()  # the probe failed: open again, for longer
        assert cb.state == "open"
    assert waits == [1.0, 2.0, 4.0, 8.0, 8.0, 8.0]
    assert cb.opens == 1 and lines(caplog, "open") == 1  # a failed probe logs nothing more
    clock.now += 8.0
    assert cb.admit()
    cb.success()  # closed: the next opening starts from `backoff` again
    cb.failure()
    clock.now += 1.0
    assert cb.admit()
    assert (cb.opens, lines(caplog, "open"), lines(caplog, "closed")) == (2, 2, 1)


def test_disabled_breaker_never_opens() -> None:
    cb = CircuitBreaker("s3", 1, enabled=False, clock=Clock())
    for _ in range(10):
        cb.failure()
    assert cb.state == "closed" and cb.admit()


def health(clock: Clock, failures: int = 3) -> TierHealth:
    return TierHealth("redis", breaker(clock, failures=failures))


async def test_run_counts_timeouts_and_noted_errors_not_misses() -> None:
    clock = Clock()
    tier = health(clock, failures=2)

    async def answer(attempt: Attempt, fail: bool) -> None:
        if fail:
            attempt.fail()  # what ChunkTier does where it counts an error of the tier

    await tier.run(lambda attempt: answer(attempt, fail=True), 1.0)
    with pytest.raises(TimeoutError):
        await tier.run(lambda attempt: asyncio.Event().wait(), 0.001)  # a timeout is a failure
    assert tier.breaker.state == "open" and tier.stats.timeouts == 1
    skipped, called = [], []
    with pytest.raises(TierSkipped):
        await tier.run(lambda attempt: called.append(1), 1.0, writes=3, on_end=lambda: skipped.append(1))  # type: ignore[arg-type,func-returns-value]
    assert skipped == [1] and called == [] and tier.breaker.skipped_writes == 3
    clock.now += 1.0
    await tier.run(lambda attempt: answer(attempt, fail=False), 1.0)  # the probe: a miss is an answer
    assert tier.breaker.state == "closed"


async def test_a_failure_is_blamed_on_its_own_operation_only() -> None:
    """Concurrent operations on one tier: one that fails must not count against the others."""
    tier = health(Clock(), failures=2)
    started, go = asyncio.Event(), asyncio.Event()

    async def healthy(attempt: Attempt) -> None:
        started.set()
        await go.wait()

    async def failing(attempt: Attempt) -> None:
        await started.wait()
        attempt.fail()
        go.set()

    await asyncio.gather(
        *(tier.run(op, 5.0, detached=detached) for op in (healthy, failing, healthy) for detached in (True, False))
    )
    assert tier.breaker.state == "closed"  # blamed on all six, it would have opened
    tier.breaker.failure()
    assert tier.breaker.state == "closed"  # the healthy ones answered after the failure: the count starts again


async def test_a_cancelled_probe_lets_the_next_caller_probe() -> None:
    clock = Clock()
    cb = breaker(clock, failures=1)
    cb.failure()
    clock.now += 1.0
    hang = asyncio.Event()
    tier = TierHealth("redis", cb)
    task = asyncio.create_task(tier.run(lambda attempt: hang.wait(), None, detached=False))
    await asyncio.sleep(0)
    assert cb.state == "half-open"
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    assert cb.state == "open" and cb.admit()  # not stuck half-open


def test_config_defaults_and_clear_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    section = StoreConfig().breaker
    assert (section.enabled, section.failures, section.backoff, section.backoff_max) == (True, 3, 1.0, 60.0)
    with pytest.raises(ConfigError, match=r"breaker.backoff_max .* must be at least breaker.backoff"):
        StoreConfig(breaker={"backoff": 10, "backoff_max": 5})
    with pytest.raises(ConfigError, match=r"breaker.failures = 0: .*greater than or equal to 1"):
        StoreConfig(breaker={"failures": 0})
    with pytest.raises(ConfigError, match=r"breaker.backoff = -1"):
        StoreConfig(breaker={"backoff": -1})
    with pytest.raises(ConfigError, match=r"breaker.backoff_max = inf: .*finite"):  # never probed again
        StoreConfig(breaker={"backoff_max": float("inf")})
    with pytest.raises(ConfigError, match=r"breaker.backoff_max = 86400.*less than or equal to 3600"):
        StoreConfig(breaker={"backoff_max": 86400})
    with pytest.raises(ConfigError, match="did you mean 'breaker.failures'"):
        StoreConfig(breaker={"failure": 2})
    monkeypatch.setenv("KVSTORE_BREAKER__BACKOFF_MAX", "30")
    assert StoreConfig().breaker.backoff_max == 30.0
    monkeypatch.setenv("KVSTORE_BREAKER__BACKOF", "2")
    with pytest.raises(ConfigError, match="did you mean KVSTORE_BREAKER__BACKOFF"):
        StoreConfig()


class DeadServer(MemoryBackend):
    """A backend whose server refuses every request (connection refused), counting what reaches it."""

    name = "dead"

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    async def fetch(self, key, byte_range):
        self.calls += 1
        raise ConnectionRefusedError("server down")

    async def set(self, key, parts):
        self.calls += 1
        raise ConnectionRefusedError("server down")

    async def exists(self, key):
        self.calls += 1
        raise ConnectionRefusedError("server down")


def two_tiers(dead: DeadServer, below: MemoryBackend) -> list[ChunkTier]:
    settings = store_config().breaker  # each tier is built with its breaker (the store does not swap it)
    return [ChunkTier(backend, make_codec("identity"), LAYOUT, None, breaker=settings) for backend in (dead, below)]


def store_config() -> StoreConfig:
    return StoreConfig(
        dram={"capacity": 8 * LAYOUT.chunk_nbytes},
        disk={"enabled": False},
        breaker={"failures": 2, "backoff": 60, "backoff_max": 60},  # no probe during the test
    )


CHUNK = torch.ones(LAYOUT.chunk_shape, dtype=LAYOUT.dtype)


async def test_store_stops_asking_a_failing_tier_and_says_so_in_stats_and_metrics(caplog) -> None:
    objects: dict[str, bytes] = {}
    writer_dead = DeadServer()
    async with KVStore(store_config(), LAYOUT, "breaker", tiers=two_tiers(writer_dead, MemoryBackend(objects))) as w:
        keys = w.chunk_keys(list(range(5 * LAYOUT.chunk_tokens)))
        for key in keys[:2]:  # one write batch each, both failing on the dead tier: it opens
            assert await w.put(key, CHUNK)
            await w.flush()
        assert w.stats()["dead"]["breaker"]["state"] == "open"
        calls = writer_dead.calls
        for key in keys[2:]:
            assert await w.put(key, CHUNK)
        await w.flush()
        assert writer_dead.calls == calls and len(objects) == 5  # dropped above, written below
        assert w.stats()["dead"]["breaker"] == {"state": "open", "opens": 1, "skipped_reads": 0, "skipped_writes": 3}

    dead = DeadServer()
    async with KVStore(store_config(), LAYOUT, "breaker", tiers=two_tiers(dead, MemoryBackend(objects))) as store:
        assert await store.lookup(keys) == 5  # the dead tier fails (once), the tier below answers
        assert await store.lookup(keys) == 5  # twice: open
        calls = dead.calls
        got = await store.get_many(keys[:3])  # read from the tier below, without asking the dead one
        assert all(kv is not None and torch.equal(kv, CHUNK) for kv in got)
        async with store.prefetch(keys[3:]) as stream:  # layer streams skip it too
            layers = [kv async for _, kv in stream]
        assert all(torch.equal(kv, CHUNK[layer].repeat(1, 2, 1, 1)) for layer, kv in enumerate(layers))
        await store.flush()  # the promotions' writes to the faster (dead) tier: dropped
        assert dead.calls == calls, "an open breaker must keep every call away from the tier"
        stats = store.stats()
        # Skipped writes: get_many's 3 promotions and the stream's 2 (streams promote too).
        assert stats["dead"]["breaker"] == {"state": "open", "opens": 1, "skipped_reads": 2, "skipped_writes": 5}
        assert stats["memory"]["breaker"]["state"] == "closed"
        families = {family.name: family for family in metrics.KVStoreCollector()._families([store])}
    assert sum("circuit breaker open" in r.getMessage() for r in caplog.records) == 2  # one per store
    opens = {s.labels["tier"]: s.value for s in families["kvstore_tier_breaker_opens"].samples}
    assert opens == {"dead": 1, "memory": 0}
    skipped = {s.labels["tier"]: s.value for s in families["kvstore_tier_breaker_skipped_reads"].samples}
    assert skipped == {"dead": 2, "memory": 0}
    state = {(s.labels["tier"], s.labels["state"]): s.value for s in families["kvstore_tier_breaker_state"].samples}
    assert state == {
        ("dead", "closed"): 0, ("dead", "open"): 1, ("dead", "half-open"): 0,
        ("memory", "closed"): 1, ("memory", "open"): 0, ("memory", "half-open"): 0,
    }  # fmt: skip


async def four_stored_chunks() -> tuple[dict[str, bytes], list[str]]:
    """Four chunks written to an in-memory tier (below a dead one); its objects and the keys."""
    objects: dict[str, bytes] = {}
    async with KVStore(store_config(), LAYOUT, "breaker", tiers=two_tiers(DeadServer(), MemoryBackend(objects))) as w:
        keys = w.chunk_keys(list(range(4 * LAYOUT.chunk_tokens)))
        for key in keys:
            assert await w.put(key, CHUNK)
        await w.flush()
    return objects, keys


async def test_corrupt_objects_are_not_failures_of_their_tier(caplog) -> None:
    """A corrupt object is the object's fault: however many there are, the tier stays in use."""
    objects, keys = await four_stored_chunks()
    for name, data in objects.items():
        objects[name] = data[:-1] + bytes([data[-1] ^ 0xFF])
    tier = ChunkTier(MemoryBackend(objects), make_codec("identity"), LAYOUT, None)
    async with KVStore(store_config(), LAYOUT, "breaker", tiers=[tier]) as store:
        for key in keys:  # one read each: four corrupt objects in a row
            assert await store.get(key) is None
        assert store.stats()["memory"]["corrupt"] == 4
        assert store.stats()["memory"]["breaker"]["state"] == "closed"


async def test_a_timeout_cut_short_by_the_calls_deadline_is_not_the_tiers_failure() -> None:
    """get_many and lookup share one deadline across tiers: a tier left less than its fair share of it
    (blame=False) that times out was cut short by the tiers before it, and must not open its breaker."""
    tier, never = health(Clock(), failures=1), asyncio.Event()
    with pytest.raises(TierTimeout):
        await tier.run(lambda attempt: never.wait(), 0.001, blame=False)
    assert tier.breaker.state == "closed" and tier.stats.timeouts == 1  # counted as a timeout, not a failure
    with pytest.raises(TierTimeout):
        await tier.run(lambda attempt: never.wait(), 0.001)
    assert tier.breaker.state == "open"


def test_unreachable_tells_a_server_gone_from_a_request_refused() -> None:
    import errno

    import redis.exceptions
    from botocore.exceptions import ClientError, EndpointConnectionError

    gone = [
        ConnectionRefusedError("refused"),
        TimeoutError(),
        redis.exceptions.ConnectionError("Error 111 connecting"),
        redis.exceptions.TimeoutError("Timeout reading from socket"),
        EndpointConnectionError(endpoint_url="http://127.0.0.1:1"),
    ]
    refused = [
        redis.exceptions.ResponseError("OOM command not allowed when used memory > 'maxmemory'"),
        ClientError({"Error": {"Code": "AccessDenied", "Message": "denied"}}, "PutObject"),
        OSError(errno.ENOSPC, "No space left on device"),
        ValueError("bad"),
    ]
    assert [unreachable(error) for error in gone] == [True] * len(gone)
    assert [unreachable(error) for error in refused] == [False] * len(refused)
    try:
        try:
            raise ConnectionResetError("reset")
        except ConnectionResetError as cause:
            raise RuntimeError("redis GET failed") from cause
    except RuntimeError as wrapped:
        assert unreachable(wrapped)  # a backend's wrapper: its cause decides


class FullServer(DeadServer):
    """A server that answers every write with a refusal (Redis at maxmemory) and serves reads."""

    name = "full"

    async def fetch(self, key, byte_range):
        self.calls += 1
        return await MemoryBackend.fetch(self, key, byte_range)

    async def exists(self, key):
        self.calls += 1
        return await MemoryBackend.exists(self, key)

    async def set(self, key, parts):
        self.calls += 1
        raise RuntimeError("OOM command not allowed when used memory > 'maxmemory'")


async def test_writes_the_server_refuses_leave_its_reads_alone() -> None:
    """A Redis at maxmemory refuses every SET but serves every GET: its breaker must stay closed."""
    full = FullServer()
    async with KVStore(store_config(), LAYOUT, "breaker", tiers=two_tiers(full, MemoryBackend({}))) as store:
        keys = store.chunk_keys(list(range(4 * LAYOUT.chunk_tokens)))
        for key in keys:  # one failing write batch each: four refusals in a row
            assert await store.put(key, CHUNK)
            await store.flush()
        assert store.stats()["full"]["errors"] == 4
        assert store.stats()["full"]["breaker"]["state"] == "closed"


async def test_a_corrupt_object_it_cannot_remove_is_not_a_failure_of_its_tier() -> None:
    """Read-only credentials: each corrupt read's removal fails, and the tier still serves the rest."""

    class ReadOnly(MemoryBackend):
        name = "readonly"

        async def delete(self, key):
            raise PermissionError("read-only credentials")

    objects, keys = await four_stored_chunks()
    for key in keys[:3]:
        objects[key] = objects[key][:-1] + bytes([objects[key][-1] ^ 1])  # a payload byte flipped
    tier = ChunkTier(ReadOnly(objects), make_codec("identity"), LAYOUT, None)
    async with KVStore(store_config(), LAYOUT, "breaker", tiers=[tier]) as store:
        for key in keys[:3]:
            assert await store.get(key) is None
        assert store.stats()["readonly"]["corrupt"] == 3
        assert store.stats()["readonly"]["breaker"]["state"] == "closed"
        assert torch.equal(await store.get(keys[3]), CHUNK)


async def test_a_failed_probe_adds_no_warning_to_the_log(caplog: pytest.LogCaptureFixture) -> None:
    """A frozen tier: one line for the timeout that opens the breaker, one for the opening, then silence while
    each probe times out (the state does not change), however many probes fail."""
    clock = Clock()
    tier, never = health(clock, failures=1), asyncio.Event()
    with pytest.raises(TierTimeout):
        await tier.run(lambda attempt: never.wait(), 0.001)
    for _ in range(3):
        clock.now += 60.0
        with pytest.raises(TierTimeout):
            await tier.run(lambda attempt: never.wait(), 0.001)  # the probe
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 2 and "exceeded" in warnings[0] and "circuit breaker open" in warnings[1], warnings
    assert tier.stats.timeouts == 4 and tier.breaker.state == "open"
