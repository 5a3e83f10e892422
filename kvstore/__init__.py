"""kvstore: a tiered KV-cache store for LLM inference engines.

from kvstore import KVStore, SyncKVStore, StoreConfig, KVLayout, chunk_keys

The package, from the bottom up (each layer imports only the ones below it):

- ``errors``, ``layout``, ``keys``, ``config`` and ``util/``: what every layer shares;
- ``eviction/``: which chunk leaves DRAM or the disk (lru, s3fifo, arc); ``admission/``: which
  tier below DRAM a put reaches, and when (write-through, second-sighting); ``codecs/``: per-layer
  compression stages and the pipelines made of them;
- ``backends/``: where stored objects live (disk, Redis, S3, plugins), behind one small async
  interface; ``events/``: KV events for routers, in vLLM's wire format;
- ``storage/``: the chunk container, encryption, the tier that checks every byte it reads, and
  ``build_tiers`` (the tiers a config enables: the engine is given them);
- ``sizing/``: miss-ratio curves, the cost model, advice and auto mode;
- ``engine/``: the store itself (KVStore: DRAM pool, cascade, layer streams, load planner, metrics)
  and :class:`SyncKVStore`, the whole contract an engine integration uses;
- ``connectors/``: vLLM, SGLang (HiCache) and transformers, over ``SyncKVStore`` only;
  ``testing/``: the backend conformance suite and dev servers;
- ``bench/``: what ``kvstore bench`` measures; ``cli/``: the ``kvstore`` command.

The research benchmarks are not part of the package: ``benchmarks/`` in a clone.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvstore.config import StoreConfig
    from kvstore.engine.store import KVStore
    from kvstore.engine.sync import SyncKVStore, SyncLayerStream
    from kvstore.errors import (
        ChunkFormatError,
        ConfigError,
        KVStoreError,
        LayerTimeout,
        PrefetchError,
        StoreClosedError,
        TierTimeout,
    )
    from kvstore.keys import ChunkKey, chain_parents, chunk_keys
    from kvstore.layout import KVLayout

__version__ = "0.1.0"

__all__ = [
    "ChunkFormatError",
    "ChunkKey",
    "ConfigError",
    "KVLayout",
    "KVStore",
    "KVStoreError",
    "LayerTimeout",
    "PrefetchError",
    "StoreClosedError",
    "StoreConfig",
    "SyncKVStore",
    "SyncLayerStream",
    "TierTimeout",
    "chain_parents",
    "chunk_keys",
]

# Where each public name lives. They are imported on first use (PEP 562), so that `import kvstore.cli`
# (the `kvstore` command, its --help and --version) does not import torch.
_HOMES = {
    "StoreConfig": "kvstore.config",
    "KVStore": "kvstore.engine.store",
    "SyncKVStore": "kvstore.engine.sync",
    "SyncLayerStream": "kvstore.engine.sync",
    "ChunkKey": "kvstore.keys",
    "chunk_keys": "kvstore.keys",
    "chain_parents": "kvstore.keys",
    "KVLayout": "kvstore.layout",
    **dict.fromkeys(
        ("ChunkFormatError", "ConfigError", "KVStoreError", "LayerTimeout", "PrefetchError", "StoreClosedError"),
        "kvstore.errors",
    ),
    "TierTimeout": "kvstore.errors",
}


def __getattr__(name: str) -> Any:
    """The public name ``name``, imported from its module the first time it is asked for."""
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'kvstore' has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
