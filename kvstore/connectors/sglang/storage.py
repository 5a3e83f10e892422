"""KVStoreHiCacheStorage: kvstore as an SGLang HiCache storage backend (the L3 below SGLang's host pool).

SGLang loads it by module path::

    --enable-hierarchical-cache --hicache-storage-backend dynamic \\
    --hicache-storage-backend-extra-config '{"backend_name": "kvstore",
        "module_path": "kvstore.connectors.sglang", "class_name": "KVStoreHiCacheStorage",
        "interface_v1": 1, "kvstore_config": {"disk": {"path": "/nvme/kv"}}}'

``interface_v1`` makes SGLang call the zero-copy ``batch_get_v1`` / ``batch_set_v1`` with host
pool indices; without it SGLang uses the legacy ``get`` / ``set`` calls, which kvstore does not
serve (they raise ``NotImplementedError`` naming the fix).

**Pages and chunks.** One SGLang page is one kvstore chunk (``chunk_tokens`` = ``--page-size``).
SGLang names a page by a hash chained over the prompt's pages, asks ``batch_exists`` for the
leading run of stored pages, and writes pages in batches that start wherever a radix node
starts: any page boundary. A chunk of several pages would be stored only once all its pages were
written, and a prompt whose length is not a multiple of it would lose its last pages; a chunk
per page stores and finds exactly what SGLang asks for. A larger ``--page-size`` (64-256) makes
fewer, larger objects, which remote tiers (S3, Redis) serve faster per byte.

**Copies.** A page is handed to kvstore as a strided view of the host pool (no copy):
``batch_set_v1`` copies it once, into kvstore's DRAM tier, from which the slower tiers are
written; ``batch_get_v1`` copies a DRAM hit once into the host pool. A page that is not in
kvstore's DRAM is read from its tier into a DRAM slot (its promotion to DRAM) and copied from
there into the host pool: one copy more than a read straight into the pool, which kvstore does
only into contiguous buffers, and a page of SGLang's host pool is never contiguous in canonical
``[layers, planes, tokens, heads, head_dim]`` order. Size kvstore's DRAM tier (``dram.capacity``)
with that in mind: SGLang's host pool already keeps hot pages in host memory.

**Namespace.** Chunks are stored under kvstore's namespace (:mod:`kvstore.keys`): by default
``sglang:<model>#id=<weights and KV dtype>`` (:func:`kvstore.connectors.identity.default_namespace`,
or ``kvstore_namespace``), then the shard: ``#tp=<rank>/<size>`` for MHA models, whose ranks hold
different heads, and ``#pp=``, ``#cp=`` under pipeline or context parallelism. MLA models keep one
latent on every tensor-parallel rank: their namespace has no ``#tp``, rank 0 writes (SGLang's
``is_storage_writer``), every other rank's ``batch_set_v1`` stores nothing and reports success,
and every rank reads rank 0's chunks. A chunk key is SHA-256 over the namespace's seed
(:func:`kvstore.keys.namespace_seed`: the namespace and the layout's fingerprint) and SGLang's
page hash, so another model, shard, dtype or page size never reads these chunks.

**Failures.** kvstore answers each lookup and read within ``timeouts.get``, and a write only copies
into its DRAM tier; a call still running ``timeouts.get`` + 5 s later is stopped (within
``timeouts.close``) and answered as a miss: a dead tier is a miss, never a hang. A corrupt or
foreign chunk is a counted miss (kvstore checks every chunk it reads), never wrong KV.

**Threads.** SGLang (0.5.23's ``HiCacheController``) calls ``batch_exists`` from its prefetch
thread (the hit query), ``batch_get_v1`` from its prefetch I/O thread and ``batch_set_v1`` from
its backup thread: each waits there for kvstore, within the bound above. Its scheduler thread only
queues prefetches and backups and polls their acknowledgements; into this backend it calls
``get_stats`` (each step, with ``--enable-metrics``: counters read on that thread, no wait for
kvstore's loop) and ``clear``, and ``register_mem_pool_host`` / ``close`` when storage is attached
or detached (the store opens or closes then).

Options (keys of ``--hicache-storage-backend-extra-config`` besides SGLang's own): see :data:`OPTIONS`.
"""

from __future__ import annotations

import difflib
import hashlib
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig, HiCacheStorageExtraInfo
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost
from sglang.srt.observability.metrics_collector import StorageMetrics

from kvstore.config import StoreConfig
from kvstore.connectors.identity import default_namespace
from kvstore.connectors.sglang.host_pages import HostPages
from kvstore.engine.sync import LoopCall, SyncKVStore
from kvstore.errors import ConfigError, KVStoreError
from kvstore.events import ChunkIdentity
from kvstore.keys import ChunkKey, chain_parents, namespace_seed
from kvstore.layout import dtype_name

log = logging.getLogger("kvstore.connectors.sglang")
T = TypeVar("T")

OPTIONS = {
    "kvstore_config": "a dict of kvstore config sections, e.g. {'disk': {'path': '/nvme/kv'}}",
    "kvstore_config_file": "path of a kvstore TOML config file",
    "kvstore_namespace": "the model's identity in chunk keys (default 'sglang:<model>#id=<weights and KV dtype>')",
}
# Keys SGLang itself reads from the extra config (0.5.23): the dynamic factory's (backend_factory.py), the
# interface switch and tp_lcm_size (cache_controller.py), the prefetch settings
# (HybridCacheController.parse_storage_backend_extra_config), and what --file-storage-path adds.
SGLANG_KEYS = frozenset(
    {
        "backend_name",
        "module_path",
        "class_name",
        "interface_v1",
        "tp_lcm_size",
        "prefetch_threshold",
        "prefetch_timeout_base",
        "prefetch_timeout_per_ki_token",
        "hicache_storage_pass_prefix_keys",
        "file_storage_path",
    }
)
_KEY_TAG = b"kvstore-sglang-page-v1\x00"


def read_options(extra: Mapping[str, Any]) -> tuple[StoreConfig, str | None]:
    """The kvstore config and explicit namespace (or None) of SGLang's extra config; an unknown key is refused."""
    for key in extra:
        if key not in OPTIONS and key not in SGLANG_KEYS:
            close = difflib.get_close_matches(str(key), sorted(OPTIONS), n=1, cutoff=0.6)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            valid = "; ".join(f"{name}: {text}" for name, text in OPTIONS.items())
            raise ConfigError(
                f"unknown option {key!r} in --hicache-storage-backend-extra-config for kvstore{hint}; "
                f"kvstore's options are {valid}"
            )
    sections = extra.get("kvstore_config") or {}
    if not isinstance(sections, Mapping):
        raise ConfigError(f"kvstore_config must be a dict of config sections, got {type(sections).__name__}")
    config = StoreConfig.load(extra.get("kvstore_config_file"), **dict(sections))
    namespace = extra.get("kvstore_namespace")
    return config, str(namespace) if namespace else None


def shard_suffix(storage_config: HiCacheStorageConfig) -> str:
    """What tells this rank's chunks apart from other ranks' (MLA: the latent is the same on every TP rank)."""
    parts = [] if storage_config.is_mla_model else [f"#tp={storage_config.tp_rank}/{storage_config.tp_size}"]
    if storage_config.pp_size > 1:
        parts.append(f"#pp={storage_config.pp_rank}/{storage_config.pp_size}")
    if storage_config.attn_cp_size > 1:
        parts.append(f"#cp={storage_config.attn_cp_rank}/{storage_config.attn_cp_size}")
    return "".join(parts)


def events_of_rank(config: StoreConfig, storage_config: HiCacheStorageConfig, is_writer: bool) -> StoreConfig:
    """The config of this rank's store with KV events set for it (``config`` itself when events are off).

    One rank per data-parallel rank publishes: the writer of the first tensor, pipeline and context
    parallel rank (the others would bind the same port, or repeat its events); the DP rank is in
    its batches and its ports (:mod:`kvstore.events`), the model's name in its topic.
    """
    if not config.events.enabled:
        return config
    config = config.model_copy(deep=True)
    first = storage_config.tp_rank == 0 and storage_config.pp_rank == 0 and storage_config.attn_cp_rank == 0
    config.events.enabled = first and is_writer
    if not config.events.model and storage_config.model_name:
        config.events.model = storage_config.model_name
    if storage_config.dp_rank and not config.events.data_parallel_rank:
        config.events.data_parallel_rank = storage_config.dp_rank
    return config


class KVStoreHiCacheStorage(HiCacheStorage):
    """SGLang's ``HiCacheStorage`` over a :class:`~kvstore.SyncKVStore` (see the module's doc).

    Built by SGLang's ``StorageBackendFactory`` as ``KVStoreHiCacheStorage(storage_config, kwargs)``;
    the store opens in :meth:`register_mem_pool_host`, once the host pool's geometry is known. The
    options are checked here, first, so a wrong one stops SGLang at start with its name and the fix.
    """

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: Mapping[str, Any] | None = None) -> None:
        if storage_config.dcp_size > 1:
            raise ConfigError("kvstore's SGLang storage backend does not support decode context parallelism (dcp)")
        self.storage_config = storage_config
        self.config, self._namespace = read_options(storage_config.extra_config or {})
        self.is_writer = storage_config.is_storage_writer
        self.store: SyncKVStore | None = None
        self.pages: HostPages | None = None
        self.namespace = ""
        self._seed = b""
        self._metrics = StorageMetrics()

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Take the host pool whose pages are read and written, and open the store for its layout."""
        super().register_mem_pool_host(mem_pool_host)
        pages = HostPages(mem_pool_host, latent=isinstance(mem_pool_host, MLATokenToKVPoolHost))
        config = self.storage_config
        base = self._namespace or default_namespace(
            "sglang", config.model_name or "unnamed", {"kv_dtype": dtype_name(pages.layout.dtype)}
        )
        namespace = base + shard_suffix(config)
        if self.store is not None:
            self.store.close()
        self.store = SyncKVStore(events_of_rank(self.config, config, self.is_writer), pages.layout, namespace)
        self.pages, self.namespace = pages, namespace
        self._seed = namespace_seed(pages.layout, namespace)
        log.info(
            "kvstore HiCache storage (%s) opened for %s pages: %s",
            "writer" if self.is_writer else "reader; MLA: rank 0 writes",
            pages.host_layout,
            self.store.description,
        )

    def chunk_key(self, page_key: str) -> ChunkKey:
        """The kvstore key of SGLang's page ``page_key`` in this backend's namespace and layout."""
        return hashlib.sha256(self._seed + _KEY_TAG + page_key.encode()).hexdigest()

    # -- the zero-copy interface (interface_v1) ------------------------------------------------------

    def batch_exists(self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None) -> int:
        """How many leading pages of ``keys`` kvstore holds (0 if the store cannot answer in time)."""
        store = self._open_store()
        if not keys:
            return 0
        found = self._bounded(store, lambda: store.lookup_future([self.chunk_key(key) for key in keys]), "lookup")
        return found or 0

    def batch_get_v1(
        self, keys: list[str], host_indices: torch.Tensor, extra_info: HiCacheStorageExtraInfo | None = None
    ) -> list[bool]:
        """Read each page into the host pool at ``host_indices``; per page, whether it was read.

        A page that is not read (a miss, a corrupt chunk, a tier past its timeout) leaves its
        host pages undefined; SGLang uses only the leading pages read.
        """
        store, pages = self._open_store(), self._host_pages()
        outs = pages.chunks(host_indices, len(keys))
        start = time.perf_counter()
        chunks = self._bounded(store, lambda: store.get_many_future([self.chunk_key(key) for key in keys], outs), "get")
        read = [chunk is not None for chunk in chunks] if chunks is not None else [False] * len(keys)
        self._record(self._metrics.prefetch_pgs, self._metrics.prefetch_bandwidth, sum(read), start)
        return read

    def batch_set_v1(
        self, keys: list[str], host_indices: torch.Tensor, extra_info: HiCacheStorageExtraInfo | None = None
    ) -> list[bool]:
        """Store each page of the host pool at ``host_indices``; per page, whether kvstore took it.

        Pages already stored (the leading run kvstore holds) are not written again. On an MLA
        model's non-writing ranks nothing is stored and every page reports success: rank 0 writes.
        """
        store, pages = self._open_store(), self._host_pages()
        views = pages.chunks(host_indices, len(keys))
        if not self.is_writer:
            return [True] * len(keys)
        start = time.perf_counter()
        chunk_keys = [self.chunk_key(key) for key in keys]
        held = self._bounded(store, lambda: store.lookup_future(chunk_keys), "lookup") or 0
        taken: list[bool] | None = []
        if held < len(keys):
            self._name_pages(store, keys, chunk_keys, held)
            prefix = extra_info.prefix_keys if extra_info is not None else None  # the pages before keys[0]
            before = chunk_keys[held - 1] if held else (self.chunk_key(prefix[-1]) if prefix else None)
            parents = chain_parents(chunk_keys[held:], before)
            taken = self._bounded(
                store, lambda: store.put_many_future(chunk_keys[held:], views[held:], parents=parents), "put"
            )
        stored = [True] * held + (taken if taken is not None else [False] * (len(keys) - held))
        self._record(self._metrics.backup_pgs, self._metrics.backup_bandwidth, sum(stored) - held, start)
        return stored

    def _name_pages(self, store: SyncKVStore, keys: list[str], chunk_keys: list[ChunkKey], start: int) -> None:
        """With KV events on, pages from ``start`` on are advertised by SGLang's own page hashes (32 bytes)."""
        if not store.publishes_events:
            return
        names: dict[ChunkKey, ChunkIdentity] = {}
        for i in range(start, len(keys)):
            try:
                name, parent = bytes.fromhex(keys[i]), bytes.fromhex(keys[i - 1]) if i else None
            except ValueError:  # not a SHA-256 hex page hash: the chunk is named by its kvstore key
                continue
            names[chunk_keys[i]] = ChunkIdentity(name, parent, ())
        store.name_chunks(names)

    def _bounded(self, store: SyncKVStore, start: Callable[[], LoopCall[T]], what: str) -> T | None:
        """The call ``start()`` makes, waited for as the store bounds it (``SyncKVStore.call_within``); None if it
        failed, did not start (a closed store) or was late (then stopped first: a late read writes nothing into
        the host pool afterwards)."""
        try:
            return store.call_within(start(), what)
        except KVStoreError as exc:  # StoreClosedError once the store is closed
            log.warning("kvstore %s failed (%s); treated as a miss", what, exc)
        return None

    def _record(self, pages: list[int], bandwidth: list[float], count: int, start: float) -> None:
        if self.storage_config.enable_storage_metrics and count:
            assert self.pages is not None
            gigabytes = count * self.pages.layout.chunk_nbytes / 1e9
            pages.append(count)
            bandwidth.append(gigabytes / max(time.perf_counter() - start, 1e-9))

    def _open_store(self) -> SyncKVStore:
        if self.store is None:
            raise RuntimeError("KVStoreHiCacheStorage has no store: call register_mem_pool_host() (not after close())")
        return self.store

    def _host_pages(self) -> HostPages:
        assert self.pages is not None  # set with the store
        return self.pages

    # -- statistics and lifecycle --------------------------------------------------------------------

    def get_stats(self) -> StorageMetrics:
        """SGLang's storage metrics since the last call (pages and GB/s per batch), with kvstore's own
        counters (hits, misses, per-tier errors, timeouts, corrupt chunks) as the ``kvstore`` attribute.

        SGLang's scheduler thread calls this every step (``--enable-metrics``): the counters are read on
        that thread (``SyncKVStore.stats_now``), without waiting for kvstore's loop, however busy it is."""
        metrics, self._metrics = self._metrics, StorageMetrics()
        metrics.kvstore = self.store.stats_now() if self.store is not None else {}  # type: ignore[attr-defined]
        return metrics

    def clear(self) -> None:
        """Not supported: kvstore's chunks are shared by every engine of the namespace (``kvstore gc`` deletes)."""
        log.warning("kvstore HiCache storage: clear() keeps the stored chunks; use `kvstore gc` to delete them")

    def close(self) -> None:
        """Finish pending writes (within ``timeouts.close``) and close the store."""
        if self.store is not None:
            self.store.close()
            self.store = None

    # -- the legacy per-page interface and the sidecar pools' v2 interface: not served -------------------

    def _legacy(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(
            'kvstore serves SGLang\'s zero-copy interface only: add "interface_v1": 1 to '
            "--hicache-storage-backend-extra-config"
        )

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> torch.Tensor | None:
        return self._legacy()

    def batch_get(
        self, keys: Sequence[str], target_locations: Any = None, target_sizes: Any = None
    ) -> list[torch.Tensor | None]:
        return self._legacy()

    def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None) -> bool:
        return self._legacy()

    def batch_set(
        self, keys: Sequence[str], values: Any = None, target_locations: Any = None, target_sizes: Any = None
    ) -> bool:
        return self._legacy()

    def _sidecars(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(
            "kvstore's SGLang backend stores the KV pool only: models with sidecar pools (Mamba or SWA state, a "
            "DSA indexer; SGLang's batch_*_v2 calls) are not supported"
        )

    batch_exists_v2 = batch_get_v2 = batch_set_v2 = _sidecars

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        """Refuse a sidecar pool at attach (SGLang fails the attach), not at the model's first request."""
        if host_pool is getattr(self, "mem_pool_host", None):
            return super().register_mem_host_pool_v2(host_pool, host_pool_name)
        raise ConfigError(
            f"kvstore's SGLang backend stores the KV pool only; this model also has the host pool "
            f"{host_pool_name!r} (Mamba or SWA state, a DSA indexer), which it cannot store: use another "
            "HiCache storage backend for this model, or none"
        )

    def exists(self, key: str) -> bool:
        """Whether kvstore holds the page ``key``."""
        return self.batch_exists([key]) == 1
