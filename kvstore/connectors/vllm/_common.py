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
- ``kvstore_chunk_tokens`` (256), ``kvstore_prefetch_depth`` (4, connector only).

Any other key is refused at engine start with the closest valid name (a misspelled
``kv_store_config`` would otherwise leave the engine running without the configured tiers),
except the few that vLLM itself writes or reads there (:data:`VLLM_KEYS`).
"""

from __future__ import annotations

import difflib
import json
import logging
import threading
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Any

from kvstore.config import StoreConfig
from kvstore.connectors.identity import default_namespace
from kvstore.engine.sync import SyncKVStore
from kvstore.errors import ConfigError
from kvstore.layout import KVLayout

log = logging.getLogger("kvstore.connectors.vllm")

OPTIONS = {
    "kvstore_config": "a dict of kvstore config sections, e.g. {'disk': {'path': '/nvme/kv'}}",
    "kvstore_config_file": "path of a kvstore TOML config file",
    "kvstore_namespace": "the model's identity in chunk keys (default 'vllm:<model>#id=<weights and settings>')",
    "kvstore_chunk_tokens": "tokens per stored chunk, a multiple of vLLM's block size (default 256)",
    "kvstore_prefetch_depth": "layers a load stream runs ahead of the forward pass (default 4)",
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
    )


def vllm_settings(model_config: Any, kv_cache_dtype: str) -> dict[str, Any]:
    """What besides the checkpoint's files changes the KV in vLLM (not max_model_len, which does not).

    Read from vLLM's ``ModelConfig``; equal on the scheduler and worker sides of one engine.
    """
    hf_config = getattr(model_config, "hf_config", None)
    overrides = getattr(model_config, "hf_overrides", None)
    if callable(overrides):  # a function's repr carries its address: name it instead
        overrides = f"{overrides.__module__}.{overrides.__qualname__}"
    return {
        "dtype": str(model_config.dtype),
        "quantization": model_config.quantization,
        "hf_overrides": overrides,
        "rope_scaling": getattr(hf_config, "rope_scaling", None),
        "rope_parameters": getattr(hf_config, "rope_parameters", None),
        "kv_cache_dtype": kv_cache_dtype,
    }


def vllm_namespace(prefix: str, model_config: Any, kv_cache_dtype: str) -> str:
    """The default namespace of a vLLM integration: ``<prefix>:<model>#id=<weights and settings>``."""
    settings = vllm_settings(model_config, kv_cache_dtype)
    return default_namespace(prefix, model_config.model, settings, model_config.revision)


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
    scheduler's store only looks chunks up: ``lookup_only`` gives it a DRAM pool of one chunk.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._stores: dict[str, tuple[SyncKVStore, int]] = {}

    def acquire(self, options: KVStoreOptions, layout: KVLayout, lookup_only: bool = False) -> SyncKVStore:
        ident = self._ident(options, layout)
        with self._lock:
            store, users = self._stores.get(ident, (None, 0))
            if store is None and lookup_only:
                config = options.config.model_copy(deep=True)
                config.dram.capacity = layout.chunk_nbytes  # type: ignore[assignment]
                config.dram.pin_memory = "never"
                return SyncKVStore(config, layout, options.namespace)  # not shared: release() closes it
            if store is None:
                store = SyncKVStore(options.config, layout, options.namespace)
                log.info(
                    "kvstore for %s opened: %s; tiers: %s",
                    options.namespace,
                    layout.describe(),
                    ", ".join(["dram", *(tier.name for tier in store.store.tiers)]),
                )
            self._stores[ident] = (store, users + 1)
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
