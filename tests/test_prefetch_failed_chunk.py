"""A failed layer stream names its first failed chunk (``PrefetchError.chunk``).

The vLLM connector once reported every block of a load failed when one chunk was
corrupt; knowing which chunk failed first, it keeps the sound chunks before it.
"""

from __future__ import annotations

import uuid

import pytest
from redis import Redis
from test_prefetch import LAYOUT, config, fill

from kvstore import KVStore
from kvstore.errors import PrefetchError
from kvstore.storage.container import parse_header


def flip_layer(data: bytearray, key: str, layer: int) -> bytes:
    header = parse_header(data, LAYOUT, key)
    data[header.header_len + header.segments[layer].offset + 7] ^= 0x10
    return bytes(data)


async def test_a_corrupt_chunk_on_disk_is_named(tmp_path):
    cfg = config(tmp_path)
    keys, _ = await fill(cfg, 3)
    async with KVStore(cfg, LAYOUT, "prefetch") as store:
        for victim in keys[1:]:  # chunks 1 and 2, layer 2: the first failed chunk is 1
            path = store.tiers[0].backend.path_for(victim)
            path.write_bytes(flip_layer(bytearray(path.read_bytes()), victim, 2))
        async with store.prefetch(keys) as stream:
            with pytest.raises(PrefetchError) as failed:
                await stream.layer(2)
    assert failed.value.chunk == 1


async def test_a_missing_chunk_is_named(tmp_path):
    cfg = config(tmp_path)
    keys, _ = await fill(cfg, 3)
    async with KVStore(cfg, LAYOUT, "prefetch") as store:
        store.tiers[0].backend.path_for(keys[2]).unlink()
        async with store.prefetch(keys) as stream:
            with pytest.raises(PrefetchError, match="in no tier") as failed:
                await stream.layer(0)
    assert failed.value.chunk == 2


async def test_of_two_corrupt_chunks_on_redis_the_first_is_named_whichever_fails_first(tmp_path, redis_server):
    """Remote reads of one layer run concurrently: the error names the lowest failed chunk."""
    prefix = f"failed-{uuid.uuid4().hex[:8]}"
    cfg = config(tmp_path, disk={"enabled": False}, redis={"enabled": True, "url": redis_server.url, "prefix": prefix})
    keys, _ = await fill(cfg, 3)
    client = Redis.from_url(redis_server.url)
    for victim in keys[1:]:
        name = f"{prefix}:prefetch:{victim}"
        client.set(name, flip_layer(bytearray(client.get(name)), victim, 0))
    client.close()
    async with KVStore(cfg, LAYOUT, "prefetch") as store:
        async with store.prefetch(keys) as stream:
            with pytest.raises(PrefetchError) as failed:
                await stream.layer(0)
    assert failed.value.chunk == 1
