"""kvstore's counters on vLLM's own ``/metrics``, for both integrations.

vLLM collects a connector's statistics at every step (``get_kv_connector_stats`` on the workers, a
secondary tier's ``get_stats`` in the scheduler), carries them to the process serving ``/metrics``,
sums them over workers and hands them to Prometheus metrics the connector (or the tier) declared.
Both kvstore integrations send the same payload: vLLM's own ``OffloadingConnectorStats`` (counters
as increments since the last report, gauges as the latest value, labelled by tier), so one
table here (:data:`METRICS`) names every metric, and vLLM's offloading code, or
:class:`KVStorePromMetrics` for the connector, registers them.

The names start ``vllm:kvstore_`` beside vLLM's ``vllm:kv_offload_*``; kvstore's own exporter
(``metrics.enabled``) keeps its ``kvstore_*`` names on its own port.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import OffloadingConnectorStats
from vllm.v1.kv_offload.base import OffloadingCounterMetadata, OffloadingGaugeMetadata, OffloadingMetricMetadata

Stats = Mapping[str, Any]  # KVStore.stats(), plus the connector's counters under "connector"


@dataclass(frozen=True)
class Metric:
    """One metric: counter or gauge, what it means, and how to read it from the stats (per tier, or once)."""

    kind: str  # "counter" or "gauge"
    documentation: str
    read: Callable[[Stats], float | None] | None = None  # once per store
    read_tier: Callable[[Stats], float | None] | None = None  # per secondary tier, labelled tier=...

    def metadata(self) -> OffloadingMetricMetadata:
        labels = ("tier",) if self.read_tier is not None else ()
        kind = OffloadingCounterMetadata if self.kind == "counter" else OffloadingGaugeMetadata
        return kind(documentation=self.documentation, labelnames=labels)


def _path(*keys: str) -> Callable[[Stats], float | None]:
    """Read ``stats[k1][k2]...``; None where a part is missing (a store without that tier or counter)."""

    def read(stats: Stats) -> float | None:
        value: Any = stats
        for key in keys:
            if not isinstance(value, Mapping) or key not in value:
                return None
            value = value[key]
        return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None

    return read


def _healthy(tier: Stats) -> float | None:
    breaker = tier.get("breaker")
    return None if not isinstance(breaker, Mapping) else float(breaker.get("state") == "closed")


METRICS: dict[str, Metric] = {
    "vllm:kvstore_chunks_put": Metric("counter", "Chunks put into kvstore's DRAM tier.", _path("store", "puts")),
    "vllm:kvstore_chunk_hits": Metric("counter", "Chunks kvstore found when asked for them.", _path("store", "hits")),
    "vllm:kvstore_chunk_misses": Metric(
        "counter", "Chunks kvstore was asked for and did not hold.", _path("store", "misses")
    ),
    "vllm:kvstore_chunks_streamed": Metric(
        "counter", "Chunks kvstore loaded layer by layer (layer streams).", _path("store", "streamed")
    ),
    "vllm:kvstore_connector_loaded_chunks": Metric(
        "counter", "Chunks the kvstore connector loaded into vLLM's KV blocks.", _path("connector", "loaded_chunks")
    ),
    "vllm:kvstore_connector_load_failures": Metric(
        "counter",
        "Loads the kvstore connector gave up on (their chunks are recomputed).",
        _path("connector", "load_failures"),
    ),  # fmt: skip
    "vllm:kvstore_connector_saved_chunks": Metric(
        "counter", "Chunks the kvstore connector saved from vLLM's KV blocks.", _path("connector", "saved_chunks")
    ),
    "vllm:kvstore_dram_chunks": Metric("gauge", "Chunks held in kvstore's DRAM tier.", _path("dram", "chunks")),
    "vllm:kvstore_dram_capacity_bytes": Metric(
        "gauge", "Bytes of kvstore's DRAM tier.", _path("dram", "capacity_bytes")
    ),
    "vllm:kvstore_tier_hits": Metric("counter", "Chunks a kvstore tier below DRAM found.", read_tier=_path("hits")),
    "vllm:kvstore_tier_misses": Metric(
        "counter", "Chunks a kvstore tier below DRAM did not hold.", read_tier=_path("misses")
    ),
    "vllm:kvstore_tier_read_bytes": Metric(
        "counter", "Bytes read from a kvstore tier below DRAM.", read_tier=_path("bytes_read")
    ),
    "vllm:kvstore_tier_written_bytes": Metric(
        "counter", "Bytes written to a kvstore tier below DRAM.", read_tier=_path("bytes_written")
    ),
    "vllm:kvstore_tier_errors": Metric(
        "counter", "Failed calls to a kvstore tier below DRAM (timeouts counted apart).", read_tier=_path("errors")
    ),
    "vllm:kvstore_tier_timeouts": Metric(
        "counter", "Calls to a kvstore tier below DRAM that ran out of time.", read_tier=_path("timeouts")
    ),
    "vllm:kvstore_tier_corrupt": Metric(
        "counter", "Objects a kvstore tier held that failed their checksums (each a miss).", read_tier=_path("corrupt")
    ),
    "vllm:kvstore_tier_up": Metric(
        "gauge", "1 while a kvstore tier below DRAM is in use, 0 while its breaker keeps it off.", read_tier=_healthy
    ),
    "vllm:kvstore_tier_used_bytes": Metric(
        "gauge", "Bytes a kvstore tier below DRAM holds (where it keeps count).", read_tier=_path("bytes_used")
    ),
}
NOT_TIERS = frozenset({"store", "dram", "adaptive", "connector"})  # every other section of the stats is a tier


def metric_definitions() -> dict[str, OffloadingMetricMetadata]:
    """Every metric, as vLLM's offloading code declares its own (``build_metric_definitions``)."""
    return {name: metric.metadata() for name, metric in METRICS.items()}


class StatsReport:
    """What changed since the last report, as vLLM's stats payload: counter increments and current gauges.

    Not thread-safe: one caller (a connector's step, a tier's ``get_stats``) owns a report.
    """

    def __init__(self) -> None:
        self._last: dict[tuple[str, tuple[str, ...]], float] = {}

    def take(self, stats: Stats) -> OffloadingConnectorStats | None:
        """The payload for ``stats`` (a store's, with the connector's counters); None if nothing to say."""
        report = OffloadingConnectorStats()
        tiers = [(name, part) for name, part in stats.items() if name not in NOT_TIERS and isinstance(part, Mapping)]
        for name, metric in METRICS.items():
            readings: list[tuple[tuple[str, ...], float | None]] = []
            if metric.read is not None:
                readings.append(((), metric.read(stats)))
            if metric.read_tier is not None:
                readings += [((tier,), metric.read_tier(section)) for tier, section in tiers]
            for labels, value in readings:
                if value is None:
                    continue
                if metric.kind == "gauge":
                    report.set_gauge(name, value, labels)
                    continue
                before = self._last.get((name, labels), 0.0)
                self._last[(name, labels)] = value
                if value > before:
                    report.increase_counter(name, value - before, labels)
        return None if report.is_empty() else report


class KVStorePromMetrics(KVConnectorPromMetrics):
    """The connector's metrics on vLLM's Prometheus registry (vLLM makes one, in the process serving /metrics)."""

    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._metrics: dict[str, Any] = {}
        for name, metric in METRICS.items():
            make = self._counter_cls if metric.kind == "counter" else self._gauge_cls
            labels = [*labelnames, *metric.metadata().labelnames]
            self._metrics[name] = make(name=name, documentation=metric.documentation, labelnames=labels)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        stats = OffloadingConnectorStats(data=transfer_stats_data)
        engine = self.per_engine_labelvalues[engine_idx]
        for name, by_labels in stats.data["data"].items():
            metric = self._metrics.get(name)
            if metric is None:  # another kvstore version's metric: nothing declared for it here
                continue
            for labels, value in by_labels.items():
                bound = metric.labels(*engine, *labels)
                if METRICS[name].kind == "counter":
                    bound.inc(value)
                else:
                    bound.set(value)
