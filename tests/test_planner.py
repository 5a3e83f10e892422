"""Load or recompute (kvstore.engine.planner): the arithmetic with explicit numbers, then real tiers.

The slow tier is a real redis-server behind a proxy that delays each request or caps its
bandwidth (kvstore.testing.slow_proxy): the proxy sleeps, so the slow side of each comparison is a
lower bound on time, never a race. The prefill rate is pinned in the config.
"""

from __future__ import annotations

import asyncio
import math
import time
import uuid

import pytest
import torch

from kvstore import KVLayout, KVStore, StoreConfig
from kvstore.config import PlannerConfig
from kvstore.engine.planner import DRAM, LoadPlanner, PrefillClock
from kvstore.errors import ConfigError
from kvstore.testing.servers import RedisServer
from kvstore.testing.slow_proxy import SlowProxy

MB = 1_000_000


class ManualClock:
    """The planner's clock, moved by hand: staleness without sleeping."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def planner(prefill: float | None = 1000.0, enabled: bool = True, clock: ManualClock | None = None) -> LoadPlanner:
    """Chunks of 1 MB and 100 tokens: at 1000 tokens/s a chunk costs 0.1 s to recompute."""
    config = PlannerConfig(enabled=enabled, prefill_tokens_per_s=prefill)
    return LoadPlanner(config, MB, 100, 10e9, probe_interval=30.0, clock=clock or ManualClock())


def set_estimate(plan: LoadPlanner, tier: str, latency: float, bytes_per_s: float, local: bool = False) -> None:
    estimate = plan.estimate(tier, local)
    estimate.latency_s, estimate.bytes_per_s, estimate.reads = latency, bytes_per_s, 1  # as if measured
    estimate.read_at = plan.clock()


# -- the arithmetic ------------------------------------------------------------------------------


def test_a_slow_tier_s_chunks_are_recomputed_and_the_faster_ones_before_them_loaded():
    plan = planner()
    set_estimate(plan, DRAM, 0.0, 10e9)  # the DRAM path measured at 10 GB/s
    set_estimate(plan, "disk", 0.001, 1e9, local=True)  # 1 ms + 1 ms for the first chunk, 1 ms each after
    set_estimate(plan, "s3", 0.05, 1e7)  # 50 ms + 100 ms for the first, 100 ms each after: recompute is 100
    result = plan.plan([DRAM, DRAM, "disk", "s3", "s3"])
    assert (result.held, result.load, result.recomputed) == (5, 3, 2)
    assert result.load_seconds == pytest.approx(2 * MB / 10e9 + 0.002)
    assert result.recompute_seconds == pytest.approx(0.3)


def test_dram_costs_its_seed_until_its_loads_are_measured():
    """The seed is this machine's copy rate; the connector's timed loads replace it (on a GPU
    the path is the bus, not a memcpy)."""
    plan = planner()
    plan.dram.bytes_per_s = 1e6  # a seed far too slow: a chunk would cost 1 s against 0.1 s of recompute
    assert plan.plan([DRAM, DRAM]).load == 0
    plan.observe_read(DRAM, 0.001, 10 * MB)  # measured: 10 GB/s, the first measurement replaces the seed
    assert plan.plan([DRAM, DRAM]).load == 2
    for _ in range(20):
        plan.observe_read(DRAM, 2.0, 2 * MB)  # the path got slow (1 MB/s): the EWMA follows
    assert plan.plan([DRAM, DRAM]).load == 0


def test_a_fast_enough_remote_tier_is_loaded_whole():
    plan = planner()
    set_estimate(plan, "s3", 0.01, 1e8)  # 20 ms for the first chunk, 10 ms each after: below 100 ms
    result = plan.plan([DRAM, "s3", "s3", "s3"])
    assert result.load == 4
    assert result.load_seconds <= result.recompute_seconds


def test_a_request_latency_worth_paying_only_over_several_chunks_loads_them_all():
    """One chunk does not pay for a 150 ms request; three do (150 + 3 ms against 300 ms)."""
    plan = planner()
    set_estimate(plan, "s3", 0.15, 1e9)
    assert plan.plan(["s3"]).load == 0
    result = plan.plan(["s3", "s3", "s3"])
    assert result.load == 3 and result.load_seconds == pytest.approx(0.153)


def test_an_engine_that_has_not_measured_its_prefill_is_never_refused_a_hit():
    plan = planner(prefill=None)
    set_estimate(plan, "s3", 10.0, 1.0)  # absurdly slow
    result = plan.plan(["s3", "s3"])
    assert result.load == 2 and result.recompute_seconds == math.inf
    plan.observe_prefill(1000, 1.0)  # one step is not a rate yet: it could be an outlier
    assert plan.prefill_tokens_per_s is None and plan.plan(["s3", "s3"]).load == 2
    plan.observe_prefill(2000, 2.0)  # now it has: 0.1 s a chunk
    assert plan.prefill_tokens_per_s == 1000
    assert plan.plan(["s3", "s3"]).load == 0


def test_a_planner_turned_off_loads_every_held_chunk():
    plan = planner(enabled=False)
    set_estimate(plan, "s3", 10.0, 1.0)
    assert plan.plan([DRAM, "s3", "s3"]).load == 3


def test_the_estimates_start_from_the_first_measurement_and_then_move_by_an_ewma():
    plan = planner()
    plan.observe_read("s3", 0.2, MB, local=False)  # seeded latency 5 ms: 1 MB in 195 ms
    estimate = plan.estimate("s3")
    assert estimate.bytes_per_s == pytest.approx(MB / 0.195)
    plan.observe_read("s3", 0.005 + 0.01, MB)  # 100 MB/s: the estimate moves 30% of the way
    assert estimate.bytes_per_s == pytest.approx(0.7 * MB / 0.195 + 0.3 * 1e8)
    assert estimate.reads == 2
    plan.observe_read("s3", 1.0, 0)  # a read that timed out: nothing arrived
    assert estimate.bytes_per_s < 0.71 * (0.7 * MB / 0.195 + 0.3 * 1e8)


def test_the_prefill_clock_times_prefill_steps_and_leaves_out_decodes_and_idle_gaps():
    plan = planner(prefill=None)
    clock = PrefillClock(plan, min_tokens=100)
    clock.step(512, now=10.0)
    clock.step(1, now=10.5)  # the 512-token step took 0.5 s
    assert plan.measured_prefill == pytest.approx(1024)
    clock.step(1, now=10.6)  # a decode step took 0.1 s: not a prefill
    clock.step(512, now=10.7)
    clock.step(512, now=30.0)  # 19 s for 512 tokens: the engine sat idle
    assert plan.measured_prefill == pytest.approx(1024)
    for now in (40.0, 50.0, 60.0):  # ...unless it keeps happening: the engine did get slower
        clock.step(512, now=now)
    assert plan.measured_prefill < 1024
    PrefillClock(None, 100).step(512)  # a rank without a store measures nothing (and does not fail)


def test_a_tier_refused_during_a_slow_spell_is_probed_and_loaded_again_once_fast():
    """Redis measured at 1 MB/s (1 s a chunk against 0.1 s of recompute) is refused; once its read
    estimate is older than the probe interval, one plan loads one Redis chunk more, and that read
    replaces the stale estimate: a link fast again is loaded from the next plan on."""
    clock = ManualClock()
    plan = planner(clock=clock)
    set_estimate(plan, "disk", 0.001, 1e9, local=True)
    plan.observe_read("redis", 0.005 + 1.0, MB, local=False)  # the slow spell
    prefix = ["disk"] * 3 + ["redis"] * 5
    for _ in range(12):  # within the interval: refused, never probed
        clock.now += 2.0
        result = plan.plan(prefix)
        assert (result.load, result.probe) == (3, None)
    clock.now += 30.0
    probe = plan.plan(prefix)
    assert (probe.load, probe.probe) == (4, "redis"), "a stale refused tier must be re-measured"
    plan.observe_read("redis", 0.005 + 0.01, MB, local=False)  # the probe's read: 100 MB/s again
    assert plan.estimate("redis").bytes_per_s == pytest.approx(1e8), "a stale estimate is replaced, not averaged"
    assert (plan.plan(prefix).load, plan.plan(prefix).probe) == (8, None)


def test_a_probe_that_finds_the_tier_still_slow_refuses_it_for_another_interval():
    clock = ManualClock()
    plan = planner(clock=clock)
    plan.observe_read("s3", 0.005 + 1.0, MB, local=False)
    clock.now += 31.0
    assert plan.plan(["s3", "s3"]).probe == "s3"
    plan.observe_read("s3", 0.005 + 2.0, MB, local=False)  # still slow (0.5 MB/s)
    for _ in range(5):
        clock.now += 5.0
        assert (plan.plan(["s3", "s3"]).load, plan.plan(["s3", "s3"]).probe) == (0, None)


def test_a_tier_slow_to_answer_is_never_probed_and_a_slow_dram_path_is():
    """Lookups keep a tier's latency fresh: a probe could not help a tier whose latency alone
    loses. DRAM's seed counts as a measurement: one seeded too slow is probed like any tier."""
    clock = ManualClock()
    plan = planner(clock=clock)
    set_estimate(plan, "s3", 10.0, 1e9)  # 10 s per request
    plan.dram.bytes_per_s = 1e6  # 1 s a chunk
    clock.now += 3600.0
    assert (plan.plan(["s3", "s3"]).load, plan.plan(["s3", "s3"]).probe) == (0, None)
    probe = plan.plan([DRAM, DRAM])
    assert (probe.load, probe.probe) == (1, DRAM)


def test_a_probe_whose_read_is_never_measured_is_repeated_once_an_interval_not_every_plan():
    """vLLM never reports DRAM reads to the planner: a probe of DRAM leaves its estimate stale. The next
    plans within the interval must not probe again (one slow chunk per tier and interval, at most)."""
    clock = ManualClock()
    plan = planner(clock=clock)
    plan.dram.bytes_per_s = 1e6  # 1 s a chunk: refused
    clock.now += 3600.0
    plans = [plan.plan([DRAM, DRAM]) for _ in range(5)]
    assert [(p.load, p.probe) for p in plans] == [(1, DRAM)] + [(0, None)] * 4
    clock.now += 30.0
    again = plan.plan([DRAM, DRAM])
    assert (again.load, again.probe) == (1, DRAM)


@pytest.mark.parametrize("seconds", [math.nan, math.inf, -1.0, 0.0])
def test_a_prefill_measurement_that_is_not_a_finite_positive_number_is_ignored_and_counted(seconds, caplog):
    plan = planner(prefill=None)
    for _ in range(3):
        plan.observe_prefill(1000, 1.0)
    for _ in range(3):
        plan.observe_prefill(256, seconds)
    plan.observe_prefill(math.inf, 1.0)
    assert plan.prefill_tokens_per_s == 1000
    assert plan.plan([DRAM, DRAM]).load == 2
    assert plan.describe()["prefill_rejected"] == 4
    assert len([r for r in caplog.records if "prefill measurement" in r.getMessage()]) == 1, "logged once"


def test_one_outlier_prefill_step_never_refuses_a_dram_hit():
    """2,048 tokens in 1 us (a clock glitch) between steady steps: the rate stays the steps' own."""
    plan = planner(prefill=None)
    plan.dram.bytes_per_s = 1e9  # a DRAM chunk costs 1 ms against 100 ms of recompute
    for _ in range(4):
        plan.observe_prefill(1000, 1.0)
    plan.observe_prefill(2048, 1e-6)
    for step in range(16):
        assert plan.plan([DRAM] * 4).load == 4, f"step {step} after the outlier refused a DRAM hit"
        plan.observe_prefill(1000, 1.0)
    fresh = planner(prefill=None)  # the outlier first: one step is not a rate, two give the lower one
    fresh.dram.bytes_per_s = 1e9
    fresh.observe_prefill(2048, 1e-6)
    fresh.observe_prefill(1000, 1.0)
    assert fresh.prefill_tokens_per_s == 1000 and fresh.plan([DRAM] * 4).load == 4


@pytest.mark.parametrize("section", ["planner", "adaptive"])
@pytest.mark.parametrize("value", [math.inf, math.nan, "inf"])
def test_a_prefill_rate_setting_that_is_not_finite_is_refused_with_the_key_named(section, value):
    with pytest.raises(ConfigError) as excinfo:
        StoreConfig(**{section: {"prefill_tokens_per_s": value}})
    message = str(excinfo.value)
    assert f"{section}.prefill_tokens_per_s" in message and "finite" in message, message


@pytest.mark.parametrize(
    "section,problem",
    [({"prefill_tokens_per_s": 0}, "greater than 0"), ({"enabled": "sometimes"}, "bool"), ({"rate": 1}, "rate")],
)
def test_bad_planner_settings_are_refused_with_the_setting_named(section, problem):
    with pytest.raises(ConfigError) as excinfo:
        StoreConfig(planner=section)
    assert "planner." in str(excinfo.value) and problem in str(excinfo.value), str(excinfo.value)


# -- a store over real tiers ------------------------------------------------------------------------

LAYOUT = KVLayout(num_layers=4, num_kv_heads=4, head_dim=64, dtype=torch.float16, chunk_tokens=128)  # 512 KiB


def store_config(tmp_path, redis_port: int, prefix: str, *, disk: bool, prefill: float) -> StoreConfig:
    redis = {"enabled": True, "url": f"redis://127.0.0.1:{redis_port}/0", "prefix": prefix, "codec": "identity"}
    return StoreConfig(
        dram={"capacity": "16MiB"},
        disk={"enabled": disk, "path": tmp_path / "disk"},
        redis=redis,
        timeouts={"get": 10.0, "put": 10.0},
        planner={"prefill_tokens_per_s": prefill},
    )


async def put_all(config: StoreConfig, tokens: list[int]) -> None:
    """Put every chunk of ``tokens`` into each tier of ``config`` (a store of its own)."""
    async with KVStore(config, LAYOUT, "planner-test") as store:
        for index, key in enumerate(store.chunk_keys(tokens)):
            await store.put(key, torch.full(LAYOUT.chunk_shape, float(index), dtype=LAYOUT.dtype))
        await store.flush()


@pytest.fixture
def redis_proxy(redis_server: RedisServer):
    with SlowProxy("127.0.0.1", redis_server.port) as proxy:
        yield proxy


async def test_a_bandwidth_starved_tier_is_recomputed_once_reads_have_measured_it(tmp_path, redis_proxy):
    """Redis capped at 0.5 MB/s: a 512 KiB chunk takes >= 1 s to read; recompute (pinned) 0.3 s.

    Before any read the planner trusts the seed and loads (lookups are not slowed); after two
    warm-up reads it recomputes the Redis chunks and still loads the disk's. Margins of 0.7 s and
    more on either side: a busy machine cannot turn one answer into the other.
    """
    prefix = f"planner-{uuid.uuid4().hex[:8]}"
    prefill = LAYOUT.chunk_tokens / 0.3
    document, other = list(range(1024)), list(range(5000, 5000 + 1024))  # 8 chunks each
    for tokens in (document, other):
        await put_all(store_config(tmp_path, redis_proxy.port, prefix, disk=False, prefill=prefill), tokens)
    # The disk holds the document's first 3 chunks only (a store of its own, disk alone).
    disk_only = StoreConfig(dram={"capacity": "16MiB"}, disk={"path": tmp_path / "disk"})
    async with KVStore(disk_only, LAYOUT, "planner-test") as store:
        for index, key in enumerate(store.chunk_keys(document)[:3]):
            await store.put(key, torch.full(LAYOUT.chunk_shape, float(index), dtype=LAYOUT.dtype))
        await store.flush()

    redis_proxy.bytes_per_s = 5e5
    config = store_config(tmp_path, redis_proxy.port, prefix, disk=True, prefill=prefill)
    async with KVStore(config, LAYOUT, "planner-test") as store:  # a fresh store: DRAM empty
        keys = store.chunk_keys(document)
        plan = await store.plan(keys)
        assert plan.tiers == ("disk",) * 3 + ("redis",) * 5
        assert plan.load == 8, "before any read, the seeds must not refuse a hit"
        warm_up = store.chunk_keys(other)
        for pair in (warm_up[:2], warm_up[2:4]):
            results = await store.get_many(pair)
            assert all(result is not None for result in results)
        assert store.stats()["redis"]["hits"] == 4
        plan = await store.plan(keys)
        assert plan.tiers == ("disk",) * 3 + ("redis",) * 5
        assert plan.load == 3, f"the measured Redis ({store.planner.describe()}) should have lost to recompute"
        assert plan.load_seconds <= plan.recompute_seconds
        # What the plan loads is what the store serves.
        loaded = await store.get_many(keys[: plan.load])
        assert [int(chunk[0, 0, 0, 0, 0]) for chunk in loaded] == [0, 1, 2]
        assert store.stats()["disk"]["hits"] == 3
        # The link is fast again: once Redis's estimate is stale, a plan probes one chunk of it, and
        # that read alone (measured by the store's own counters) brings the whole prefix back.
        redis_proxy.bytes_per_s = None
        store.planner.clock = lambda: time.monotonic() + store.planner.probe_interval
        plan = await store.plan(keys)
        assert (plan.load, plan.probe) == (4, "redis")
        loaded = await store.get_many(keys[: plan.load])
        assert [int(chunk[0, 0, 0, 0, 0]) for chunk in loaded] == [0, 1, 2, 3]
        plan = await store.plan(keys)
        assert (plan.load, plan.probe) == (8, None), f"the probed Redis ({store.planner.describe()}) is fast again"


async def test_a_tier_whose_every_request_is_delayed_is_recomputed_from_its_lookups_alone(tmp_path, redis_proxy):
    """Each Redis request delayed 0.3 s; recompute (pinned) is 0.05 s a chunk: no read is needed to know."""
    prefix = f"planner-{uuid.uuid4().hex[:8]}"
    prefill = LAYOUT.chunk_tokens / 0.05
    document = list(range(512))  # 4 chunks
    await put_all(store_config(tmp_path, redis_proxy.port, prefix, disk=False, prefill=prefill), document)
    redis_proxy.delay = 0.3
    config = store_config(tmp_path, redis_proxy.port, prefix, disk=False, prefill=prefill)
    async with KVStore(config, LAYOUT, "planner-test") as store:
        keys = store.chunk_keys(document)
        plan = await store.plan(keys)
        assert (plan.held, plan.load) == (4, 0)
        assert store.planner.estimate("redis").latency_s >= 0.3
        # The same chunks in DRAM are loaded: a copy beats recompute.
        for index, key in enumerate(keys[:2]):
            await store.put(key, torch.full(LAYOUT.chunk_shape, float(index), dtype=LAYOUT.dtype))
        plan = await store.plan(keys)
        assert plan.tiers[:2] == (DRAM, DRAM) and plan.load == 2
        assert await store.lookup(keys) == 4, "lookup still answers what is held"


async def test_a_tier_that_streams_slowly_is_measured_by_the_streams_themselves(tmp_path, redis_proxy):
    """The connectors load through layer streams: their range requests measure the tier too.

    Redis capped at 0.5 MB/s (a 512 KiB chunk >= 1 s; recompute pinned at 0.3 s): the seeds load
    everything; after one stream of two other chunks, the Redis chunks are recomputed.
    """
    prefix = f"planner-{uuid.uuid4().hex[:8]}"
    prefill = LAYOUT.chunk_tokens / 0.3
    document, other = list(range(512)), list(range(5000, 5000 + 256))  # 4 chunks, 2 chunks
    for tokens in (document, other):
        await put_all(store_config(tmp_path, redis_proxy.port, prefix, disk=False, prefill=prefill), tokens)
    redis_proxy.bytes_per_s = 5e5
    config = store_config(tmp_path, redis_proxy.port, prefix, disk=False, prefill=prefill)
    async with KVStore(config, LAYOUT, "planner-test") as store:
        keys = store.chunk_keys(document)
        assert (await store.plan(keys)).load == 4, "before any read, the seeds must not refuse a hit"
        async with store.prefetch(store.chunk_keys(other)) as stream:
            layers = [layer async for layer, _ in stream]
        redis = next(tier for tier in store.tiers if tier.name == "redis")
        assert layers == list(range(LAYOUT.num_layers)) and store.stats()["redis"]["hits"] == 2
        assert sum(redis.latency.read.counts) == 0, "no batch read: only the stream measured the tier"
        plan = await store.plan(keys)
        assert plan.tiers == ("redis",) * 4
        assert plan.load == 0, f"the streamed Redis ({store.planner.describe()}) should have lost to recompute"


async def test_reads_sharing_a_link_measure_the_link_not_their_share_of_it(tmp_path, redis_proxy):
    """Eight reads at once through a Redis link capped at 2 MB/s in all (4 MiB: >= 2 s). Each timed alone
    would show an eighth of the link (~0.25 MB/s); timed together while any is in flight, they show the
    link: the estimate is above half of it, a margin of more than a second on a busy machine."""
    prefix = f"planner-{uuid.uuid4().hex[:8]}"
    tokens = list(range(8 * LAYOUT.chunk_tokens))
    await put_all(store_config(tmp_path, redis_proxy.port, prefix, disk=False, prefill=1.0), tokens)
    redis_proxy.total_bytes_per_s = 2e6
    async with KVStore(
        store_config(tmp_path, redis_proxy.port, prefix, disk=False, prefill=1.0), LAYOUT, "planner-test"
    ) as store:
        keys = store.chunk_keys(tokens)
        assert store.planner.estimate("redis", local=False).reads == 0  # the seed until the reads are measured
        loaded = await asyncio.gather(*(store.get_many([key]) for key in keys))
        assert [int(chunk[0][0, 0, 0, 0, 0]) for chunk in loaded] == list(range(8)), store.stats()
        store.planner.sync(store.tiers)
        redis = store.planner.estimate("redis", local=False)
        assert redis.reads == 1 and 1e6 < redis.bytes_per_s <= 2.2e6, store.planner.describe()
