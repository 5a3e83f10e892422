"""Prometheus metrics for every open :class:`~kvstore.KVStore` in the process.

Nothing is counted twice: at scrape time :class:`KVStoreCollector` reads each store's own
counters (``KVStore.stats()``, what the CLI and the tests read too) and its latency histograms
(:class:`kvstore.storage.stats.Histogram`, fed where the store waits for a tier). Stores register on
open and unregister on close, held weakly so a store never closed is not kept alive from here.

Prometheus wants one series per label set, so stores of one namespace in one process (say an
engine's scheduler and worker) are summed into one series, as their counters add up.

``[metrics] enabled = true`` makes ``KVStore.open()`` call :func:`start_exporter`. To serve the
metrics from a server of your own instead, register a :class:`KVStoreCollector` in its registry
(``prometheus_client.REGISTRY.register(KVStoreCollector())``) or render :data:`REGISTRY`.
"""

from __future__ import annotations

import errno
import logging
import threading
import weakref
from collections import defaultdict
from collections.abc import Iterator, Sequence
from typing import Any, Protocol, TypeVar

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from kvstore.engine.stats import StoreLatency
from kvstore.errors import ConfigError
from kvstore.storage.breaker import STATES
from kvstore.storage.stats import LATENCY_BUCKETS, Histogram, TierLatency

log = logging.getLogger("kvstore.metrics")
F = TypeVar("F", CounterMetricFamily, GaugeMetricFamily)

NS = ("namespace",)
NS_TIER = ("namespace", "tier")
NS_TIER_STATE = ("namespace", "tier", "state")

# What each stats() counter is exposed as: (section, key) -> (metric, help); the tests check none is missing.
# A section is stats()["store"], the stats() entry of each tier (labelled with the tier), its "breaker" entry,
# or stats()["adaptive"]. This table, with FAMILIES below, is the one place a figure's meaning is written:
# vLLM's /metrics (kvstore.connectors.vllm.stats) shows some of the same figures under its own names and
# takes their meaning from here.
COUNTERS = {
    ("store", "puts"): ("kvstore_puts", "chunks put (duplicates included)"),
    ("store", "put_rejected"): ("kvstore_put_rejected", "puts refused: every DRAM slot was held by a transfer"),
    ("store", "put_duplicate"): ("kvstore_put_duplicate", "puts of a chunk DRAM already held"),
    ("store", "gets"): ("kvstore_gets", "chunks asked of get()/get_many()"),
    ("store", "hits"): ("kvstore_hits", "chunks get()/get_many() returned, from any tier"),
    ("store", "misses"): ("kvstore_misses", "chunks get()/get_many() found in no tier"),
    ("store", "streamed"): ("kvstore_streamed", "chunks opened by layer streams (prefetch), from any tier"),
    ("store", "streamed_from_dram"): ("kvstore_streamed_from_dram", "chunks layer streams found in DRAM"),
    ("store", "admitted"): ("kvstore_admitted", "chunks get_many read into the caller's buffers, then put in DRAM"),
    ("store", "admissions_dropped"): (
        "kvstore_admissions_dropped",
        "chunks get_many read into the caller's buffers and did not admit to DRAM (no slot free, or a failed read)",
    ),
    ("store", "stream_promoted"): (
        "kvstore_stream_promoted",
        "chunks layer streams read from a tier and put in DRAM (and queued for the faster tiers)",
    ),
    ("store", "stream_promotions_dropped"): (
        "kvstore_stream_promotions_dropped",
        "stream promotions dropped: no staging slot within half the pool (per chunk),"
        " a faster tier's queue full (per tier)",
    ),
    ("tier", "hits"): ("kvstore_tier_hits", "chunks read from the tier"),
    ("tier", "misses"): ("kvstore_tier_misses", "chunk reads the tier did not hold"),
    ("tier", "bytes_read"): ("kvstore_tier_read_bytes", "stored bytes read from the tier"),
    ("tier", "bytes_written"): ("kvstore_tier_written_bytes", "stored bytes written to the tier"),
    ("tier", "writes"): ("kvstore_tier_writes", "chunks written to the tier"),
    ("tier", "errors"): ("kvstore_tier_errors", "tier operations that raised (I/O error, full disk, server down)"),
    ("tier", "timeouts"): ("kvstore_tier_timeouts", "tier operations that ran past their configured timeout"),
    ("tier", "drops"): ("kvstore_tier_drops", "writes dropped: the tier's queue was full, or the store closed"),
    ("tier", "corrupt"): ("kvstore_tier_corrupt", "objects that failed their checks (removed; read as a miss)"),
    ("tier", "foreign"): (
        "kvstore_tier_foreign",
        "valid objects this store cannot open (another layout, encryption key or codec; left in place)",
    ),
    ("tier", "skipped"): ("kvstore_tier_skipped", "writes skipped: the tier already held the chunk"),
    ("tier", "lossy_reads"): (
        "kvstore_tier_lossy_reads",
        "chunks read that were stored with a lossy codec (int8, int4, fp8: values not exact)",
    ),
    ("breaker", "opens"): ("kvstore_tier_breaker_opens", "times the tier's circuit breaker opened"),
    ("breaker", "skipped_reads"): ("kvstore_tier_breaker_skipped_reads", "reads and lookups skipped: breaker open"),
    ("breaker", "skipped_writes"): ("kvstore_tier_breaker_skipped_writes", "chunks not written: breaker open"),
    ("adaptive", "decisions"): ("kvstore_auto_decisions", "sizing decisions auto mode made"),
    ("adaptive", "resizes"): ("kvstore_auto_resizes", "DRAM resizes auto mode made"),
    ("adaptive", "policy_switches"): ("kvstore_auto_policy_switches", "write policy changes auto mode made"),
    ("adaptive", "held_back"): ("kvstore_held_back", "chunks the second-sighting policy kept out of the lower tiers"),
    ("adaptive", "released"): (
        "kvstore_held_back_released",
        "held-back chunks sent below later (a DRAM hit: a second sighting)",
    ),
    ("adaptive", "lookups_tracked"): ("kvstore_lookups_tracked", "chunk lookups the hit-rate tracker has processed"),
}
STORE_COUNTERS, TIER_COUNTERS, BREAKER_COUNTERS, ADAPTIVE_COUNTERS = (
    {key: metric for (place, key), metric in COUNTERS.items() if place == section}
    for section in ("store", "tier", "breaker", "adaptive")
)
EXTRA_COUNTERS = {
    "kvstore_dram_evictions": ("chunks evicted from DRAM to make room", NS),
    **{name: (help_text, NS_TIER) for name, help_text in BREAKER_COUNTERS.values()},
    **{name: (help_text, NS) for name, help_text in ADAPTIVE_COUNTERS.values()},
}
# Gauges and histograms: name -> (kind, help, labels); what each reads is in _read().
FAMILIES = {
    "kvstore_dram_capacity_bytes": ("gauge", "bytes of the DRAM slab pool", NS),
    "kvstore_dram_used_bytes": ("gauge", "bytes of the DRAM pool holding chunks", NS),
    "kvstore_dram_chunks": ("gauge", "chunks held in DRAM", NS),
    "kvstore_dram_referenced_slots": ("gauge", "DRAM slots held by a transfer in progress", NS),
    "kvstore_tier_queue_depth": ("gauge", "writes waiting in the tier's queue (queue_depth at most)", NS_TIER),
    "kvstore_write_policy_second_sighting": ("gauge", "1 while the write policy is second-sighting, else 0", NS),
    "kvstore_tier_breaker_state": (
        "gauge",
        "stores whose circuit breaker for the tier is in this state (closed, open: skipped, half-open: probing)",
        NS_TIER_STATE,
    ),
    "kvstore_tier_read_seconds": (
        "histogram",
        "seconds per tier read (one batch: a get's chunks missing from faster tiers)",
        NS_TIER,
    ),
    "kvstore_tier_write_seconds": ("histogram", "seconds per tier write (one batch of up to 8 queued chunks)", NS_TIER),
    "kvstore_tier_lookup_seconds": ("histogram", "seconds per tier lookup (how many leading chunks it holds)", NS_TIER),
    "kvstore_lookup_seconds": ("histogram", "seconds per lookup() call", NS),
    "kvstore_get_seconds": ("histogram", "seconds per get()/get_many() call", NS),
}
GAUGES = {name: (help_text, labels) for name, (kind, help_text, labels) in FAMILIES.items() if kind == "gauge"}
HISTOGRAMS = {name: (help_text, labels) for name, (kind, help_text, labels) in FAMILIES.items() if kind == "histogram"}


class MeteredTier(Protocol):
    """What a scrape reads of one tier: its name (a label) and its latency histograms."""

    name: str
    latency: TierLatency


class MeteredStore(Protocol):
    """What a scrape reads of a store (:class:`kvstore.KVStore` is one): counters and histograms, no I/O."""

    namespace: str
    latency: StoreLatency

    @property
    def tiers(self) -> Sequence[MeteredTier]: ...

    def stats(self) -> dict[str, dict[str, Any]]: ...


_stores: weakref.WeakSet[MeteredStore] = weakref.WeakSet()
_stores_lock = threading.Lock()


def register(store: MeteredStore) -> None:
    """Include ``store`` in every scrape (``KVStore.open`` calls this)."""
    with _stores_lock:
        _stores.add(store)


def unregister(store: MeteredStore) -> None:
    """Leave ``store`` out of scrapes from now on (``KVStore.close`` calls this)."""
    with _stores_lock:
        _stores.discard(store)


def registered_stores() -> list[MeteredStore]:
    with _stores_lock:
        return list(_stores)


Sample = tuple[str, tuple[str, ...], float]
HistSample = tuple[str, tuple[str, ...], Histogram]


def _read(store: MeteredStore) -> tuple[list[Sample], list[HistSample]]:
    """One store's samples: (metric, label values, value) and (metric, label values, histogram)."""
    stats = store.stats()
    ns = store.namespace
    samples: list[Sample] = [
        (STORE_COUNTERS[key][0], (ns,), value) for key, value in stats["store"].items() if key in STORE_COUNTERS
    ]
    dram = stats["dram"]
    samples += [
        ("kvstore_dram_capacity_bytes", (ns,), dram["slots"] * dram["slot_bytes"]),
        ("kvstore_dram_used_bytes", (ns,), dram["chunks"] * dram["slot_bytes"]),
        ("kvstore_dram_chunks", (ns,), dram["chunks"]),
        ("kvstore_dram_referenced_slots", (ns,), dram["referenced"]),
        ("kvstore_dram_evictions", (ns,), dram["evictions"]),
    ]
    adaptive = stats["adaptive"]
    samples += [
        (ADAPTIVE_COUNTERS[key][0], (ns,), value) for key, value in adaptive.items() if key in ADAPTIVE_COUNTERS
    ]
    samples.append(("kvstore_write_policy_second_sighting", (ns,), float(adaptive["policy"] == "second-sighting")))
    hists: list[HistSample] = [
        ("kvstore_lookup_seconds", (ns,), store.latency.lookup),
        ("kvstore_get_seconds", (ns,), store.latency.get),
    ]
    for tier in store.tiers:
        labels = (ns, tier.name)
        hists += [
            ("kvstore_tier_read_seconds", labels, tier.latency.read),
            ("kvstore_tier_write_seconds", labels, tier.latency.write),
            ("kvstore_tier_lookup_seconds", labels, tier.latency.lookup),
        ]
    for name in dict.fromkeys(tier.name for tier in store.tiers):  # stats() has one entry per tier name
        labels, tier_stats = (ns, name), stats[name]
        samples += [(metric, labels, tier_stats[key]) for key, (metric, _) in TIER_COUNTERS.items()]
        samples.append(("kvstore_tier_queue_depth", labels, tier_stats["queued"]))
        breaker = tier_stats["breaker"]
        samples += [(metric, labels, breaker[key]) for key, (metric, _) in BREAKER_COUNTERS.items()]
        samples += [
            ("kvstore_tier_breaker_state", (*labels, state), float(breaker["state"] == state)) for state in STATES
        ]
    return samples, hists


class KVStoreCollector(Collector):
    """Every registered store's counters, gauges and latency histograms, read at scrape time."""

    def describe(self) -> Iterator[Metric]:
        """The families without samples: names and types, for a registry's duplicate checks."""
        return self._families([])

    def collect(self) -> Iterator[Metric]:
        return self._families(registered_stores())

    def _families(self, stores: list[MeteredStore]) -> Iterator[Metric]:
        values: defaultdict[str, defaultdict[tuple[str, ...], float]] = defaultdict(lambda: defaultdict(float))
        buckets: dict[str, dict[tuple[str, ...], tuple[list[int], float]]] = defaultdict(dict)
        for store in stores:
            try:
                samples, hists = _read(store)
            except Exception as exc:  # a store torn down mid-scrape must not fail the whole scrape
                log.warning("metrics: store %r left out of this scrape: %r", getattr(store, "namespace", "?"), exc)
                continue
            for name, labels, value in samples:
                values[name][labels] += value
            for name, labels, histogram in hists:
                counts, total = histogram.snapshot()
                if labels in buckets[name]:  # same namespace and tier in another store: add up
                    previous, previous_total = buckets[name][labels]
                    counts = [a + b for a, b in zip(previous, counts, strict=True)]
                    total += previous_total
                buckets[name][labels] = (counts, total)

        for name, help_text in STORE_COUNTERS.values():
            yield _filled(CounterMetricFamily(name, help_text, labels=NS), values[name])
        for name, help_text in TIER_COUNTERS.values():
            yield _filled(CounterMetricFamily(name, help_text, labels=NS_TIER), values[name])
        for name, (help_text, labelnames) in EXTRA_COUNTERS.items():
            yield _filled(CounterMetricFamily(name, help_text, labels=labelnames), values[name])
        for name, (help_text, labelnames) in GAUGES.items():
            yield _filled(GaugeMetricFamily(name, help_text, labels=labelnames), values[name])
        bounds = [*(floatToGoString(bound) for bound in LATENCY_BUCKETS), "+Inf"]
        for name, (help_text, labelnames) in HISTOGRAMS.items():
            family = HistogramMetricFamily(name, help_text, labels=labelnames)
            for labels, (counts, total) in buckets[name].items():
                cumulative, running = [], 0
                for bound, count in zip(bounds, counts, strict=True):
                    running += count
                    cumulative.append((bound, running))
                family.add_metric(list(labels), cumulative, total)
            yield family


def _filled(family: F, series: dict[tuple[str, ...], float]) -> F:
    for labels, value in series.items():
        family.add_metric(list(labels), value)
    return family


REGISTRY = CollectorRegistry()
"""A registry holding only kvstore's collector: what :func:`start_exporter` serves."""
REGISTRY.register(KVStoreCollector())

_exporters: dict[tuple[str, int], int] = {}
_exporters_lock = threading.Lock()


def start_exporter(address: str = "127.0.0.1", port: int = 9464) -> int:
    """Serve ``/metrics`` for every store in the process on ``address:port``; the port it listens on.

    Once per (address, port) per process, so every store may ask; port 0 binds a free port once.
    A port already taken, or an address that cannot be bound, raises :class:`ConfigError`: the
    operator asked for metrics, and an engine silently without them is worse than a clear stop.
    """
    with _exporters_lock:
        if (address, port) in _exporters:
            return _exporters[address, port]
        try:
            server, _ = start_http_server(port, address, registry=REGISTRY)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise ConfigError(
                    f"metrics.port {port} on {address} is already in use: set metrics.port "
                    f"(KVSTORE_METRICS__PORT) to a free port, one per process when several processes open "
                    f"stores (0 picks any free port), or set metrics.enabled = false"
                ) from None
            raise ConfigError(
                f"metrics.address {address!r} (port {port}) cannot be listened on: {exc.strerror or exc}; "
                f"set metrics.address (KVSTORE_METRICS__ADDRESS) to an address of this machine, e.g. 127.0.0.1"
            ) from None
        bound = int(server.server_address[1])
        _exporters[address, port] = bound
        log.info("kvstore metrics at http://%s:%d/metrics", address, bound)
        return bound
