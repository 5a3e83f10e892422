"""Online tracking of chunk lookups, and the auto mode that sizes the DRAM tier and picks the write policy.

The lookup path only appends the keys to a list (~0.2 us). They are processed in batches of a few
thousand, right after the lookup that filled a batch returns: hashed, fed to the reuse-time
sampler (:mod:`kvstore.sizing.mrc`, which also counts sightings for the second-sighting admission policy)
and, when asked, appended to a trace file that ``kvstore advise`` reads. Everything here runs on
the store's event loop; nothing is shared with other threads.

Auto mode sees the store only through :class:`SizingTarget`: what it may read (the advice for the
traffic so far, the DRAM size) and change (the write policy, :mod:`kvstore.admission`, by name; the
DRAM size). Nothing here imports the engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from kvstore.admission import POLICIES as ADMISSION_POLICIES
from kvstore.config import AdaptiveConfig
from kvstore.errors import ConfigError
from kvstore.keys import ChunkKey, namespace_dir
from kvstore.layout import KVLayout
from kvstore.sizing.advice import Advice, CostModel, Policy
from kvstore.sizing.mrc import ReuseProfile, ReuseSampler
from kvstore.sizing.traces import TraceWriter, key_hash, spread_ids, valid_key_ids

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
        ids = valid_key_ids(itertools.chain.from_iterable(batches), count)  # one hex decode: sampling and trace
        self.sampler.record(spread_ids(ids))
        if self.trace is not None:
            try:
                self._write_trace(batches, times, ids)
            except OSError as exc:  # a full disk must not break lookups: stop tracing, say so once
                log.warning("adaptive.trace: writing %s failed (%r); no longer tracing", self.trace.path, exc)
                trace, self.trace = self.trace, None
                with contextlib.suppress(OSError):
                    trace.close()
        self.references += count
        self.requests += len(batches)

    def _write_trace(self, batches: list[Sequence[ChunkKey]], times: list[float], ids: np.ndarray) -> None:
        assert self.trace is not None
        lengths = np.fromiter(map(len, batches), dtype=np.int64, count=len(batches))
        request_numbers = ((np.arange(len(batches)) + self.requests) % 2**32).astype(np.uint32)  # wraps, as stored
        self.trace.append(
            np.repeat(np.asarray(times) - self._started, lengths),
            np.repeat(request_numbers, lengths),
            ids,
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
        return self.sampler.sightings(key_hash(key)) >= 2

    def profile(self) -> ReuseProfile:
        self.drain()
        return self.sampler.profile()

    def close(self) -> None:
        self.drain()
        if self.trace is not None:
            self.trace.close()


class AdaptiveCounters:
    """What auto mode did, for ``stats()["adaptive"]`` and Prometheus (the admission policy counts its own)."""

    def __init__(self) -> None:
        self.decisions = 0
        self.resizes = 0
        self.grown = 0
        self.shrunk = 0
        self.policy_switches = 0

    def as_dict(self) -> dict[str, int]:
        return dict(vars(self))


def make_tracker(settings: AdaptiveConfig, layout: KVLayout, namespace: str, dram_bytes: int) -> AccessTracker | None:
    """A store's tracker, if anything needs one (advice, auto mode, a policy's sightings, a trace); else None.

    A trace file records the store's layout, namespace and DRAM size, for ``kvstore advise`` to
    size chunks by. A trace path that cannot be created raises :class:`ConfigError` naming it.
    """
    sightings = ADMISSION_POLICIES[settings.policy].uses_sightings
    wanted = settings.track or settings.auto or sightings or settings.trace is not None
    if not wanted:
        return None
    try:
        return AccessTracker(
            sample_rate=settings.sample_rate,
            max_watches=settings.max_watches,
            half_life=settings.half_life,
            trace_path=settings.trace,
            trace_meta={
                "chunk_tokens": layout.chunk_tokens,
                "chunk_bytes": layout.chunk_nbytes,
                "layout": layout.describe(),
                "namespace": namespace_dir(namespace),
                "dram_bytes": dram_bytes,
                "started": time.time(),
            },
        )
    except OSError as exc:
        raise ConfigError(f"adaptive.trace: cannot create {settings.trace} ({exc}); fix the path") from None


class SizingTarget(Protocol):
    """What auto mode may read and change in a store (:class:`kvstore.KVStore` is one)."""

    policy: Policy  # the write policy in force; auto mode assigns the one it recommends

    @property
    def dram_bytes(self) -> int:
        """The DRAM tier's capacity now."""
        ...

    def sizing_advice(self, bounds: tuple[int, int] | None) -> tuple[Advice, ReuseProfile, CostModel]:
        """The advice for the traffic seen so far, with the curve and the costs it came from (no I/O)."""
        ...

    async def resize_dram(self, capacity_bytes: int) -> int:
        """Resize the DRAM tier (off the event loop: it allocates); the capacity it has afterwards."""
        ...


class AutoMode:
    """Auto mode for one store: now and then, decides the DRAM size and the write policy; logs and counts changes."""

    def __init__(
        self,
        target: SizingTarget,
        tracker: AccessTracker,
        settings: AdaptiveConfig,
        bounds: tuple[int, int],
        counters: AdaptiveCounters,
    ) -> None:
        self.target, self.tracker, self.settings = target, tracker, settings
        self.bounds, self.counters = bounds, counters
        self._task: asyncio.Task[None] | None = None
        self._last = (0, time.monotonic())  # (lookups seen, time) at the last decision

    def cancel(self) -> None:
        """Stop a decision in progress (the store is closing); a resize thread already running finishes."""
        if self._task is not None:
            self._task.cancel()

    async def settle(self) -> None:
        """Wait for the decision in progress, if any, to finish (it never raises: failures are logged)."""
        if self._task is not None:
            await asyncio.wait([self._task])

    def maybe_decide(self) -> None:
        """Start a decision when enough lookups and time have passed since the last one (never waits)."""
        if self._task is not None and not self._task.done():
            return
        seen, (references, at) = self.tracker.references + self.tracker.pending, self._last
        if seen - references < self.settings.min_references or time.monotonic() - at < self.settings.interval:
            return
        self._last = (seen, time.monotonic())
        self._task = asyncio.create_task(self.decide(), name="kvstore-auto")

    async def decide(self) -> None:
        """One decision: the write policy, then DRAM resized within the bounds."""
        target, counters = self.target, self.counters
        try:
            advice, profile, cost = target.sizing_advice(self.bounds)
            counters.decisions += 1
            policy = advice.recommended_policy
            if policy != target.policy:
                log.info(
                    "auto: write policy %s -> %s (net saving %+.1f%% -> %+.1f%% of prefill)",
                    target.policy,
                    policy,
                    100 * advice.savings[target.policy],
                    100 * advice.savings[policy],
                )
                target.policy = policy
                counters.policy_switches += 1
            before, wanted = target.dram_bytes, advice.recommended_dram_bytes
            chunk = cost.chunk_bytes
            gain = cost.net_saving(profile, wanted / chunk, policy) - cost.net_saving(profile, before / chunk, policy)
            # Hysteresis, so sampling noise does not resize back and forth: grow for a real gain, shrink
            # for real memory (the knee already bounds what a shrink gives up).
            if wanted == before or (wanted > before and gain < GROW_GAIN) or (before > wanted > SHRINK_BY * before):
                return
            after = await target.resize_dram(wanted)
            if after == before:
                return
            counters.resizes += 1
            counters.grown += after > before
            counters.shrunk += after < before
            expected = next(row.dram_hit_rate for row in advice.rows if row.dram_bytes == wanted)
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
