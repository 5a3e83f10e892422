"""KVStoreConnector: vLLM's KV connector API over a kvstore, with layer-by-layer loads and saves.

    --kv-transfer-config '{"kv_connector": "KVStoreConnector",
                           "kv_connector_module_path": "kvstore.connectors.vllm",
                           "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                           "kv_connector_extra_config": {"kvstore_config": {"disk": {"path": "/nvme/kv"}}}}'

Scheduler side: a new request's prompt is cut into chunks, their keys looked up in the store
(without blocking the scheduler: it answers "ask again" until the lookup is back), and vLLM is
told how many tokens beyond its own prefix cache will be loaded. Worker side: each load is a
layer stream (``store.prefetch``) started before the forward pass; layer i is copied into the
paged blocks when the attention of layer i asks for it, so later layers keep arriving while
earlier ones compute. A prompt chunk whose tokens have all been computed is gathered layer by
layer after each attention call and put into the store at the end of the step (a copy into
kvstore's DRAM; disk, Redis and S3 follow in the background).

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

import collections
import concurrent.futures
import dataclasses
import logging
from dataclasses import dataclass, field
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

from kvstore.connectors.attention_groups import loaded_blocks, saved_blocks
from kvstore.connectors.identity import require_one_namespace
from kvstore.connectors.paged import CANONICAL_FORMATS, PagedLayer
from kvstore.connectors.vllm._common import read_options, shared_stores, vllm_namespace
from kvstore.connectors.vllm.engine_config import (
    attention_groups,
    engine_layer,
    expected_paged_format,
    layout_for_vllm,
    request_extra,
    warn_of_another_compute_path,
)
from kvstore.connectors.vllm.layer_loads import LayerStreamLoads
from kvstore.connectors.vllm.stats import KVStorePromMetrics, StatsReport
from kvstore.connectors.vllm.step_metadata import BlockRun, KVStoreConnectorMetadata, LoadSpec, SaveSpec
from kvstore.connectors.vllm.tensor_parallel import TensorParallelRanks
from kvstore.connectors.vllm.whole_loads import WholeChunkLoads
from kvstore.engine.planner import DRAM, LoadPlan, LoadPlanner, PrefillClock
from kvstore.engine.store import KVStore
from kvstore.engine.sync import SyncKVStore
from kvstore.engine.transfer import Completion, ready_on_current_stream
from kvstore.errors import ConfigError, KVStoreError
from kvstore.keys import ChunkKey

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
SPARE_CHUNKS = 8  # staging buffers kept between steps (a long prefill step may need more, briefly)


async def _put_all(
    store: KVStore, chunks: list[tuple[ChunkKey, torch.Tensor]], ready: Completion | None = None
) -> list[bool]:
    """One ``put_many``: chunks on a GPU cross the bus as one batch, after ``ready`` (the engine's stream)."""
    return await store.put_many([key for key, _ in chunks], [chunk for _, chunk in chunks], ready=ready)


@dataclass
class _Request:
    """Scheduler-side state of one request."""

    keys: list[ChunkKey]  # one per full chunk of the prompt
    prompt_tokens: int
    lookup: concurrent.futures.Future[LoadPlan] | None = None
    plan: LoadPlan | None = None  # where the store holds the leading chunks, once the lookup is back
    decided: bool = False  # its chunks left to recompute are counted (once)
    local_tokens: int = 0  # what vLLM's own prefix cache had, as last told
    next_save: int = 0  # chunks before this one are in the store or queued for it
    block_ids: list[list[int]] = field(default_factory=list)  # the block table of each vLLM KV cache group
    load: LoadSpec | None = None  # to send to the worker with the next step
    loading: tuple[int, LoadSpec] | None = None  # (first chunk, spec) of the load planned
    load_failed: bool = False  # a whole-prefix load failed: the request is recomputed, not loaded again


class KVStoreConnector(KVConnectorBase_V1, SupportsHMA):
    """vLLM KV connector with kvstore's DRAM primary tier and its disk, Redis and S3 tiers below."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        transfer = self._kv_transfer_config
        model = vllm_config.model_config
        cache_dtype = vllm_config.cache_config.cache_dtype
        options = read_options(
            transfer.kv_connector_extra_config or {}, lambda: vllm_namespace("vllm", model, cache_dtype)
        )
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
            self.store = shared_stores.acquire(options, self.layout, lookup_only=role == KVConnectorRole.SCHEDULER)
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
        }
        # scheduler side
        self._requests: dict[str, _Request] = {}
        self._unsent_loads: list[LoadSpec] = []  # whole-prefix loads for the next step's metadata
        # Chunks this scheduler had the worker put into its DRAM tier, newest last: the worker may
        # be another process, whose DRAM the scheduler's lookups cannot see.
        self._saved: collections.OrderedDict[ChunkKey, None] = collections.OrderedDict()
        self._saved_limit = max(1, int(options.config.dram.capacity) // self.layout.chunk_nbytes)
        # The prefill rate, timed from this scheduler's steps: only when a step's scheduling follows
        # the one before it having run (with async scheduling, vLLM's GPU default, the next step is
        # scheduled as the last is submitted: no time between them to measure). Else pin it:
        # planner.prefill_tokens_per_s.
        timed = self.store is not None and not vllm_config.scheduler_config.async_scheduling
        self._prefill_clock = PrefillClock(self.store.store.planner if timed else None, self.chunk_tokens)
        # worker side
        self._scheduler_counters: dict[str, int] = {}  # as of the last step's metadata
        self._identity_checked = False  # the scheduler's identity is checked against ours once, at the first step
        self.attention = ""  # the attention backend (and CPU kernels) of the registered layers
        self._layers: list[PagedLayer] = []
        self._layer_index: dict[str, int] = {}
        # key -> (block ids of each group, chunk)
        self._staging: dict[ChunkKey, tuple[list[torch.Tensor], torch.Tensor]] = {}
        self._spare_chunks: list[torch.Tensor] = []  # staging buffers, reused: fresh ones pay page faults
        # How long a layer may take to come: every tier's get, and some (the reading rank's streams only).
        tiers = len(self.store.store.tiers) if self.store is not None else 0
        wait_timeout = (tiers + 2) * options.config.timeouts.get
        self._layer_loads = LayerStreamLoads(
            self.layout, self.ranks, self.store, self.chunk_tokens, self.block_size, options.prefetch_depth,
            wait_timeout, self.counters,
        )  # fmt: skip
        self._whole_loads = WholeChunkLoads(
            self.layout, self.ranks, self.store, self._layers, self._layer_groups, self.counters
        )
        self._report = StatsReport()  # what vLLM's /metrics shows (stats.py)

    # -- scheduler side ----------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        state = self._requests.get(request.request_id)
        if state is None:
            tokens = list(request.prompt_token_ids or [])  # none for prompt embeddings: nothing to key
            keys = self._held_store().chunk_keys(tokens, request_extra(request))
            state = _Request(keys=keys, prompt_tokens=len(tokens))
            self._requests[request.request_id] = state
        state.local_tokens = num_computed_tokens
        if state.load_failed:
            return 0, False  # its load failed: vLLM computes the prompt (and it is saved again)
        if state.lookup is None and state.keys:
            # Every full chunk, even one vLLM has itself: the answer also tells what not to save again.
            self.counters["lookups"] += 1
            state.lookup = self._lookup(state.keys)
        # At least one prompt token must be computed: it yields the first output token.
        usable = min(len(state.keys), (state.prompt_tokens - 1) // self.chunk_tokens)
        if usable * self.chunk_tokens <= num_computed_tokens:
            return 0, False  # nothing to load beyond vLLM's own cache (the lookup goes on, for saves)
        plan = self._found(state)
        if plan is None:
            return None, False  # vLLM asks again next step; the scheduler never waits on I/O
        # Only what vLLM lacks is loaded: the plan weighs the held chunks from its first missing one.
        start, held = num_computed_tokens // self.chunk_tokens, min(plan.held, usable)
        load = start + self._planner().plan(plan.tiers[start:held]).load if held > start else 0
        if not state.decided:
            state.decided = True
            self.counters["recomputed_chunks"] += max(0, held - max(load, start))
        state.next_save = min(state.next_save, max(load, start))  # what it recomputes is saved again
        matched = load * self.chunk_tokens
        # Hybrid models load whole prefixes asynchronously (vLLM takes their failures per request).
        return max(0, matched - num_computed_tokens), self.hybrid and matched > num_computed_tokens

    def _lookup(self, keys: list[ChunkKey]) -> concurrent.futures.Future[LoadPlan]:
        """The plan for ``keys``: those just saved to the worker's DRAM, then where the store holds the rest.

        The store's load planner (:mod:`kvstore.engine.planner`) says how many leading chunks are
        worth loading rather than recomputing, with the prefill rate this scheduler measures.
        """
        recent = 0
        while recent < len(keys) and keys[recent] in self._saved:
            recent += 1
        planner = self._planner()
        total: concurrent.futures.Future[LoadPlan] = concurrent.futures.Future()
        if recent == len(keys):
            total.set_result(planner.plan([DRAM] * recent))
            return total

        def add_recent(rest: concurrent.futures.Future[LoadPlan]) -> None:
            if rest.exception() is not None:
                total.set_exception(rest.exception())  # type: ignore[arg-type]
            else:  # the tiers matter (get_num_new_matched_tokens plans what vLLM lacks), not this load
                total.set_result(planner.plan([DRAM] * recent + list(rest.result().tiers)))

        self._held_store().plan_future(keys[recent:]).add_done_callback(add_recent)
        return total

    def _found(self, state: _Request) -> LoadPlan | None:
        """The lookup's plan (None while it is out); a failed lookup is a miss."""
        if state.plan is None and state.lookup is not None and state.lookup.done():
            try:
                state.plan = state.lookup.result()
            except Exception as exc:
                self.counters["lookup_errors"] += 1
                log.warning("kvstore lookup failed (the prompt is computed instead): %r", exc)
                state.plan = LoadPlan((), 0, 0.0, 0.0)
            state.next_save = max(state.next_save, state.plan.held)  # held chunks are not saved again
        return state.plan

    def _planner(self) -> LoadPlanner:
        return self._held_store().store.planner

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        state = self._requests.get(request.request_id)
        if state is None or num_external_tokens <= 0:
            return
        start, end = state.local_tokens, state.local_tokens + num_external_tokens
        first_chunk = start // self.chunk_tokens
        tables = blocks.get_block_ids()
        runs: list[BlockRun] = []
        for group in self.groups:
            try:  # which of the group's blocks the load fills: all from ``start``, or those in the window
                first, block_ids = loaded_blocks(group, list(tables[group.index]), start, end)
            except ValueError as exc:  # vLLM allocated what kvstore cannot account for: fail, never guess
                log.warning("kvstore: request %s's load is failed: %s", request.request_id, exc)
                held = tables[group.index][start // group.block_size : end // group.block_size]
                first, block_ids = start, [block for block in held if block]
                state.load_failed = True  # the worker fails the load (no keys), reporting these blocks
            runs.append(BlockRun(first - first_chunk * self.chunk_tokens, block_ids))
        state.load = LoadSpec(
            req_id=request.request_id,
            keys=[] if state.load_failed else state.keys[first_chunk : end // self.chunk_tokens],
            runs=runs,
            tokens=num_external_tokens,
        )
        state.loading = (first_chunk, state.load)
        if self.hybrid:  # asynchronous: sent with the next step, which does not schedule the request
            self._unsent_loads.append(state.load)
            state.load = None
        self.counters["hit_tokens"] += num_external_tokens

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        self._prefill_clock.step(scheduler_output.total_num_scheduled_tokens)
        meta = KVStoreConnectorMetadata(loads=self._unsent_loads)
        self._unsent_loads = []
        progress: list[tuple[str, int, int]] = []  # (request, tokens computed before this step, and after it)
        for new in scheduler_output.scheduled_new_reqs:
            state = self._requests.get(new.req_id)
            if state is None:
                continue
            state.block_ids = [list(table) for table in new.block_ids]
            if state.load is not None:
                meta.loads.append(state.load)
                state.load = None
            scheduled = scheduler_output.num_scheduled_tokens[new.req_id]
            progress.append((new.req_id, new.num_computed_tokens, new.num_computed_tokens + scheduled))
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            state = self._requests.get(req_id)
            if state is None:
                continue
            new_blocks = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                state.block_ids = [list(table) for table in new_blocks] if new_blocks is not None else []
            elif new_blocks is not None:
                if len(state.block_ids) != len(new_blocks):  # resumed without blocks before: tables start empty
                    state.block_ids = [[] for _ in new_blocks]
                for table, added in zip(state.block_ids, new_blocks, strict=True):
                    table.extend(added)
            computed = cached.num_computed_tokens[i]
            progress.append((req_id, computed, computed + scheduler_output.num_scheduled_tokens[req_id]))
        # A chunk already sent for saving (by this step's or an earlier step's request with the same
        # prefix, e.g. n > 1 sampling, or a twin request whose lookup answered a step later) is not
        # saved again: ``_saved`` holds every key emitted until a failed load takes it out.
        for req_id, before, after in progress:
            state = self._requests[req_id]
            self._found(state)  # chunks the store already holds are not saved again
            done = min(after, state.prompt_tokens) // self.chunk_tokens
            for chunk in range(state.next_save, done):
                if state.keys[chunk] in self._saved:
                    continue
                runs = self._saved_runs(state, chunk, before)
                if runs is None:
                    self.counters["unsaveable_chunks"] += 1
                    continue
                meta.saves.append(SaveSpec(req_id, state.keys[chunk], runs))
                self._saved[state.keys[chunk]] = None
                self._saved.move_to_end(state.keys[chunk])
                if len(self._saved) > self._saved_limit:
                    self._saved.popitem(last=False)
            state.next_save = max(state.next_save, done)
        for req_id in scheduler_output.finished_req_ids:
            self._requests.pop(req_id, None)
        meta.scheduler_counters = dict(self.counters)
        meta.identity = self.identity()
        return meta

    def _saved_runs(self, state: _Request, chunk: int, computed_tokens: int) -> list[BlockRun] | None:
        """Each group's blocks of ``chunk`` (see :func:`saved_blocks`), or None if a group no longer has them all."""
        runs: list[BlockRun] = []
        for group in self.groups:
            if group.index >= len(state.block_ids):
                return None
            held = saved_blocks(group, state.block_ids[group.index], chunk, self.chunk_tokens, computed_tokens)
            if held is None:
                return None
            runs.append(BlockRun(*held))
        return runs

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """A load that failed is recomputed by vLLM: its chunks are saved again once they are."""
        failed_requests = getattr(connector_output, "failed_recving", None) or set()
        for req_id in failed_requests:  # a whole-prefix (hybrid) load: the request is recomputed whole
            state = self._requests.get(req_id)
            if state is not None and state.loading is not None:
                self._recompute_from(state, state.loading[0])
                state.load_failed = True
        failed = connector_output.invalid_block_ids
        if not failed:
            return
        for state in self._requests.values():
            if state.loading is None:
                continue
            first_chunk, spec = state.loading
            run = spec.runs[0]  # block-level failures come from one-group models only
            bad = [i for i, block in enumerate(run.block_ids) if block in failed]
            if bad:  # from the first failed block's chunk on: recomputed, to be saved again
                first_bad_row = run.first_row + bad[0] * self.block_size
                self._recompute_from(state, first_chunk + first_bad_row // self.chunk_tokens)

    def _recompute_from(self, state: _Request, chunk: int) -> None:
        """vLLM recomputes ``state``'s chunks from ``chunk`` on: save them again once it has."""
        state.next_save = min(state.next_save, chunk)
        for key in state.keys[chunk:]:
            self._saved.pop(key, None)  # gone from the worker's DRAM, or bad: ask the store next time
        state.loading = None

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._requests.pop(request.request_id, None)
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
        for spec in meta.loads:
            if self.hybrid:  # whole prefixes, in the background; reported by get_transfer_results
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
        layer, group = self._layers[index], self._layer_groups[index]
        for spec in meta.saves:
            staged = self._staging.get(spec.key)
            if staged is None:
                chunk = self._spare_chunks.pop() if self._spare_chunks else self._new_chunk()
                tables = [torch.tensor(run.block_ids, dtype=torch.long) for run in spec.runs]
                staged = self._staging[spec.key] = (tables, chunk)
            tables, chunk = staged
            first_row = spec.runs[group].first_row
            if first_row:  # rows no window reaches (see attention_groups.py): zeros, not a reused buffer's rows
                chunk[index, :, :first_row].zero_()
            layer.gather(tables[group], chunk[index, :, first_row:])

    def _new_chunk(self) -> torch.Tensor:
        """A staging buffer for this rank's heads of one chunk (all heads without tensor parallelism).

        On the GPU cache's device when there is one and no tensor parallelism (whose ranks send their heads
        over CPU tensors): the gather stays on the device and ``put`` copies the chunk out asynchronously
        (kvstore.engine.transfer). Such a buffer is not kept for reuse: torch's allocator hands its memory
        out again only once that copy has read it.
        """
        layers, planes, tokens, heads, head_dim = self.layout.chunk_shape
        shape = (layers, planes, tokens, self.ranks.head_count(heads), head_dim)
        device = self._layers[0].device if self._layers and self.ranks.size == 1 else torch.device("cpu")
        return torch.empty(shape, dtype=self.layout.dtype, device=device if device.type == "cuda" else "cpu")

    def wait_for_save(self) -> None:
        self._layer_loads.end_step()
        if not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVStoreConnectorMetadata)
        # Chunks no attention layer ran for this step (nothing computed for them) are not in staging.
        chunks = [(spec.key, self._staging[spec.key][1]) for spec in meta.saves if spec.key in self._staging]
        staged = chunks
        if chunks and self.ranks.size > 1:  # every rank's heads to the first rank, which puts whole chunks
            chunks = self._gather_chunks(chunks)
        if chunks:
            try:  # one hop to kvstore's loop for all of them; each put copies into its DRAM tier
                assert self.store is not None  # chunks to put are on the reading rank only
                ready = ready_on_current_stream(chunks[0][1].device)  # the gathers queued on this thread's stream
                saved = self.store.submit(_put_all(self.store.store, chunks, ready)).result()
            except Exception as exc:  # a save is best effort: a missed one is a future cache miss
                log.warning("kvstore: saving %d chunks failed: %r", len(chunks), exc)
                saved = [False] * len(chunks)
            self.counters["saved_chunks"] += sum(saved)
            self.counters["save_rejected"] += len(chunks) - sum(saved)
        # The staging buffers are free again (put copied them): keep a few for the next steps (each once).
        spare = {id(chunk): chunk for _, chunk in staged if chunk.device.type == "cpu"}
        self._spare_chunks.extend(list(spare.values())[: max(0, SPARE_CHUNKS - len(self._spare_chunks))])
        self._staging.clear()

    def _gather_chunks(self, staged: list[tuple[ChunkKey, torch.Tensor]]) -> list[tuple[ChunkKey, torch.Tensor]]:
        """Tensor parallelism: the whole chunks on the reading rank (every rank sends its heads); none elsewhere."""
        local = torch.stack([chunk for _, chunk in staged])
        full = None
        if self.store is not None:
            full = torch.empty((len(staged), *self.layout.chunk_shape), dtype=self.layout.dtype)
        self.ranks.gather_heads(local, full)
        return [] if full is None else [(key, full[i]) for i, (key, _) in enumerate(staged)]

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """Whole-prefix (hybrid) loads that are done: copied into their blocks, or failed (vLLM recomputes)."""
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
        return self._report.take({"connector": self.counters, **self.store.store.stats()})

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> OffloadingConnectorStats:
        """The payload's class, on the side of vLLM that sums and logs it."""
        return OffloadingConnectorStats(data=data) if data is not None else OffloadingConnectorStats()

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
        store, self.store = self.store, None
        if store is not None:
            shared_stores.release(store)
