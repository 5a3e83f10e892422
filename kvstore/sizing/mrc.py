"""Online miss-ratio curves: the hit rate an LRU tier would have at every size, from sampled reuse times.

The model is AET (Hu et al., "Kinetic Modeling of Data Eviction in Cache", USENIX ATC '16). Let
``P(t)`` be the fraction of references whose chunk is not referenced again within ``t`` further
references (its *reuse time* exceeds ``t``). An LRU cache of ``c`` chunks evicts a chunk ``T``
references after its last use, where ``P(0) + ... + P(T) = c``; a reference hits when its reuse
time is at most ``T``. So one histogram of reuse times gives the hit rate at every size.

Reuse times are sampled *in time*: each reference is watched with probability ``rate``, and its
reuse time is known when its chunk comes back. Watches still open when the curve is read count
as survivors up to their age (Kaplan-Meier), so recent traffic is not taken for cold.

Why not SHARDS (hashed sampling of chunks, measuring reuse *distances*)? It was built first and
measured: on prompt-prefix traffic a few hot prefixes carry a large share of all references,
and whether their chunks fall in the hashed sample swings the curve: 10-22 percentage points
off the exact LRU curve on a Zipf prefix workload at the same CPU cost, against under 1 point
here. Sampling references in time has no such lottery: each reference is watched alike.

The cost per reference is a handful of vector operations over a batch (hashing is the caller's)
plus Python for the ~2 x ``rate`` references that start or end a watch.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import numpy as np

MODELLED_EVICTION = "lru"
"""The eviction policy whose hit rates the curves give: AET models LRU (a tier evicting by a scan-resistant
policy, ``dram.eviction`` / ``disk.eviction``, hits differently: docs/eviction.md measures by how much)."""
BUCKETS_PER_OCTAVE = 16  # reuse-time resolution: ~4.4% apart
BUCKETS = BUCKETS_PER_OCTAVE * 48  # reuse times up to 2**48 references
SIGHTING_SLOTS = 1 << 22  # per row of the sighting sketch: 2 rows of uint8, 8 MiB (count-min: a chunk counts as
# seen early only if both its counters collide, ~6% of chunks with a million distinct ones per half-life)
# Integers in each bucket [2**(b/16), 2**((b+1)/16)): bucket b holds reuse times t with floor(16*log2(t)) == b.
_WIDTH = np.diff(np.ceil(np.exp2(np.arange(BUCKETS + 1) / BUCKETS_PER_OCTAVE)))


def time_bucket(reuse_time: int) -> int:
    return min(int(BUCKETS_PER_OCTAVE * math.log2(reuse_time)), BUCKETS - 1)


def _time_buckets(ages: np.ndarray) -> np.ndarray:
    return np.minimum((BUCKETS_PER_OCTAVE * np.log2(np.maximum(ages, 1))).astype(np.intp), BUCKETS - 1)


@dataclass
class ReuseProfile:
    """A snapshot of the sampled reuse times: what advice and plots are computed from.

    ``second`` is the part of ``reused`` where the chunk came back for its *second* sighting:
    what a write-on-second-sighting policy gives up below DRAM. Plain numbers and lists, so it
    travels as JSON.
    """

    references: float  # references seen (decayed like the histograms)
    first_sightings: float  # of which, a chunk's first sighting
    reused: np.ndarray  # watches ended by a reuse, per reuse-time bucket
    second: np.ndarray  # of which, the reuse was the chunk's second sighting
    censored: np.ndarray  # watches not ended (yet, or given up), per age bucket
    sample_rate: float
    tracked: int  # watches open now

    def hit_rate(self, size_chunks: float) -> float:
        """Fraction of references an LRU of ``size_chunks`` chunks would have served."""
        point = self._eviction_point(size_chunks)
        return 0.0 if point is None else self._hit_rate_at(point)

    def second_sighting_hit_rate(self, size_chunks: float) -> float:
        """Of :meth:`hit_rate`, the part that were chunks' second sightings (their share of the reuses it counts)."""
        point = self._eviction_point(size_chunks)
        if point is None:
            return 0.0
        _, _, bucket, fraction = point
        whole = self.reused[:bucket].sum() + (fraction * self.reused[bucket] if bucket < BUCKETS else 0.0)
        part = self.second[:bucket].sum() + (fraction * self.second[bucket] if bucket < BUCKETS else 0.0)
        return self._hit_rate_at(point) * part / whole if whole > 0 else 0.0

    def _hit_rate_at(self, point: tuple[np.ndarray, np.ndarray, int, float]) -> float:
        before, after, bucket, fraction = point
        survive = after[-1] if bucket == BUCKETS else before[bucket] - fraction * (before[bucket] - after[bucket])
        # Watches open at the end include chunks never seen again, which Kaplan-Meier takes for late
        # returns; but a first sighting never hits, so that is a hard ceiling.
        return float(min(1.0 - self.cold_fraction, max(0.0, 1.0 - survive)))

    def hit_rates(self, sizes: list[float] | np.ndarray) -> list[float]:
        return [self.hit_rate(size) for size in sizes]

    @property
    def cold_fraction(self) -> float:
        """References that were a chunk's first sighting (a miss at any size)."""
        return min(1.0, self.first_sightings / self.references) if self.references > 0 else 0.0

    def _survival(self) -> tuple[np.ndarray, np.ndarray]:
        """P(reuse time > t) at the start and at the end of each bucket (Kaplan-Meier)."""
        at_risk = np.cumsum((self.reused + self.censored)[::-1])[::-1]
        hazard = np.divide(self.reused, at_risk, out=np.zeros(BUCKETS), where=at_risk > 0)
        after = np.cumprod(1.0 - hazard)
        before = np.concatenate(([1.0], after[:-1]))
        return before, after

    def _eviction_point(self, size: float) -> tuple[np.ndarray, np.ndarray, int, float] | None:
        """The survival curve and where an LRU of ``size`` chunks evicts on it: (bucket, fraction into it).

        AET: the cache holds 1 + P(1) + ... + P(T) chunks after T references without a reuse, so the
        eviction time T is where that sum reaches ``size``. Bucket ``BUCKETS`` means past the last one.
        None without data, or for a cache of no chunk.
        """
        if size < 1 or self.reused.sum() + self.censored.sum() <= 0:
            return None
        before, after = self._survival()
        # Sum of P(t) over each bucket's integer times, the reuses spread evenly across them.
        per_bucket = _WIDTH * before - (before - after) * (_WIDTH + 1) / 2 * (_WIDTH > 0)
        filled = 1.0 + np.cumsum(per_bucket)
        bucket = int(np.searchsorted(filled, size))
        if bucket >= BUCKETS:
            return before, after, BUCKETS, 1.0
        start = filled[bucket - 1] if bucket > 0 else 1.0
        fraction = min(1.0, max(0.0, (size - start) / per_bucket[bucket])) if per_bucket[bucket] > 0 else 1.0
        return before, after, bucket, fraction

    def as_dict(self) -> dict[str, Any]:
        used = int(np.flatnonzero(self.reused + self.censored).max() + 1) if (self.reused + self.censored).any() else 0
        return {
            "references": self.references,
            "first_sightings": self.first_sightings,
            "reused": self.reused[:used].tolist(),
            "second": self.second[:used].tolist(),
            "censored": self.censored[:used].tolist(),
            "sample_rate": self.sample_rate,
            "tracked": self.tracked,
            "buckets_per_octave": BUCKETS_PER_OCTAVE,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ReuseProfile:
        if data.get("buckets_per_octave") != BUCKETS_PER_OCTAVE:
            raise ValueError(
                f"reuse profile has {data.get('buckets_per_octave')} buckets per octave, expected {BUCKETS_PER_OCTAVE}"
            )

        def array(name: str) -> np.ndarray:
            values = np.zeros(BUCKETS)
            values[: len(data[name])] = data[name]
            return values

        return cls(
            float(data["references"]),
            float(data["first_sightings"]),
            array("reused"),
            array("second"),
            array("censored"),
            float(data["sample_rate"]),
            int(data["tracked"]),
        )


class _Batch:
    """A batch of ids sorted by their sketch slot, then by position: each chunk's references in order.

    np.unique(return_index, return_counts) by hand, ~10x faster on a 4096-id batch (numpy 2.4): one
    plain sort of slot and position packed in an int64.
    """

    def __init__(self, ids: np.ndarray) -> None:
        self.ids = ids
        slots = (ids & np.uint64(SIGHTING_SLOTS - 1)).astype(np.intp)
        shift = len(ids).bit_length()
        packed = np.sort((slots << shift) | np.arange(len(ids)))
        self.slots_sorted = packed >> shift
        self.positions = packed & ((1 << shift) - 1)
        self.group_start = np.concatenate(([True], self.slots_sorted[1:] != self.slots_sorted[:-1]))


class ReuseSampler:
    """Watches a random ``rate`` of references until their chunk comes back. One writer (the event loop).

    Memory is bounded: at most ``max_watches`` open watches (the oldest is given up, counted as
    surviving to its age), plus fixed arrays (~8 MiB). ``half_life`` (references) lets old traffic
    fade after a phase change. ``count_sightings`` also answers :meth:`sightings`, which the
    second-sighting write policy asks at every put.
    """

    def __init__(
        self,
        rate: float = 1 / 64,
        max_watches: int = 1 << 16,
        half_life: float | None = None,
        seed: int | None = None,
    ) -> None:
        if not 0 < rate <= 1 or max_watches < 16:
            raise ValueError("rate must be in (0, 1] and max_watches >= 16")
        self.rate = rate
        self.max_watches = max_watches
        self.half_life = half_life
        self._random = np.random.default_rng(seed)
        self._watches: OrderedDict[int, int] = OrderedDict()  # hashed id -> 2 * start + (first sighting)
        self._watching = np.zeros(SIGHTING_SLOTS, dtype=np.uint8)  # open watches per sketch slot
        self._sightings = np.zeros((2, SIGHTING_SLOTS), dtype=np.uint8)
        self._reused, self._second, self._censored = np.zeros(BUCKETS), np.zeros(BUCKETS), np.zeros(BUCKETS)
        self.position = 0  # references seen, never decayed (watch starts are positions)
        self.references = 0.0
        self.first_sightings = 0.0
        self._since_decay = 0

    def record(self, ids: np.ndarray) -> None:
        """References to ``ids`` (uint64 hashes), in order."""
        count = len(ids)
        if count == 0:
            return
        batch = _Batch(ids.astype(np.uint64, copy=False))
        first = self._count_sightings(batch)
        picked = self._random.random(count) < self.rate
        base = self.position
        watches, reused, second, watching = self._watches, self._reused, self._second, self._watching
        for index in self._candidates(batch, picked).tolist():
            key = int(batch.ids[index])
            opened = watches.pop(key, None)
            if opened is not None:
                bucket = time_bucket(base + index - (opened >> 1))
                reused[bucket] += 1.0
                if opened & 1:
                    second[bucket] += 1.0
                watching[key & (SIGHTING_SLOTS - 1)] -= 1
            if picked[index]:
                watches[key] = 2 * (base + index) + int(first[index])
                watching[key & (SIGHTING_SLOTS - 1)] += 1
        while len(watches) > self.max_watches:  # give up the oldest: it survived at least this long
            key, opened = watches.popitem(last=False)
            self._censored[time_bucket(max(1, base + count - (opened >> 1)))] += 1.0
            watching[key & (SIGHTING_SLOTS - 1)] -= 1
        self.position += count
        self.references += count
        self.first_sightings += float(first.sum())
        if self.half_life is not None:
            self._since_decay += count
            if self._since_decay >= self.half_life:
                self._decay()

    def _candidates(self, batch: _Batch, picked: np.ndarray) -> np.ndarray:
        """Positions that may start or end a watch, in order: the only ones that need Python.

        A picked reference, the next reference to the same chunk (it ends that watch), and a chunk's
        first reference in the batch when a watch on it is open from before. Hot chunks come up many
        times a batch; their other references are skipped here, not in the loop.
        """
        picked_sorted = picked[batch.positions]
        wanted = picked_sorted.copy()
        wanted[1:] |= picked_sorted[:-1] & ~batch.group_start[1:]
        wanted |= batch.group_start & (self._watching[batch.slots_sorted] > 0)
        return np.sort(batch.positions[wanted])

    def _count_sightings(self, batch: _Batch) -> np.ndarray:
        """Count the batch into the sighting sketch; True where a reference is its chunk's first sighting."""
        starts = np.flatnonzero(batch.group_start)
        slots, first_at = batch.slots_sorted[starts], batch.positions[starts]
        times = np.diff(np.append(starts, len(batch.positions)))
        other = ((batch.ids[first_at] >> np.uint64(32)) & np.uint64(SIGHTING_SLOTS - 1)).astype(np.intp)
        rows = self._sightings
        seen = np.minimum(rows[0][slots], rows[1][other])
        rows[0][slots] = np.minimum(rows[0][slots] + times, 255)
        rows[1][other] = np.minimum(rows[1][other] + times, 255)
        first = np.zeros(len(batch.ids), dtype=bool)
        first[first_at[seen == 0]] = True
        return first

    def sightings(self, hashed: int) -> int:
        """How often the chunk with this hash has been referenced (recently: counts halve with the half-life)."""
        mask = SIGHTING_SLOTS - 1
        return int(min(self._sightings[0][hashed & mask], self._sightings[1][(hashed >> 32) & mask]))

    def _decay(self) -> None:
        self._since_decay = 0
        for histogram in (self._reused, self._second, self._censored):
            histogram *= 0.5
        self.references *= 0.5
        self.first_sightings *= 0.5
        self._sightings >>= 1

    def profile(self) -> ReuseProfile:
        censored = self._censored.copy()
        if self._watches:  # open watches have survived to their age so far
            starts = np.fromiter(self._watches.values(), dtype=np.int64, count=len(self._watches)) >> 1
            np.add.at(censored, _time_buckets(self.position - starts), 1.0)
        return ReuseProfile(
            references=self.references,
            first_sightings=self.first_sightings,
            reused=self._reused.copy(),
            second=self._second.copy(),
            censored=censored,
            sample_rate=self.rate,
            tracked=len(self._watches),
        )
