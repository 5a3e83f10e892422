"""kvstore's counters on vLLM's own ``/metrics``, for both integrations.

vLLM collects a connector's statistics at every step (``get_kv_connector_stats`` on the workers, a
secondary tier's ``get_stats`` in the scheduler), carries them to the process serving ``/metrics``,
sums them over workers and hands them to Prometheus metrics the connector (or the tier) declared.
Both kvstore integrations send the same payload: vLLM's own ``OffloadingConnectorStats`` (counters
as increments since the last report, gauges as the latest value, labelled by tier), so one
mapping here (:data:`METRICS`) names every metric, and vLLM's offloading code, or
:class:`KVStorePromMetrics` for the connector, registers them. What the store's figures mean is
kvstore's own metrics table (:mod:`kvstore.engine.metrics`), read here: only their names on this
page, and the connector's own counters, are written in this module.

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

from kvstore.connectors.vllm._common import read_options
from kvstore.engine.metrics import COUNTERS, GAUGES
from kvstore.errors import ConfigError

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


def _meaning(text: str) -> str:
    """vLLM's help text for one of kvstore's own metrics: the meaning kvstore's table gives it."""
    return f"kvstore: {text}."


# The store's figures vLLM's page shows. What each means is written once, in kvstore's own metrics table
# (kvstore.engine.metrics: COUNTERS, GAUGES, what kvstore's exporter serves); here only the names vLLM's
# page gives them. The store's counters: vLLM name -> stats()["store"] key.
STORE_COUNTERS = {
    "vllm:kvstore_chunks_put": "puts",
    "vllm:kvstore_chunk_hits": "hits",
    "vllm:kvstore_chunk_misses": "misses",
    "vllm:kvstore_chunks_streamed": "streamed",
}
DRAM_GAUGES = ("chunks", "capacity_bytes")  # stats()["dram"] keys, as vllm:kvstore_dram_<key> (kvstore's names)
TIER_COUNTERS = ("hits", "misses", "bytes_read", "bytes_written", "errors", "timeouts", "corrupt")  # per tier
# (stats()[tier] keys; named as on kvstore's exporter, with the vllm: prefix)

METRICS: dict[str, Metric] = {
    **{
        name: Metric("counter", _meaning(COUNTERS["store", key][1]), _path("store", key))
        for name, key in STORE_COUNTERS.items()
    },
    # the connector's own counters, and the tiers' health and size: only on vLLM's page
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
    **{
        f"vllm:kvstore_dram_{key}": Metric("gauge", _meaning(GAUGES[f"kvstore_dram_{key}"][0]), _path("dram", key))
        for key in DRAM_GAUGES
    },
    **{
        f"vllm:{COUNTERS['tier', key][0]}": Metric("counter", _meaning(COUNTERS["tier", key][1]), read_tier=_path(key))
        for key in TIER_COUNTERS
    },
    "vllm:kvstore_tier_up": Metric(
        "gauge", "1 while a kvstore tier below DRAM is in use, 0 while its breaker keeps it off.", read_tier=_healthy
    ),
    "vllm:kvstore_tier_used_bytes": Metric(
        "gauge", "Bytes a kvstore tier below DRAM holds (where it keeps count).", read_tier=_path("bytes_used")
    ),
}
NOT_TIERS = frozenset({"store", "dram", "adaptive", "connector"})  # every other section of the stats is a tier


def configured_tiers(vllm_config: Any) -> list[str]:
    """The tiers below DRAM the connector's options enable (``disk``, ``redis``, ...); [] if they cannot be read
    (the connector refuses them, with the reason, where it reads them)."""
    transfer = getattr(vllm_config, "kv_transfer_config", None)
    try:
        options = read_options(getattr(transfer, "kv_connector_extra_config", None) or {}, lambda: "metrics")
    except ConfigError:
        return []
    return options.config.enabled_backends()


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
        tiers = configured_tiers(vllm_config)
        for name, metric in METRICS.items():
            make = self._counter_cls if metric.kind == "counter" else self._gauge_cls
            labels = [*labelnames, *metric.metadata().labelnames]
            self._metrics[name] = make(name=name, documentation=metric.documentation, labelnames=labels)
            if metric.kind != "counter":
                continue  # a gauge has no value before its first report (a 0 would say a tier is down)
            # Every counter at 0 from the start, not a bare description until it first moves.
            for engine in per_engine_labelvalues.values():
                for tier in [()] if metric.read is not None else [(tier,) for tier in tiers]:
                    self._metrics[name].labels(*engine, *tier)

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
