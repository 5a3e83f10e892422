"""Adaptive sizing on live stores: tracking, advice, the second-sighting policy and auto mode, on replayed traffic."""

from __future__ import annotations

import logging
import os
import stat
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from benchmarks.adaptive import LAYOUT, ReplayResult, compare_one, lookup_overhead, replay, store_config
from kvstore.config import StoreConfig
from kvstore.engine import costs
from kvstore.engine.store import KVStore
from kvstore.engine.sync import SyncKVStore
from kvstore.errors import ConfigError
from kvstore.sizing import traces, workloads
from kvstore.sizing.advice import DEFAULT_BANDWIDTH

CHUNK = LAYOUT.chunk_nbytes


async def run(
    tmp_path: Path, chains: list[np.ndarray], dram: int, disk: int = 50_000, learn: int = 0, **adaptive
) -> ReplayResult:
    """Replay ``chains`` into a fresh store, settled (no timing), and report the chains after the first ``learn``."""
    directory = tmp_path / f"run-{len(list(tmp_path.iterdir()))}"
    async with KVStore(store_config(directory, dram, disk, **adaptive), LAYOUT, "adaptive") as store:
        await replay(store, chains[:learn], settle=True)
        return await replay(store, chains[learn:], settle=True)


AUTO = {"auto": True, "interval": 0, "min_references": 4000, "half_life": 20_000}


@pytest.fixture(autouse=True)
def pinned_costs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Advice and auto mode weigh fixed costs here, never this run's timings of its disk and memory.

    A 1 KiB chunk file costs a disk about 100 us to write or read (an open, a write or read, a close)
    whatever its bandwidth: 10 MB/s, what this machine kind measures for this layout, pinned.
    """
    monkeypatch.setattr(costs, "MEASURED_AFTER", sys.maxsize)
    monkeypatch.setitem(DEFAULT_BANDWIDTH, "disk_read", 10e6)
    monkeypatch.setitem(DEFAULT_BANDWIDTH, "disk_write", 10e6)
    monkeypatch.setattr(costs, "copy_bandwidth", lambda: DEFAULT_BANDWIDTH["dram_copy"])


# -- tracking and advice on a live store ---------------------------------------------------------


async def test_live_store_estimates_the_dram_hit_rate_of_its_own_traffic(tmp_path: Path) -> None:
    chains = workloads.multi_turn(1500, seed=11)
    ids = traces.flatten(chains)
    async with KVStore(store_config(tmp_path, 1000, 50_000), LAYOUT, "adaptive") as store:
        await replay(store, chains)
        advice = store.advise()
        profile = store._tracker.profile()
    sizes = [125, 250, 500, 1000, 2000, 4000, 8000]
    exact = workloads.exact_lru_hit_rates(ids, sizes)
    estimated = profile.hit_rates(sizes)
    assert max(abs(a - b) for a, b in zip(estimated, exact, strict=True)) < 0.05, (estimated, exact)
    assert profile.references == len(ids)
    # the advice shows 1/8x .. 8x of the current size, and the rows agree with the curve
    assert [row.dram_bytes for row in advice.rows][0] == 125 * CHUNK
    assert max(row.dram_bytes for row in advice.rows) == 8000 * CHUNK
    for row in advice.rows:
        assert row.dram_hit_rate == pytest.approx(profile.hit_rate(row.dram_bytes / CHUNK))
    assert advice.verdict and "hit rate" in advice.verdict[0]


async def test_advise_needs_tracking(tmp_path: Path) -> None:
    async with KVStore(store_config(tmp_path, 100, 1000, track=False), LAYOUT, "adaptive") as store:
        with pytest.raises(RuntimeError, match="adaptive.track"):
            store.advise()
        assert "lookups_tracked" not in store.stats()["adaptive"]


async def test_all_unique_traffic_is_judged_not_worth_writing_below(tmp_path: Path) -> None:
    async with KVStore(store_config(tmp_path, 500, 50_000), LAYOUT, "adaptive") as store:
        await replay(store, workloads.all_unique(3000, seed=12))
        advice = store.advise()
    assert advice.cold_fraction == pytest.approx(1.0, abs=0.01)  # the sighting sketch may take a few as seen
    assert advice.recommended_policy == "second-sighting"
    assert advice.savings["second-sighting"] > advice.savings["write-through"]
    assert advice.recommended_dram_bytes == min(row.dram_bytes for row in advice.rows)
    assert any("selective writes" in line for line in advice.verdict)


# -- the second-sighting write policy -------------------------------------------------------------


async def test_second_sighting_writes_nothing_below_for_one_off_prompts(tmp_path: Path) -> None:
    fixed = await run(tmp_path, workloads.all_unique(2000, seed=13), 500)
    selective = await run(tmp_path, workloads.all_unique(2000, seed=13), 500, policy="second-sighting")
    assert fixed.written_below >= 2000 * 8 * CHUNK
    # The sighting sketch (count-min, 2 rows of 4M slots) takes a chunk seen once for
    # one seen twice only where other chunks share its slot in both rows: about 0.1 of these 16,000
    # chunks on average, so a run may write one below; 5 or more would be a broken sketch (p < 1e-6).
    false_positives = 2000 * 8 - selective.adaptive["held_back"]
    assert 0 <= false_positives <= 4
    assert (selective.written_below > 0) == (false_positives > 0)
    assert selective.written_below <= false_positives * 8 * CHUNK  # a chunk's file: the chunk and its header


async def test_second_sighting_writes_a_prefix_once_it_comes_back(tmp_path: Path) -> None:
    config = store_config(tmp_path, 64, 10_000, policy="second-sighting")
    first, other = workloads.all_unique(2, chunks=4, seed=14)
    keys = [traces.trace_key(int(i)) for i in first]
    async with KVStore(config, LAYOUT, "adaptive") as store:
        (disk,) = store.tiers
        await replay(store, [first])
        assert not any(disk.backend.holds(key) for key in keys), "a first sighting stays in DRAM"
        await replay(store, [first])  # looked up again: a DRAM hit, so it goes below now
        assert all(disk.backend.holds(key) for key in keys)
        assert store.stats()["adaptive"]["released"] == 4
        # a prefix evicted from DRAM before it came back is written when it is computed again
        chunks = [traces.trace_key(int(i)) for i in other]
        await replay(store, [other])
        for key in chunks:
            assert store.pool.discard(key)
        result = await replay(store, [other])
        assert result.prefix_hits == 0
        assert all(disk.backend.holds(key) for key in chunks)
        assert store.stats()["adaptive"]["released"] == 4  # written by the put, not released from DRAM


# -- auto mode ----------------------------------------------------------------------------------------


async def test_auto_mode_cuts_writes_on_all_unique_traffic(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    chains = workloads.all_unique(2500, seed=15)
    fixed = await run(tmp_path, chains, 1000)
    with caplog.at_level(logging.INFO, logger="kvstore"):
        auto = await run(tmp_path, chains, 1000, **AUTO, dram_min=125 * CHUNK, dram_max=8000 * CHUNK)
    assert auto.written_below <= 0.5 * fixed.written_below, (auto.written_below, fixed.written_below)
    assert auto.policy_end == "second-sighting"
    assert auto.adaptive["policy_switches"] >= 1
    assert auto.dram_bytes_end < 1000 * CHUNK, "no reuse: DRAM shrinks toward its minimum"
    assert auto.adaptive["shrunk"] >= 1
    assert any("write policy write-through -> second-sighting" in r.getMessage() for r in caplog.records)
    assert any("auto: DRAM" in r.getMessage() for r in caplog.records)


async def test_auto_mode_keeps_the_hit_rate_of_the_best_fixed_size(tmp_path: Path) -> None:
    # Once it has learnt the traffic (the first half), auto mode started small serves about what the
    # largest DRAM allowed would (LRU: the largest size has the best DRAM hit rate of all).
    chains = workloads.zipf_prefixes(3000, prefixes=120, seed=16)
    largest = await run(tmp_path, chains, 2400, learn=1500, track=False)
    auto = await run(tmp_path, chains, 300, learn=1500, **AUTO, dram_min=40 * CHUNK, dram_max=2400 * CHUNK)
    assert auto.hit_rate >= 0.95 * largest.hit_rate, (largest.hit_rate, auto.hit_rate)
    assert auto.dram_hit_rate >= 0.95 * largest.dram_hit_rate, (largest.dram_hit_rate, auto.dram_hit_rate)
    assert auto.adaptive["grown"] >= 1
    assert auto.dram_bytes_end < 2400 * CHUNK, "past the knee, more DRAM buys little: auto stops short of the largest"


async def test_auto_mode_follows_a_phase_change(tmp_path: Path) -> None:
    chains = workloads.phase_change(
        workloads.zipf_prefixes(4000, prefixes=300, seed=17), workloads.all_unique(8000, seed=18)
    )
    auto = await run(
        tmp_path, chains, 1000, **{**AUTO, "half_life": 10_000}, dram_min=125 * CHUNK, dram_max=8000 * CHUNK
    )
    assert auto.adaptive["grown"] >= 1, "the Zipf phase wants more DRAM"
    assert auto.policy_end == "second-sighting", "the unique phase does not pay for writes below"
    assert auto.dram_bytes_end < 1000 * CHUNK


async def test_flush_waits_for_the_decision_a_lookup_started(tmp_path: Path) -> None:
    keys = [traces.trace_key(int(i)) for i in workloads.all_unique(1, chunks=4096, seed=19)[0]]
    config = store_config(tmp_path, 1000, 1000, **AUTO, dram_min=125 * CHUNK, dram_max=8000 * CHUNK)
    async with KVStore(config, LAYOUT, "adaptive") as store:
        assert await store.lookup(keys) == 0  # enough lookups for a decision: it starts, it has not run
        await store.flush()
        assert store.stats()["adaptive"]["decisions"] == 1
        assert store.stats()["adaptive"]["shrunk"] == 1, "nothing came back: DRAM shrinks, and flush saw it done"
        assert store.pool.capacity_bytes < 1000 * CHUNK


def test_auto_bounds_must_contain_the_capacity(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="adaptive.dram_max"):
        StoreConfig(dram={"capacity": "1GiB"}, adaptive={"auto": True, "dram_max": "512MiB"})


# -- the access trace ------------------------------------------------------------------------------------


async def test_store_writes_a_trace_of_every_lookup(tmp_path: Path) -> None:
    path = tmp_path / "lookups.kvtrace"
    chains = workloads.rag(300, seed=19)
    async with KVStore(store_config(tmp_path / "disk", 200, 10_000, trace=path), LAYOUT, "adaptive") as store:
        await replay(store, chains)
        running = traces.read_trace(path)  # a running store's trace is readable: whole batches so far
        assert 4096 <= len(running) < sum(len(chain) for chain in chains)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    trace = traces.read_trace(path)
    assert trace.meta["chunk_bytes"] == CHUNK and trace.meta["chunk_tokens"] == LAYOUT.chunk_tokens
    assert len(trace) == sum(len(chain) for chain in chains)
    assert [chain.tolist() for chain in trace.requests_as_chains()] == [chain.tolist() for chain in chains]
    assert np.all(np.diff(trace.times) >= 0)


async def test_a_trace_path_that_cannot_be_written_fails_at_open(tmp_path: Path) -> None:
    config = store_config(tmp_path, 100, 1000, trace=tmp_path / "missing" / "dir" / "t.kvtrace")
    with pytest.raises(ConfigError, match="adaptive.trace"):
        async with KVStore(config, LAYOUT, "adaptive"):
            pass


async def test_tracking_sees_the_keys_of_put_and_get_unchanged(tmp_path: Path) -> None:
    """Tracking changes no result: the same traffic gives the same hits with tracking on and off."""
    chains = workloads.zipf_prefixes(1500, prefixes=100, seed=20)
    off = await run(tmp_path, chains, 300, track=False)
    on = await run(tmp_path, chains, 300, track=True)
    assert (on.prefix_hits, on.dram_hits, on.written_below) == (off.prefix_hits, off.dram_hits, off.written_below)


async def test_second_sighting_writes_through_until_the_store_sees_a_lookup(tmp_path: Path) -> None:
    """A store that never looks up (a vLLM worker: lookups run in the scheduler's process) cannot judge: it writes."""
    config = store_config(tmp_path, 64, 10_000, policy="second-sighting")
    keys = [traces.trace_key(int(i)) for i in workloads.all_unique(1, chunks=3, seed=21)[0]]
    chunk = torch.zeros(LAYOUT.chunk_shape, dtype=LAYOUT.dtype)
    async with KVStore(config, LAYOUT, "adaptive") as store:
        (disk,) = store.tiers
        for key in keys:
            assert await store.put(key, chunk)
        await store.flush()
        assert all(disk.backend.holds(key) for key in keys)
        assert store.stats()["adaptive"]["held_back"] == 0


async def test_a_layer_stream_from_dram_releases_held_back_chunks(tmp_path: Path) -> None:
    config = store_config(tmp_path, 64, 10_000, policy="second-sighting")
    (chain,) = workloads.all_unique(1, chunks=3, seed=22)
    keys = [traces.trace_key(int(i)) for i in chain]
    async with KVStore(config, LAYOUT, "adaptive") as store:
        (disk,) = store.tiers
        await replay(store, [chain])
        assert not any(disk.backend.holds(key) for key in keys)
        async with store.prefetch(keys) as stream:
            layers = [layer async for layer, _ in stream]
        await store.flush()
        assert layers == list(range(LAYOUT.num_layers))
        assert all(disk.backend.holds(key) for key in keys)
        assert store.stats()["adaptive"]["released"] == 3


def test_sync_store_gives_advice(tmp_path: Path) -> None:
    chains = workloads.zipf_prefixes(400, prefixes=20, seed=23)
    chunk = torch.zeros(LAYOUT.chunk_shape, dtype=LAYOUT.dtype)
    with SyncKVStore(store_config(tmp_path, 200, 10_000), LAYOUT, "adaptive") as store:
        for chain in chains:
            keys = [traces.trace_key(int(i)) for i in chain]
            for key in keys[store.lookup(keys) :]:
                store.put(key, chunk)
        advice = store.advise()
    assert advice.references == sum(len(chain) for chain in chains)
    assert 0 < advice.rows[-1].hit_rate <= 1


async def test_a_trace_that_fails_to_write_stops_tracing_not_lookups(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "lookups.kvtrace"

    def full_disk(*args: object, **kwargs: object) -> None:
        raise OSError(28, "No space left on device")

    async with KVStore(store_config(tmp_path / "disk", 200, 10_000, trace=path), LAYOUT, "adaptive") as store:
        monkeypatch.setattr(store._tracker.trace, "append", full_disk)
        with caplog.at_level(logging.WARNING, logger="kvstore"):
            result = await replay(store, workloads.zipf_prefixes(1000, prefixes=50, seed=24))
        assert store._tracker.trace is None
        assert result.prefix_hits > 0
        assert store.advise().references == result.references  # the curve is still measured
    assert any("no longer tracing" in record.getMessage() for record in caplog.records)


async def test_the_bench_compares_fixed_configurations_with_auto_mode() -> None:
    """A smoke run of the replay bench's parts on little traffic (timings are printed, never checked)."""
    rows = await compare_one(workloads.all_unique(600, seed=25), dram_chunks=80, disk_chunks=5000)
    labels = [row.label for row in rows]
    assert labels[:3] == [f"write-through, {n} chunks" for n in ("10", "80", "640")]
    assert labels[3].startswith("second-sighting") and labels[4].startswith("auto")
    assert rows[3].written_below == 0 < rows[1].written_below  # one-off prompts: nothing below DRAM
    timings = await lookup_overhead(lookups=300, chain=4, rounds=1)
    assert set(timings) == {
        f"{case}_{variant}{suffix}"
        for case in ("dram", "disk")
        for variant in ("tracked", "untracked")
        for suffix in ("", "_call")
    }
    assert all(value > 0 for value in timings.values())
