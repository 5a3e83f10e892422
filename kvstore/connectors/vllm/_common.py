"""What both vLLM integrations share: reading their options, and one store per process.

Options come from vLLM's ``kv_connector_extra_config`` (connector) or the secondary-tier dict
(tier), all spelled ``kvstore_*``:

- ``kvstore_config``: a dict of :class:`~kvstore.StoreConfig` sections, e.g.
  ``{"disk": {"path": "/nvme/kv"}, "s3": {"enabled": true, "bucket": "kv"}}``; the environment
  (``KVSTORE_*``, AWS and Redis conventions for credentials) and ``kvstore_config_file`` (TOML)
  fill in the rest, as everywhere in kvstore.
- ``kvstore_namespace``: the model's identity in keys; defaults to ``vllm:<model>``.
- ``kvstore_chunk_tokens`` (256), ``kvstore_prefetch_depth`` (4, connector only).
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvstore.config import StoreConfig
from kvstore.engine.sync import SyncKVStore
from kvstore.errors import ConfigError
from kvstore.layout import KVLayout

log = logging.getLogger("kvstore.connectors.vllm")

OPTIONS = {
    "kvstore_config": "a dict of kvstore config sections, e.g. {'disk': {'path': '/nvme/kv'}}",
    "kvstore_config_file": "path of a kvstore TOML config file",
    "kvstore_namespace": "the model's identity in chunk keys (default 'vllm:<model>')",
    "kvstore_chunk_tokens": "tokens per stored chunk, a multiple of vLLM's block size (default 256)",
    "kvstore_prefetch_depth": "layers a load stream runs ahead of the forward pass (default 4)",
}


@dataclass(frozen=True)
class KVStoreOptions:
    config: StoreConfig
    namespace: str
    chunk_tokens: int
    prefetch_depth: int


def read_options(extra: Mapping[str, Any], default_namespace: str, allowed: set[str] | None = None) -> KVStoreOptions:
    """The ``kvstore_*`` options of ``extra``; an unknown or bad one is a :class:`ConfigError` naming it."""
    allowed = set(OPTIONS) if allowed is None else allowed
    for key in extra:
        if key.startswith("kvstore") and key not in allowed:
            valid = "; ".join(f"{name}: {OPTIONS[name]}" for name in sorted(allowed))
            raise ConfigError(f"unknown vLLM option {key!r} for kvstore; valid options are {valid}")
    sections = extra.get("kvstore_config") or {}
    if not isinstance(sections, Mapping):
        raise ConfigError(f"kvstore_config must be a dict of config sections, got {type(sections).__name__}")
    config = StoreConfig.load(extra.get("kvstore_config_file"), **dict(sections))
    return KVStoreOptions(
        config=config,
        namespace=str(extra.get("kvstore_namespace") or default_namespace),
        chunk_tokens=_positive(extra, "kvstore_chunk_tokens", 256),
        prefetch_depth=_positive(extra, "kvstore_prefetch_depth", 4),
    )


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
