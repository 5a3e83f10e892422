"""The store's latency histograms, per engine-facing call (each tier keeps its own: :mod:`kvstore.storage.stats`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvstore.storage.stats import Histogram


@dataclass
class StoreLatency:
    """Seconds per engine-facing call: ``lookup`` and ``get``/``get_many`` (the ``kvstore_*_seconds`` metrics)."""

    lookup: Histogram = field(default_factory=Histogram)
    get: Histogram = field(default_factory=Histogram)
