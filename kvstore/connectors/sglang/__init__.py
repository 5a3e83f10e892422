"""SGLang integration: kvstore as a HiCache storage backend, loaded by module path.

``--hicache-storage-backend dynamic`` with ``"module_path": "kvstore.connectors.sglang"`` and
``"class_name": "KVStoreHiCacheStorage"`` in ``--hicache-storage-backend-extra-config`` (see
:mod:`kvstore.connectors.sglang.storage` and the SGLang page of the docs).
"""

try:
    import sglang.srt.mem_cache.hicache_storage  # noqa: F401
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        "kvstore.connectors.sglang needs SGLang's HiCache (0.5.23 is the version tested): pip install sglang"
    ) from exc

from kvstore.connectors.sglang.storage import KVStoreHiCacheStorage

__all__ = ["KVStoreHiCacheStorage"]
