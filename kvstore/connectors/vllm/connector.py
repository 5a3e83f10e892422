"""KVStoreConnector: vLLM's KV connector API over a kvstore, with layer-by-layer loads and saves.

    --kv-transfer-config '{"kv_connector": "KVStoreConnector",
                           "kv_connector_module_path": "kvstore.connectors.vllm",
                           "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                           "kv_connector_extra_config": {"kvstore_config": {"disk": {"path": "/nvme/kv"}}}}'

This class is what vLLM loads (``kvstore.connectors.vllm.connector:KVStoreConnector``, re-exported
by the package): it reads the engine's configuration, holds the store and forwards vLLM's calls to
the parts that do the work, one module each:

- scheduler side (:mod:`~kvstore.connectors.vllm.scheduler`): a new request's prompt is cut into
  chunks, their keys looked up in the store (without blocking the scheduler: it answers "ask
  again" until the lookup is back), and vLLM is told how many tokens beyond its own prefix cache
  will be loaded; each step's metadata names the loads and saves for the workers;
- worker side, loads: each load is a layer stream (``store.prefetch``) started before the forward
  pass; layer i is copied into the paged blocks when the attention of layer i asks for it, so
  later layers keep arriving while earlier ones compute (:mod:`~kvstore.connectors.vllm.layer_loads`);
- worker side, saves: a prompt chunk whose tokens have all been computed is gathered layer by
  layer after each attention call and put into the store at the end of the step (a copy into
  kvstore's DRAM; disk, Redis and S3 follow in the background; :mod:`~kvstore.connectors.vllm.saves`).

A chunk that cannot be loaded (corrupt, vanished, a tier timing out) is reported through
``get_block_ids_with_load_errors``: vLLM recomputes those tokens instead of using bad blocks.

Hybrid models (sliding-window and full-attention layers, vLLM's hybrid KV cache manager on, as
it is by default): a chunk still holds every layer; a sliding-window layer stores and loads only
the rows inside the windows that need them (:mod:`kvstore.connectors.attention_groups`), and
loads are whole-prefix and asynchronous (:mod:`kvstore.connectors.vllm.whole_loads`), because
vLLM takes failures of such models per request, not per block.

With tensor parallelism, the first worker of the TP group holds the store: it streams loads and
puts saves, and the workers exchange their KV heads with it over the TP group
(:mod:`kvstore.connectors.vllm.tensor_parallel`). Chunks hold all heads, so a cache written at
one TP degree is reused at any other.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import OffloadingConnectorStats
from vllm.model_executor.models.utils import extract_layer_index

from kvstore.connectors.identity import require_one_namespace
from kvstore.connectors.paged import CANONICAL_FORMATS, PagedLayer
from kvstore.connectors.vllm._common import log_with_vllm, name_events, read_options, shared_stores, vllm_namespace
from kvstore.connectors.vllm.engine_config import (
    attention_groups,
    engine_layer,
    expected_paged_format,
    layout_for_vllm,
    warn_of_another_compute_path,
)
from kvstore.connectors.vllm.layer_loads import LayerStreamLoads
from kvstore.connectors.vllm.saves import ChunkSaves
from kvstore.connectors.vllm.scheduler import ConnectorScheduler
from kvstore.connectors.vllm.stats import KVStorePromMetrics, StatsReport
from kvstore.connectors.vllm.step_metadata import KVStoreConnectorMetadata
from kvstore.connectors.vllm.tensor_parallel import TensorParallelRanks
from kvstore.connectors.vllm.whole_loads import WholeChunkLoads
from kvstore.connectors.vllm.worker_context import WorkerContext
from kvstore.engine.planner import PrefillClock
from kvstore.engine.sync import SyncKVStore
from kvstore.errors import ConfigError, KVStoreError

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger("kvstore.connectors.vllm")


class KVStoreConnector(KVConnectorBase_V1, SupportsHMA):
    """vLLM KV connector with kvstore's DRAM primary tier and its disk, Redis and S3 tiers below."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        log_with_vllm()
        transfer = self._kv_transfer_config
        model = vllm_config.model_config
        cache_dtype = vllm_config.cache_config.cache_dtype
        options = read_options(
            transfer.kv_connector_extra_config or {}, lambda: vllm_namespace("vllm", model, cache_dtype)
        )
        name_events(options.config, model.served_model_name, vllm_config.parallel_config.data_parallel_rank)
        if transfer.kv_load_failure_policy != "recompute":
            # A cache that fails requests on a bad chunk is worse than no cache: kvstore's promise
            # is that a corrupt or missing chunk costs a recompute, never an error or wrong KV.
            log.warning(
                "kvstore: setting kv_load_failure_policy to 'recompute' (a chunk that fails to load is recomputed)"
            )
            transfer.kv_load_failure_policy = "recompute"
        self.layout = layout_for_vllm(vllm_config, options.chunk_tokens)
        self.paged_format, self.kernels = expected_paged_format(vllm_config)
        if self.paged_format not in CANONICAL_FORMATS:
            # Raw block bytes of kernels kvstore cannot read as K and V: never mixed with canonical chunks.
            options = dataclasses.replace(options, namespace=f"{options.namespace}#paged={self.kernels}")
        self.groups = attention_groups(kv_cache_config, options.chunk_tokens)
        # Several groups, or a sliding window: vLLM cannot take block-level failures (it stops on them
        # with several groups; with one sliding group it would recompute from a block whose window
        # it no longer holds), so loads are whole-prefix and asynchronous (whole_loads.py).
        self.hybrid = len(self.groups) > 1 or any(group.sliding for group in self.groups)
        partial = [group for group in self.groups if group.partial_rows(options.chunk_tokens)]
        if partial:
            # Such chunks hold zeros where no window reaches: kept apart from chunks with every row,
            # and from chunks written for other windows (which zero other rows).
            windows = ",".join(f"w{group.window}+{group.extra}" for group in partial)
            options = dataclasses.replace(options, namespace=f"{options.namespace}#rows=in-window:{windows}")
        self._layer_groups = [0] * self.layout.num_layers  # chunk layer -> its group's position in self.groups
        for position, group in enumerate(self.groups):
            for layer in group.layers:
                self._layer_groups[layer] = position
        self.block_size = self.groups[0].block_size  # the one group's, for one-group (layer-stream) loads
        self.chunk_tokens = options.chunk_tokens
        self.namespace = options.namespace
        # Workers: the TP group's first rank holds the store for the group (see tensor_parallel.py).
        self.ranks = TensorParallelRanks.of_vllm_worker() if role == KVConnectorRole.WORKER else TensorParallelRanks()
        self.store: SyncKVStore | None = None
        if self.ranks.is_reader:
            scheduler = role == KVConnectorRole.SCHEDULER
            where = "connector, scheduler" if scheduler else f"connector, worker rank {self.ranks.rank}"
            self.store = shared_stores.acquire(options, self.layout, where, lookup_only=scheduler)
        self.counters = {
            "lookups": 0,
            "lookup_errors": 0,
            "hit_tokens": 0,  # scheduler: tokens it told vLLM would be loaded (some may fail later)
            "loaded_chunks": 0,
            "loaded_tokens": 0,  # worker: tokens actually loaded into vLLM's blocks
            "load_failures": 0,
            "partial_loads": 0,  # loads whose chunks before a failed one were kept
            "host_ring_loads": 0,  # worker, one rank on a GPU: loads the device had no memory for (via host memory)
            "failed_blocks": 0,
            "saved_chunks": 0,
            "save_rejected": 0,
            "unsaveable_chunks": 0,  # a sliding-window group no longer held a chunk's blocks: not saved
            "recomputed_chunks": 0,  # scheduler: stored chunks the load planner found faster to compute
            "background_loads": 0,  # scheduler: loads run outside the forward pass (see kvstore_max_stall_ms)
        }
        # The prefill rate, timed from this scheduler's steps: only when a step's scheduling follows
        # the one before it having run (with async scheduling, vLLM's GPU default, the next step is
        # scheduled as the last is submitted: no time between them to measure). Else pin it:
        # planner.prefill_tokens_per_s.
        timed = self.store is not None and not vllm_config.scheduler_config.async_scheduling
        # A step is timed when it computes half the step's token budget or a chunk, whichever is fewer (a
        # budget below a chunk, --max-num-batched-tokens 128, prefills in such steps); decodes alone are not.
        step_tokens = min(self.chunk_tokens, max(1, vllm_config.scheduler_config.max_num_batched_tokens // 2))
        self._scheduler = ConnectorScheduler(
            held_store=self._held_store,
            groups=self.groups,
            chunk_tokens=self.chunk_tokens,
            hybrid=self.hybrid,
            saved_limit=max(1, int(options.config.dram.capacity) // self.layout.chunk_nbytes),
            prefill_clock=self.store.prefill_clock(step_tokens, timed)
            if self.store is not None
            else PrefillClock(None, step_tokens),
            identity=self.identity(),
            counters=self.counters,
            max_stall_s=options.max_stall_s,
            max_background_bytes=options.max_background_bytes,
            hash_block_size=self._hash_block_size(kv_cache_config) if options.config.events.enabled else None,
        )
        # worker side
        self._scheduler_counters: dict[str, int] = {}  # as of the last step's metadata
        self._identity_checked = False  # the scheduler's identity is checked against ours once, at the first step
        self.attention = ""  # the attention backend (and CPU kernels) of the registered layers
        self._layers: list[PagedLayer] = []
        self._layer_index: dict[str, int] = {}
        # How long a layer may take to come: every tier's get, and some (the reading rank's streams only).
        wait_timeout = self.store.layer_wait_timeout if self.store is not None else 2 * options.config.timeouts.get
        worker = WorkerContext(self.layout, self.ranks, self.store, self._layers, self._layer_groups, self.counters)
        self._layer_loads = LayerStreamLoads(
            worker, self.chunk_tokens, self.block_size, options.prefetch_depth, wait_timeout
        )
        self._whole_loads = WholeChunkLoads(worker)
        self._saves = ChunkSaves(worker)
        self._report = StatsReport()  # what vLLM's /metrics shows (stats.py)

    # -- scheduler side ----------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        self._scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self._scheduler.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """A load that failed is recomputed by vLLM: its chunks are saved again once they are."""
        self._scheduler.update_connector_output(connector_output)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._scheduler.request_finished(request.request_id)
        return False, None  # saves are copied into kvstore's DRAM within the step: blocks may be freed

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        """What vLLM calls instead of :meth:`request_finished` for a connector that supports hybrid models."""
        return self.request_finished(request, list(block_ids[0]) if block_ids else [])

    # -- worker side -------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        layout = self.layout
        names = sorted(kv_caches, key=extract_layer_index)
        if len(names) != layout.num_layers:
            raise ConfigError(
                f"vLLM registered {len(names)} KV cache layers, the model config says {layout.num_layers}"
            )
        forward_context = self._vllm_config.compilation_config.static_forward_context
        for index, name in enumerate(names):
            attention = forward_context[name]
            layer, kernels = engine_layer(name, attention, kv_caches[name], layout, self.paged_format, self.kernels)
            self.attention = self.attention or kernels  # what a report names: the first layer's backend and kernels
            heads = self.ranks.head_count(layout.num_kv_heads)  # this rank's share of the model's heads
            block_size = self.groups[self._layer_groups[index]].block_size
            if layer.heads != heads or layer.block_size != block_size:
                raise ConfigError(
                    f"layer {name}'s KV cache has {layer.heads} heads and blocks of {layer.block_size} tokens; "
                    f"expected {heads} heads (of {layout.num_kv_heads}, tensor parallel rank {self.ranks.rank} "
                    f"of {self.ranks.size}) and blocks of {block_size}"
                )
            self._layers.append(layer)
            self._layer_index[name] = index
        warn_of_another_compute_path(self.attention, layout.dtype)
        # One rank on a GPU: loads land on the device (across the bus asynchronously) and are put in place there.
        if self._layers[0].device.type == "cuda" and self.ranks.size == 1:
            self._layer_loads.device = self._layers[0].device

    @staticmethod
    def _hash_block_size(kv_cache_config: KVCacheConfig) -> int | None:
        """The tokens of each of vLLM's block hashes, for KV events (None: chunks are named by their keys)."""
        size = getattr(kv_cache_config, "hash_block_size", None)
        if not size:
            log.warning("kvstore: vLLM gave no hash block size: KV events name chunks by their kvstore keys")
        return size

    def identity(self) -> str:
        """Where this side files chunks: its namespace and layout (with the layout's fingerprint)."""
        return f"{self.namespace} [{self.layout.describe()}, {self.layout.fingerprint.hex()[:16]}]"

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVStoreConnectorMetadata)
        self._scheduler_counters = meta.scheduler_counters
        if not self._identity_checked:  # the first step, before any chunk is loaded or saved
            require_one_namespace((f"worker rank {self.ranks.rank}", self.identity()), {"the scheduler": meta.identity})
            self._identity_checked = True
            log.info("kvstore: worker rank %d keys chunks as the scheduler does: %s", self.ranks.rank, meta.identity)
        if meta.chunk_identities and self.store is not None:
            self.store.name_chunks(meta.chunk_identities)
        for spec in meta.loads:
            if spec.background:  # whole prefixes, in the background; reported by get_transfer_results
                self._whole_loads.start(spec)
            else:  # layer by layer, as the forward pass asks for them
                self._layer_loads.start(spec)

    def wait_for_layer_load(self, layer_name: str) -> None:
        index = self._layer_index.get(layer_name)
        if index is not None:
            self._layer_loads.load_layer(index, self._layers[index])

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata, **kwargs: Any
    ) -> None:
        index = self._layer_index.get(layer_name)
        if index is None:
            return
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVStoreConnectorMetadata)
        self._saves.gather_layer(meta.saves, index)

    def wait_for_save(self) -> None:
        self._layer_loads.end_step()
        if not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVStoreConnectorMetadata)
        self._saves.put(meta.saves)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """Background (whole-prefix) loads that are done: copied into their blocks, or failed (vLLM recomputes)."""
        finished, failed = self._whole_loads.poll()
        return KVConnectorTransferResults(finished_recving=finished, failed_recving=failed)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._layer_loads.take_failed_blocks()

    def _held_store(self) -> SyncKVStore:
        """The store: the scheduler holds one, and so does the reading worker (the TP group's first rank)."""
        if self.store is None:
            raise KVStoreError("this kvstore connector holds no store (a TP rank after the first, or shut down)")
        return self.store

    # -- both sides --------------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        """This connector's counters, the store's (``store.stats()``) and, on a worker, the scheduler's.

        The scheduler's (``hit_tokens``, ``recomputed_chunks``, ``unsaveable_chunks``, ...) come
        with each step's metadata, so any worker reports them, wherever the scheduler runs.
        """
        store = self.store.stats() if self.store is not None else {}  # TP ranks after the first hold none
        stats: dict[str, Any] = {"connector": dict(self.counters), **store}
        if self._scheduler_counters:  # a worker: the scheduler's counters, as of the last step
            stats["scheduler"] = dict(self._scheduler_counters)
        return stats

    def get_kv_connector_stats(self) -> OffloadingConnectorStats | None:
        """What the store and this connector counted since the last step, for vLLM's /metrics.

        Workers holding a store report it; a scheduler does not (its store is the worker's, shared in
        one process, or a lookup-only one that counts nothing worth showing).
        """
        if self._role != KVConnectorRole.WORKER or self.store is None:
            return None
        return self._report.take({"connector": self.counters, **self.store.stats_now()})

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> OffloadingConnectorStats:
        """The payload's class, on the side of vLLM that sums and logs it."""
        return OffloadingConnectorStats(data=data) if data is not None else OffloadingConnectorStats()

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        """True: loads stream layer by layer inside the forward pass (``wait_for_layer_load``) and saves copy
        layer by layer (``save_kv_layer``), Python between the layers that a full CUDA graph's replay would
        skip; vLLM then keeps its CUDA graphs piecewise. A request whose prompt is loaded but for its
        last token makes a step that looks like a decode step, which a full graph would otherwise run.

        vLLM asks while it builds its configuration, in the process that parses the command line and
        before any engine process starts, wherever full CUDA graphs are on (a GPU build's default). So
        kvstore's options are checked here too: a wrong one stops ``vllm serve`` in seconds, not after
        the model has loaded. (vLLM's CPU build does not ask: there the connector checks them when
        vLLM first builds it.)
        """
        read_options(extra_config or {}, lambda: "checked-only")
        return True

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: Any) -> bool:
        """vLLM 0.33 and later ask this before allowing sleep mode (``--enable-sleep-mode``): not supported.

        The connector keeps views of the engine's KV caches from ``register_kv_caches``, and its
        background loads copy into them at the ends of steps; sleep unmaps that memory and wake-up
        remaps it, which has not been run with kvstore (a GPU-only feature). So vLLM refuses the
        combination at start, with a message naming the connector, rather than risk a copy into
        unmapped memory. (vLLM 0.32 does not ask.)
        """
        return False

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVStorePromMetrics:
        """kvstore's metrics on vLLM's Prometheus registry (``vllm:kvstore_*``)."""
        return KVStorePromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        self._layer_loads.close()
        self._whole_loads.close()
        self._saves.close()
        store, self.store = self.store, None
        if store is not None:
            shared_stores.release(store)
