"""Online tracking of chunk lookups, and the auto mode that sizes the DRAM tier and picks the write policy.

The lookup path only appends the keys to a list (~0.2 us). They are processed in batches of a few
thousand, right after the lookup that filled a batch returns: hashed, fed to the reuse-time
sampler (:mod:`kvstore.sizing.mrc`, which also counts sightings for the second-sighting write policy)
and, when asked, appended to a trace file that ``kvstore advise`` reads. Everything here runs on
the store's event loop; nothing is shared with other threads.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from kvstore.errors import ConfigError
from kvstore.keys import ChunkKey, namespace_dir
from kvstore.sizing.advice import DEFAULT_BANDWIDTH, UNBOUNDED, Advice, CostModel, TierCost, advise
from kvstore.sizing.mrc import ReuseProfile, ReuseSampler
from kvstore.sizing.traces import TraceWriter, key_ids

if TYPE_CHECKING:
    from kvstore.engine.store import KVStore

log = logging.getLogger("kvstore.adaptive")
DRAIN_REFERENCES = 4096  # batch size: numpy's per-call overhead spread over this many keys
GROW_GAIN = 0.005  # auto mode grows DRAM only for at least this much more net saving (of prefill compute)
SHRINK_BY = 0.8  # and shrinks it only to at most this share of its size


class AccessTracker:
    """Sees every chunk lookup; keeps the reuse profile, sighting counts and (optionally) a trace."""

    def __init__(
        self,
        *,
        sample_rate: float,
        max_watches: int,
        half_life: float,
        trace_path: Path | None = None,
        trace_meta: dict[str, Any] | None = None,
    ) -> None:
        self.sampler = ReuseSampler(sample_rate, max_watches, half_life, seed=0)  # seeded: same traffic, same advice
        self._pending: list[Sequence[ChunkKey]] = []
        self._pending_times: list[float] = []
        self._pending_count = 0
        self._drain_scheduled = False
        self.references = 0  # lookups' keys processed so far
        self.requests = 0
        self._started = time.monotonic()
        self.trace = TraceWriter(trace_path, trace_meta or {}) if trace_path is not None else None

    def note(self, keys: Sequence[ChunkKey]) -> None:
        """One lookup's keys, in prefix order (the caller must not change the sequence afterwards)."""
        self._pending.append(keys)
        self._pending_times.append(time.monotonic())
        self._pending_count += len(keys)
        if self._pending_count >= DRAIN_REFERENCES and not self._drain_scheduled:
            # Right after the lookup returns, not inside it: the engine does not wait for the batch.
            asyncio.get_running_loop().call_soon(self.drain)
            self._drain_scheduled = True

    @property
    def pending(self) -> int:
        """Keys noted but not processed yet."""
        return self._pending_count

    def drain(self) -> None:
        """Process the pending lookups (cheap when there are none)."""
        self._drain_scheduled = False
        if not self._pending:
            return
        batches, times = self._pending, self._pending_times
        self._pending, self._pending_times, self._pending_count = [], [], 0
        count = sum(map(len, batches))
        # str caches its hash, and the DRAM index already computed it: ~30 ns a key, uniform enough to
        # sample on (per process: traces store stable ids instead).
        hashed = np.fromiter(map(hash, itertools.chain.from_iterable(batches)), dtype=np.int64, count=count)
        self.sampler.record(hashed.view(np.uint64))
        if self.trace is not None:
            try:
                self._write_trace(batches, times)
            except OSError as exc:  # a full disk must not break lookups: stop tracing, say so once
                log.warning("adaptive.trace: writing %s failed (%r); no longer tracing", self.trace.path, exc)
                trace, self.trace = self.trace, None
                with contextlib.suppress(OSError):
                    trace.close()
        self.references += count
        self.requests += len(batches)

    def _write_trace(self, batches: list[Sequence[ChunkKey]], times: list[float]) -> None:
        assert self.trace is not None
        lengths = np.fromiter(map(len, batches), dtype=np.int64, count=len(batches))
        request_numbers = ((np.arange(len(batches)) + self.requests) % 2**32).astype(np.uint32)  # wraps, as stored
        self.trace.append(
            np.repeat(np.asarray(times) - self._started, lengths),
            np.repeat(request_numbers, lengths),
            key_ids([key for batch in batches for key in batch]),
        )
        self.trace.flush()  # one write per batch: `kvstore advise` can read the trace of a running store

    def seen_before(self, key: ChunkKey) -> bool:
        """Whether ``key`` was looked up before the lookup that led to this put (two sightings or more).

        True while this store has seen no lookup at all: it cannot judge (e.g. a vLLM worker process,
        whose lookups run in the scheduler's process), so it writes through.
        """
        if self.references + self._pending_count == 0:
            return True
        self.drain()
        return self.sampler.sightings(hash(key)) >= 2

    def profile(self) -> ReuseProfile:
        self.drain()
        return self.sampler.profile()

    def close(self) -> None:
        self.drain()
        if self.trace is not None:
            self.trace.close()


class HeldBack:
    """Chunks put into DRAM but not yet below it (second-sighting policy), so a DRAM hit can send them on.

    Bounded: the oldest entries go first; by then their chunk has usually left DRAM anyway.
    """

    def __init__(self, limit: int) -> None:
        self.limit = max(16, limit)
        self._keys: OrderedDict[ChunkKey, None] = OrderedDict()

    def add(self, key: ChunkKey) -> None:
        self._keys[key] = None
        if len(self._keys) > self.limit:
            self._keys.popitem(last=False)

    def take(self, key: ChunkKey) -> bool:
        """True (once) if ``key`` was held back."""
        return self._keys.pop(key, False) is None

    def __len__(self) -> int:
        return len(self._keys)


class AdaptiveCounters:
    """What auto mode did, for ``stats()`` and Prometheus."""

    def __init__(self) -> None:
        self.decisions = 0
        self.resizes = 0
        self.grown = 0
        self.shrunk = 0
        self.policy_switches = 0
        self.held_back = 0  # chunks kept out of the lower tiers by the second-sighting policy
        self.released = 0  # of which, sent on later (a second sighting hit them in DRAM)

    def as_dict(self) -> dict[str, int]:
        return dict(vars(self))


def make_tracker(store: KVStore) -> AccessTracker | None:
    """The store's tracker, if anything needs one (advice, auto mode, a policy, a trace)."""
    adaptive = store.config.adaptive
    wanted = adaptive.track or adaptive.auto or adaptive.policy != "write-through" or adaptive.trace is not None
    if not wanted:
        return None
    layout = store.layout
    meta = {
        "chunk_tokens": layout.chunk_tokens,
        "chunk_bytes": layout.chunk_nbytes,
        "layout": layout.describe(),
        "namespace": namespace_dir(store.namespace),
        "dram_bytes": store.pool.capacity_bytes,
        "started": time.time(),
    }
    try:
        return AccessTracker(
            sample_rate=adaptive.sample_rate,
            max_watches=adaptive.max_watches,
            half_life=adaptive.half_life,
            trace_path=adaptive.trace,
            trace_meta=meta,
        )
    except OSError as exc:
        raise ConfigError(f"adaptive.trace: cannot create {adaptive.trace} ({exc}); fix the path") from None


def cost_model(store: KVStore) -> CostModel:
    """Seconds per chunk to recompute, copy in DRAM and use each tier: the store's own timings where it has them."""
    chunk = store.layout.chunk_nbytes
    lower = []
    for tier in store.tiers:
        stats, latency = tier.stats, tier.latency
        local = tier.is_local
        default_read = DEFAULT_BANDWIDTH["disk_read" if local else "remote"]
        default_write = DEFAULT_BANDWIDTH["disk_write" if local else "remote"]
        read_s = latency.read.sum / stats.hits if stats.hits >= 8 else chunk / default_read
        writes = stats.writes + stats.skipped
        write_s = latency.write.sum / writes if writes >= 8 else chunk / default_write
        capacity = getattr(tier.backend, "capacity_bytes", None)
        stored = stats.bytes_written / stats.writes if stats.writes else chunk
        chunks = capacity / max(1.0, stored) if capacity else UNBOUNDED
        lower.append(TierCost(tier.name, chunks, read_s, write_s))
    return CostModel(
        chunk_bytes=chunk,
        recompute_s=store.layout.chunk_tokens / store.config.adaptive.prefill_tokens_per_s,
        dram_copy_s=chunk / copy_bandwidth(),
        lower=lower,
    )


def store_advice(store: KVStore, bounds: tuple[int, int] | None) -> tuple[Advice, ReuseProfile, CostModel]:
    """The store's advice, with the curve and the costs it came from (auto mode weighs them again)."""
    if store._tracker is None:
        raise RuntimeError("advise() needs the access tracker: set adaptive.track = true")
    profile, cost = store._tracker.profile(), cost_model(store)
    knee = store.config.adaptive.knee
    return advise(profile, cost, store.pool.capacity_bytes, store.policy, bounds=bounds, knee=knee), profile, cost


_copy_rate: float | None = None


def copy_bandwidth() -> float:
    """Bytes per second of a copy into pre-allocated memory, measured once per process (~10 ms)."""
    global _copy_rate
    if _copy_rate is None:
        source, target = torch.ones(16 << 20, dtype=torch.uint8), torch.empty(16 << 20, dtype=torch.uint8)
        target.copy_(source)  # first touch
        start = time.perf_counter()
        for _ in range(4):
            target.copy_(source)
        _copy_rate = 4 * source.numel() / max(1e-6, time.perf_counter() - start)
    return _copy_rate


class AutoMode:
    """Auto mode for one store: now and then, decides the DRAM size and the write policy; logs and counts changes."""

    def __init__(self, store: KVStore) -> None:
        self.store = store
        self._task: asyncio.Task[None] | None = None
        self._last = (0, time.monotonic())  # (lookups seen, time) at the last decision

    def cancel(self) -> None:
        """Stop a decision in progress (the store is closing); a resize thread already running finishes."""
        if self._task is not None:
            self._task.cancel()

    def maybe_decide(self) -> None:
        """Start a decision when enough lookups and time have passed since the last one."""
        tracker, adaptive = self.store._tracker, self.store.config.adaptive
        assert tracker is not None
        if self._task is not None and not self._task.done():
            return
        seen, (references, at) = tracker.references + tracker.pending, self._last
        if seen - references < adaptive.min_references or time.monotonic() - at < adaptive.interval:
            return
        self._last = (seen, time.monotonic())
        self._task = asyncio.create_task(self.decide(), name="kvstore-auto")

    async def decide(self) -> None:
        """One decision: the write policy, then DRAM resized within the bounds (in a thread: it allocates)."""
        store, counters = self.store, self.store.adaptive
        try:
            advice, profile, cost = store_advice(store, store.config.dram_bounds())
            counters.decisions += 1
            policy = advice.recommended_policy
            if policy != store.policy:
                log.info(
                    "auto: write policy %s -> %s (net saving %+.1f%% -> %+.1f%% of prefill)",
                    store.policy,
                    policy,
                    100 * advice.savings[store.policy],
                    100 * advice.savings[policy],
                )
                store.policy = policy
                counters.policy_switches += 1
            before, target = store.pool.capacity_bytes, advice.recommended_dram_bytes
            chunk = store.layout.chunk_nbytes
            gain = cost.net_saving(profile, target / chunk, policy) - cost.net_saving(profile, before / chunk, policy)
            # Hysteresis, so sampling noise does not resize back and forth: grow for a real gain, shrink
            # for real memory (the knee already bounds what a shrink gives up).
            if target == before or (target > before and gain < GROW_GAIN) or (before > target > SHRINK_BY * before):
                return
            await asyncio.get_running_loop().run_in_executor(store._executor, store.pool.resize, target)
            after = store.pool.capacity_bytes
            if after == before:
                return
            counters.resizes += 1
            counters.grown += after > before
            counters.shrunk += after < before
            expected = next(row.dram_hit_rate for row in advice.rows if row.dram_bytes == target)
            log.info(
                "auto: DRAM %d -> %d chunks (%.1f -> %.1f MiB; DRAM hit rate %.0f%% expected)",
                before // chunk,
                after // chunk,
                before / 2**20,
                after / 2**20,
                100 * expected,
            )
        except Exception:
            log.exception("auto: a sizing decision failed; the store keeps its current size and policy")
