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
)
from vllm.model_executor.models.utils import extract_layer_index

from kvstore.connectors.paged import CANONICAL_FORMATS, PagedLayer, paged_format
from kvstore.connectors.vllm._common import read_options, shared_stores, vllm_namespace
from kvstore.connectors.vllm.engine_config import expected_paged_format, layout_for_vllm, request_extra
from kvstore.connectors.vllm.tensor_parallel import LoadStatus, TensorParallelRanks
from kvstore.engine.store import KVStore
from kvstore.engine.sync import SyncKVStore, SyncLayerStream
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


async def _put_all(store: KVStore, chunks: list[tuple[ChunkKey, torch.Tensor]]) -> list[bool]:
    return [await store.put(key, chunk) for key, chunk in chunks]


@dataclass
class LoadSpec:
    """Load chunks ``keys`` and write their tokens from ``skip`` on into ``block_ids``."""

    req_id: str
    keys: list[ChunkKey]
    skip: int  # tokens of the first chunk that vLLM already has (its own prefix cache)
    block_ids: list[int]


@dataclass
class SaveSpec:
    """Gather ``block_ids`` (one chunk's worth, in order) and put them as chunk ``key``."""

    req_id: str
    key: ChunkKey
    block_ids: list[int]


@dataclass
class KVStoreConnectorMetadata(KVConnectorMetadata):
    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)


@dataclass
class _Request:
    """Scheduler-side state of one request."""

    keys: list[ChunkKey]  # one per full chunk of the prompt
    prompt_tokens: int
    lookup: concurrent.futures.Future[int] | None = None
    found: int | None = None  # leading chunks the store holds, once the lookup is back
    local_tokens: int = 0  # what vLLM's own prefix cache had, as last told
    next_save: int = 0  # chunks before this one are in the store or queued for it
    block_ids: list[int] = field(default_factory=list)
    load: LoadSpec | None = None  # to send to the worker with the next step
    loading: tuple[int, LoadSpec] | None = None  # (first chunk, spec) of the load planned


@dataclass
class _ActiveLoad:
    spec: LoadSpec
    stream: SyncLayerStream | None  # None: it could not start (see ``error``), or this rank does not read
    block_ids: torch.Tensor
    failed: bool = False
    layers_done: int = 0
    error: str = ""  # why the stream is gone, once it is (the reading rank only)


class KVStoreConnector(KVConnectorBase_V1):
    """vLLM KV connector with kvstore's DRAM primary tier and its disk, Redis and S3 tiers below."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        transfer = self._kv_transfer_config
        model = vllm_config.model_config
        cache_dtype = vllm_config.cache_config.cache_dtype
        options = read_options(
            transfer.kv_connector_extra_config or {}, lambda: vllm_namespace("vllm", model, cache_dtype)
        )
        if len(kv_cache_config.kv_cache_groups) > 1:
            raise ConfigError("kvstore's KVStoreConnector supports models with one KV cache group (no hybrid models)")
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
        self.block_size = vllm_config.cache_config.block_size
        self.chunk_tokens = options.chunk_tokens
        self.prefetch_depth = options.prefetch_depth
        self.namespace = options.namespace
        # Workers: the TP group's first rank holds the store for the group (see tensor_parallel.py).
        self.ranks = TensorParallelRanks.of_vllm_worker() if role == KVConnectorRole.WORKER else TensorParallelRanks()
        self.store: SyncKVStore | None = None
        if self.ranks.is_reader:
            self.store = shared_stores.acquire(options, self.layout, lookup_only=role == KVConnectorRole.SCHEDULER)
        self.local_heads = self.ranks.heads(self.layout.num_kv_heads)
        # How long a layer may take to come: every tier's get, and some (not used by the other ranks).
        tiers = len(self.store.store.tiers) if self.store is not None else 0
        self.wait_timeout = (tiers + 2) * options.config.timeouts.get
        self.counters = {
            "lookups": 0,
            "lookup_errors": 0,
            "hit_tokens": 0,  # scheduler: tokens it told vLLM would be loaded (some may fail later)
            "loaded_chunks": 0,
            "loaded_tokens": 0,  # worker: tokens actually loaded into vLLM's blocks
            "load_failures": 0,
            "partial_loads": 0,  # loads whose chunks before a failed one were kept
            "failed_blocks": 0,
            "saved_chunks": 0,
            "save_rejected": 0,
        }
        # scheduler side
        self._requests: dict[str, _Request] = {}
        # Chunks this scheduler had the worker put into its DRAM tier, newest last: the worker may
        # be another process, whose DRAM the scheduler's lookups cannot see.
        self._saved: collections.OrderedDict[ChunkKey, None] = collections.OrderedDict()
        self._saved_limit = max(1, int(options.config.dram.capacity) // self.layout.chunk_nbytes)
        # worker side
        self._layers: list[PagedLayer] = []
        self._layer_index: dict[str, int] = {}
        self._loads: list[_ActiveLoad] = []
        self._staging: dict[ChunkKey, tuple[torch.Tensor, torch.Tensor]] = {}  # key -> (block ids, chunk)
        self._spare_chunks: list[torch.Tensor] = []  # staging buffers, reused: fresh ones pay page faults
        self._failed_blocks: set[int] = set()

    # -- scheduler side ----------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        state = self._requests.get(request.request_id)
        if state is None:
            tokens = list(request.prompt_token_ids or [])  # none for prompt embeddings: nothing to key
            keys = self._held_store().chunk_keys(tokens, request_extra(request))
            state = _Request(keys=keys, prompt_tokens=len(tokens))
            self._requests[request.request_id] = state
        state.local_tokens = num_computed_tokens
        if state.lookup is None and state.keys:
            # Every full chunk, even one vLLM has itself: the answer also tells what not to save again.
            self.counters["lookups"] += 1
            state.lookup = self._lookup(state.keys)
        # At least one prompt token must be computed: it yields the first output token.
        usable = min(len(state.keys), (state.prompt_tokens - 1) // self.chunk_tokens)
        if usable * self.chunk_tokens <= num_computed_tokens:
            return 0, False  # nothing to load beyond vLLM's own cache (the lookup goes on, for saves)
        found = self._found(state)
        if found is None:
            return None, False  # vLLM asks again next step; the scheduler never waits on I/O
        matched = min(found, usable) * self.chunk_tokens
        return max(0, matched - num_computed_tokens), False

    def _lookup(self, keys: list[ChunkKey]) -> concurrent.futures.Future[int]:
        """How many leading ``keys`` are stored: those just saved to the worker's DRAM, then the store's answer."""
        recent = 0
        while recent < len(keys) and keys[recent] in self._saved:
            recent += 1
        total: concurrent.futures.Future[int] = concurrent.futures.Future()
        if recent == len(keys):
            total.set_result(recent)
            return total

        def add_recent(rest: concurrent.futures.Future[int]) -> None:
            if rest.exception() is not None:
                total.set_exception(rest.exception())  # type: ignore[arg-type]
            else:
                total.set_result(recent + rest.result())

        self._held_store().lookup_future(keys[recent:]).add_done_callback(add_recent)
        return total

    def _found(self, state: _Request) -> int | None:
        """The lookup's answer (None while it is out); a failed lookup is a miss."""
        if state.found is None and state.lookup is not None and state.lookup.done():
            try:
                state.found = state.lookup.result()
            except Exception as exc:
                self.counters["lookup_errors"] += 1
                log.warning("kvstore lookup failed (the prompt is computed instead): %r", exc)
                state.found = 0
            state.next_save = max(state.next_save, state.found)
        return state.found

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        state = self._requests.get(request.request_id)
        if state is None or num_external_tokens <= 0:
            return
        start, end = state.local_tokens, state.local_tokens + num_external_tokens
        first_chunk = start // self.chunk_tokens
        block_ids = blocks.get_block_ids()[0]
        state.load = LoadSpec(
            req_id=request.request_id,
            keys=state.keys[first_chunk : end // self.chunk_tokens],
            skip=start - first_chunk * self.chunk_tokens,
            block_ids=list(block_ids[start // self.block_size : end // self.block_size]),
        )
        state.loading = (first_chunk, state.load)
        self.counters["hit_tokens"] += num_external_tokens

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = KVStoreConnectorMetadata()
        progress: list[tuple[str, int]] = []  # (request, tokens computed once this step ends)
        for new in scheduler_output.scheduled_new_reqs:
            state = self._requests.get(new.req_id)
            if state is None:
                continue
            state.block_ids = list(new.block_ids[0])
            if state.load is not None:
                meta.loads.append(state.load)
                state.load = None
            progress.append((new.req_id, new.num_computed_tokens + scheduler_output.num_scheduled_tokens[new.req_id]))
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            state = self._requests.get(req_id)
            if state is None:
                continue
            new_blocks = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                state.block_ids = list(new_blocks[0]) if new_blocks is not None else []
            elif new_blocks is not None:
                state.block_ids.extend(new_blocks[0])
            progress.append((req_id, cached.num_computed_tokens[i] + scheduler_output.num_scheduled_tokens[req_id]))
        per_chunk = self.chunk_tokens // self.block_size
        for req_id, computed in progress:
            state = self._requests[req_id]
            self._found(state)  # chunks the store already holds are not saved again
            done = min(computed, state.prompt_tokens) // self.chunk_tokens
            for chunk in range(state.next_save, done):
                blocks = state.block_ids[chunk * per_chunk : (chunk + 1) * per_chunk]
                if len(blocks) == per_chunk:
                    meta.saves.append(SaveSpec(req_id, state.keys[chunk], blocks))
                    self._saved[state.keys[chunk]] = None
                    self._saved.move_to_end(state.keys[chunk])
                    if len(self._saved) > self._saved_limit:
                        self._saved.popitem(last=False)
            state.next_save = max(state.next_save, done)
        for req_id in scheduler_output.finished_req_ids:
            self._requests.pop(req_id, None)
        return meta

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """A load that failed is recomputed by vLLM: its chunks are saved again once they are."""
        failed = connector_output.invalid_block_ids
        if not failed:
            return
        for state in self._requests.values():
            if state.loading is None:
                continue
            first_chunk, spec = state.loading
            bad = [i for i, block in enumerate(spec.block_ids) if block in failed]
            if bad:  # from the first failed block's chunk on: recomputed, to be saved again
                chunk = first_chunk + (spec.skip + bad[0] * self.block_size) // self.chunk_tokens
                state.next_save = min(state.next_save, chunk)
                for key in state.keys[chunk:]:
                    self._saved.pop(key, None)  # gone from the worker's DRAM, or bad: ask the store next time
                state.loading = None

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._requests.pop(request.request_id, None)
        return False, None  # saves are copied into kvstore's DRAM within the step: blocks may be freed

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
            backend, isa = attention.attn_backend.get_name(), getattr(attention, "isa", None)
            fmt = paged_format(backend, isa)
            if fmt != self.paged_format or (fmt == "opaque" and f"{backend}/{isa}" != self.kernels):
                raise ConfigError(
                    f"layer {name} uses attention backend {backend} (kernels {isa}), whose blocks kvstore reads as "
                    f"{fmt!r}; the scheduler expected {self.paged_format!r} ({self.kernels}). Please report this "
                    "with your vLLM version and --attention-backend"
                )
            kv = kv_caches[name]
            if kv.dtype != layout.dtype:
                raise ConfigError(f"layer {name}'s KV cache is {kv.dtype}, expected {layout.dtype}")
            layer = PagedLayer(kv, fmt, layout.head_dim)
            heads = self.local_heads.stop - self.local_heads.start  # this rank's share of the model's heads
            if layer.heads != heads or layer.block_size != self.block_size:
                raise ConfigError(
                    f"layer {name}'s KV cache has {layer.heads} heads and blocks of {layer.block_size} tokens; "
                    f"expected {heads} heads (of {layout.num_kv_heads}, tensor parallel rank {self.ranks.rank} "
                    f"of {self.ranks.size}) and blocks of {self.block_size}"
                )
            self._layers.append(layer)
            self._layer_index[name] = index

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVStoreConnectorMetadata)
        for spec in meta.loads:
            load = _ActiveLoad(spec, None, torch.tensor(spec.block_ids, dtype=torch.long))
            self._loads.append(load)
            if self.store is not None:  # the reading rank; a stream that cannot start fails at layer 0, agreed
                self._start_stream(load, "the stream did not start")

    def _start_stream(self, load: _ActiveLoad, failure: str) -> None:
        try:
            load.stream = self._held_store().prefetch(load.spec.keys, depth=self.prefetch_depth)
        except KVStoreError as exc:  # e.g. the store closed under a shutting-down engine
            load.stream, load.error = None, f"{failure}: {exc!r}"

    def wait_for_layer_load(self, layer_name: str) -> None:
        index = self._layer_index.get(layer_name)
        if index is None:
            return
        layer = self._layers[index]
        for load in self._loads:
            if load.failed or load.layers_done != index:
                continue
            # Every rank runs this for the same loads in the same order: the statuses are agreed.
            kv = self._read_layer(load, index) if self.store is not None else None
            status = self.ranks.agree(
                LoadStatus(kv is not None, len(load.spec.keys), len(load.spec.block_ids))
                if self.store is not None
                else None
            )
            if status.blocks < len(load.spec.block_ids):  # the reading rank narrowed the load (reported there)
                self._narrow(load, status.keys, status.blocks, f"layer {index}: another rank's chunk failed")
            if not status.loaded:
                self._fail(load, load.error or f"layer {index} failed on the reading rank")
                continue
            rows = len(load.block_ids) * self.block_size
            mine = self._layer_rows(rows) if self.ranks.size > 1 else None
            layer.scatter(load.block_ids, self.ranks.scatter_heads(kv, mine) if mine is not None else kv)
            load.layers_done += 1
        self._finish_loads(complete_only=True)

    def _read_layer(self, load: _ActiveLoad, index: int) -> torch.Tensor | None:
        """The reading rank: layer ``index`` of the load's blocks (all heads), or None (``load.error`` says why).

        A chunk that fails narrows the load to the chunks before it and the stream starts again
        (:meth:`_keep_sound_chunks`), so this returns the layer of fewer blocks, never wrong rows.
        """
        while load.stream is not None:
            try:
                kv = load.stream.wait_layer(index, self.wait_timeout)
                return kv[:, load.spec.skip : load.spec.skip + len(load.block_ids) * self.block_size]
            except KVStoreError as exc:  # PrefetchError (a layer that cannot come, or is late), a closed store
                if not self._keep_sound_chunks(load, exc):
                    load.error = f"layer {index}: {exc}"
                    self._close_stream(load)
                    load.stream = None
        return None

    def _keep_sound_chunks(self, load: _ActiveLoad, exc: KVStoreError) -> bool:
        """After chunk c of ``load`` failed, go on loading its chunks before c; False if none are left.

        Only chunk c's blocks and those after it are reported failed: vLLM recomputes from
        there, not the whole prefix. The chunks before c are streamed again from a new stream
        (their layers up to the failed one included: the old stream fails that layer as a whole).
        Each narrowing drops at least one chunk, so a load is retried at most once per chunk.
        """
        bad = getattr(exc, "chunk", None)  # None: not one chunk's fault (a late layer, a closed store)
        keep = 0 if bad is None else (bad * self.chunk_tokens - load.spec.skip) // self.block_size
        if bad is None or keep <= 0 or keep >= len(load.spec.block_ids):
            return False
        self._close_stream(load)
        self._narrow(load, bad, keep, f"chunk {bad} of {len(load.spec.keys)}: {exc}")
        self._start_stream(load, f"the stream of its first {bad} chunks did not start")
        return True

    def _narrow(self, load: _ActiveLoad, keys: int, blocks: int, reason: str) -> None:
        """Keep the first ``keys`` chunks (``blocks`` blocks) of ``load``; report the rest failed."""
        spec = load.spec
        self._report_failed(spec, spec.block_ids[blocks:], reason)
        self.counters["partial_loads"] += 1
        load.spec = dataclasses.replace(spec, keys=spec.keys[:keys], block_ids=spec.block_ids[:blocks])
        load.block_ids = load.block_ids[:blocks]

    def _layer_rows(self, tokens: int) -> torch.Tensor:
        """A buffer for this rank's heads of one layer of ``tokens`` tokens (tensor parallelism only)."""
        layout = self.layout
        heads = self.local_heads.stop - self.local_heads.start
        return torch.empty((layout.kv_planes, tokens, heads, layout.head_dim), dtype=layout.dtype)

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata, **kwargs: Any
    ) -> None:
        index = self._layer_index.get(layer_name)
        if index is None:
            return
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVStoreConnectorMetadata)
        layer = self._layers[index]
        for spec in meta.saves:
            staged = self._staging.get(spec.key)
            if staged is None:
                chunk = self._spare_chunks.pop() if self._spare_chunks else self._new_chunk()
                staged = self._staging[spec.key] = (torch.tensor(spec.block_ids, dtype=torch.long), chunk)
            block_ids, chunk = staged
            layer.gather(block_ids, chunk[index])

    def _new_chunk(self) -> torch.Tensor:
        """A staging buffer for this rank's heads of one chunk (all heads without tensor parallelism)."""
        layers, planes, tokens, heads, head_dim = self.layout.chunk_shape
        if self.ranks.size > 1:
            heads = self.local_heads.stop - self.local_heads.start
        return torch.empty((layers, planes, tokens, heads, head_dim), dtype=self.layout.dtype)

    def wait_for_save(self) -> None:
        # Loads the forward pass did not take every layer of (it cannot have used them) are failures.
        for load in self._loads:
            if not load.failed and load.layers_done < self.layout.num_layers:
                self._fail(load, f"only {load.layers_done} of {self.layout.num_layers} layers were taken")
        self._finish_loads(complete_only=False)
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
                saved = self.store.submit(_put_all(self.store.store, chunks)).result()
            except Exception as exc:  # a save is best effort: a missed one is a future cache miss
                log.warning("kvstore: saving %d chunks failed: %r", len(chunks), exc)
                saved = [False] * len(chunks)
            self.counters["saved_chunks"] += sum(saved)
            self.counters["save_rejected"] += len(chunks) - sum(saved)
        # The staging buffers are free again (put copied them): keep a few for the next steps.
        self._spare_chunks.extend(chunk for _, chunk in staged[: SPARE_CHUNKS - len(self._spare_chunks)])
        self._staging.clear()

    def _gather_chunks(self, staged: list[tuple[ChunkKey, torch.Tensor]]) -> list[tuple[ChunkKey, torch.Tensor]]:
        """Tensor parallelism: the whole chunks on the reading rank (every rank sends its heads); none elsewhere."""
        local = torch.stack([chunk for _, chunk in staged])
        full = None
        if self.store is not None:
            full = torch.empty((len(staged), *self.layout.chunk_shape), dtype=self.layout.dtype)
        self.ranks.gather_heads(local, full)
        return [] if full is None else [(key, full[i]) for i, (key, _) in enumerate(staged)]

    def get_block_ids_with_load_errors(self) -> set[int]:
        failed, self._failed_blocks = self._failed_blocks, set()
        return failed

    def _fail(self, load: _ActiveLoad, reason: str) -> None:
        load.failed = True
        self._report_failed(load.spec, load.spec.block_ids, reason)

    def _report_failed(self, spec: LoadSpec, block_ids: list[int], reason: str) -> None:
        """Blocks of ``spec`` that vLLM must recompute (counted once per failure)."""
        self.counters["load_failures"] += 1
        self.counters["failed_blocks"] += len(block_ids)
        self._failed_blocks.update(block_ids)
        log.warning(
            "kvstore: %d of %d blocks of request %s's cached prefix failed to load (%s); vLLM recomputes them",
            len(block_ids), len(spec.block_ids), spec.req_id, reason,
        )  # fmt: skip

    @staticmethod
    def _close_stream(load: _ActiveLoad) -> None:
        try:
            if load.stream is not None:
                load.stream.close()
        except Exception as exc:  # closing must not turn a finished load into an engine error
            log.debug("kvstore: closing a layer stream failed: %r", exc)

    def _finish_loads(self, complete_only: bool) -> None:
        keep: list[_ActiveLoad] = []
        for load in self._loads:
            finished = load.failed or load.layers_done == self.layout.num_layers
            if complete_only and not finished:
                keep.append(load)
                continue
            if not load.failed:
                self.counters["loaded_chunks"] += len(load.spec.keys)
                self.counters["loaded_tokens"] += len(load.spec.block_ids) * self.block_size
            self._close_stream(load)
        self._loads = keep

    def _held_store(self) -> SyncKVStore:
        """The store: the scheduler holds one, and so does the reading worker (the TP group's first rank)."""
        if self.store is None:
            raise KVStoreError("this kvstore connector holds no store (a TP rank after the first, or shut down)")
        return self.store

    # -- both sides --------------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        """This connector's counters, and the store's (``store.stats()``)."""
        store = self.store.stats() if self.store is not None else {}  # TP ranks after the first hold none
        return {"connector": dict(self.counters), **store}

    def shutdown(self) -> None:
        for load in self._loads:
            load.failed = True
        self._finish_loads(complete_only=False)
        store, self.store = self.store, None
        if store is not None:
            shared_stores.release(store)
