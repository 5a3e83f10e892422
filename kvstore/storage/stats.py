"""Counters and latency histograms per tier, read by ``KVStore.stats()``, the CLI and Prometheus.

The store's own, for the calls the engine makes, are in :mod:`kvstore.engine.stats`.
"""

from __future__ import annotations

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
    read_chunks: int = 0  # chunks the reads timed in ``read`` delivered (their throughput: kvstore.engine.planner)
    # Layer streams' range requests to a remote tier, each timed, and the bytes they brought: the
    # throughput of the reads connectors make (they load through streams), for kvstore.engine.planner.
    span: Histogram = field(default_factory=Histogram)
    span_bytes: int = 0
