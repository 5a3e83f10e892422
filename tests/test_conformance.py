"""One suite, every secondary tier: disk, S3 on moto and on SeaweedFS, Redis, Redis Cluster.

Each backend runs against its real server over the network (or a real directory). The
"raw" side of each case reaches under kvstore with the server's own client, to plant
corrupt, truncated or foreign objects exactly where kvstore will look for them.
"""

from __future__ import annotations

import asyncio
import os
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis
import redis.cluster
import torch
from conftest import TEST_BUCKET, raw_s3_client

from kvstore.backends.base import Backend
from kvstore.backends.disk import DiskBackend
from kvstore.backends.redis import RedisBackend
from kvstore.backends.s3 import S3Backend
from kvstore.codecs import make_codec
from kvstore.config import StoreConfig
from kvstore.engine.store import KVStore
from kvstore.keys import chunk_keys
from kvstore.layout import KVLayout
from kvstore.storage.container import Segment, checksum, encode_header, parse_header
from kvstore.storage.crypto import ChunkCipher
from kvstore.storage.tier import ChunkTier

LAYOUT = KVLayout(num_layers=4, num_kv_heads=2, head_dim=16, chunk_tokens=32, dtype=torch.bfloat16)
OTHER_LAYOUT = KVLayout(num_layers=4, num_kv_heads=2, head_dim=16, chunk_tokens=32, dtype=torch.float16)
BACKENDS = ["disk", "s3-moto", "s3-seaweedfs", "redis", "redis-cluster"]


@dataclass
class Case:
    """A backend under test plus raw access to the objects it stores."""

    name: str
    make: Callable[[], Backend]  # a fresh backend instance on the same storage (another engine)
    raw_get: Callable[[str], bytes | None]
    raw_put: Callable[[str, bytes], None]


@pytest.fixture
def executor():
    with ThreadPoolExecutor(4) as pool:
        yield pool


@pytest.fixture(params=BACKENDS)
def case(request, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, executor) -> Case:
    prefix = f"conformance-{uuid.uuid4().hex[:10]}"  # each test its own namespace on the shared servers
    kind = request.param
    if kind == "disk":
        root = tmp_path / "disk"

        def disk_file(key: str) -> Path:
            return root / "default" / key[:2] / key[2:4] / f"{key}.kvc"

        def disk_put(key: str, data: bytes) -> None:
            disk_file(key).parent.mkdir(parents=True, exist_ok=True)
            disk_file(key).write_bytes(data)

        return Case(
            kind,
            lambda: DiskBackend(root, 1 << 30, executor=executor),
            lambda key: disk_file(key).read_bytes() if disk_file(key).exists() else None,
            disk_put,
        )
    if kind.startswith("s3"):
        server = request.getfixturevalue("moto_server" if kind == "s3-moto" else "seaweedfs_server")
        for name, value in server.credentials_env().items():  # the standard AWS chain, as users set it
            monkeypatch.setenv(name, value)
        client = raw_s3_client(server)

        def s3_get(key: str) -> bytes | None:
            try:
                return client.get_object(Bucket=TEST_BUCKET, Key=f"{prefix}/default/{key}")["Body"].read()
            except client.exceptions.NoSuchKey:
                return None

        return Case(
            kind,
            lambda: S3Backend(TEST_BUCKET, prefix=prefix, endpoint_url=server.endpoint_url, read_timeout=10),
            s3_get,
            lambda key, data: client.put_object(Bucket=TEST_BUCKET, Key=f"{prefix}/default/{key}", Body=data),
        )
    cluster = kind == "redis-cluster"
    server = request.getfixturevalue("redis_cluster" if cluster else "redis_server")
    raw = redis.cluster.RedisCluster.from_url(server.url) if cluster else redis.Redis.from_url(server.url)
    request.addfinalizer(raw.close)
    return Case(
        kind,
        lambda: RedisBackend(server.url, cluster=cluster, prefix=prefix),
        lambda key: raw.get(f"{prefix}:default:{key}"),
        lambda key, data: raw.set(f"{prefix}:default:{key}", data),
    )


@pytest.fixture
async def backend(case: Case) -> AsyncIterator[Backend]:
    backend = case.make()
    await backend.open()
    try:
        yield backend
    finally:
        await backend.close()


def keys_for(count: int, seed: int = 0) -> list[str]:
    tokens = torch.randint(0, 50_000, (count * LAYOUT.chunk_tokens,), generator=torch.Generator().manual_seed(seed))
    return chunk_keys(tokens.tolist(), LAYOUT, namespace=f"conformance-{seed}")


def chunk(seed: int) -> torch.Tensor:
    return torch.randn(LAYOUT.chunk_shape, generator=torch.Generator().manual_seed(seed)).to(LAYOUT.dtype)


def view(tensor: torch.Tensor) -> memoryview:
    return memoryview(tensor.view(torch.uint8).numpy()).cast("B")


def empty_out() -> torch.Tensor:
    return torch.full(LAYOUT.chunk_shape, float("nan"), dtype=LAYOUT.dtype)


def tier_on(backend: Backend, executor, codec: str = "bytesplit", cipher: ChunkCipher | None = None, layout=LAYOUT):
    return ChunkTier(backend, make_codec(codec), layout, executor, cipher=cipher)


# -- the object interface ---------------------------------------------------------------------------


async def test_set_get_exists_delete(backend: Backend):
    (key,) = keys_for(1)
    assert await backend.get(key) is None
    assert not await backend.exists(key)
    await backend.delete(key)  # absent: not an error
    await backend.set(key, [b"head-", memoryview(b"payload"), bytearray(b"-tail")])
    assert await backend.get(key) == b"head-payload-tail"
    assert await backend.exists(key)
    await backend.set(key, [b"replaced"])
    assert await backend.get(key) == b"replaced"
    await backend.delete(key)
    assert await backend.get(key) is None
    assert not await backend.exists(key)


@pytest.mark.parametrize("byte_range", [(0, 1), (0, 100), (17, 42), (99, 100), (50, 50)])
async def test_byte_ranges(backend: Backend, byte_range: tuple[int, int]):
    (key,) = keys_for(1)
    data = bytes(range(100))
    await backend.set(key, [data])
    got = await backend.get(key, byte_range)
    if byte_range[0] == byte_range[1]:
        assert got in (b"", None)  # an empty range: nothing to read, either answer is honest
    else:
        assert got == data[byte_range[0] : byte_range[1]]
    assert await backend.get(keys_for(1, seed=9)[0], (0, 10)) is None  # a range of a missing object


async def test_list_keys(backend: Backend):
    keys = keys_for(6, seed=3)
    for i, key in enumerate(keys):
        await backend.set(key, [bytes([i]) * 10])
    assert sorted([key async for key in backend.list_keys()]) == sorted(keys)
    first = keys[0][:1]
    assert sorted([key async for key in backend.list_keys(first)]) == sorted(k for k in keys if k.startswith(first))


async def test_get_many_and_prefix_count(backend: Backend):
    keys = keys_for(6, seed=4)
    assert await backend.prefix_count(keys) == 0
    for i, key in enumerate(keys[:4]):
        await backend.set(key, [bytes([i]) * 1000])
    assert await backend.prefix_count(keys) == 4
    assert await backend.prefix_count(keys[:3]) == 3
    assert await backend.get_many(keys) == [bytes([i]) * 1000 for i in range(4)] + [None, None]
    for key in keys[4:]:
        await backend.set(key, [b"x"])
    assert await backend.prefix_count(keys) == 6


async def test_another_instance_sees_the_same_objects(case: Case, backend: Backend):
    """Two engines on one store: what one writes, the other reads (and a delete is seen too)."""
    (key,) = keys_for(1, seed=5)
    await backend.set(key, [b"shared"])
    other = case.make()
    await other.open()
    try:
        assert await other.get(key) == b"shared"
        await other.delete(key)
        assert await backend.get(key) is None
    finally:
        await other.close()


# -- chunks through the tier ------------------------------------------------------------------------


@pytest.mark.parametrize("codec", ["identity", "bytesplit", "zstd:3", "lz4"])
@pytest.mark.parametrize("encrypted", [False, True], ids=["plain", "aes-gcm"])
async def test_chunks_round_trip_bit_exact(backend: Backend, executor, codec: str, encrypted: bool):
    cipher = ChunkCipher(os.urandom(32)) if encrypted else None
    tier = tier_on(backend, executor, codec, cipher)
    keys = keys_for(3, seed=6)
    chunks = [chunk(i) for i in range(3)]
    assert await tier.write_many(list(zip(keys, map(view, chunks), strict=True))) == [None] * 3
    outs = [empty_out() for _ in keys]
    assert await tier.read_many_into(keys, [view(out) for out in outs]) == [True] * 3
    for out, expected in zip(outs, chunks, strict=True):
        assert torch.equal(out.view(torch.int16), expected.view(torch.int16))
    assert tier.stats.hits == 3 and tier.stats.corrupt == 0 and tier.stats.errors == 0
    assert tier.stats.writes == 3 and tier.stats.bytes_written > 0


@pytest.mark.parametrize("encrypted", [False, True], ids=["plain", "aes-gcm"])
async def test_each_layer_reads_alone(backend: Backend, executor, encrypted: bool):
    """Layer i costs a header read and one segment read, and decodes on its own."""
    tier = tier_on(backend, executor, "bytesplit", ChunkCipher(os.urandom(32)) if encrypted else None)
    (key,) = keys_for(1, seed=7)
    expected = chunk(7)
    await tier.write(key, view(expected))
    for layer in reversed(range(LAYOUT.num_layers)):
        out = torch.empty(LAYOUT.layer_shape, dtype=LAYOUT.dtype)
        assert await tier.read_layer(key, layer, view(out))
        assert torch.equal(out.view(torch.int16), expected[layer].view(torch.int16))
    missing = torch.empty(LAYOUT.layer_shape, dtype=LAYOUT.dtype)
    assert not await tier.read_layer(keys_for(1, seed=8)[0], 0, view(missing))


async def test_missing_chunk_is_a_counted_miss(backend: Backend, executor):
    tier = tier_on(backend, executor)
    out = empty_out()
    assert not await tier.read_into(keys_for(1, seed=10)[0], view(out))
    assert tier.stats.misses == 1 and tier.stats.hits == 0


def _flip(position: Callable[[int], int]) -> Callable[[bytes], bytes]:
    def mutate(data: bytes) -> bytes:
        spoiled = bytearray(data)
        spoiled[position(len(data))] ^= 0x40
        return bytes(spoiled)

    return mutate


CORRUPTIONS = {
    "header-byte": _flip(lambda n: 70),
    "first-payload-byte": _flip(lambda n: 4096),
    "middle-byte": _flip(lambda n: n // 2 + 3),
    "last-byte": _flip(lambda n: n - 1),
    "truncated": lambda data: data[: len(data) - 100],
    "header-only": lambda data: data[:4096],
    "extended": lambda data: data + b"\0" * 16,
    "garbage": lambda data: os.urandom(len(data)),
    "tiny": lambda data: b"KVSTCHNK",
}


@pytest.mark.parametrize("codec", ["identity", "bytesplit"])  # in-place receive, and decode paths
@pytest.mark.parametrize("corruption", list(CORRUPTIONS))
async def test_corrupt_objects_are_counted_misses_never_wrong_data(
    case: Case, backend: Backend, executor, corruption: str, codec: str
):
    tier = tier_on(backend, executor, codec)
    (key,) = keys_for(1, seed=11)
    await tier.write(key, view(chunk(11)))
    stored = case.raw_get(key)
    assert stored is not None
    case.raw_put(key, CORRUPTIONS[corruption](stored))
    out = empty_out()
    assert not await tier.read_into(key, view(out))
    assert tier.stats.corrupt == 1 and tier.stats.hits == 0
    assert case.raw_get(key) is None, "a corrupt object is removed so it is not read again"
    # The next write heals the tier.
    await tier.write(key, view(chunk(11)))
    assert await tier.read_into(key, view(out)) and torch.equal(out.view(torch.int16), chunk(11).view(torch.int16))


async def test_corrupt_layer_read_is_a_miss(case: Case, backend: Backend, executor):
    tier = tier_on(backend, executor)
    (key,) = keys_for(1, seed=12)
    await tier.write(key, view(chunk(12)))
    case.raw_put(key, CORRUPTIONS["last-byte"](case.raw_get(key)))
    out = torch.empty(LAYOUT.layer_shape, dtype=LAYOUT.dtype)
    assert await tier.read_layer(key, 0, view(out))  # layer 0 is intact and checks out alone
    assert not await tier.read_layer(key, LAYOUT.num_layers - 1, view(out))
    assert tier.stats.corrupt == 1


async def test_foreign_layout_is_never_returned(backend: Backend, executor):
    """A chunk written for another model under the very key we look up: a miss, counted."""
    (key,) = keys_for(1, seed=13)
    foreign = torch.randn(OTHER_LAYOUT.chunk_shape).to(OTHER_LAYOUT.dtype)
    await tier_on(backend, executor, layout=OTHER_LAYOUT).write(key, view(foreign))
    tier = tier_on(backend, executor)
    assert not await tier.read_into(key, view(empty_out()))
    assert tier.stats.corrupt == 1 and tier.stats.hits == 0


async def test_wrong_key_and_missing_encryption_are_foreign_misses(case: Case, backend: Backend, executor):
    """Another key's chunk, or a plain chunk where encryption is required: a miss, left in place."""
    mine, theirs = ChunkCipher(os.urandom(32)), ChunkCipher(os.urandom(32))
    sealed, plain = keys_for(2, seed=14)
    await tier_on(backend, executor, cipher=theirs).write(sealed, view(chunk(14)))
    await tier_on(backend, executor).write(plain, view(chunk(15)))
    tier = tier_on(backend, executor, cipher=mine)
    assert await tier.read_many_into([sealed, plain], [view(empty_out()), view(empty_out())]) == [False, False]
    assert tier.stats.foreign == 2 and tier.stats.corrupt == 0
    unkeyed = tier_on(backend, executor)
    assert not await unkeyed.read_into(sealed, view(empty_out()))
    assert unkeyed.stats.foreign == 1
    assert case.raw_get(sealed) is not None and case.raw_get(plain) is not None  # not ours to delete
    out = empty_out()
    assert await tier_on(backend, executor, cipher=theirs).read_into(sealed, view(out))
    assert torch.equal(out.view(torch.int16), chunk(14).view(torch.int16))


async def test_tampered_ciphertext_with_valid_checksums_is_a_miss(case: Case, backend: Backend, executor):
    """Someone who can write to the bucket but lacks the key rewrites a segment and fixes the checksums."""
    cipher = ChunkCipher(os.urandom(32))
    tier = tier_on(backend, executor, "identity", cipher)
    (key,) = keys_for(1, seed=16)
    await tier.write(key, view(chunk(16)))
    stored = bytearray(case.raw_get(key))
    header = parse_header(stored, LAYOUT, key, cipher)
    segment = header.segments[1]
    start = header.header_len + segment.offset
    stored[start + 20] ^= 1  # inside the ciphertext
    segments = list(header.segments)
    resealed = checksum(stored[start : start + segment.stored_len])
    segments[1] = Segment(segment.offset, segment.stored_len, segment.raw_len, resealed)
    new_header = encode_header(LAYOUT, key, header.codec.id, segments, cipher.key_id)
    case.raw_put(key, new_header + bytes(stored[header.header_len :]))
    assert not await tier.read_into(key, view(empty_out()))
    assert tier.stats.corrupt == 1


async def test_concurrent_writers_of_one_key(case: Case, backend: Backend, executor):
    """Engines racing to store the same chunk (in different codecs): readers see a whole chunk or none."""
    (key,) = keys_for(1, seed=17)
    expected = chunk(17)
    writers = [tier_on(case.make(), executor, codec) for codec in ["identity", "bytesplit", "zstd", "lz4"] * 2]
    for writer in writers:
        await writer.open()
    reader = tier_on(backend, executor)
    try:

        async def read_until_done() -> list[bool]:
            outcomes = []
            while not all(task.done() for task in writes):
                out = empty_out()
                found = await reader.read_into(key, view(out))
                if found:
                    assert torch.equal(out.view(torch.int16), expected.view(torch.int16))
                outcomes.append(found)
                await asyncio.sleep(0)
            return outcomes

        writes = [asyncio.create_task(writer.write(key, view(expected))) for writer in writers]
        await asyncio.gather(read_until_done(), *writes)
    finally:
        for writer in writers:
            await writer.close()
    assert reader.stats.corrupt == 0, "a reader saw a half-written object"
    out = empty_out()
    assert await reader.read_into(key, view(out)) and torch.equal(out.view(torch.int16), expected.view(torch.int16))


async def test_store_on_this_tier_survives_a_restart(case: Case, tmp_path: Path, executor):
    """The whole store over this one tier: put, flush, then a fresh store with empty DRAM gets it back."""
    config = StoreConfig(dram={"capacity": LAYOUT.chunk_nbytes * 8}, disk={"enabled": False})
    keys = keys_for(4, seed=18)
    chunks = [chunk(100 + i) for i in range(4)]
    async with KVStore(config, LAYOUT, "conformance", tiers=[tier_on(case.make(), executor)]) as store:
        for key, kv in zip(keys, chunks, strict=True):
            assert await store.put(key, kv)
        await store.flush()
        assert store.stats()[store.tiers[0].name]["writes"] == 4
    async with KVStore(config, LAYOUT, "conformance", tiers=[tier_on(case.make(), executor)]) as fresh:
        assert await fresh.lookup(keys) == 4
        got = await fresh.get_many(keys)
        for kv, expected in zip(got, chunks, strict=True):
            assert kv is not None and torch.equal(kv.view(torch.int16), expected.view(torch.int16))
        assert fresh.stats()[fresh.tiers[0].name]["hits"] == 4
