"""Small helpers for tests of tiers and backends: one chunk at a time through a tier's batch methods, and listings.

The chunk tier only offers batches (that is how the store uses it); a test of one chunk reads
better with these. No pytest here: the module imports anywhere.
"""

from __future__ import annotations

from kvstore.backends.base import Backend
from kvstore.keys import DEFAULT_NAMESPACE, ChunkKey
from kvstore.storage.tier import ChunkTier


async def write_chunk(tier: ChunkTier, key: ChunkKey, chunk: memoryview) -> None:
    """Store one chunk through ``tier``; raises what stopped the write (it is counted either way)."""
    (outcome,) = await tier.write_many([(key, chunk)])
    if outcome is not None:
        raise outcome


async def read_chunk(tier: ChunkTier, key: ChunkKey, out: memoryview) -> bool:
    """Fill ``out`` with one chunk from ``tier``; False on a miss of any kind (counted in its stats)."""
    (found,) = await tier.read_many_into([key], [out])
    return found


async def read_layer(tier: ChunkTier, key: ChunkKey, layer: int, out: memoryview) -> bool:
    """Fill ``out`` with one layer of a chunk (a header read, then one segment read); False on a miss."""
    (reader,) = await tier.open_layers_many([key])
    if reader is None:
        return False
    try:
        return await reader.read_counted(layer, out)
    finally:
        reader.close()


async def listed_keys(backend: Backend, prefix: str = "", namespace: str = DEFAULT_NAMESPACE) -> list[str]:
    """The keys ``backend``'s listing (the operator's ``scan``) shows in ``namespace``, starting with ``prefix``."""
    return [
        item.key
        async for page in backend.scan(lambda name: name == namespace)
        for item in page
        if item.key.startswith(prefix)
    ]
