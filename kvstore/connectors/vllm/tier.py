"""KVStoreTier: kvstore's disk, Redis and S3 tiers as a secondary tier of vLLM's native offloading.

    --kv-transfer-config '{"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
        "kv_connector_extra_config": {"spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": 8589934592,
            "secondary_tiers": [{"type": "KVStoreTier", "module_path": "kvstore.connectors.vllm",
                                 "kvstore_config": {"disk": {"path": "/nvme/kv"}}}]}}'

vLLM's CPU tier stays the primary: it copies blocks between GPU and its pinned buffer, and
cascades chunks to this tier (``submit_store``) or promotes them back (``submit_load``). Each
primary chunk (one row of vLLM's buffer: every layer's pages of ``blocks_per_chunk`` blocks,
in the layout of vLLM's kernels) is one kvstore chunk, compressed by the tier's codec, under a
key derived from vLLM's block hash (which carries the request's ``cache_salt``) and kvstore's
namespace (model, block layout). With tensor parallelism the workers share the primary buffer
(``SharedOffloadRegion``); the tier stores each row in TP-1 order (all KV heads, as one worker
would write it), so a chunk written at TP=2 loads at TP=1 and the reverse (:class:`RowOrder`).

Every method runs on vLLM's scheduler thread and returns at once: lookups answer RETRY until
kvstore's answer is back, jobs run on kvstore's event loop and are reported by
``get_finished_jobs``. A chunk that fails to load is reported as such (and answered MISS from
then on), so vLLM recomputes it.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import hashlib
import inspect
import logging
import threading
from collections.abc import Callable, Collection, Iterable
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
import torch
from vllm.v1.kv_offload.base import LookupResult, Medium, OffloadKey, ReqContext, RequestOffloadingContext
from vllm.v1.kv_offload.tiering.base import JobResult, SecondaryTierManager, TransferJob

from kvstore.connectors.identity import default_namespace
from kvstore.connectors.vllm._common import (
    FP8_KV_DTYPES,
    kv_values_dtype,
    log_with_vllm,
    read_options,
    refuse_split_layers_or_tokens,
    shared_stores,
    vllm_namespace,
)
from kvstore.connectors.vllm.stats import StatsReport, metric_definitions
from kvstore.errors import ConfigError
from kvstore.keys import ChunkKey, namespace_seed
from kvstore.layout import KVLayout, dtype_from_name

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import OffloadingConnectorStats
    from vllm.v1.kv_offload.base import OffloadingMetricMetadata, OffloadingSpec
    from vllm.v1.kv_offload.tiering.backpressure import BackpressureDetector

log = logging.getLogger("kvstore.connectors.vllm")
TIER_OPTIONS = {"kvstore_config", "kvstore_config_file", "kvstore_namespace"}
KNOWN_KEYS = 1 << 16  # lookup answers remembered (present / failed), oldest forgotten first


def engine_config(model: str) -> VllmConfig | None:
    """The engine's ``VllmConfig``, where a tier can find it; None elsewhere.

    vLLM 0.32 hands a secondary tier only its ``OffloadingSpec`` (the model's name and the KV
    cache's dtype: not the model's dtype, quantization or config overrides) and builds the
    scheduler outside ``set_current_vllm_config``. The offloading connector's scheduler, which
    builds the tiers, holds the config as its ``vllm_config`` argument: it is taken from there
    (by type, and only if it serves this model). Read-only, looked up once at start.
    """
    from vllm.config import VllmConfig, get_current_vllm_config_or_none

    def serves(candidate: object) -> bool:
        return isinstance(candidate, VllmConfig) and getattr(candidate.model_config, "model", None) == model

    current = get_current_vllm_config_or_none()
    if serves(current):
        return current
    frame = inspect.currentframe()
    try:
        while frame is not None:
            candidate = frame.f_locals.get("vllm_config")
            if serves(candidate):
                return candidate  # type: ignore[return-value]
            frame = frame.f_back
    finally:
        del frame  # a frame held in a local would keep every caller's locals alive
    return None


def tier_namespace(model: str, kv_dtype: str, config: VllmConfig | None) -> str:
    """``vllm-tier:<model>#id=<weights and settings>``: the tier's default namespace.

    With the engine's config (:func:`engine_config`), the settings are the connector's
    (dtype, quantization, ``hf_overrides``, KV cache dtype: :func:`vllm_settings`); without it,
    the checkpoint's files and the KV dtype only, and a warning says what that misses.
    """
    if config is not None:
        return vllm_namespace("vllm-tier", config.model_config, kv_dtype)
    log.warning(
        "kvstore tier: vLLM's engine config is not visible here, so the default namespace identifies %s by "
        "its files and KV dtype only; if this engine overrides dtype, quantization or hf_overrides at run "
        "time, set kvstore_namespace in kv_connector_extra_config (one namespace per such setting)",
        model,
    )
    return default_namespace("vllm-tier", model, {"kv_cache_dtype": kv_dtype})


@dataclasses.dataclass(frozen=True)
class RowOrder:
    """Where one chunk's bytes lie in a primary row, and how they become TP-1 order.

    kvstore stores every row in TP-1 order (the row a single worker would write: each layer's
    ``blocks_per_chunk`` pages, each page with all KV heads), so that engines of every
    tensor-parallel degree share one namespace and one set of chunks. vLLM's canonical layout,
    its one-copy MLA layout and any row of a single worker are already in that order
    (``rank_slots == 1``). vLLM's default direct layout under tensor parallelism is rank-major
    (``SharedOffloadRegion.create_next_worker_view``): rank r's slot holds its ``pages`` pages
    of ``page_bytes`` (its heads only), after rank r-1's; the tier interleaves the slots page
    by page on store and splits them again on load.
    """

    chunk_bytes: int  # the chunk's bytes, from the row's start (the rest of the row is padding)
    rank_slots: int  # rank-major slots to interleave; 1: the row is in TP-1 order as it lies
    pages: int = 1  # pages per rank slot: layers x blocks_per_chunk
    page_bytes: int = 0  # one rank's page of one layer and block

    def to_tp1(self, row: torch.Tensor) -> torch.Tensor:
        """The chunk in TP-1 order: ``row`` itself (a view) or, for rank slots, a reordered copy."""
        if self.rank_slots == 1:
            return row
        tp1 = torch.empty_like(row)
        tp1.view(self.pages, self.rank_slots, self.page_bytes).copy_(self._by_page(row))
        return tp1

    def from_tp1(self, tp1: torch.Tensor, row: torch.Tensor) -> None:
        """Write a TP-1 chunk into ``row`` in the engine's order (no-op when ``tp1`` is ``row``)."""
        if tp1 is not row:
            self._by_page(row).copy_(tp1.view(self.pages, self.rank_slots, self.page_bytes))

    def _by_page(self, row: torch.Tensor) -> torch.Tensor:
        """A rank-major row seen page-major: ``[pages, rank_slots, page_bytes]`` (a strided view)."""
        return row.view(self.rank_slots, self.pages, self.page_bytes).transpose(0, 1)


def row_order(spec: OffloadingSpec) -> RowOrder:
    """How this engine's primary rows map to TP-1 order; ConfigError for what cannot be stored so.

    Refused, naming the alternative: pipeline and context parallelism (a worker holds only some
    layers or tokens, so no row is a model's chunk), and vLLM's direct layout under tensor
    parallelism where concatenating the ranks' pages does not give the TP-1 page (KV heads
    replicated across ranks, token-major pages): vLLM's ``canonical_layout`` writes TP-1 rows
    itself there.
    """
    config, parallel = spec.config, spec.config.parallel
    per_chunk = config.worker_kv_bytes_per_block * config.cache.blocks_per_chunk
    refuse_split_layers_or_tokens("KVStoreTier", parallel.pp_size, parallel.pcp_size, parallel.dcp_size)
    if parallel.world_size == 1 or getattr(spec, "replicated_layout", False):
        return RowOrder(chunk_bytes=per_chunk, rank_slots=1)  # one worker's row, or one copy (MLA)
    if config.canonical_layout:
        if not parallel.is_parallelism_agnostic:
            raise ConfigError(
                f"vLLM cannot lay this model's KV out in TP-1 order at tensor_parallel_size={parallel.tp_size} "
                "(its canonical layout falls back to per-rank pages), so KVStoreTier cannot share its rows "
                "across TP degrees; use a tensor_parallel_size that divides the model's KV heads"
            )
        return RowOrder(chunk_bytes=per_chunk * parallel.world_size, rank_slots=1)
    layers = sum(len(group.layer_names) for group in config.groups)
    if not parallel.is_parallelism_agnostic or config.kv_cache_layout != "LBHNC":
        why = (
            "the ranks do not each hold their own KV heads of one attention group"
            if not parallel.is_parallelism_agnostic
            else f"pages in kv_cache_layout {config.kv_cache_layout} are not head-major"
        )
        raise ConfigError(
            f"KVStoreTier stores rows in TP-1 order, and vLLM's direct layout at tensor_parallel_size="
            f'{parallel.tp_size} cannot be put in that order here ({why}); add "canonical_layout": true to '
            "kv_connector_extra_config, so that vLLM writes TP-1 rows itself"
        )
    if config.worker_kv_bytes_per_block % layers:
        raise ConfigError(f"a worker's {config.worker_kv_bytes_per_block} bytes per block are not {layers} pages")
    return RowOrder(
        chunk_bytes=per_chunk * parallel.world_size,
        rank_slots=parallel.world_size,
        pages=layers * config.cache.blocks_per_chunk,
        page_bytes=config.worker_kv_bytes_per_block // layers,
    )


def layout_for_primary(spec: OffloadingSpec, chunk_bytes: int, engine: VllmConfig | None = None) -> KVLayout:
    """A :class:`KVLayout` for one chunk's bytes in TP-1 order (kernel layout: opaque to kvstore, but typed).

    The chunk is every layer's K and V for ``tokens`` tokens in vLLM's block layout, all KV
    heads. kvstore only needs its dtype (for the codecs) and its size; heads x head_dim is
    folded into head_dim.
    """
    config = spec.config
    dtype = _values_dtype(config.model.dtype, engine)
    layers = sum(len(group.layer_names) for group in config.groups)
    tokens = config.groups[0].tokens_per_block * config.cache.blocks_per_chunk
    per_token = chunk_bytes // (layers * 2 * tokens * dtype.itemsize)
    if layers * 2 * tokens * per_token * dtype.itemsize != chunk_bytes:
        raise ConfigError(f"a primary chunk of {chunk_bytes} bytes is not {layers} layers x K,V x {tokens} tokens")
    return KVLayout(num_layers=layers, num_kv_heads=1, head_dim=per_token, dtype=dtype, chunk_tokens=tokens)


def _values_dtype(name: str, engine: VllmConfig | None) -> torch.dtype:
    """The dtype of a primary row's values: the spec's KV dtype (a model dtype, or fp8 kept as bytes)."""
    try:
        return dtype_from_name(name)
    except ValueError:  # fp8, or a dtype the tier refuses, naming what it stores
        if engine is None:
            return kv_values_dtype("KVStoreTier", name, None)
        skipped = getattr(engine.cache_config, "kv_cache_dtype_skip_layers", ())
        return kv_values_dtype("KVStoreTier", name, None, mla=engine.model_config.use_mla, skipped_layers=skipped)


def primary_format(spec: OffloadingSpec, engine: VllmConfig | None = None) -> str:
    """What a chunk's bytes mean beyond their size: the platform, page layout and kernels that wrote them.

    Part of the tier's namespace, so that engines sharing a bucket but not a block layout (a GPU
    and a CPU engine, two CPU kernel sets) never read each other's rows as their own. Not the
    tensor-parallel degree: the tier stores every row in TP-1 order (:class:`RowOrder`), the same
    bytes at TP=1 and TP=2. Rows of vLLM's ``canonical_layout`` are the same bytes as direct TP-1
    rows where pages are head-major (``LBHNC``, the CPU backend's) and share their tag,
    ``direct`` (the tag TP=1 rows always had: caches written before stay readable); elsewhere
    (token-major GPU pages) they are other bytes, tagged ``canonical``.

    On a CPU the kernel set depends on the model's dtype and head size (from the ``engine``'s
    config, where the tier finds it): an fp8 cache's blocks are laid out by AMX kernels for a
    bfloat16 model and by the portable ones otherwise, so without it an fp8 cache is refused
    rather than tagged ambiguously.
    """
    from vllm.platforms import current_platform

    config = spec.config
    parts = [
        str(current_platform.device_type),
        str(config.kv_cache_layout),
        "canonical" if config.canonical_layout and config.kv_cache_layout != "LBHNC" else "direct",
    ]
    if current_platform.is_cpu():
        fp8 = config.model.dtype in FP8_KV_DTYPES
        if fp8 and engine is None:  # the kernels (AMX for bfloat16 models, else vec) lay fp8 blocks out apart
            raise ConfigError(
                f"KVStoreTier cannot tell which CPU kernels lay out this engine's {config.model.dtype} KV blocks "
                "(vLLM did not let it see the model's dtype); use kv_cache_dtype 'auto', or set kvstore_namespace "
                "to one of its own per model dtype"
            )
        model = engine.model_config if engine is not None else None
        try:
            from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

            dtype = dtype_from_name(str(model.dtype) if model is not None else config.model.dtype)
            head_size = model.get_head_size() if model is not None else None
            parts.append(_get_attn_isa(dtype, config.groups[0].tokens_per_block, head_size))
        except Exception:  # a vLLM without this helper: rows stay apart from every named kernel set
            parts.append("unknown-kernels")
    return "/".join(parts)


class KVStoreTier(SecondaryTierManager):
    """A vLLM secondary tier backed by a kvstore (its DRAM pool is only a write-back buffer here)."""

    medium: ClassVar[Medium] = Medium.STORAGE

    def __init__(
        self,
        offloading_spec: OffloadingSpec,
        primary_kv_view: memoryview,
        tier_type: str,
        backpressure_detector: BackpressureDetector | None = None,
        locality: str | None = None,
        **options: Any,
    ) -> None:
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        log_with_vllm()
        model = offloading_spec.config.model
        engine = engine_config(model.name)
        # Its own dict in secondary_tiers: vLLM takes out type, module_path, backpressure and locality.
        settings = read_options(options, lambda: tier_namespace(model.name, model.dtype, engine), TIER_OPTIONS, ())
        self.row_order = row_order(offloading_spec)
        self.layout = layout_for_primary(offloading_spec, self.row_order.chunk_bytes, engine)
        self.format = primary_format(offloading_spec, engine)
        settings = dataclasses.replace(settings, namespace=f"{settings.namespace}#{self.format}")
        # Keys: vLLM's block hash (a SHA-256 chain over the prefix) under kvstore's namespace and salt.
        self._seed = namespace_seed(self.layout, settings.namespace)
        rows = torch.from_numpy(np.asarray(primary_kv_view))  # [chunks, row bytes], vLLM's own memory
        self._rows = rows[:, : self.row_order.chunk_bytes].view(torch.uint8)
        self.store = shared_stores.acquire(settings, self.layout, "KVStoreTier")
        self._finished: collections.deque[JobResult] = collections.deque()
        self._jobs: dict[int, concurrent.futures.Future[JobResult]] = {}
        self._job_keys: dict[int, tuple[bool, list[OffloadKey]]] = {}  # job -> (is a load, keys)
        self._lock = threading.Lock()
        self._lookups: dict[OffloadKey, concurrent.futures.Future[int]] = {}
        self._present: collections.OrderedDict[OffloadKey, None] = collections.OrderedDict()
        self._failed: collections.OrderedDict[OffloadKey, None] = collections.OrderedDict()
        self.counters = collections.Counter[str]()
        self._report = StatsReport()

    def chunk_key(self, key: OffloadKey) -> ChunkKey:
        return hashlib.sha256(self._seed + bytes(key)).hexdigest()

    def _row(self, chunk_id: int) -> torch.Tensor:
        """Primary row ``chunk_id``'s chunk bytes, in the engine's order (a view of vLLM's buffer)."""
        return self._rows[int(chunk_id)]

    def _as_chunk(self, data: torch.Tensor) -> torch.Tensor:
        """Chunk bytes in TP-1 order as a chunk-shaped tensor (a view: no copy)."""
        return data.view(self.layout.dtype).view(self.layout.chunk_shape)

    # -- lookups -----------------------------------------------------------------------------

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        if key in self._failed:
            return LookupResult.MISS
        if key in self._present:
            self._present.move_to_end(key)
            return LookupResult.HIT
        pending = self._lookups.get(key)
        if pending is None:
            if len(self._lookups) >= KNOWN_KEYS:  # answers nobody came back for (requests gone)
                self._lookups = {k: f for k, f in self._lookups.items() if not f.done()}
            try:
                self._lookups[key] = self.store.lookup_future([self.chunk_key(key)])
            except Exception as exc:
                log.warning("KVStoreTier lookup not started (treated as a miss): %r", exc)
                return LookupResult.MISS
            self.counters["lookups"] += 1
            self.counters["lookup_retries"] += 1
            return LookupResult.RETRY
        if not pending.done():
            self.counters["lookup_retries"] += 1
            return LookupResult.RETRY
        del self._lookups[key]
        try:
            found = pending.result() > 0
        except Exception as exc:
            log.warning("KVStoreTier lookup failed (treated as a miss): %r", exc)
            found = False
        if found:
            self._remember(self._present, key)
        self.counters["lookup_hits" if found else "lookup_misses"] += 1
        return LookupResult.HIT if found else LookupResult.MISS

    @staticmethod
    def _remember(known: collections.OrderedDict[OffloadKey, None], key: OffloadKey) -> None:
        known[key] = None
        known.move_to_end(key)
        while len(known) > KNOWN_KEYS:
            known.popitem(last=False)

    # -- jobs --------------------------------------------------------------------------------

    def submit_store(self, job_metadata: TransferJob) -> None:
        pairs = [
            (key, self._row(chunk_id))
            for key, chunk_id in zip(job_metadata.keys, job_metadata.chunk_ids, strict=True)
            if key not in self._present  # already in kvstore: nothing to write
        ]
        self._job_keys[job_metadata.job_id] = (False, [key for key, _ in pairs])
        # Each row is reordered to TP-1 on kvstore's loop, one chunk at a time, not on the scheduler's thread
        # (vLLM keeps a row unchanged until its cascade job is reported).
        self._submit(
            job_metadata.job_id,
            lambda: self.store.put_many_future(
                [self.chunk_key(key) for key, _ in pairs],
                [row for _, row in pairs],
                prepare=lambda row: self._as_chunk(self.row_order.to_tp1(row)),
                then=lambda accepted: self._stored(job_metadata.job_id, accepted),
            ),
        )

    def submit_load(self, job_metadata: TransferJob) -> None:
        keys = list(job_metadata.keys)
        rows = [self._row(chunk_id) for chunk_id in job_metadata.chunk_ids]
        self._job_keys[job_metadata.job_id] = (True, keys)
        # A row in TP-1 order is read into in place; a rank-major one through a TP-1 buffer that is then
        # split into the ranks' slots (on kvstore's loop, as the reads end).
        tp1 = [row if self.row_order.rank_slots == 1 else torch.empty_like(row) for row in rows]
        self._submit(
            job_metadata.job_id,
            lambda: self.store.get_many_future(
                [self.chunk_key(key) for key in keys],
                list(map(self._as_chunk, tp1)),
                then=lambda results: self._loaded(job_metadata.job_id, keys, rows, tp1, results),
            ),
        )

    def _submit(self, job_id: int, start: Callable[[], concurrent.futures.Future[JobResult]]) -> None:
        try:
            future = start()
        except Exception as exc:  # the store is closed: the job fails, the scheduler goes on
            log.warning("KVStoreTier job %d not started: %r", job_id, exc)
            self._finished.append(JobResult(job_id, success=False))
            return
        with self._lock:
            self._jobs[job_id] = future
        future.add_done_callback(lambda done: self._job_done(job_id, done))

    def _stored(self, job_id: int, accepted: list[bool]) -> JobResult:
        """A store job's puts ended (on kvstore's loop): each accepted row is in its DRAM, its tiers follow."""
        taken = sum(accepted)
        self.counters["stored_chunks"] += taken
        self.counters["store_rejected"] += len(accepted) - taken
        return JobResult(job_id, success=taken == len(accepted), transfer_bytes=taken * self.layout.chunk_nbytes)

    def _loaded(
        self,
        job_id: int,
        keys: list[OffloadKey],
        rows: list[torch.Tensor],
        tp1: list[torch.Tensor],
        results: list[torch.Tensor | None],
    ) -> JobResult:
        """A load job's reads ended (on kvstore's loop): each chunk read goes into its row; a miss of any kind
        (absent, corrupt, late) fails that key only."""
        for chunk, row, result in zip(tp1, rows, results, strict=True):
            if result is not None:
                self.row_order.from_tp1(chunk, row)
        loaded = [key for key, result in zip(keys, results, strict=True) if result is not None]
        self.counters["loaded_chunks"] += len(loaded)
        self.counters["load_failures"] += len(keys) - len(loaded)
        success = len(loaded) == len(keys)
        if loaded and not success:
            self.counters["partial_loads"] += 1  # the chunks that did load are reported and used
        return JobResult(
            job_id,
            success=success,
            successful_keys=None if success else tuple(loaded),
            transfer_bytes=len(loaded) * self.layout.chunk_nbytes,
        )

    def _job_done(self, job_id: int, future: concurrent.futures.Future[JobResult]) -> None:
        """On kvstore's loop thread: queue the result for the scheduler's next poll."""
        try:
            result = future.result()
        except Exception as exc:
            log.warning("KVStoreTier job %d failed: %r", job_id, exc)
            result = JobResult(job_id, success=False)
        self._finished.append(result)

    def get_finished_jobs(self) -> Iterable[JobResult]:
        finished: list[JobResult] = []
        while self._finished:
            result = self._finished.popleft()
            with self._lock:
                self._jobs.pop(result.job_id, None)
            is_load, keys = self._job_keys.pop(result.job_id, (False, []))
            succeeded = set(keys) if result.success else set(result.successful_keys or ())
            for key in keys:
                if key in succeeded:
                    self._failed.pop(key, None)
                    self._remember(self._present, key)
                elif is_load:  # corrupt, vanished or timed out: a miss from now on, so vLLM recomputes
                    self._present.pop(key, None)
                    self._remember(self._failed, key)
            finished.append(result)
        return finished

    def has_pending_work(self) -> bool:
        with self._lock:
            return bool(self._jobs) or bool(self._finished)

    def drain_jobs(self) -> None:
        """Wait for every submitted job (each is bounded by kvstore's timeouts; none is abandoned)."""
        with self._lock:
            running = list(self._jobs.values())
        concurrent.futures.wait(running)

    # -- request lifecycle -----------------------------------------------------------------------

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        return  # kvstore's tiers keep their own recency

    def stats(self) -> dict[str, Any]:
        """The tier's counters, how it orders rows (``rank_slots`` > 1: rank-major rows it reorders), the store's."""
        rows = {"rank_slots": self.row_order.rank_slots, "chunk_bytes": self.row_order.chunk_bytes}
        return {"tier": dict(self.counters), "rows": rows, **self.store.stats()}

    @classmethod
    def build_metric_definitions(cls, extra_config: dict[str, Any]) -> dict[str, OffloadingMetricMetadata]:
        """kvstore's metrics on vLLM's /metrics (``vllm:kvstore_*``; see :mod:`kvstore.connectors.vllm.stats`)."""
        return metric_definitions()

    def get_stats(self) -> OffloadingConnectorStats | None:
        """What the store counted since the last call (vLLM's offloading code reports it on /metrics)."""
        return None if self.store is None else self._report.take(self.store.stats_now())

    def shutdown(self) -> None:
        self.drain_jobs()
        del self._rows  # our view of vLLM's buffer: vLLM cannot unmap it while a view exists
        store, self.store = self.store, None  # type: ignore[assignment]
        if store is not None:
            shared_stores.release(store)
