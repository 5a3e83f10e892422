"""Online tracking of chunk lookups, and the auto mode that sizes the DRAM tier and picks the write policy.

The lookup path only appends the keys to a list (~0.1 us); they are processed in batches of a few
thousand: hashed, fed to the SHARDS sampler (:mod:`kvstore.mrc`), counted as sightings (for the
second-sighting write policy) and, when asked, appended to a trace file that ``kvstore advise``
reads. Everything here runs on the store's event loop; nothing is shared with other threads.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from kvstore.advice import Policy
from kvstore.keys import ChunkKey
from kvstore.mrc import ReuseProfile, ShardsSampler

log = logging.getLogger("kvstore.adaptive")
DRAIN_REFERENCES = 4096  # batch size: numpy's per-call overhead spread over this many keys
SIGHTING_SLOTS = 1 << 21  # hashed sighting counters (uint16): 4 MiB; a collision only admits a write early
SIGHTING_CAP = 1000


class AccessTracker:
    """Sees every chunk lookup; keeps the reuse profile, sighting counts and (optionally) a trace."""

    def __init__(
        self,
        *,
        max_keys: int,
        max_rate: float,
        half_life: float,
        count_sightings: bool,
        trace_path: Path | None = None,
        trace_meta: dict[str, Any] | None = None,
    ) -> None:
        self.sampler = ShardsSampler(max_keys=max_keys, max_rate=max_rate, half_life=half_life)
        self._half_life = half_life
        self._pending: list[Sequence[ChunkKey]] = []
        self._pending_times: list[float] = []
        self._pending_count = 0
        self.references = 0  # lookups' keys processed so far
        self.requests = 0
        self._sightings = np.zeros(SIGHTING_SLOTS, dtype=np.uint16) if count_sightings else None
        self._since_halving = 0
        self._started = time.monotonic()
        self.trace = None
        if trace_path is not None:
            from kvstore.traces import TraceWriter

            self.trace = TraceWriter(trace_path, trace_meta or {})

    def note(self, keys: Sequence[ChunkKey]) -> None:
        """One lookup's keys, in prefix order (the caller must not change the sequence afterwards)."""
        self._pending.append(keys)
        self._pending_times.append(time.monotonic())
        self._pending_count += len(keys)
        if self._pending_count >= DRAIN_REFERENCES:
            self.drain()

    @property
    def pending(self) -> int:
        """Keys noted but not processed yet."""
        return self._pending_count

    def drain(self) -> None:
        """Process the pending lookups (cheap when there are none)."""
        if not self._pending:
            return
        batches, times = self._pending, self._pending_times
        self._pending, self._pending_times, self._pending_count = [], [], 0
        keys = [key for batch in batches for key in batch]
        # str caches its hash, and the DRAM index already computed it: ~20 ns a key, uniform enough to
        # sample on (per process: traces store stable ids instead).
        hashed = np.fromiter(map(hash, keys), dtype=np.int64, count=len(keys)).view(np.uint64)
        self.sampler.record(hashed)
        if self._sightings is not None:
            self._count_sightings(hashed)
        if self.trace is not None:
            self._write_trace(batches, times, keys)
        self.references += len(keys)
        self.requests += len(batches)

    def _count_sightings(self, hashed: np.ndarray) -> None:
        assert self._sightings is not None
        slots = (hashed & np.uint64(SIGHTING_SLOTS - 1)).astype(np.intp)
        np.add.at(self._sightings, slots, 1)
        np.minimum(self._sightings[slots], SIGHTING_CAP, out=self._sightings[slots])
        self._since_halving += len(hashed)
        if self._since_halving >= self._half_life:  # old sightings fade like the profile's weights
            self._sightings >>= 1
            self._since_halving = 0

    def _write_trace(self, batches: list[Sequence[ChunkKey]], times: list[float], keys: list[ChunkKey]) -> None:
        from kvstore.traces import key_ids

        assert self.trace is not None
        lengths = np.fromiter(map(len, batches), dtype=np.int64, count=len(batches))
        request_numbers = np.arange(self.requests, self.requests + len(batches), dtype=np.uint32)
        self.trace.append(
            np.repeat(np.asarray(times) - self._started, lengths),
            np.repeat(request_numbers, lengths),
            key_ids(keys),
        )

    def seen_before(self, key: ChunkKey) -> bool:
        """Whether ``key`` was looked up before the lookup that led to this put (two sightings or more)."""
        if self._sightings is None:
            return True
        self.drain()
        return bool(self._sightings[hash(key) & (SIGHTING_SLOTS - 1)] >= 2)

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

    def __init__(self, policy: Policy) -> None:
        self.policy: Policy = policy
        self.decisions = 0
        self.resizes = 0
        self.grown = 0
        self.shrunk = 0
        self.policy_switches = 0
        self.held_back = 0  # chunks kept out of the lower tiers by the second-sighting policy
        self.released = 0  # of which, sent on later (a second sighting hit them in DRAM)

    def as_dict(self) -> dict[str, int | str]:
        return dict(vars(self))
