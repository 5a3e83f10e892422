"""What both vLLM integrations share: reading their options, and one store per process.

Options come from vLLM's ``kv_connector_extra_config`` (connector) or the secondary-tier dict
(tier), all spelled ``kvstore_*``:

- ``kvstore_config``: a dict of :class:`~kvstore.StoreConfig` sections, e.g.
  ``{"disk": {"path": "/nvme/kv"}, "s3": {"enabled": true, "bucket": "kv"}}``; the environment
  (``KVSTORE_*``, AWS and Redis conventions for credentials) and ``kvstore_config_file`` (TOML)
  fill in the rest, as everywhere in kvstore.
- ``kvstore_namespace``: the model's identity in keys; defaults to ``vllm:<model>#id=<identity>``,
  the identity hashing the weights' bytes and the settings that change the KV
  (:mod:`kvstore.connectors.identity`, :func:`vllm_settings`).
- ``kvstore_chunk_tokens`` (256); connector only: ``kvstore_prefetch_depth`` (4),
  ``kvstore_max_stall_ms`` (50; null: no background loads) and ``kvstore_max_background_mib`` (1024):
  when a load runs in the forward pass and when in the background (docs/vllm.md).

Any other key is refused at engine start with the closest valid name (a misspelled
``kv_store_config`` would otherwise leave the engine running without the configured tiers),
except the few that vLLM itself writes or reads there (:data:`VLLM_KEYS`).
"""

from __future__ import annotations

import difflib
import json
import logging
import os
import threading
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from kvstore.config import StoreConfig
from kvstore.connectors.identity import default_namespace, weights_fingerprint
from kvstore.engine.sync import SyncKVStore
from kvstore.errors import ConfigError
from kvstore.layout import KVLayout, dtype_from_name

log = logging.getLogger("kvstore.connectors.vllm")

OPTIONS = {
    "kvstore_config": "a dict of kvstore config sections, e.g. {'disk': {'path': '/nvme/kv'}}",
    "kvstore_config_file": "path of a kvstore TOML config file",
    "kvstore_namespace": "the model's identity in chunk keys (default 'vllm:<model>#id=<weights and settings>')",
    "kvstore_chunk_tokens": "tokens per stored chunk, a multiple of vLLM's block size (default 256)",
    "kvstore_prefetch_depth": "layers a load stream runs ahead of the forward pass (default 4)",
    "kvstore_max_stall_ms": (
        "longest a load from DRAM or a local disk may be expected to hold the batch inside the forward pass; "
        "a longer one, and any from a tier off this machine, loads in the background (default 50; "
        "null: every load in the forward pass)"
    ),
    "kvstore_max_background_mib": "host memory that background loads may stage at once, in MiB (default 1024)",
}
# Keys of kv_connector_extra_config that vLLM itself writes or reads for any connector:
# --kv-offloading-backend native adds cpu_bytes_to_use (vLLM 0.32, config/vllm.py).
VLLM_KEYS = frozenset({"cpu_bytes_to_use"})


@dataclass(frozen=True)
class KVStoreOptions:
    config: StoreConfig
    namespace: str
    chunk_tokens: int
    prefetch_depth: int
    max_stall_s: float | None  # None: every load in the forward pass
    max_background_bytes: int


def log_with_vllm() -> None:
    """kvstore's log lines in vLLM's log, formatted as vLLM's own (process, level, time, file); idempotent.

    vLLM configures its ``vllm`` logger only (not propagating to the root), so by Python's default
    kvstore's INFO lines (each role's store at start, each load) would go nowhere. Where logging was
    configured otherwise (handlers on the root logger or on ``kvstore``, or vLLM's own turned off
    with ``VLLM_CONFIGURE_LOGGING=0``), nothing is changed.
    """
    ours, theirs = logging.getLogger("kvstore"), logging.getLogger("vllm")
    if ours.handlers or logging.getLogger().handlers or not theirs.handlers:
        return
    for handler in theirs.handlers:
        ours.addHandler(handler)
    ours.setLevel(theirs.level)
    ours.propagate = False


def read_options(
    extra: Mapping[str, Any],
    namespace: Callable[[], str],
    allowed: Collection[str] = frozenset(OPTIONS),
    engine_keys: Collection[str] = VLLM_KEYS,
) -> KVStoreOptions:
    """The options of ``extra``; ``namespace()`` gives the default namespace (called only if none is set).

    Every key must be in ``allowed`` or ``engine_keys`` (vLLM's own); any other, or a bad value,
    is a :class:`ConfigError` naming it, the closest valid name and the valid options.
    """
    for key in extra:
        if key not in allowed and key not in engine_keys:
            close = difflib.get_close_matches(str(key), sorted(allowed), n=1, cutoff=0.6)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            valid = "; ".join(f"{name}: {OPTIONS[name]}" for name in sorted(allowed))
            raise ConfigError(f"unknown vLLM option {key!r} for kvstore{hint}; valid options are {valid}")
    sections = extra.get("kvstore_config") or {}
    if not isinstance(sections, Mapping):
        raise ConfigError(f"kvstore_config must be a dict of config sections, got {type(sections).__name__}")
    config = StoreConfig.load(extra.get("kvstore_config_file"), **dict(sections))
    return KVStoreOptions(
        config=config,
        namespace=str(extra.get("kvstore_namespace") or namespace()),
        chunk_tokens=_positive(extra, "kvstore_chunk_tokens", 256),
        prefetch_depth=_positive(extra, "kvstore_prefetch_depth", 4),
        max_stall_s=_stall_budget(extra),
        max_background_bytes=_positive(extra, "kvstore_max_background_mib", 1024) << 20,
    )


def name_events(config: StoreConfig, served_model_name: str, data_parallel_rank: int) -> None:
    """KV events name the engine's model (unless ``events.model`` is set) and its data-parallel rank."""
    if config.events.enabled:
        if not config.events.model:
            config.events.model = served_model_name
        if data_parallel_rank and not config.events.data_parallel_rank:
            config.events.data_parallel_rank = data_parallel_rank


def vllm_settings(model_config: Any, kv_cache_dtype: str) -> dict[str, Any]:
    """What besides the checkpoint's files changes the KV in vLLM (not max_model_len, which does not).

    Only what the user set (or vLLM resolved from it before any process was started) is read
    from vLLM's ``ModelConfig``, never the live ``hf_config``: vLLM's model code rewrites the
    loaded config in the process that builds the model (DeepseekV2 renames the rope type "yarn"
    to "deepseek_yarn"), so a namespace hashing it differs between a worker, which loaded the
    model, and a scheduler in another process, which did not: the worker would store chunks
    where the scheduler never looks. The config as it is on disk (``config.json``) is hashed
    with the weights; ``hf_overrides`` carries what the user changed in it.
    """
    overrides = getattr(model_config, "hf_overrides", None)
    if callable(overrides):  # a function's repr carries its address: name it instead
        overrides = f"{overrides.__module__}.{overrides.__qualname__}"
    settings: dict[str, Any] = {
        "dtype": str(model_config.dtype),
        "quantization": model_config.quantization,
        "hf_overrides": overrides,
        "kv_cache_dtype": kv_cache_dtype,
    }
    config_path = getattr(model_config, "hf_config_path", None)
    if config_path:  # a config.json apart from the weights (--hf-config-path): hashed like the checkpoint's
        settings["hf_config_path"] = str(config_path)
        if os.path.exists(config_path):
            settings["hf_config"] = weights_fingerprint(config_path)
    return settings


def vllm_namespace(prefix: str, model_config: Any, kv_cache_dtype: str) -> str:
    """The default namespace of a vLLM integration: ``<prefix>:<model>#id=<weights and settings>``.

    Equal in every process of one engine (scheduler, workers of every rank), as long as they
    see the same checkpoint files: see :func:`vllm_settings`.
    """
    settings = vllm_settings(model_config, kv_cache_dtype)
    return default_namespace(prefix, model_config.model, settings, model_config.revision)


# vLLM's fp8 KV cache dtypes, whose values kvstore stores as they are (one byte each; vLLM keeps
# them as uint8). "fp8" and "fp8_e4m3" are the platform's e4m3 (``float8_e4m3fn``; the ``fnuz``
# variant on AMD MI300), "fp8_e5m2" is e5m2. Their per-layer scales (k_scale, v_scale) come from
# the checkpoint (1.0 without calibrated ones), so the namespace, which hashes the checkpoint
# and the KV cache dtype, names them too.
FP8_KV_DTYPES = ("fp8", "fp8_e4m3", "fp8_e5m2")


def kv_values_dtype(
    who: str, cache_dtype: str, model_dtype: Any, mla: bool = False, skipped_layers: Collection[str] = ()
) -> torch.dtype:
    """The dtype of the values an engine keeps in its KV cache; ConfigError for what ``who`` cannot store.

    ``"auto"``: the model's dtype. fp8 (:data:`FP8_KV_DTYPES`): stored byte for byte, on
    platforms whose vLLM kernels run it (on a CPU: x86 with AVX-512 or AMX), for every layer
    (``skipped_layers``: vLLM's ``kv_cache_dtype_skip_layers``, which keep the model's dtype, are
    refused) and, with ``mla``, refused (fp8 latents are not verified). Anything else (int8,
    per-token-head scales packed into blocks, fp8 MLA formats) is refused, naming what works.
    """
    if cache_dtype == "auto":
        return dtype_from_name(str(model_dtype))
    if cache_dtype not in FP8_KV_DTYPES:
        raise ConfigError(
            f"{who} cannot store kv_cache_dtype {cache_dtype!r}: it stores KV caches of the model's dtype "
            f"('auto') and fp8 ones ({', '.join(FP8_KV_DTYPES)}). Use one of those; to shrink what kvstore "
            "keeps of an 'auto' cache, give its tiers an fp8 codec (e.g. {'disk': {'codec': 'fp8+zstd', "
            "'allow_lossy': true}})"
        )
    if mla or skipped_layers:
        what = (
            "an MLA model's fp8 latents" if mla else f"fp8 KV with kv_cache_dtype_skip_layers {sorted(skipped_layers)}"
        )
        raise ConfigError(
            f"{who} cannot store {what} (not verified against a running engine); use kv_cache_dtype 'auto', "
            "and to shrink what kvstore keeps, an fp8 codec on its tiers (e.g. {'disk': {'codec': 'fp8+zstd', "
            "'allow_lossy': true}})"
        )
    _require_fp8_kv_kernels(who, cache_dtype)
    if cache_dtype == "fp8_e5m2":
        return torch.float8_e5m2
    from vllm.platforms import current_platform

    return current_platform.fp8_dtype()


def _require_fp8_kv_kernels(who: str, cache_dtype: str) -> None:
    """On vLLM's CPU platform, fp8 KV runs only on x86 with AVX-512 or AMX: refuse at start elsewhere.

    vLLM itself fails later there, building its first attention metadata ("FP8 KV cache on CPU
    requires x86 with AVX-512 or AMX"); kvstore says so before any request is taken.
    """
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    if torch.cpu._is_amx_tile_supported() or torch.cpu._is_avx512_supported():
        return
    raise ConfigError(
        f"{who}: kv_cache_dtype {cache_dtype!r} needs, on a CPU, x86 with AVX-512 or AMX (vLLM's CPU fp8 "
        "KV kernels); this CPU has neither (no avx512f or amx_tile in /proc/cpuinfo). Use kv_cache_dtype "
        "'auto' here; to shrink what kvstore keeps, give its tiers an fp8 codec (e.g. {'disk': {'codec': "
        "'fp8+zstd', 'allow_lossy': true}})"
    )


def refuse_split_layers_or_tokens(who: str, pipeline: int, prefill_context: int, decode_context: int) -> None:
    """ConfigError, naming the alternative, for parallelism under which no worker holds whole chunks.

    A chunk holds every layer and every token of its 256: under pipeline parallelism a stage
    holds only its layers, under (prefill or decode) context parallelism a worker only some
    tokens of each block. Both integrations refuse them alike, at engine start.
    """
    if pipeline > 1:
        raise ConfigError(
            f"{who} cannot store KV under pipeline parallelism (pipeline_parallel_size={pipeline}): each "
            "stage's workers hold only their own layers, so no worker has a whole chunk; use "
            "pipeline_parallel_size 1, and tensor parallelism (tensor_parallel_size) to spread a model too "
            "large for one device"
        )
    if prefill_context > 1 or decode_context > 1:
        raise ConfigError(
            f"{who} cannot store KV under context parallelism (prefill_context_parallel_size={prefill_context}, "
            f"decode_context_parallel_size={decode_context}): each worker holds only some tokens of a block; "
            "use tensor parallelism (tensor_parallel_size) instead"
        )


def _stall_budget(extra: Mapping[str, Any]) -> float | None:
    """``kvstore_max_stall_ms`` in seconds: a number of milliseconds, 0 or more, or None (no budget)."""
    value = extra.get("kvstore_max_stall_ms", 50)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < float("inf"):
        raise ConfigError(
            f"kvstore_max_stall_ms must be a number of milliseconds, 0 or more (0: every load in the background), "
            f"or null (every load in the forward pass); got {value!r}"
        )
    return value / 1000


def _positive(extra: Mapping[str, Any], key: str, default: int) -> int:
    value = extra.get(key, default)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ConfigError(f"{key} must be a positive integer, got {value!r}")
    return value


class _SharedStores:
    """One :class:`SyncKVStore` per (config, layout, namespace) in a process, reference-counted.

    vLLM builds a scheduler-side and a worker-side connector; with one GPU worker they live in
    the same process, and sharing the store lets the scheduler's lookups see the worker's DRAM
    tier. Where the worker has a process of its own (vLLM's CPU backend, tensor parallelism), the
    scheduler's store only looks chunks up: ``lookup_only`` gives it a DRAM pool of one chunk, and
    no metrics exporter (the worker's store has it, on the configured port).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._stores: dict[str, tuple[SyncKVStore, int]] = {}

    def acquire(self, options: KVStoreOptions, layout: KVLayout, role: str, lookup_only: bool = False) -> SyncKVStore:
        """The store for ``options`` and ``layout``, opened or shared; logs one line saying what ``role`` uses."""
        ident = self._ident(options, layout)
        with self._lock:
            store, users = self._stores.get(ident, (None, 0))
            if store is None and lookup_only:
                config = options.config.model_copy(deep=True)
                config.dram.capacity = layout.chunk_nbytes  # type: ignore[assignment]
                config.dram.pin_memory = "never"
                config.metrics.enabled = False  # the worker's store exports; a second exporter wants its port
                config.events.enabled = False  # the worker's store publishes what it stores
                lookups = SyncKVStore(config, layout, options.namespace)  # not shared: release() closes it
                log.info("kvstore %s (looks chunks up; the worker's store reads them): %s", role, lookups.description)
                return lookups
            if store is None:
                store = SyncKVStore(options.config, layout, options.namespace)
            self._stores[ident] = (store, users + 1)
        log.info("kvstore %s: %s", role, store.description)
        return store

    def release(self, store: SyncKVStore) -> None:
        with self._lock:
            for ident, (held, users) in list(self._stores.items()):
                if held is store:
                    if users > 1:
                        self._stores[ident] = (held, users - 1)
                        return
                    del self._stores[ident]
                    break
        store.close()  # outside the lock: close() waits for pending writes (bounded by timeouts.close)

    @staticmethod
    def _ident(options: KVStoreOptions, layout: KVLayout) -> str:
        config = options.config.model_dump(mode="json")
        return json.dumps([config, options.namespace, layout.fingerprint.hex()], sort_keys=True, default=str)


shared_stores = _SharedStores()
