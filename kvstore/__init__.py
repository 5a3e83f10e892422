"""kvstore: a tiered KV-cache store for LLM inference engines.

from kvstore import KVStore, StoreConfig, KVLayout, chunk_keys
"""

from kvstore.config import ConfigError, StoreConfig
from kvstore.format import ChunkFormatError
from kvstore.keys import ChunkKey, chunk_keys
from kvstore.layout import KVLayout
from kvstore.store import KVStore, StoreClosedError
from kvstore.sync import SyncKVStore

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
