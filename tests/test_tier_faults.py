"""What a tier makes of objects it cannot use as they are: a plugin codec that raises anything while
decoding, and a lossy chunk another store wrote (its promotion keeps its codec; its reads are counted).

The disk tier is real (files in tmp_path); the lossy chunk comes from a real ``redis-server``.
"""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import pytest
import torch

from kvstore import KVLayout, KVStore, StoreConfig
from kvstore.codecs import BytesBytesCodec, register_codec
from kvstore.codecs import registry as codec_registry
from kvstore.codecs.registry import CodecRegistry
from kvstore.errors import ConfigError
from kvstore.storage.container import header_codec
from kvstore.testing.servers import RedisServer

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=16, chunk_tokens=32)
MARK = 0x7F  # a chunk whose first byte is this is encoded as one the plugin's decoder chokes on


class FragileCodec(BytesBytesCodec):
    """A third-party stage with a bug: some of what it encodes, its decoder fails on with ``struct.error``
    (not one of the exception types a codec is expected to raise)."""

    name = "fragile"

    def encode(self, data, spec):
        marker = b"\xff" if data[0] == MARK else b"\x00"
        return bytes(data) + marker

    def decode(self, data, spec):
        if data[-1] == 0xFF:
            struct.unpack("<Q", b"")  # raises struct.error
        return bytes(data[:-1])


@pytest.fixture
def fragile(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(codec_registry, "default_registry", CodecRegistry())
    register_codec(FragileCodec)


def chunk(first_byte: int, seed: int) -> torch.Tensor:
    values = torch.from_numpy(np.random.default_rng(seed).standard_normal(LAYOUT.chunk_shape).astype(np.float32))
    kv = values.to(LAYOUT.dtype)
    kv.view(torch.uint8).view(-1)[0] = first_byte
    return kv


async def test_a_codec_that_raises_anything_on_decode_makes_a_corrupt_object_not_a_tier_failure(
    tmp_path: Path, fragile: None
) -> None:
    """Three objects its decoder fails on: each is counted corrupt and removed; the tier's breaker stays
    closed and the good chunks on it are still served (before: three tier failures opened the breaker)."""
    config = StoreConfig(dram={"capacity": 2 * LAYOUT.chunk_nbytes}, disk={"path": tmp_path, "codec": "fragile"})
    async with KVStore(config, LAYOUT, "fragile") as writer:
        keys = writer.chunk_keys(list(range(6 * LAYOUT.chunk_tokens)))
        chunks = [chunk(MARK if i < 3 else 0, i) for i in range(6)]
        for key, kv in zip(keys, chunks, strict=True):
            assert await writer.put(key, kv)
            await writer.flush()
        paths = [writer.tiers[0].backend.path_for(key) for key in keys]
    assert all(path.exists() for path in paths)
    async with KVStore(config, LAYOUT, "fragile") as reader:
        for key in keys[:3]:
            assert await reader.get(key) is None
        got = await reader.get_many(keys[3:])
        disk = reader.stats()["disk"]
    assert all(g is not None and torch.equal(g, kv) for g, kv in zip(got, chunks[3:], strict=True))
    assert disk["corrupt"] == 3 and disk["errors"] == 0 and disk["hits"] == 3, disk
    assert disk["breaker"]["state"] == "closed" and disk["breaker"]["opens"] == 0
    assert [path.exists() for path in paths] == [False] * 3 + [True] * 3


def test_a_codec_that_cannot_encode_the_layout_is_refused_when_the_store_is_made(tmp_path: Path) -> None:
    """hadamard rotates over a power-of-two head_dim: with head_dim 80 every write would fail, one at a time."""
    layout = KVLayout(num_layers=2, num_kv_heads=2, head_dim=80, chunk_tokens=16)
    config = StoreConfig(disk={"path": tmp_path, "codec": "hadamard+int4", "allow_lossy": True})
    with pytest.raises(ConfigError, match=r"disk.codec 'hadamard\+int4' cannot store this model's KV.*power of two"):
        KVStore(config, layout, "odd")


@pytest.mark.parametrize("path", ["get", "prefetch"])
async def test_a_lossy_chunk_promoted_to_disk_keeps_its_codec_and_its_reads_are_counted(
    tmp_path: Path, redis_server: RedisServer, path: str
) -> None:
    """Another store wrote the chunk to Redis in int8; this one (lossless, no allow_lossy) reads it and
    promotes it to its disk, where it must stay marked int8 (before: re-encoded as 'identity', lossless
    on paper) with the same values, and each tier counts the lossy chunk it served."""
    namespace = f"lossy-{path}"
    redis = {"enabled": True, "url": redis_server.url, "prefix": f"lossy-{path}"}
    writer = StoreConfig(disk={"enabled": False}, redis={**redis, "codec": "int8", "allow_lossy": True})
    kv = chunk(0, 7)
    async with KVStore(writer, LAYOUT, namespace) as store:
        key = store.chunk_keys(list(range(LAYOUT.chunk_tokens)))[0]
        assert await store.put(key, kv)
        await store.flush()
    reader = StoreConfig(disk={"path": tmp_path, "codec": "identity"}, redis={**redis, "codec": "byteplanes"})
    async with KVStore(reader, LAYOUT, namespace) as store:
        if path == "get":
            served = await store.get(key)
        else:
            async with store.prefetch([key]) as stream:
                layers = [layer_kv.clone() async for _, layer_kv in stream]
            served = torch.stack(layers)
        await store.flush()
        stats = store.stats()
        file = store.tiers[0].backend.path_for(key)
    assert served is not None and not torch.equal(served, kv)  # int8: close, not equal
    assert stats["redis"]["lossy_reads"] == 1 and stats["disk"]["writes"] == 1, stats
    assert header_codec(file.read_bytes()[:4096]) == "int8"
    disk_only = StoreConfig(disk={"path": tmp_path, "codec": "identity"})
    async with KVStore(disk_only, LAYOUT, namespace) as store:
        again = await store.get(key)
        assert store.stats()["disk"]["lossy_reads"] == 1
    assert again is not None and torch.equal(again, served)
