"""What a tier size and a write policy are worth: a cost model over a miss-ratio curve, and plain advice.

Every figure is a fraction of *prefill compute*: the engine time that recomputing every chunk
would take. A hit saves a chunk's recompute time less the time to load it; every chunk stored
costs the copy into DRAM and the writes below it. So "net saving 40%" means the cache, all
costs paid, gives back 40% of the prefill time the engine would otherwise spend.

Tiers are inclusive (each lower tier holds what the faster ones hold, as write-through makes
them), so a tier's cumulative hit rate is the curve at the larger of its size and the faster
tiers' sizes. Remote tiers (Redis, S3) are taken as unbounded: their size is set by retention
(``kvstore gc``, TTL), not by a budget.

Write (admission) policies, :mod:`kvstore.admission`, modelled here by name:
- ``write-through``: every chunk put goes to every tier.
- ``second-sighting``: a chunk goes below DRAM only once its prefix has been looked up before,
  so one-off prompts cost a DRAM copy and nothing else. It gives up the lower-tier hits that
  were chunks' second sightings (the profile measures those).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any, get_args

import numpy as np

from kvstore.admission import AdmissionName
from kvstore.sizing.mrc import ReuseProfile
from kvstore.util.units import human_bytes

Policy = AdmissionName  # the admission policies this cost model weighs, by name
POLICIES: tuple[Policy, ...] = get_args(AdmissionName)
SIZE_FACTORS = (1 / 8, 1 / 4, 1 / 2, 1, 2, 4, 8)  # the sizes advice shows, relative to the current one
UNBOUNDED = float(1 << 40)  # chunks: "as large as retention lets it grow"
# Bytes per second until a store has timed its own tiers: this machine kind's baselines (DESIGN.md).
DEFAULT_BANDWIDTH = {"dram_copy": 15e9, "disk_read": 2e9, "disk_write": 1e9, "remote": 1e9}


@dataclass
class TierCost:
    """One tier below DRAM: its size, and seconds per chunk to read it back and to store it."""

    name: str
    capacity_chunks: float  # UNBOUNDED for remote tiers
    read_s: float
    write_s: float


@dataclass
class CostModel:
    """Seconds per chunk for each thing a reference can cost or save."""

    chunk_bytes: int
    recompute_s: float  # chunk_tokens / prefill rate
    dram_copy_s: float  # one copy of a chunk to or from DRAM
    lower: list[TierCost] = field(default_factory=list)  # fastest first

    def net_saving(self, profile: ReuseProfile, dram_chunks: float, policy: Policy) -> float:
        """Net fraction of prefill compute the cache saves at this DRAM size under ``policy``."""
        sizes = [dram_chunks] + [max(dram_chunks, tier.capacity_chunks) for tier in self.lower]
        cumulative = [profile.hit_rate(size) for size in sizes]
        second = [profile.second_sighting_hit_rate(size) for size in sizes]
        saved = cumulative[0] * (self.recompute_s - self.dram_copy_s)
        hits = cumulative[0]
        for i, tier in enumerate(self.lower, start=1):
            tier_hits = cumulative[i] - cumulative[i - 1]
            if policy == "second-sighting":  # a chunk's second sighting finds nothing below DRAM yet
                tier_hits -= second[i] - second[i - 1]
            saved += tier_hits * (self.recompute_s - tier.read_s - self.dram_copy_s)
            hits += tier_hits
        write_below = sum(tier.write_s for tier in self.lower)
        misses = max(0.0, 1.0 - hits)
        if policy == "write-through":
            written_below = misses
        else:  # repeats that missed, plus DRAM hits on second sightings (cascaded then)
            written_below = max(0.0, misses - profile.cold_fraction) + second[0]
        cost = misses * self.dram_copy_s + written_below * write_below
        return (saved - cost) / self.recompute_s

    def hit_rate(self, profile: ReuseProfile, dram_chunks: float, policy: Policy) -> float:
        """Fraction of lookups served by some tier."""
        if not self.lower:
            return profile.hit_rate(dram_chunks)
        largest = max(dram_chunks, max(tier.capacity_chunks for tier in self.lower))
        rate = profile.hit_rate(largest)
        if policy == "second-sighting":
            rate -= profile.second_sighting_hit_rate(largest) - profile.second_sighting_hit_rate(dram_chunks)
        return rate


@dataclass(frozen=True)
class TierRates:
    """A tier below DRAM as measured or assumed: its size in bytes and its bandwidths in bytes per second.

    What a caller knows (a store's timings, or ``kvstore advise`` options); :func:`cost_model` turns
    it into the per-chunk terms of a :class:`TierCost`.
    """

    name: str
    capacity_bytes: float | None  # None: unbounded (Redis/S3: retention sets their size)
    read_bytes_per_s: float  # math.inf: too fast to matter (costs nothing per chunk)
    write_bytes_per_s: float


def cost_model(
    chunk_bytes: int,
    chunk_tokens: int,
    prefill_tokens_per_s: float,
    dram_copy_bytes_per_s: float,
    tiers: Sequence[TierRates],
) -> CostModel:
    """The cost model of a store whose chunks are ``chunk_bytes`` for ``chunk_tokens`` tokens.

    Sizes become chunks (:data:`UNBOUNDED` for a tier without one) and bandwidths become seconds
    per chunk; ``tiers`` are the tiers below DRAM, fastest first. The one place both auto mode and
    ``kvstore advise`` build their costs, so the two always weigh a configuration alike.
    """
    lower = [
        TierCost(
            tier.name,
            UNBOUNDED if tier.capacity_bytes is None else tier.capacity_bytes / chunk_bytes,
            chunk_bytes / tier.read_bytes_per_s,
            chunk_bytes / tier.write_bytes_per_s,
        )
        for tier in tiers
    ]
    return CostModel(
        chunk_bytes=chunk_bytes,
        recompute_s=chunk_tokens / prefill_tokens_per_s,
        dram_copy_s=chunk_bytes / dram_copy_bytes_per_s,
        lower=lower,
    )


@dataclass
class SizeRow:
    """One DRAM size in the advice's table: its hit rates and net saving."""

    dram_bytes: int
    dram_hit_rate: float  # of lookups, served by DRAM
    hit_rate: float  # of lookups, served by some tier (under the recommended policy)
    net_saving: float  # fraction of prefill compute (under the recommended policy)


@dataclass
class Advice:
    """What :func:`advise` found: the rows it weighed, the size and policy it recommends, and why, in sentences."""

    references: float
    sample_rate: float
    cold_fraction: float
    policy: Policy  # in force now
    recommended_policy: Policy
    savings: dict[str, float]  # per policy, at the current DRAM size
    dram_bytes: int
    recommended_dram_bytes: int
    rows: list[SizeRow]
    disk_rows: list[tuple[int, float]]  # disk bytes, cumulative hit rate (DRAM + disk) at the current DRAM size
    verdict: list[str]
    recommended_disk_bytes: int | None = None  # the first bounded tier below DRAM (the disk), if any

    def as_dict(self) -> dict[str, Any]:
        """Plain data for JSON (``kvstore advise --json``, ``store.advise()``)."""
        return asdict(self)


def advise(
    profile: ReuseProfile,
    cost: CostModel,
    dram_bytes: int,
    policy: Policy = "write-through",
    *,
    bounds: tuple[int, int] | None = None,
    knee: float = 0.95,
) -> Advice:
    """The hit rate and net saving at DRAM sizes around ``dram_bytes``, the size and policy to use, and why.

    ``bounds`` (bytes) limits the recommendation (auto mode's configured range); by default the
    sizes shown are 1/8x to 8x of the current one. The recommended size is the smallest whose
    gain over the smallest size is at least ``knee`` of the largest size's gain: past it, more
    DRAM buys little.
    """
    chunk = cost.chunk_bytes
    low, high = bounds if bounds is not None else (int(dram_bytes / 8), int(dram_bytes * 8))
    low, high = max(chunk, low), max(chunk, high)
    savings = {p: cost.net_saving(profile, dram_bytes / chunk, p) for p in POLICIES}
    best_policy = choose_policy(profile, cost, high / chunk, policy)
    grid = _size_grid(low, high, chunk)
    recommended = _knee(grid, [cost.net_saving(profile, size / chunk, best_policy) for size in grid], knee)
    shown = sorted({int(dram_bytes * f) // chunk * chunk for f in SIZE_FACTORS if dram_bytes * f >= chunk})
    shown = sorted(set(shown) | {recommended})
    rows = [
        SizeRow(
            size,
            profile.hit_rate(size / chunk),
            cost.hit_rate(profile, size / chunk, best_policy),
            cost.net_saving(profile, size / chunk, best_policy),
        )
        for size in shown
    ]
    disk_rows = []
    recommended_disk = None
    bounded = [i for i, tier in enumerate(cost.lower) if tier.capacity_chunks < UNBOUNDED]
    if bounded:
        disk = int(cost.lower[bounded[0]].capacity_chunks * chunk)
        recommended_disk = _disk_knee(profile, cost, bounded[0], dram_bytes, best_policy, disk, knee)
        sizes = sorted({int(disk * factor) for factor in SIZE_FACTORS} | {recommended_disk})
        disk_rows = [(size, profile.hit_rate(max(size, dram_bytes) / chunk)) for size in sizes]
    advice = Advice(
        references=profile.references,
        sample_rate=profile.sample_rate,
        cold_fraction=profile.cold_fraction,
        policy=policy,
        recommended_policy=best_policy,
        savings=savings,
        dram_bytes=dram_bytes,
        recommended_dram_bytes=recommended,
        rows=rows,
        disk_rows=disk_rows,
        verdict=[],
        recommended_disk_bytes=recommended_disk,
    )
    advice.verdict = _verdict(advice, profile, cost, decided_at=high)
    return advice


def _disk_knee(
    profile: ReuseProfile, cost: CostModel, index: int, dram_bytes: int, policy: Policy, disk: int, knee: float
) -> int:
    """The smallest disk size (1/8x to 8x of ``disk``) with ``knee`` of the largest one's gain, as for DRAM."""
    chunk, tier = cost.chunk_bytes, cost.lower[index]
    grid = _size_grid(max(chunk, disk // 8), disk * 8, chunk)
    net = []
    for size in grid:
        resized = replace(tier, capacity_chunks=size / chunk)
        lower = [*cost.lower[:index], resized, *cost.lower[index + 1 :]]
        net.append(replace(cost, lower=lower).net_saving(profile, dram_bytes / chunk, policy))
    return _knee(grid, net, knee)


def _knee(sizes: list[int], net: list[float], knee: float) -> int:
    """The smallest size whose gain over the first is ``knee`` of the last one's; the first if nothing is gained."""
    gain = net[-1] - net[0]
    if gain <= 1e-3:  # under 0.1% of prefill: not worth any memory
        return sizes[0]
    return next(size for size, value in zip(sizes, net, strict=True) if value - net[0] >= knee * gain)


def choose_policy(
    profile: ReuseProfile, cost: CostModel, dram_chunks: float, current: Policy, margin: float = 0.01
) -> Policy:
    """The policy with the larger net saving; the current one unless the other wins by ``margin``."""
    if not cost.lower:
        return current  # nothing below DRAM: the policy changes nothing
    other: Policy = "second-sighting" if current == "write-through" else "write-through"
    gain = cost.net_saving(profile, dram_chunks, other) - cost.net_saving(profile, dram_chunks, current)
    return other if gain > margin else current


def _size_grid(low: int, high: int, chunk: int, points: int = 48) -> list[int]:
    """Sizes from ``low`` to ``high`` (whole chunks), evenly spaced on a log scale."""
    sizes = np.geomspace(low, high, points) if high > low else np.array([low])
    return sorted({max(chunk, int(size) // chunk * chunk) for size in sizes})


def _verdict(advice: Advice, profile: ReuseProfile, cost: CostModel, decided_at: int) -> list[str]:
    """Plain sentences; a policy change quotes both policies' savings at ``decided_at`` (bytes), where it was chosen."""
    lines: list[str] = []
    if profile.references < 1000:
        lines.append(f"only {profile.references:,.0f} chunk lookups seen: too few to judge; look again later.")
    now = advice.savings[advice.policy]
    chunk = cost.chunk_bytes
    dram_rate = profile.hit_rate(advice.dram_bytes / chunk)
    total = cost.hit_rate(profile, advice.dram_bytes / chunk, advice.policy)
    lines.append(
        f"hit rate {total:.0%} ({dram_rate:.0%} from DRAM) over {profile.references:,.0f} chunk lookups; "
        f"{profile.cold_fraction:.0%} were first sightings, which no cache can serve."
    )
    if advice.recommended_policy != advice.policy:
        # The policy is chosen at the largest size considered; at the current size the two may be level.
        now = cost.net_saving(profile, decided_at / chunk, advice.policy)
        better = cost.net_saving(profile, decided_at / chunk, advice.recommended_policy)
        where = "" if decided_at == advice.dram_bytes else f" with {human_bytes(decided_at)} DRAM"
        if advice.recommended_policy == "second-sighting":
            judgement = (
                "the cascade costs more than it returns"
                if now < 0
                else "writing every chunk below DRAM returns less than writing only the prefixes that come back"
            )
            lines.append(
                f"at {total:.0%} hits, {judgement} (net saving {now:+.1%} of prefill{where}); "
                f"use selective writes (policy 'second-sighting': {better:+.1%})."
            )
        else:
            lines.append(
                f"prefixes come back often enough that write-through pays: net saving {better:+.1%} of prefill "
                f"against {now:+.1%} with selective writes{where}."
            )
    else:
        lines.append(f"policy '{advice.policy}' is the better one here: net saving {now:+.1%} of prefill.")
    size, recommended = advice.dram_bytes, advice.recommended_dram_bytes
    at_recommended = next(row for row in advice.rows if row.dram_bytes == recommended)
    if recommended < size * 0.8:  # as auto mode: a smaller step is not worth a resize
        lines.append(
            f"DRAM: {human_bytes(recommended)} gets nearly all that {human_bytes(size)} does "
            f"({at_recommended.dram_hit_rate:.0%} against {dram_rate:.0%} from DRAM)"
            "; shrink it and give the memory back."
        )
    elif recommended > size * 1.1:
        lines.append(
            f"DRAM: the working set is larger than {human_bytes(size)}; {human_bytes(recommended)} would serve "
            f"{at_recommended.dram_hit_rate:.0%} of lookups from DRAM (now {dram_rate:.0%})."
        )
    elif recommended < size:
        lines.append(
            f"DRAM: {human_bytes(size)} is about right for this traffic "
            f"({human_bytes(recommended)} would do nearly as well)."
        )
    else:
        lines.append(f"DRAM: {human_bytes(size)} is about right for this traffic.")
    if advice.recommended_disk_bytes is not None and advice.disk_rows:
        disk = int(next(t.capacity_chunks for t in cost.lower if t.capacity_chunks < UNBOUNDED) * chunk)
        target = advice.recommended_disk_bytes
        rate = {size: hit for size, hit in advice.disk_rows}
        now_rate = profile.hit_rate(max(disk, advice.dram_bytes) / chunk)
        if target < disk * 0.8:
            lines.append(
                f"disk: {human_bytes(target)} keeps nearly every hit that {human_bytes(disk)} does "
                f"({rate[target]:.0%})."
            )
        elif target > disk * 1.1:
            lines.append(
                f"disk: {human_bytes(target)} would raise the hit rate to {rate[target]:.0%} (now {now_rate:.0%})."
            )
        else:
            lines.append(f"disk: {human_bytes(disk)} is about right for this traffic.")
    return lines
