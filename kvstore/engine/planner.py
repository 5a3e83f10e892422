"""Load or recompute: which leading chunks of a prompt are worth loading, and from which tier.

A hit is only worth taking if loading it is faster than computing it: a chunk held only by an S3
bucket across a slow link can cost more to fetch than the engine takes to prefill its tokens.
:class:`LoadPlanner` keeps online estimates and answers :meth:`LoadPlanner.plan`:

- per tier, the **latency** of one request (an EWMA of the tier's lookups: a HEAD on S3, EXISTS
  on Redis, a stat on disk, which the store does on every ``lookup``) and its **throughput** in
  chunk bytes per second (an EWMA over the periods some read of the tier was in flight, batch
  reads ``get_many`` does and range requests layer streams make alike, timed together so that reads
  sharing a link show the link, and of the loads a connector reports through :meth:`observe_read`); each
  seeded from conservative defaults until measured (:data:`SEED_LATENCY`,
  :data:`kvstore.sizing.advice.DEFAULT_BANDWIDTH`);
- the engine's **prefill rate** in tokens per second: pinned by ``planner.prefill_tokens_per_s``,
  else the lower median of the last :data:`PREFILL_WINDOW` steps the connector measured
  (:meth:`observe_prefill`), once there are :data:`MIN_PREFILL_STEPS`. Until then, recompute is
  taken to cost without bound: an engine that has not measured yet is never refused a hit. A
  median, not a mean: one step timed absurdly fast (a clock glitch, a step that waited for loads
  as long as it ran) cannot raise the rate above what the other steps measured, so it never
  refuses a hit; a measurement that is not a finite positive number (NaN, inf, 0 tokens or
  seconds) is ignored, counted (``describe()["prefill_rejected"]``) and logged once.

**Re-measuring a refused tier.** A tier's throughput is learned from its reads, and a tier the
plans refuse is not read: a link measured slow during a bad spell would be refused for good. So a
read estimate older than ``planner.probe_interval`` seconds (default 30; the planner's clock,
injectable) is *stale*: a plan that refuses a chunk of a stale tier, and would load it if that tier
cost only its request latency (as an unmeasured tier does; its lookups keep the latency fresh, so a
tier that is slow to answer is never probed), loads one chunk of it more (with the chunks before
it): a *probe* (``LoadPlan.probe``). The probe's read replaces the stale estimate outright, as a
first read replaces a seed: a link that became fast is loaded again from the next plan on, one
still slow is refused for another interval. A probe costs at most one chunk's slow read per tier
and interval (plus those of plans made while the probe's read is in flight), whatever the traffic;
plans that load a tier keep its estimate fresh, so a tier in use is never probed. DRAM's seed
counts as measured when the planner is made: a DRAM path seeded too slow is probed too.

The plan for the held prefix (chunk i held by ``tiers[i]``; DRAM first) is the number ``k`` of
leading chunks to load that saves the most time: ``k * chunk_tokens / prefill_rate`` (their
recompute) minus the expected load of chunks ``0..k-1`` (per tier used, one latency plus its
bytes over its throughput; tiers in turn, as the store reads them). Loading the first chunks
from DRAM and recomputing the ones only S3 holds is such a plan. As recompute is linear in k,
the chosen k never has an expected load time above its expected recompute time (but for a
probe's one chunk, above). Overlap of a
layer stream with the suffix's compute is not counted: the plan errs towards recompute by that.

Thread-safe (a lock): the store's loop reads tiers and plans, an engine thread reports its steps.
"""

from __future__ import annotations

import logging
import math
import statistics
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvstore.config import PlannerConfig
from kvstore.sizing.advice import DEFAULT_BANDWIDTH
from kvstore.storage.tier import ChunkTier

DRAM = "dram"  # the tier name a plan gives chunks held in the DRAM pool
SEED_LATENCY = {"local": 0.0005, "remote": 0.005}  # seconds per request until a tier's lookups are measured
SMOOTHING = 0.3  # weight of a new measurement in each EWMA
PREFILL_WINDOW = 8  # the prefill rate is the lower median of this many last measured steps
MIN_PREFILL_STEPS = 2  # steps measured before the rate is used (one outlier alone never refuses a hit)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoadPlan:
    """What to do with a prompt's held prefix: load its first ``load`` chunks, recompute the rest.

    ``tiers[i]`` names where chunk i is read from (``"dram"``, or a tier: ``"disk"``, ``"redis"``,
    ``"s3"``); its length is the prefix the store holds (what ``lookup`` answers). The seconds are
    the planner's expectations for the first ``load`` chunks. ``probe``: the tier whose stale
    estimate this plan re-measures by loading one of its chunks the estimates alone would refuse.
    """

    tiers: tuple[str, ...]
    load: int
    load_seconds: float
    recompute_seconds: float
    probe: str | None = None

    @property
    def held(self) -> int:
        """Leading chunks some tier holds (``lookup``'s answer)."""
        return len(self.tiers)

    @property
    def recomputed(self) -> int:
        """Held chunks the plan recomputes rather than loads."""
        return self.held - self.load


@dataclass
class TierEstimate:
    """One tier's expected cost: ``latency_s + nbytes / bytes_per_s`` to read ``nbytes`` in one request."""

    latency_s: float
    bytes_per_s: float
    lookups: int = 0  # measurements folded in so far
    reads: int = 0
    read_at: float | None = None  # the planner's clock at the last read measured (or the seed's); None: never
    probed_at: float | None = None  # the planner's clock at the last plan that probed this tier; None: never
    borrowed: bool = False  # its reads were measured by another process (or an earlier run), none here yet

    def seconds(self, nbytes: int) -> float:
        return self.latency_s + nbytes / self.bytes_per_s

    def observe_latency(self, seconds: float) -> None:
        if math.isfinite(seconds):
            self.latency_s = _ewma(self.latency_s, max(0.0, seconds), self.lookups)
            self.lookups += 1

    def observe_read(self, seconds: float, nbytes: int, now: float | None = None, stale: bool = False) -> None:
        """A read of ``nbytes`` that took ``seconds`` (0 bytes: a read that timed out or found nothing).

        ``stale``: the estimate is out of date, the read replaces it (as a first read replaces the
        seed); ``now``: the clock reading it is measured at. A non-finite or negative one is ignored.
        """
        if not (math.isfinite(seconds) and seconds >= 0 and nbytes >= 0):
            return
        # What the request's latency leaves (a tenth of it at least: a latency sample above this read's).
        transfer = max(seconds - self.latency_s, seconds / 10, 1e-9)
        self.bytes_per_s = max(1.0, _ewma(self.bytes_per_s, nbytes / transfer, 0 if stale else self.reads))
        self.reads += 1
        self.read_at = now
        self.borrowed = False


def _ewma(current: float, sample: float, seen: int) -> float:
    """The first measurement replaces the seed; later ones move the estimate by SMOOTHING."""
    return sample if seen == 0 else (1 - SMOOTHING) * current + SMOOTHING * sample


class LoadPlanner:
    """Online estimates of each tier and of the engine's prefill, and the plans made from them.

    ``chunk_nbytes``/``chunk_tokens``: the layout's chunk; ``dram_bytes_per_s``: the seed of DRAM's
    estimate, measured once per process (:func:`kvstore.engine.costs.bus_bandwidth` where the pool is
    pinned for a GPU, else :func:`kvstore.engine.costs.copy_bandwidth`); the loads a connector times
    (``observe_read(DRAM, ...)``) then move it. ``clock`` (seconds, monotonic) dates the read
    estimates; one older than ``probe_interval`` is re-measured by a probe (see the module's doc).
    """

    def __init__(
        self,
        config: PlannerConfig,
        chunk_nbytes: int,
        chunk_tokens: int,
        dram_bytes_per_s: float,
        *,
        probe_interval: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config, self.chunk_nbytes, self.chunk_tokens = config, chunk_nbytes, chunk_tokens
        self.probe_interval = config.probe_interval if probe_interval is None else probe_interval
        self.clock = clock
        self.dram = TierEstimate(0.0, dram_bytes_per_s, read_at=clock())  # the seed is a measurement
        self.tiers: dict[str, TierEstimate] = {}
        self._prefill_rates: deque[float] = deque(maxlen=PREFILL_WINDOW)  # tokens/s of the last steps measured
        self._prefills = 0
        self._prefills_rejected = 0
        # per tier, its counters at the last sync: (lookups, their seconds), (transfer periods, seconds, bytes)
        self._seen: dict[str, tuple[tuple[int, float], tuple[int, float, int]]] = {}
        self._lock = threading.RLock()  # describe() reads the rate under it

    # -- estimates ---------------------------------------------------------------------------------

    def estimate(self, tier: str, local: bool = True) -> TierEstimate:
        """The estimate of ``tier`` (``"dram"`` included), seeded on first use (``local``: a disk-like tier)."""
        if tier == DRAM:
            return self.dram
        with self._lock:
            if tier not in self.tiers:
                kind = "local" if local else "remote"
                bandwidth = DEFAULT_BANDWIDTH["disk_read" if local else "remote"]
                self.tiers[tier] = TierEstimate(SEED_LATENCY[kind], bandwidth)
            return self.tiers[tier]

    def observe_read(self, tier: str, seconds: float, nbytes: int, local: bool = True) -> None:
        """A load of ``nbytes`` of chunk data from ``tier`` that took ``seconds`` (any thread)."""
        estimate = self.estimate(tier, local)
        with self._lock:
            self._observe_read(estimate, seconds, nbytes)

    def observe_load(self, plan: LoadPlan, seconds: float) -> None:
        """A planned load (``plan.load`` chunks) took ``seconds`` as the engine saw it (any thread).

        The time is the read estimate of the tier that was expected to cost the most; the other
        tiers' chunks (DRAM's, a faster tier's) are taken at their expected time. DRAM counts as a
        tier here too: its rate is that of the path the engine loads through.
        """
        counts = Counter(plan.tiers[: plan.load])
        if not counts:
            return
        expected = {tier: self.estimate(tier).seconds(n * self.chunk_nbytes) for tier, n in counts.items()}
        slowest = max(expected, key=expected.__getitem__)
        others = sum(expected.values()) - expected[slowest]
        self.observe_read(slowest, max(seconds - others, seconds / 2), counts[slowest] * self.chunk_nbytes)

    def _observe_read(self, estimate: TierEstimate, seconds: float, nbytes: int) -> None:
        now = self.clock()
        estimate.observe_read(seconds, nbytes, now, stale=self._stale(estimate, now))

    def _stale(self, estimate: TierEstimate, now: float) -> bool:
        """Whether ``estimate``'s reads were measured, but not in the last ``probe_interval`` seconds."""
        measured = estimate.reads > 0 or estimate is self.dram
        return measured and (estimate.read_at is None or now - estimate.read_at >= self.probe_interval)

    def _probe_due(self, estimate: TierEstimate, now: float) -> bool:
        """Whether a plan may probe ``estimate``'s tier: stale, and not probed in the last ``probe_interval``
        seconds (a probe whose read is never measured, DRAM's under vLLM, must not make every plan a probe)."""
        recently = estimate.probed_at is not None and now - estimate.probed_at < self.probe_interval
        return self._stale(estimate, now) and not recently

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        """The engine computed ``tokens`` prompt tokens in ``seconds`` (any thread).

        Ignored unless both are finite and positive (counted; the first such one is logged).
        """
        if not (tokens > 0 and seconds > 0 and math.isfinite(tokens) and math.isfinite(seconds)):
            with self._lock:
                self._prefills_rejected += 1
                first = self._prefills_rejected == 1
            if first:
                log.warning(
                    "kvstore planner: ignored a prefill measurement of %r tokens in %r seconds (not a finite "
                    "positive number; further ones are counted in the planner's prefill_rejected, not logged)",
                    tokens,
                    seconds,
                )
            return
        with self._lock:
            self._prefill_rates.append(tokens / seconds)
            self._prefills += 1

    @property
    def measured_prefill(self) -> float | None:
        """The measured prefill rate (tokens/s): the lower median of the last steps; None before any."""
        with self._lock:
            rates = list(self._prefill_rates)
        return statistics.median_low(rates) if rates else None

    @property
    def prefill_tokens_per_s(self) -> float | None:
        """The rate plans use: the pinned one, else the measured one once :data:`MIN_PREFILL_STEPS` steps
        were, else None (not known yet)."""
        pinned = self.config.prefill_tokens_per_s
        if pinned is not None:
            return pinned
        return self.measured_prefill if len(self._prefill_rates) >= MIN_PREFILL_STEPS else None

    def sync(self, tiers: Sequence[ChunkTier]) -> None:
        """Fold in what ``tiers`` measured since the last sync (loop thread: the tiers' counters are its).

        Lookups (``tier.latency.lookup``) give the per-request latency; reads (batch reads and layer
        streams' range requests alike) the throughput (``tier.latency.transfer``: per period some
        read was in flight, its seconds and the bytes it brought, however many reads shared the link).
        """
        for tier in tiers:
            lookup, transfer = tier.latency.lookup, tier.latency.transfer
            lookups = (sum(lookup.counts), lookup.sum)
            transfers = (transfer.periods, transfer.seconds, transfer.nbytes)
            lookups_before, transfers_before = self._seen.get(tier.name, ((0, 0.0), (0, 0.0, 0)))
            self._seen[tier.name] = (lookups, transfers)
            estimate = self.estimate(tier.name, tier.is_local)
            with self._lock:
                if lookups[0] > lookups_before[0]:
                    estimate.observe_latency((lookups[1] - lookups_before[1]) / (lookups[0] - lookups_before[0]))
                # Per period: its seconds and its bytes. Reads that found nothing say nothing of the
                # throughput (a faster tier had the chunks, or a timeout: its lookups' latency shows a
                # tier that stopped answering); the clock leaves them out.
                periods = transfers[0] - transfers_before[0]
                if periods > 0:
                    seconds = (transfers[1] - transfers_before[1]) / periods
                    self._observe_read(estimate, seconds, int((transfers[2] - transfers_before[2]) / periods))

    # -- plans ----------------------------------------------------------------------------------------

    def plan(self, tiers: Sequence[str], local: Sequence[bool] | None = None) -> LoadPlan:
        """The plan for a held prefix whose chunk i is in ``tiers[i]`` (``local[i]``: a disk-like tier).

        Loads the whole prefix when the planner is off or the prefill rate is not known yet; loads
        one refused chunk more to probe a tier whose read estimate is stale (see the module's doc).
        """
        tiers = tuple(tiers)
        rate = self.prefill_tokens_per_s
        per_chunk = self.chunk_tokens / rate if rate else math.inf
        estimates = [self.estimate(tier, True if local is None else local[i]) for i, tier in enumerate(tiers)]
        best, best_load = self._best(tiers, estimates, per_chunk, stale=frozenset())
        probe = None
        if best < len(tiers) and self.config.enabled:
            now = self.clock()
            with self._lock:
                stale = frozenset(
                    tier for tier, e in zip(tiers[best:], estimates[best:], strict=True) if self._probe_due(e, now)
                )
            if stale:
                hopeful, _ = self._best(tiers, estimates, per_chunk, stale)  # stale tiers at their latency only
                first_stale = next(i for i in range(best, len(tiers)) if tiers[i] in stale)
                if hopeful > first_stale:
                    probe, best = tiers[first_stale], first_stale + 1
                    best_load = self._load_seconds(tiers[:best], estimates[:best])
                    with self._lock:
                        estimates[first_stale].probed_at = now
        recompute = best * per_chunk if best else 0.0
        return LoadPlan(tiers, best, best_load, recompute, probe)

    def _best(
        self, tiers: tuple[str, ...], estimates: list[TierEstimate], per_chunk: float, stale: frozenset[str]
    ) -> tuple[int, float]:
        """The number of leading chunks whose load saves the most time, and their expected load time.

        Tiers in ``stale`` cost their latency only, as a tier whose reads were never measured.
        """
        best, best_saving, best_load = 0, 0.0, 0.0
        load, used = 0.0, set()
        for k, (tier, estimate) in enumerate(zip(tiers, estimates, strict=True), start=1):
            load += self._chunk_seconds(tier, estimate, tier in used, tier in stale)
            used.add(tier)
            saving = k * per_chunk - load
            if not self.config.enabled or saving >= best_saving:  # ties: the longer prefix
                best, best_saving, best_load = k, saving, load
        return best, best_load

    def _load_seconds(self, tiers: Sequence[str], estimates: Sequence[TierEstimate]) -> float:
        """The expected time to load chunks held by ``tiers`` (one estimate each), tier after tier."""
        load, used = 0.0, set()
        for tier, estimate in zip(tiers, estimates, strict=True):
            load += self._chunk_seconds(tier, estimate, tier in used, False)
            used.add(tier)
        return load

    def expected_seconds(self, tiers: Sequence[str], local: Sequence[bool] | None = None) -> float:
        """The expected time to load chunks held by ``tiers``, a tier never measured at its seed bandwidth.

        Unlike a plan's (where an unmeasured tier costs its latency only, so that it is read and
        measured), this errs towards slow: it says how long a load may hold an engine's step.
        """
        load, used = 0.0, set()
        for i, tier in enumerate(tiers):
            estimate = self.estimate(tier, True if local is None else local[i])
            load += self.chunk_nbytes / estimate.bytes_per_s + (0.0 if tier in used else estimate.latency_s)
            used.add(tier)
        return load

    def _chunk_seconds(self, tier: str, estimate: TierEstimate, requested: bool, stale: bool) -> float:
        """One more chunk from ``tier``: its bytes, and the request's latency unless ``requested`` already.

        A tier none of whose reads was measured yet (or ``stale``) costs its latency only: a seed never
        refuses a hit (else the tier would never be read, and never measured). DRAM is always counted:
        its seed is measured on this machine (the bus to a GPU, or a memcpy), then its loads' rate.
        """
        measured = (estimate.reads > 0 or tier == DRAM) and not stale
        transfer = self.chunk_nbytes / estimate.bytes_per_s if measured else 0.0
        return transfer + (0.0 if requested else estimate.latency_s)

    # -- shared with the engine's other processes (kvstore.engine.planner_share) ----------------------

    def measured_here(self) -> dict[str, Any]:
        """What this planner measured itself (not pinned, not borrowed): the prefill rates of its window
        (when it timed steps) and, per tier read here, its estimate, with its age in seconds."""
        now = self.clock()
        with self._lock:
            shared: dict[str, Any] = {"tiers": {}}
            if self._prefills:
                shared["prefill_rates"] = list(self._prefill_rates)
            for name, e in self.tiers.items():
                if e.reads and not e.borrowed and e.read_at is not None:
                    shared["tiers"][name] = {
                        "latency_s": e.latency_s,
                        "bytes_per_s": e.bytes_per_s,
                        "reads": e.reads,
                        "age_s": max(0.0, now - e.read_at),
                    }
            return shared

    def borrow(self, prefill_rates: Sequence[float], tiers: Mapping[str, Mapping[str, float]]) -> None:
        """Take what another process (or an earlier run) measured, where this planner measured nothing itself.

        ``prefill_rates`` seed the window while this planner has timed no step; each of ``tiers``
        (``latency_s``, ``bytes_per_s``, ``reads``, ``age_s``: as :meth:`measured_here` gives them, checked
        by the caller) replaces the estimate of a tier this process has not read, dated ``age_s`` ago.
        """
        now = self.clock()
        with self._lock:
            if not self._prefills and prefill_rates:
                self._prefill_rates.clear()
                self._prefill_rates.extend(prefill_rates)
            for name, shared in tiers.items():
                estimate = self.tiers.get(name)
                if estimate is not None and estimate.reads and not estimate.borrowed:
                    continue  # measured here: this process's own reads win
                if estimate is None:
                    estimate = self.tiers[name] = TierEstimate(shared["latency_s"], shared["bytes_per_s"])
                if not estimate.lookups:
                    estimate.latency_s = shared["latency_s"]
                estimate.bytes_per_s = shared["bytes_per_s"]
                estimate.reads = max(1, int(shared["reads"]))
                estimate.read_at = now - shared["age_s"]
                estimate.borrowed = True

    def describe(self) -> dict[str, object]:
        """The estimates now (for stats and benchmarks)."""
        with self._lock:
            return {
                "enabled": self.config.enabled,
                "prefill_tokens_per_s": self.prefill_tokens_per_s,
                "prefill_measured": self._prefills,
                "prefill_rejected": self._prefills_rejected,
                **{
                    name: {
                        "latency_s": e.latency_s,
                        "bytes_per_s": e.bytes_per_s,
                        "lookups": e.lookups,
                        "reads": e.reads,
                    }
                    for name, e in self.tiers.items()
                },
            }


class PrefillClock:
    """An engine's prefill rate, timed from one scheduler step to the next (the vLLM connector's).

    ``step(tokens)`` is called as each step is scheduled, with the tokens it computes; the time
    until the next call is that step's. Steps of fewer than ``min_tokens`` (decodes) are not
    counted, nor a gap more than ``IDLE_FACTOR`` times what the rate so far predicts (the engine
    sat idle), unless ``TRUST_AFTER`` such steps come in a row (the engine got slower). What a
    step also waited for loads makes the rate look slower: the plan then errs towards loading.
    ``planner`` None: nothing is measured (a TP rank without a store).
    """

    IDLE_FACTOR = 4.0
    TRUST_AFTER = 3  # steps in a row beyond IDLE_FACTOR: the rate has changed, count them
    MAX_GAP = 60.0  # seconds: a longer gap before any rate is known is idleness, not a step

    def __init__(self, planner: LoadPlanner | None, min_tokens: int) -> None:
        self.planner, self.min_tokens = planner, min_tokens
        self._last: tuple[float, int] | None = None  # (when the previous step was scheduled, its tokens)
        self._skipped = 0  # prefill steps in a row left out as idle

    def step(self, tokens: int, now: float | None = None) -> None:
        now = time.perf_counter() if now is None else now
        last, self._last = self._last, (now, tokens)
        if self.planner is None or last is None or last[1] < self.min_tokens:
            return
        seconds, rate = now - last[0], self.planner.measured_prefill
        limit = self.IDLE_FACTOR * last[1] / rate if rate else self.MAX_GAP
        if seconds > limit and self._skipped < self.TRUST_AFTER:
            self._skipped += 1  # idle, or the engine got slower: a few such steps in a row say the latter
            return
        self._skipped = 0
        if 0 < seconds <= self.MAX_GAP:
            self.planner.observe_prefill(last[1], seconds)
