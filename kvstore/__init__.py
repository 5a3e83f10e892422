"""kvstore: a tiered KV-cache store for LLM inference engines.

from kvstore import KVStore, StoreConfig, KVLayout, chunk_keys

The package, from the bottom up (each layer imports only the ones below it):

- ``errors``, ``layout``, ``keys``, ``config`` and ``util/``: what every layer shares;
- ``codecs/``: per-layer compression stages and the pipelines made of them;
- ``backends/``: where stored objects live (disk, Redis, S3), behind one small async interface;
- ``storage/``: the chunk container, encryption, and the tier that checks every byte it reads;
- ``sizing/``: miss-ratio curves, the cost model, advice and auto mode;
- ``engine/``: the store itself (DRAM pool, cascade, layer streams, sync facade, metrics);
- ``connectors/``: vLLM and transformers; ``cli/``: the ``kvstore`` command;
  ``devtools/``: benchmarks, demo, dev servers; ``testing/``: the backend conformance suite.
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
