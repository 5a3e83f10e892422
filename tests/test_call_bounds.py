"""Every call is bounded and nothing leaks when a caller gives up.

A layer stream whose reader is cancelled closes within ``timeouts.close`` and leaves no slot,
file or task behind; ``get_many`` and ``lookup`` wait at most one ``timeouts.get`` per call,
whatever the number of chunks; bad arguments are rejected with short, clear messages.
The time bounds below are upper limits guarding against hangs, not performance targets.
"""

from __future__ import annotations

import asyncio
import os
import random
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from redis.exceptions import TimeoutError as RedisTimeoutError
from support import start_server

from kvstore import KVLayout, KVStore, StoreConfig, SyncKVStore
from kvstore.backends.base import ByteRange, ObjectRead
from kvstore.backends.disk import DiskBackend
from kvstore.backends.redis import RedisBackend
from kvstore.codecs import make_codec
from kvstore.errors import PrefetchError
from kvstore.storage.tier import ChunkTier
from kvstore.testing import MemoryBackend
from kvstore.testing.servers import RedisServer
from kvstore.util.threads import in_thread

LAYOUT = KVLayout(num_layers=4, num_kv_heads=2, head_dim=16, chunk_tokens=32, dtype=torch.bfloat16)


def chunk(seed: int) -> torch.Tensor:
    return torch.randn(LAYOUT.chunk_shape, generator=torch.Generator().manual_seed(seed)).to(LAYOUT.dtype)


def keys_of(store: KVStore, count: int, seed: int = 0) -> list[str]:
    tokens = torch.randint(0, 30_000, (count * LAYOUT.chunk_tokens,), generator=torch.Generator().manual_seed(seed))
    return store.chunk_keys(tokens.tolist())


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


# -- item 1: a layer stream whose reader is cancelled --------------------------------------------


async def test_cancelling_a_stream_reader_at_random_moments_never_hangs(tmp_path: Path) -> None:
    """The issue's repro: prefetch disk chunks in a task, cancel it at a random moment, close; 300 rounds."""
    cfg = StoreConfig(
        dram={"capacity": LAYOUT.chunk_nbytes * 8}, disk={"path": tmp_path / "disk"}, timeouts={"close": 2.0}
    )
    namespace = "cancel"
    async with KVStore(cfg, LAYOUT, namespace) as store:
        keys = keys_of(store, 4)
        for i, key in enumerate(keys):
            assert await store.put(key, chunk(i))
        await store.flush()
    rng = random.Random(15)
    async with KVStore(cfg, LAYOUT, namespace) as store:  # DRAM empty: every stream reads the files
        fds = open_fds()
        async with asyncio.timeout(60):  # a hang fails the test instead of hanging the suite
            for _ in range(300):
                stream = store.prefetch(keys, depth=1)

                async def consume(stream=stream) -> None:
                    async for _ in stream:
                        await asyncio.sleep(0)

                task = asyncio.create_task(consume())
                await asyncio.sleep(rng.random() * 0.002)  # a random moment: opening, reading, or waiting
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                await stream.close()
        assert store.stats()["dram"]["referenced"] == 0, "every stream released its slots"
        assert open_fds() == fds, "every stream closed its files"


class StubbornBackend(MemoryBackend):
    """Objects whose reads, while ``hold`` is clear, wait in a thread that no cancellation stops (10 s at most)."""

    name = "stubborn"
    is_local = False

    def __init__(self, objects: dict[str, bytes]) -> None:
        super().__init__(objects)
        self.hold = threading.Event()
        self.hold.set()
        self.entered = asyncio.Event()  # set when a request has started
        self.prefix_counts = 0

    async def fetch(self, key: str, byte_range: ByteRange | None) -> bytes | None:
        self.entered.set()
        await in_thread(None, self.hold.wait, 10)
        return await super().fetch(key, byte_range)

    async def prefix_count(self, keys: Sequence[str]) -> int:
        self.prefix_counts += 1
        await in_thread(None, self.hold.wait, 10)
        return await super().prefix_count(keys)


def memory_store(objects: dict[str, bytes], *, slots: int = 8, tiers: int = 1, **timeouts: float) -> KVStore:
    """A store over in-memory tiers (the first ``tiers - 1`` empty, the last sharing ``objects``)."""
    backends = [StubbornBackend({}) for _ in range(tiers - 1)] + [StubbornBackend(objects)]
    cfg = StoreConfig(dram={"capacity": LAYOUT.chunk_nbytes * slots}, disk={"enabled": False}, timeouts=timeouts)
    chunk_tiers = [ChunkTier(backend, make_codec("identity"), LAYOUT, None) for backend in backends]
    return KVStore(cfg, LAYOUT, "bounds", tiers=chunk_tiers)


async def stored(count: int) -> tuple[dict[str, bytes], list[str]]:
    """``count`` chunks written to an in-memory tier; its objects and the keys."""
    objects: dict[str, bytes] = {}
    async with memory_store(objects, slots=count) as writer:
        keys = keys_of(writer, count)
        for i, key in enumerate(keys):
            assert await writer.put(key, chunk(i))
        await writer.flush()
    return objects, keys


async def test_closing_a_stream_is_bounded_even_if_its_read_ignores_cancellation(tmp_path: Path) -> None:
    objects, keys = await stored(2)
    async with memory_store(objects, get=30.0, close=0.3) as store:
        backend = store.tiers[0].backend
        assert isinstance(backend, StubbornBackend)
        backend.hold.clear()
        try:
            stream = store.prefetch(keys)
            async with asyncio.timeout(5):
                await backend.entered.wait()  # the producer is stuck in its first read
            started = time.monotonic()
            await stream.close()
            assert time.monotonic() - started < 0.3 + 3.0  # one timeouts.close (+ slack); the read holds 10 s
            with pytest.raises(PrefetchError, match="closed"):
                await stream.layer(0)
        finally:
            backend.hold.set()


async def test_closing_the_store_closes_its_open_streams() -> None:
    objects, keys = await stored(2)
    store = await memory_store(objects, slots=4).open()
    for i, key in enumerate(keys):
        assert await store.put(key, chunk(i))
    stream = store.prefetch(keys, depth=1)  # never consumed past layer 0, never closed by its user
    assert torch.equal(await stream.layer(0), torch.cat([chunk(0)[0], chunk(1)[0]], dim=1))
    assert store.pool.stats()["referenced"] == 2  # the stream holds the chunks' slots
    await store.close()
    assert store.pool.stats()["referenced"] == 0
    with pytest.raises(PrefetchError, match="closed"):
        await stream.layer(LAYOUT.num_layers - 1)  # depth 1: never fetched


async def test_files_opened_for_a_cancelled_open_many_are_closed(tmp_path: Path) -> None:
    backend = DiskBackend(tmp_path / "disk", 1 << 30)
    await backend.open()
    keys = [f"{i:064x}" for i in range(8)]
    for key in keys:
        await backend.set(key, [b"x" * 64])
    reads = [ObjectRead(key, lambda file: file, backend.exists) for key in keys]  # each result owns its file
    before = open_fds()
    with ThreadPoolExecutor(1) as executor:
        for _ in range(50):
            task = asyncio.create_task(backend.open_many(reads, executor))
            await asyncio.sleep(0)  # the batch is in its thread
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
        opened = await backend.open_many(reads, executor)  # not cancelled: the caller owns the files
        assert open_fds() == before + len(keys)
        for file in opened:
            assert not isinstance(file, BaseException) and file is not None
            file.close()
    assert open_fds() == before
    await backend.close()


# -- item 2: one timeouts.get per call -----------------------------------------------------------


async def test_a_frozen_server_costs_get_many_and_lookup_one_timeout_per_call() -> None:
    """Redis stopped (SIGSTOP): a 16-chunk get_many and a lookup with 8 DRAM gaps each wait one timeout.

    Before: get_many allowed 16 x 0.3 s and lookup asked the server once per gap (8 x 0.3 s).
    """
    server = start_server(RedisServer())
    try:
        cfg = StoreConfig(
            dram={"capacity": LAYOUT.chunk_nbytes * 32},
            disk={"enabled": False},
            redis={"enabled": True, "url": server.url, "connect_timeout": 0.5},
            timeouts={"get": 0.3, "put": 2.0, "close": 1.0},
        )
        async with KVStore(cfg, LAYOUT, "frozen") as writer:
            keys = keys_of(writer, 16)
            for i, key in enumerate(keys):
                assert await writer.put(key, chunk(i))
            await writer.flush()
        async with KVStore(cfg, LAYOUT, "frozen") as reader:
            assert all(kv is not None for kv in await reader.get_many(keys[::2]))  # DRAM: every other chunk
            server.pause()
            try:
                started = time.monotonic()
                assert await reader.lookup(keys) == 1  # the first gap is not answered in time
                assert (
                    time.monotonic() - started < 8 * 0.3
                )  # a hang guard (the counts are the proof); before: 16 x 0.3 s
                assert reader.stats()["redis"]["timeouts"] == 1  # asked once

                started = time.monotonic()
                got = await reader.get_many(keys[1::2])
                assert got == [None] * 8
                assert (
                    time.monotonic() - started < 8 * 0.3
                )  # a hang guard (the counts are the proof); before: 16 x 0.3 s
            finally:
                server.resume()
    finally:
        server.close()


async def test_lookup_asks_each_tier_once_whatever_the_gaps() -> None:
    """DRAM holds every other chunk, the tier only the gaps: one query for the 8 gaps, not one per gap."""
    objects, keys = await stored(16)
    async with memory_store(objects, slots=32) as store:
        for i in range(0, 16, 2):
            assert await store.put(keys[i], chunk(i))
        await store.flush()
        for i in range(0, 16, 2):
            del objects[keys[i]]  # the tier holds the gaps only
        backend = store.tiers[0].backend
        backend.prefix_counts = 0
        assert await store.lookup(keys) == 16
        assert backend.prefix_counts == 1


async def test_a_stuck_tier_above_a_good_one_costs_lookup_one_timeout() -> None:
    """The issue's case: a frozen tier over one that answers, DRAM every other chunk; before, a timeout per gap.

    The stuck tier may take half the call's time; the tier below answers in the other half.
    """
    objects, keys = await stored(16)
    async with memory_store(objects, slots=32, tiers=2, get=1.0) as store:
        for i in range(0, 16, 2):
            assert await store.put(keys[i], chunk(i))
        await store.flush()
        for i in range(0, 16, 2):
            del objects[keys[i]]  # the good tier holds the gaps only
        stuck = store.tiers[0].backend
        stuck.hold.clear()
        try:
            started = time.monotonic()
            assert await store.lookup(keys) == 16  # the good tier, in the half the stuck one left
            assert store.tiers[0].stats.timeouts == 1 and store.tiers[1].backend.prefix_counts == 1  # each once
            assert time.monotonic() - started < 2 * 1.0  # a hang guard (the counts are the proof)
        finally:
            stuck.hold.set()


async def test_a_stuck_tier_costs_a_16_chunk_get_many_one_timeout() -> None:
    """Before: the batch was allowed timeouts.get per chunk (16 x 0.3 s)."""
    objects, keys = await stored(16)
    async with memory_store(objects, slots=32, get=0.3) as store:
        stuck = store.tiers[0].backend
        stuck.hold.clear()
        try:
            started = time.monotonic()
            assert await store.get_many(keys) == [None] * 16
            assert time.monotonic() - started < 8 * 0.3  # a hang guard; before: 16 x 0.3 s
            assert store.tiers[0].stats.timeouts == 1
        finally:
            stuck.hold.set()


async def test_get_many_shares_one_deadline_across_tiers_and_rounds() -> None:
    """A stuck first tier over a 12-chunk get with 4 free slots: one timeout in all, not one per round or tier."""
    objects, keys = await stored(12)
    async with memory_store(objects, slots=4, tiers=2, get=0.3, close=0.3) as store:
        first = store.tiers[0].backend
        first.hold.clear()
        try:
            started = time.monotonic()
            got = await store.get_many(keys)
            assert time.monotonic() - started < 8 * 0.3  # a hang guard; before: 16 x 0.3 s
            assert store.tiers[0].stats.timeouts == 1 and store.tiers[1].stats.timeouts == 0  # one wait in all
            assert got == [None] * 12
        finally:
            first.hold.set()


# -- item 15 (engine parts) ----------------------------------------------------------------------


async def test_a_chunk_that_requires_grad_leaves_no_autograd_history() -> None:
    async with memory_store({}) as store:
        key = keys_of(store, 1)[0]
        kv = chunk(0).float().requires_grad_().to(LAYOUT.dtype)  # a non-leaf with history
        assert await store.put(key, kv)
        got = await store.get(key)
        assert got is not None and got.grad_fn is None and not got.requires_grad
        assert torch.equal(got, chunk(0))


async def test_a_meta_tensor_is_rejected_naming_the_argument() -> None:
    async with memory_store({}) as store:
        key = keys_of(store, 1)[0]
        assert await store.put(key, chunk(0))
        meta = torch.empty(LAYOUT.chunk_shape, dtype=LAYOUT.dtype, device="meta")
        with pytest.raises(ValueError, match="out is on the 'meta' device"):
            await store.get(key, out=meta)
        with pytest.raises(ValueError, match="kv is on the 'meta' device"):
            await store.put(keys_of(store, 1, seed=1)[0], meta)
        assert store.stats()["store"]["hits"] == 0


async def test_a_huge_key_makes_a_short_error() -> None:
    async with memory_store({}) as store:
        with pytest.raises(ValueError, match="1000000 characters") as caught:
            await store.lookup(["ab" * 500_000])
        assert len(str(caught.value)) < 300


def test_an_engine_threads_stream_is_closed_with_its_store() -> None:
    """SyncKVStore: closing the store ends its streams (a waiting engine thread gets PrefetchError)."""
    cfg = StoreConfig(dram={"capacity": LAYOUT.chunk_nbytes * 8}, disk={"enabled": False})
    store = SyncKVStore(cfg, LAYOUT, "sync")
    try:
        keys = store.chunk_keys(list(range(2 * LAYOUT.chunk_tokens)))
        for i, key in enumerate(keys):
            assert store.put(key, chunk(i))
        stream = store.prefetch(keys, depth=1)
        stream.wait_layer(0, timeout=10)
    finally:
        store.close()
    with pytest.raises(PrefetchError, match="closed"):
        stream.wait_layer(LAYOUT.num_layers - 1, timeout=10)  # depth 1: never fetched
    stream.close()
    assert store._store.pool.stats()["referenced"] == 0


async def test_a_big_set_to_a_frozen_redis_costs_one_timeout_not_a_polite_close() -> None:
    """A 64 MiB SET fills the socket, the server stopped (SIGSTOP): the send times out and the
    half-sent connection is dropped at once. Before, closing it waited to flush into the frozen
    server for up to ``connect_timeout`` more, past the call's deadline."""
    server = start_server(RedisServer())
    try:
        backend = RedisBackend(server.url, connect_timeout=2.0, socket_timeout=0.5)
        await backend.open()
        await backend.set("ab" * 16, [b"warm"])  # a pooled connection, made while the server answers
        parts = [memoryview(bytearray(16 << 20)) for _ in range(4)]
        server.pause()
        try:
            started = time.monotonic()
            with pytest.raises(RedisTimeoutError):
                await backend.set("cd" * 16, parts)
            # A hang guard: one operation_timeout (2.75 s) plus slack; the polite close took 2 s more.
            assert time.monotonic() - started < backend.operation_timeout + 1.0
        finally:
            server.resume()
        await backend.close()
    finally:
        server.close()
