"""Online miss-ratio curves: the hit rate an LRU tier would have at every size, from sampled reuse distances.

An LRU cache of ``C`` chunks hits a reference exactly when the reference's *reuse distance* (the
number of distinct chunks referenced since the previous reference to the same chunk) is below
``C``. So one histogram of reuse distances gives the hit rate at every size at once.

Measuring every distance costs memory per distinct chunk and Python time per reference. SHARDS
(Waldspurger et al., FAST '15) samples *chunks*, not references: a chunk is tracked when its
64-bit id, mixed, falls below a threshold ``T`` (rate ``R = T / 2**64``); distances among tracked
chunks are scaled by ``1/R``. Because a chunk is either always or never sampled, its reuse is
seen whole. The fixed-size variant bounds memory: past ``max_keys`` tracked chunks the threshold
is lowered, dropping the chunks with the largest hashes. ``max_rate`` bounds CPU: at most that
fraction of references ever takes the slow path. SHARDS-adj puts the difference between the
references seen and the sampled weight into the smallest distance (where a hot chunk that
happens to be sampled, or not, lands). A half-life lets old traffic fade after a phase change.

Chosen over sampled ghost caches (one small LRU per candidate size) because one histogram answers
any size, including sizes picked after the fact (the disk tier's, an operator's what-if), and
costs one update per sampled reference instead of one per ghost.
"""

from __future__ import annotations

import heapq
import math
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import numpy as np

BUCKETS_PER_OCTAVE = 16  # histogram resolution: sizes ~4.4% apart
MAX_OCTAVES = 40  # distances up to 2**40 chunks
_FULL = 1 << 64

_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)


def mix64(ids: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser: ids that are not already uniform (counters, test ids) sample fairly."""
    z = ids.astype(np.uint64, copy=True)
    with np.errstate(over="ignore"):
        z ^= z >> np.uint64(30)
        z *= _M1
        z ^= z >> np.uint64(27)
        z *= _M2
        z ^= z >> np.uint64(31)
    return z


def bucket_of(distance: float) -> int:
    """Histogram bucket of a (scaled) reuse distance; bucket ``b`` covers [edge(b-1), edge(b))."""
    return min(int(BUCKETS_PER_OCTAVE * math.log2(distance + 1.0)), BUCKETS_PER_OCTAVE * MAX_OCTAVES - 1)


def bucket_edges() -> np.ndarray:
    """Upper edge of each bucket, in chunks (bucket ``b`` holds distances d with d + 1 < 2**((b+1)/16))."""
    return np.exp2(np.arange(1, BUCKETS_PER_OCTAVE * MAX_OCTAVES + 1) / BUCKETS_PER_OCTAVE) - 1.0


@dataclass
class ReuseProfile:
    """A snapshot of the sampled reuse-distance histogram: what advice and plots are computed from.

    Weights are in references (each sampled reference stands for ``1/R`` of them). ``second`` is the
    part of ``hits`` made of chunks' *second* sightings: what a write-on-second-sighting policy
    gives up below DRAM. Plain numbers and lists, so it travels as JSON.
    """

    references: float  # references seen (decayed)
    hits: np.ndarray  # weight per distance bucket
    second: np.ndarray  # of which, second sightings
    cold: float  # first sightings (weight)
    adjustment: float  # SHARDS-adj: references seen minus sampled weight, credited to distance 0
    sample_rate: float
    tracked: int  # chunks tracked now

    def hit_rate(self, size_chunks: float) -> float:
        """Fraction of references an LRU of ``size_chunks`` chunks would have served."""
        return self._rate(self.hits, size_chunks, self.adjustment)

    def second_sighting_hit_rate(self, size_chunks: float) -> float:
        """Of :meth:`hit_rate`, the fraction that were chunks' second sightings."""
        return self._rate(self.second, size_chunks, 0.0)

    def hit_rates(self, sizes: list[float] | np.ndarray) -> list[float]:
        return [self.hit_rate(size) for size in sizes]

    @property
    def cold_fraction(self) -> float:
        """References that were a chunk's first sighting (a miss at any size)."""
        return min(1.0, self.cold / self.references) if self.references > 0 else 0.0

    def _rate(self, histogram: np.ndarray, size: float, extra: float) -> float:
        if self.references <= 0 or size < 1:
            return 0.0
        cumulative = np.concatenate(([0.0], np.cumsum(histogram)))
        upper = np.concatenate(([0.0], bucket_edges()))  # cumulative[b] = weight of distances < upper[b]
        # Linear within a bucket: exact at the edges, which are ~4% apart.
        hits = float(np.interp(float(size), upper, cumulative)) + (extra if size >= 1 else 0.0)
        return min(1.0, max(0.0, hits / self.references))

    def as_dict(self) -> dict[str, Any]:
        used = int(np.flatnonzero(self.hits).max() + 1) if self.hits.any() else 0
        return {
            "references": self.references,
            "hits": self.hits[:used].tolist(),
            "second": self.second[:used].tolist(),
            "cold": self.cold,
            "adjustment": self.adjustment,
            "sample_rate": self.sample_rate,
            "tracked": self.tracked,
            "buckets_per_octave": BUCKETS_PER_OCTAVE,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ReuseProfile:
        if data.get("buckets_per_octave") != BUCKETS_PER_OCTAVE:
            raise ValueError(f"reuse profile has {data.get('buckets_per_octave')} buckets per octave, expected 16")
        size = BUCKETS_PER_OCTAVE * MAX_OCTAVES
        hits, second = np.zeros(size), np.zeros(size)
        hits[: len(data["hits"])] = data["hits"]
        second[: len(data["second"])] = data["second"]
        return cls(
            float(data["references"]),
            hits,
            second,
            float(data["cold"]),
            float(data["adjustment"]),
            float(data["sample_rate"]),
            int(data["tracked"]),
        )


class ShardsSampler:
    """Fixed-size SHARDS over a stream of 64-bit chunk ids. Not thread-safe: one writer (the event loop).

    ``horizon`` (chunks): a tracked chunk not referenced within that (scaled) distance is dropped,
    so a long run of never-repeated chunks does not push the rate down for good; its next
    reference counts as a first sighting, a miss at every size of interest either way.
    """

    def __init__(
        self,
        max_keys: int = 8192,
        max_rate: float = 1 / 32,
        half_life: float | None = None,
        horizon: float = float(1 << 26),
    ) -> None:
        if max_keys < 16 or not 0 < max_rate <= 1:
            raise ValueError("max_keys must be >= 16 and max_rate in (0, 1]")
        self.max_keys = max_keys
        self.half_life = half_life
        self.horizon = horizon
        self.threshold = min(_FULL, int(max_rate * _FULL))  # sample ids whose mix is below this
        self._limit = np.uint64(min(self.threshold, _FULL - 1))
        self._last: OrderedDict[int, int] = OrderedDict()  # tracked chunk -> stamp of its last reference
        self._seen_twice: set[int] = set()
        self._by_hash: list[int] = []  # max-heap (negated) of tracked hashes, for lowering the threshold
        self._alive = bytearray(4 * max_keys)  # 1 at stamps that are still some chunk's last reference
        self._clock = 0
        size = BUCKETS_PER_OCTAVE * MAX_OCTAVES
        self._hits, self._second = [0.0] * size, [0.0] * size  # lists: ~10x cheaper per update than numpy
        self._cold = 0.0
        self._sampled_weight = 0.0
        self.references = 0.0
        self._since_decay = 0.0

    @property
    def rate(self) -> float:
        return self.threshold / _FULL

    def record(self, ids: np.ndarray) -> None:
        """References to ``ids`` (uint64), in order. Costs a vector compare, plus Python per sampled one."""
        if len(ids) == 0:
            return
        mixed = mix64(ids)
        picked = np.flatnonzero(mixed < self._limit)
        for hashed in mixed[picked].tolist():
            if hashed < self.threshold:  # the threshold may have dropped within this batch
                self._reference(hashed)
        self.references += len(ids)
        if self.half_life is not None:
            self._since_decay += len(ids)
            if self._since_decay >= self.half_life:
                self._decay()

    def _reference(self, hashed: int) -> None:
        weight = _FULL / self.threshold
        self._sampled_weight += weight
        stamp = self._last.get(hashed)
        if stamp is None:
            self._cold += weight
            heapq.heappush(self._by_hash, -hashed)
            if len(self._by_hash) > 4 * self.max_keys:  # mostly stale entries of chunks forgotten as too old
                self._by_hash = [-key for key in self._last] + [-hashed]
                heapq.heapify(self._by_hash)
        else:
            distance = self._alive.count(1, stamp + 1, self._clock) * weight
            bucket = bucket_of(distance)
            self._hits[bucket] += weight
            if hashed not in self._seen_twice:
                self._second[bucket] += weight
                self._seen_twice.add(hashed)
            self._alive[stamp] = 0
            self._last.move_to_end(hashed)
        if self._clock == len(self._alive):
            self._compact()
        self._last[hashed] = self._clock
        self._alive[self._clock] = 1
        self._clock += 1
        if len(self._last) > self.max_keys:
            self._shrink()

    def _compact(self) -> None:
        """Renumber the live stamps 0..n-1 (in reference order) so the stamp array stays bounded."""
        for new, key in enumerate(self._last):
            self._last[key] = new
        self._alive[:] = bytes(len(self._alive))
        self._alive[: len(self._last)] = b"\x01" * len(self._last)
        self._clock = len(self._last)

    def _shrink(self) -> None:
        """Drop chunks until ``max_keys`` are tracked: stale ones past the horizon first, else lower the rate."""
        while len(self._last) > self.max_keys:
            oldest = next(iter(self._last))
            if (len(self._last) - 1) * _FULL / self.threshold > self.horizon:
                self._forget(oldest)
                continue
            self.threshold = -self._by_hash[0]  # the largest tracked hash: it and everything above go
            self._limit = np.uint64(self.threshold)
            while self._by_hash and -self._by_hash[0] >= self.threshold:
                self._forget(-heapq.heappop(self._by_hash))

    def _forget(self, hashed: int) -> None:
        """Stop tracking a chunk. Its heap entry, if any, goes stale and is skipped when it surfaces."""
        stamp = self._last.pop(hashed, None)
        if stamp is None:
            return
        self._alive[stamp] = 0
        self._seen_twice.discard(hashed)

    def _decay(self) -> None:
        self._since_decay = 0.0
        self._hits = [weight * 0.5 for weight in self._hits]
        self._second = [weight * 0.5 for weight in self._second]
        self._cold *= 0.5
        self._sampled_weight *= 0.5
        self.references *= 0.5

    def profile(self) -> ReuseProfile:
        return ReuseProfile(
            references=self.references,
            hits=np.array(self._hits),
            second=np.array(self._second),
            cold=self._cold,
            adjustment=self.references - self._sampled_weight,
            sample_rate=self.rate,
            tracked=len(self._last),
        )
