"""The backend conformance suite: what every kvstore backend must do, as pytest tests to subclass.

A backend proves itself against its own server (never a fake: the suite checks atomicity,
sharing between instances, byte ranges and corruption handling, which only the real thing can
answer) by subclassing :class:`BackendTests` and providing one fixture, ``case``, that returns
a :class:`BackendCase`::

    from kvstore.testing.conformance import BackendCase, BackendTests

    class TestMyBackend(BackendTests):
        @pytest.fixture
        def case(self, my_server) -> BackendCase:
            prefix = f"conformance-{uuid.uuid4().hex[:10]}"  # each test its own objects on a shared server
            raw = MyClient(my_server.url)
            return BackendCase(
                make=lambda: MyBackend(my_server.url, prefix=prefix),
                raw_get=lambda key: raw.get(f"{prefix}/default/{key}"),
                raw_put=lambda key, data: raw.put(f"{prefix}/default/{key}", data),
            )

What a subclass must provide, through the case:

- ``make()``: a new, unopened backend instance on the same storage each time it is called
  (another engine on the same server), storing objects of namespace ``default``;
- ``raw_get(key)`` / ``raw_put(key, data)``: the stored bytes of ``key`` read and written with
  the server's own client, past the backend, to plant corrupt, truncated or foreign objects
  exactly where the backend will look (``raw_get`` is None for an absent object).

Keys are 64 lowercase hex characters, as :func:`kvstore.keys.chunk_keys` makes them. The suite
covers the object interface (:class:`kvstore.backends.base.Backend`), the listing the operator's
tools use (:meth:`~kvstore.backends.maintenance.Maintenance.scan`; a backend the tools cannot
list overrides ``test_list_keys``), and whole chunks through a
:class:`~kvstore.storage.tier.ChunkTier` and a :class:`~kvstore.KVStore` on the backend.
Needs pytest and pytest-asyncio (``pip install 'kvstore-tiered[testing]'``; tests and async fixtures are
marked, so strict mode works). For pytest's detailed assertion messages inside the suite, call
``pytest.register_assert_rewrite("kvstore.testing.conformance")`` in your ``conftest.py`` before
importing it, as this repository's tests do.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import pytest
import pytest_asyncio
import torch

from kvstore import KVStore, StoreConfig
from kvstore.backends.base import Backend
from kvstore.codecs import make_codec
from kvstore.keys import chunk_keys
from kvstore.layout import KVLayout
from kvstore.storage.container import Segment, checksum, encode_header, parse_header
from kvstore.storage.crypto import ChunkCipher
from kvstore.storage.tier import ChunkTier
from kvstore.testing.helpers import listed_keys, read_chunk, read_layer, write_chunk

LAYOUT = KVLayout(num_layers=4, num_kv_heads=2, head_dim=16, chunk_tokens=32, dtype=torch.bfloat16)
OTHER_LAYOUT = KVLayout(num_layers=4, num_kv_heads=2, head_dim=16, chunk_tokens=32, dtype=torch.float16)


@dataclass
class BackendCase:
    """A backend under test, and raw access to the objects it stores (see the module docstring)."""

    make: Callable[[], Backend]  # a fresh, unopened backend instance on the same storage (another engine)
    raw_get: Callable[[str], bytes | None]  # the object's stored bytes, read past the backend; None if absent
    raw_put: Callable[[str, bytes], object]  # store these bytes as the object, past the backend


def keys_for(count: int, seed: int = 0) -> list[str]:
    """``count`` chunk keys of a prefix of random tokens, the same for the same seed."""
    tokens = torch.randint(0, 50_000, (count * LAYOUT.chunk_tokens,), generator=torch.Generator().manual_seed(seed))
    return chunk_keys(tokens.tolist(), LAYOUT, namespace=f"conformance-{seed}")


def chunk(seed: int) -> torch.Tensor:
    """A chunk of random KV of LAYOUT, the same for the same seed."""
    return torch.randn(LAYOUT.chunk_shape, generator=torch.Generator().manual_seed(seed)).to(LAYOUT.dtype)


def view(tensor: torch.Tensor) -> memoryview:
    """The tensor's bytes, writable, without a copy."""
    return memoryview(tensor.view(torch.uint8).numpy()).cast("B")


def empty_out() -> torch.Tensor:
    """A chunk-sized output full of NaNs: a read that writes nothing cannot pass for a read of zeros."""
    return torch.full(LAYOUT.chunk_shape, float("nan"), dtype=LAYOUT.dtype)


def same(got: torch.Tensor, expected: torch.Tensor) -> bool:
    """Bit-exact equality (NaN-proof)."""
    return torch.equal(got.view(torch.int16), expected.view(torch.int16))


def tier_on(
    backend: Backend,
    executor: ThreadPoolExecutor,
    codec: str = "bytesplit",
    cipher: ChunkCipher | None = None,
    layout: KVLayout = LAYOUT,
) -> ChunkTier:
    return ChunkTier(backend, make_codec(codec), layout, executor, cipher=cipher)


def _flip(position: Callable[[int], int]) -> Callable[[bytes], bytes]:
    def mutate(data: bytes) -> bytes:
        spoiled = bytearray(data)
        spoiled[position(len(data))] ^= 0x40
        return bytes(spoiled)

    return mutate


CORRUPTIONS: dict[str, Callable[[bytes], bytes]] = {
    "header-byte": _flip(lambda n: 70),
    "first-payload-byte": _flip(lambda n: 4096),
    "middle-byte": _flip(lambda n: n // 2 + 3),
    "last-byte": _flip(lambda n: n - 1),
    "truncated": lambda data: data[: len(data) - 100],
    "header-only": lambda data: data[:4096],
    "extended": lambda data: data + b"\0" * 16,
    "garbage": lambda data: os.urandom(len(data)),
    "tiny": lambda data: b"KVSTCHNK",
    "empty": lambda data: b"",
}


async def planted(case: BackendCase, tier: ChunkTier, seed: int, corruption: str) -> str:
    """Write chunk ``seed`` through ``tier``, then spoil its stored object with ``corruption``, past the backend."""
    (key,) = keys_for(1, seed=seed)
    await write_chunk(tier, key, view(chunk(seed)))
    stored = case.raw_get(key)
    assert stored is not None
    case.raw_put(key, CORRUPTIONS[corruption](stored))
    return key


class BackendTests:
    """The suite; subclass it with a ``case`` fixture (see the module docstring). Not collected itself."""

    @pytest.fixture
    def case(self) -> BackendCase:
        raise NotImplementedError(f"{type(self).__name__} must provide the `case` fixture (see BackendTests)")

    @pytest.fixture
    def executor(self) -> Iterator[ThreadPoolExecutor]:
        with ThreadPoolExecutor(4) as pool:
            yield pool

    @pytest_asyncio.fixture
    async def backend(self, case: BackendCase) -> AsyncIterator[Backend]:
        backend = case.make()
        await backend.open()
        try:
            yield backend
        finally:
            await backend.close()

    # -- the object interface -----------------------------------------------------------------------

    @pytest.mark.asyncio
    async def test_set_get_exists_delete(self, backend: Backend) -> None:
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

    @pytest.mark.asyncio
    @pytest.mark.parametrize("byte_range", [(0, 1), (0, 100), (17, 42), (99, 100), (50, 50)])
    async def test_byte_ranges(self, backend: Backend, byte_range: tuple[int, int]) -> None:
        (key,) = keys_for(1)
        data = bytes(range(100))
        await backend.set(key, [data])
        got = await backend.get(key, byte_range)
        if byte_range[0] == byte_range[1]:
            assert got in (b"", None)  # an empty range: nothing to read, either answer is honest
        else:
            assert got == data[byte_range[0] : byte_range[1]]
        assert await backend.get(keys_for(1, seed=9)[0], (0, 10)) is None  # a range of a missing object

    @pytest.mark.asyncio
    async def test_byte_range_edges_mean_the_same_everywhere(self, backend: Backend) -> None:
        """Past the end is clipped, or empty; an absent object is None; a bad range is the caller's error."""
        (key,) = keys_for(1, seed=19)
        data = bytes(range(100))
        await backend.set(key, [data])
        assert await backend.get(key, (90, 200)) == data[90:]  # clipped at the end, like a file read
        assert await backend.get(key, (100, 110)) == b""  # starts at the end
        assert await backend.get(key, (150, 160)) == b""  # starts past it
        assert await backend.get(key, (50, 50)) == b""  # empty, of a present object
        missing = keys_for(1, seed=20)[0]
        assert await backend.get(missing, (150, 160)) is None
        assert await backend.get(missing, (5, 5)) is None
        for bad in ((10, 5), (-1, 5)):
            with pytest.raises(ValueError):
                await backend.get(key, bad)

    @pytest.mark.asyncio
    async def test_get_into_scatters_the_leading_bytes(self, backend: Backend) -> None:
        (key,) = keys_for(1, seed=21)
        data = bytes(range(256)) * 4
        await backend.set(key, [data])
        first, second = bytearray(10), bytearray(2000)
        assert await backend.get_into(key, [memoryview(first), memoryview(second)]) == len(data)
        assert bytes(first) == data[:10] and bytes(second[: len(data) - 10]) == data[10:]
        assert bytes(second[len(data) - 10 :]) == bytes(2000 - len(data) + 10)  # past the object: untouched
        short = bytearray(16)
        assert await backend.get_into(key, [memoryview(short)]) == len(data)  # the object's size, not the bytes read
        assert bytes(short) == data[:16]
        assert await backend.get_into(keys_for(1, seed=22)[0], [memoryview(short)]) is None

    @pytest.mark.asyncio
    async def test_list_keys(self, backend: Backend) -> None:
        keys = keys_for(6, seed=3)
        for i, key in enumerate(keys):
            await backend.set(key, [bytes([i]) * 10])
        assert sorted(await listed_keys(backend)) == sorted(keys)
        first = keys[0][:1]
        assert sorted(await listed_keys(backend, first)) == sorted(k for k in keys if k.startswith(first))

    @pytest.mark.asyncio
    async def test_prefix_count_and_reads_of_several_keys(self, backend: Backend) -> None:
        keys = keys_for(6, seed=4)
        assert await backend.prefix_count(keys) == 0
        for i, key in enumerate(keys[:4]):
            await backend.set(key, [bytes([i]) * 1000])
        assert await backend.prefix_count(keys) == 4
        assert await backend.prefix_count(keys[:3]) == 3
        got = await asyncio.gather(*(backend.get(key) for key in keys))  # several reads at once
        assert got == [bytes([i]) * 1000 for i in range(4)] + [None, None]
        for key in keys[4:]:
            await backend.set(key, [b"x"])
        assert await backend.prefix_count(keys) == 6

    @pytest.mark.asyncio
    async def test_another_instance_sees_the_same_objects(self, case: BackendCase, backend: Backend) -> None:
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

    # -- chunks through the tier --------------------------------------------------------------------

    @pytest.mark.asyncio
    @pytest.mark.parametrize("codec", ["identity", "bytesplit", "zstd:3", "lz4"])
    @pytest.mark.parametrize("encrypted", [False, True], ids=["plain", "aes-gcm"])
    async def test_chunks_round_trip_bit_exact(
        self, backend: Backend, executor: ThreadPoolExecutor, codec: str, encrypted: bool
    ) -> None:
        cipher = ChunkCipher(os.urandom(32)) if encrypted else None
        tier = tier_on(backend, executor, codec, cipher)
        keys = keys_for(3, seed=6)
        chunks = [chunk(i) for i in range(3)]
        assert await tier.write_many(list(zip(keys, map(view, chunks), strict=True))) == [None] * 3
        outs = [empty_out() for _ in keys]
        assert await tier.read_many_into(keys, [view(out) for out in outs]) == [True] * 3
        for out, expected in zip(outs, chunks, strict=True):
            assert same(out, expected)
        assert tier.stats.hits == 3 and tier.stats.corrupt == 0 and tier.stats.errors == 0
        assert tier.stats.writes == 3 and tier.stats.bytes_written > 0

    @pytest.mark.asyncio
    @pytest.mark.parametrize("encrypted", [False, True], ids=["plain", "aes-gcm"])
    async def test_each_layer_reads_alone(
        self, backend: Backend, executor: ThreadPoolExecutor, encrypted: bool
    ) -> None:
        """Layer i costs a header read and one segment read, and decodes on its own."""
        tier = tier_on(backend, executor, "bytesplit", ChunkCipher(os.urandom(32)) if encrypted else None)
        (key,) = keys_for(1, seed=7)
        expected = chunk(7)
        await write_chunk(tier, key, view(expected))
        for layer in reversed(range(LAYOUT.num_layers)):
            out = torch.empty(LAYOUT.layer_shape, dtype=LAYOUT.dtype)
            assert await read_layer(tier, key, layer, view(out))
            assert same(out, expected[layer])
        missing = torch.empty(LAYOUT.layer_shape, dtype=LAYOUT.dtype)
        assert not await read_layer(tier, keys_for(1, seed=8)[0], 0, view(missing))

    @pytest.mark.asyncio
    async def test_missing_chunk_is_a_counted_miss(self, backend: Backend, executor: ThreadPoolExecutor) -> None:
        tier = tier_on(backend, executor)
        assert not await read_chunk(tier, keys_for(1, seed=10)[0], view(empty_out()))
        assert tier.stats.misses == 1 and tier.stats.hits == 0

    @pytest.mark.asyncio
    @pytest.mark.parametrize("codec", ["identity", "bytesplit"])  # in-place receive, and decode paths
    @pytest.mark.parametrize("corruption", list(CORRUPTIONS))
    async def test_corrupt_objects_are_counted_misses_never_wrong_data(
        self, case: BackendCase, backend: Backend, executor: ThreadPoolExecutor, corruption: str, codec: str
    ) -> None:
        tier = tier_on(backend, executor, codec)
        key = await planted(case, tier, 11, corruption)
        out = empty_out()
        assert not await read_chunk(tier, key, view(out))
        assert tier.stats.corrupt == 1 and tier.stats.hits == 0
        assert case.raw_get(key) is None, "a corrupt object is removed so it is not read again"
        # The next write heals the tier.
        await write_chunk(tier, key, view(chunk(11)))
        assert await read_chunk(tier, key, view(out)) and same(out, chunk(11))

    @pytest.mark.asyncio
    async def test_corrupt_layer_read_is_a_miss(
        self, case: BackendCase, backend: Backend, executor: ThreadPoolExecutor
    ) -> None:
        tier = tier_on(backend, executor)
        key = await planted(case, tier, 12, "last-byte")
        out = torch.empty(LAYOUT.layer_shape, dtype=LAYOUT.dtype)
        assert await read_layer(tier, key, 0, view(out))  # layer 0 is intact and checks out alone
        assert not await read_layer(tier, key, LAYOUT.num_layers - 1, view(out))
        assert tier.stats.corrupt == 1

    @pytest.mark.asyncio
    @pytest.mark.parametrize("corruption", ["extended", "empty", "truncated"])
    async def test_a_layer_stream_never_opens_an_object_of_the_wrong_length(
        self, case: BackendCase, backend: Backend, executor: ThreadPoolExecutor, corruption: str
    ) -> None:
        """The object's length is checked against its header when a stream opens it: counted corrupt, removed."""
        tier = tier_on(backend, executor)
        key = await planted(case, tier, 16, corruption)
        assert await tier.open_layers_many([key]) == [None]
        assert tier.stats.corrupt == 1 and tier.stats.hits == 0
        assert case.raw_get(key) is None, "a corrupt object is removed so it is not read again"

    @pytest.mark.asyncio
    @pytest.mark.parametrize("codec", ["identity", "bytesplit"])  # in-place receive, and decode paths
    async def test_foreign_layout_is_a_foreign_miss_left_for_its_owner(
        self, case: BackendCase, backend: Backend, executor: ThreadPoolExecutor, codec: str
    ) -> None:
        """A chunk written for another model under the very key we look up: a miss, counted foreign, kept."""
        (key,) = keys_for(1, seed=13)
        foreign = torch.randn(OTHER_LAYOUT.chunk_shape).to(OTHER_LAYOUT.dtype)
        await write_chunk(tier_on(backend, executor, codec, layout=OTHER_LAYOUT), key, view(foreign))
        stored = case.raw_get(key)
        tier = tier_on(backend, executor, codec)
        assert not await read_chunk(tier, key, view(empty_out()))
        assert not await read_layer(tier, key, 0, view(torch.empty(LAYOUT.layer_shape, dtype=LAYOUT.dtype)))
        assert tier.stats.foreign == 2 and tier.stats.corrupt == 0 and tier.stats.hits == 0
        assert case.raw_get(key) == stored, "another layout's chunk is not ours to delete"

    @pytest.mark.asyncio
    async def test_wrong_key_and_missing_encryption_are_foreign_misses(
        self, case: BackendCase, backend: Backend, executor: ThreadPoolExecutor
    ) -> None:
        """Another key's chunk, or a plain chunk where encryption is required: a miss, left in place."""
        mine, theirs = ChunkCipher(os.urandom(32)), ChunkCipher(os.urandom(32))
        sealed, plain = keys_for(2, seed=14)
        await write_chunk(tier_on(backend, executor, cipher=theirs), sealed, view(chunk(14)))
        await write_chunk(tier_on(backend, executor), plain, view(chunk(15)))
        tier = tier_on(backend, executor, cipher=mine)
        assert await tier.read_many_into([sealed, plain], [view(empty_out()), view(empty_out())]) == [False, False]
        assert tier.stats.foreign == 2 and tier.stats.corrupt == 0
        unkeyed = tier_on(backend, executor)
        assert not await read_chunk(unkeyed, sealed, view(empty_out()))
        assert unkeyed.stats.foreign == 1
        assert case.raw_get(sealed) is not None and case.raw_get(plain) is not None  # not ours to delete
        out = empty_out()
        assert await read_chunk(tier_on(backend, executor, cipher=theirs), sealed, view(out))
        assert same(out, chunk(14))

    @pytest.mark.asyncio
    async def test_tampered_ciphertext_with_valid_checksums_is_a_miss(
        self, case: BackendCase, backend: Backend, executor: ThreadPoolExecutor
    ) -> None:
        """Someone who can write to the bucket but lacks the key rewrites a segment and fixes the checksums."""
        cipher = ChunkCipher(os.urandom(32))
        tier = tier_on(backend, executor, "identity", cipher)
        (key,) = keys_for(1, seed=16)
        await write_chunk(tier, key, view(chunk(16)))
        raw = case.raw_get(key)
        assert raw is not None
        stored = bytearray(raw)
        header = parse_header(stored, LAYOUT, key, cipher)
        segment = header.segments[1]
        start = header.header_len + segment.offset
        stored[start + 20] ^= 1  # inside the ciphertext
        segments = list(header.segments)
        resealed = checksum(stored[start : start + segment.stored_len])
        segments[1] = Segment(segment.offset, segment.stored_len, segment.raw_len, resealed)
        new_header = encode_header(LAYOUT, key, header.codec.id, segments, cipher.key_id)
        case.raw_put(key, new_header + bytes(stored[header.header_len :]))
        assert not await read_chunk(tier, key, view(empty_out()))
        assert tier.stats.corrupt == 1

    @pytest.mark.asyncio
    async def test_concurrent_writers_of_one_key(
        self, case: BackendCase, backend: Backend, executor: ThreadPoolExecutor
    ) -> None:
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
                    found = await read_chunk(reader, key, view(out))
                    if found:
                        assert same(out, expected)
                    outcomes.append(found)
                    await asyncio.sleep(0)
                return outcomes

            writes = [asyncio.create_task(write_chunk(writer, key, view(expected))) for writer in writers]
            await asyncio.gather(read_until_done(), *writes)
        finally:
            for writer in writers:
                await writer.close()
        assert reader.stats.corrupt == 0, "a reader saw a half-written object"
        out = empty_out()
        assert await read_chunk(reader, key, view(out)) and same(out, expected)

    @pytest.mark.asyncio
    async def test_store_on_this_tier_survives_a_restart(self, case: BackendCase, executor: ThreadPoolExecutor) -> None:
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
                assert kv is not None and same(kv, expected)
            assert fresh.stats()[fresh.tiers[0].name]["hits"] == 4
