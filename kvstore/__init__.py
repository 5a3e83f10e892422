"""kvstore: a tiered KV-cache store for LLM inference engines.

from kvstore import KVStore, StoreConfig, KVLayout, chunk_keys
"""

from kvstore.config import ConfigError, StoreConfig
from kvstore.engine.store import KVStore, StoreClosedError
from kvstore.engine.sync import SyncKVStore
from kvstore.keys import ChunkKey, chunk_keys
from kvstore.layout import KVLayout
from kvstore.storage.container import ChunkFormatError

__version__ = "0.1.0"

__all__ = [
    "ChunkFormatError",
    "ChunkKey",
    "ConfigError",
    "KVLayout",
    "KVStore",
    "StoreClosedError",
    "StoreConfig",
    "SyncKVStore",
    "chunk_keys",
]
