"""Counters and latency histograms per tier, read by ``KVStore.stats()``, the CLI and Prometheus.

The store's own, for the calls the engine makes, are in :mod:`kvstore.engine.stats`.
"""

from __future__ import annotations

import time
from bisect import bisect_left
from dataclasses import asdict, dataclass, field

# Seconds: a warm local chunk read takes ~0.1-1 ms, a remote one ~1-100 ms, a stalled one a timeout.
LATENCY_BUCKETS = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0
)  # fmt: skip


@dataclass
class TierStats:
    """What one tier did, in chunks and stored bytes: ``stats()[tier]``, the ``kvstore_tier_*`` metrics."""

    hits: int = 0
    misses: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    writes: int = 0
    errors: int = 0  # an operation raised (I/O error, full disk, server down)
    timeouts: int = 0  # an operation ran past its configured timeout
    drops: int = 0  # a write skipped because the tier's queue was full or the store was closing
    corrupt: int = 0  # an object failed its checks: counted, removed, treated as a miss
    foreign: int = 0  # a valid object this store cannot open (another encryption key): a miss, left in place
    skipped: int = 0  # a write skipped because the tier already held the chunk
    lossy_reads: int = 0  # hits on chunks stored with a lossy codec (their values are the codec's, not exact)

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


class Histogram:
    """Fixed-bucket latency histogram, kept by the store itself rather than in a Prometheus registry.

    So several stores (and tests) never collide over metric names, and observing costs a bisect
    and two additions. Lock-free: the event loop is the one writer; a scrape thread copies the
    counts, so it may trail an observation in flight by one, never see a torn value.
    """

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...] = LATENCY_BUCKETS) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # per bucket, not cumulative; the last is above every bound
        self.sum = 0.0

    def observe(self, seconds: float) -> None:
        self.counts[bisect_left(self.bounds, seconds)] += 1  # Prometheus buckets are "<= bound"
        self.sum += seconds

    def snapshot(self) -> tuple[list[int], float]:
        """Per-bucket counts (the last one: +Inf) and the sum of observations, as of now."""
        return list(self.counts), self.sum


@dataclass
class TierLatency:
    """Seconds per tier operation as the store waits for it (a batch of chunks, or a lookup)."""

    read: Histogram = field(default_factory=Histogram)
    write: Histogram = field(default_factory=Histogram)
    lookup: Histogram = field(default_factory=Histogram)
    # The tier's throughput as its reads see it, batch reads and layer streams' range requests alike
    # (for kvstore.engine.planner): the time some read was in flight, and the bytes they brought.
    transfer: TransferClock = field(default_factory=lambda: TransferClock())


@dataclass
class TransferClock:
    """How long some read of a tier was in flight, in periods, and what those reads brought (the event loop's).

    Reads that overlap share the tier's link: each timed alone shows the share it got (16 range
    requests of a layer stream in flight at once would each show a 16th of the link). Timed together,
    from the first in flight to none, they show the link. A period whose reads brought nothing (they
    timed out, or found nothing) is left out: it says nothing of the throughput.
    """

    periods: int = 0
    seconds: float = 0.0  # the periods' length, in all
    nbytes: int = 0  # what their reads brought, in all
    _in_flight: int = 0
    _since: float = 0.0
    _brought: int = 0

    def begin(self) -> None:
        """A read starts."""
        if not self._in_flight:
            self._since, self._brought = time.perf_counter(), 0
        self._in_flight += 1

    def end(self, nbytes: int) -> None:
        """A read that :meth:`begin` started ended, bringing ``nbytes`` (0: nothing)."""
        self._in_flight -= 1
        self._brought += nbytes
        if not self._in_flight and self._brought:
            self.periods += 1
            self.seconds += time.perf_counter() - self._since
            self.nbytes += self._brought
