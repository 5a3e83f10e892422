"""What a vLLM worker's loads and saves share: one object, built once by the connector.

The connector's worker side has three parts that move KV between vLLM's paged caches and
kvstore (:class:`~kvstore.connectors.vllm.layer_loads.LayerStreamLoads`,
:class:`~kvstore.connectors.vllm.whole_loads.WholeChunkLoads`,
:class:`~kvstore.connectors.vllm.saves.ChunkSaves`); each is given this context.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from kvstore.connectors.paged import PagedLayer
from kvstore.connectors.vllm.tensor_parallel import TensorParallelRanks
from kvstore.engine.sync import SyncKVStore
from kvstore.layout import KVLayout


@dataclass
class WorkerContext:
    """One worker's view of its caches and store, shared (not copied) by its loads and saves.

    ``store`` is None on tensor-parallel ranks after the first (rank 0 reads and writes for all).
    ``layers`` and ``layer_groups`` are the connector's own lists, filled in place when vLLM
    registers its caches: each layer's paged cache, and the position of its KV cache group.
    ``counters`` is the connector's dict, updated in place by each part.
    """

    layout: KVLayout
    ranks: TensorParallelRanks
    store: SyncKVStore | None
    layers: list[PagedLayer]
    layer_groups: list[int]
    counters: Counter[str] | dict[str, int]
