"""The disk tier on the caller's path: ``get_many`` reads straight into the caller's buffers, writes run in parallel.

Reads into ``outs`` need no DRAM slot (so they work with every slot held), are
admitted to DRAM after the call, never report a corrupt chunk as data and never write into a
caller's buffer once the call has returned. Writes of a batch go to the disk over several
threads at once, each within the byte budget, atomically, as private files.
"""

from __future__ import annotations

import asyncio
import itertools
import stat
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from kvstore import KVLayout, KVStore, StoreConfig, chunk_keys
from kvstore.backends.disk import DiskBackend
from kvstore.backends.files import FileReader
from kvstore.backends.temporaries import TMP_MARK
from kvstore.codecs import make_codec
from kvstore.keys import namespace_dir
from kvstore.storage.container import encode_chunk
from kvstore.storage.tier import ChunkTier
from kvstore.util.buffers import as_bytes_view, tensor_bytes
from kvstore.util.threads import FenceClosed, WriteFence, close_fences

LAYOUT = KVLayout(num_layers=4, num_kv_heads=2, head_dim=16, chunk_tokens=32)
SENTINEL = 7.0  # what the caller's buffers hold before a call (no chunk here is all 7s)


def make_chunk(seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(LAYOUT.chunk_shape, generator=generator).to(LAYOUT.dtype)


def config(tmp_path: Path, slots: int = 16, **overrides: object) -> StoreConfig:
    values: dict[str, object] = {
        "dram": {"capacity": slots * LAYOUT.chunk_nbytes},
        "disk": {"path": tmp_path / "disk"},
        "timeouts": {"get": 0.5, "put": 2.0, "close": 2.0},
    }
    values.update(overrides)
    return StoreConfig(**values)


def keys_for(n: int) -> list[str]:
    return chunk_keys(list(range(n * LAYOUT.chunk_tokens)), LAYOUT, "test")


def caller_buffers(n: int) -> list[torch.Tensor]:
    return [torch.full(LAYOUT.chunk_shape, SENTINEL, dtype=LAYOUT.dtype) for _ in range(n)]


async def stored(tmp_path: Path, n: int) -> list[str]:
    """``n`` chunks written to the disk tier by one store, then closed (DRAM gone with it)."""
    keys = keys_for(n)
    async with KVStore(config(tmp_path), LAYOUT, namespace="test") as store:
        for i, key in enumerate(keys):
            assert await store.put(key, make_chunk(i))
    return keys


def chunk_files(root: Path) -> list[Path]:
    return [path for path in root.rglob("*") if path.is_file()]


def bytes_on_disk(root: Path) -> int:
    """The bytes of every file under ``root`` now (files removed meanwhile count nothing)."""
    total = 0
    for path in chunk_files(root):
        try:
            total += path.stat().st_size
        except FileNotFoundError:
            pass
    return total


# -- reads into the caller's buffers ---------------------------------------------------------------


async def test_get_many_into_outs_needs_no_dram_slot(tmp_path: Path) -> None:
    """Every slot held by someone else: the old path (stage through a slot) would load nothing."""
    keys = await stored(tmp_path, 6)
    async with KVStore(config(tmp_path, slots=2), LAYOUT, namespace="test") as store:
        held = [store.pool.reserve(), store.pool.reserve()]
        assert None not in held and store.pool.reserve() is None
        outs = caller_buffers(6)
        results = await store.get_many(keys, outs)
        assert all(r is out for r, out in zip(results, outs, strict=True))
        assert all(torch.equal(out, make_chunk(i)) for i, out in enumerate(outs))
        await store.flush()
        stats = store.stats()
        assert stats["store"]["admitted"] == 0 and stats["store"]["admissions_dropped"] == 6  # no slot to admit to
        assert stats["dram"]["chunks"] == 0
        for slot in held:
            assert slot is not None
            store.pool.release(slot)


async def test_chunks_read_into_outs_are_admitted_to_dram_after_the_call(tmp_path: Path) -> None:
    keys = await stored(tmp_path, 5)
    async with KVStore(config(tmp_path), LAYOUT, namespace="test") as store:
        outs = caller_buffers(5)
        results = await store.get_many(keys, outs)
        assert all(r is not None and torch.equal(r, make_chunk(i)) for i, r in enumerate(results))
        await store.flush()  # the admissions run after the call; flush waits for them
        stats = store.stats()
        assert stats["store"]["admitted"] == 5 and stats["dram"]["chunks"] == 5 and stats["dram"]["referenced"] == 0
        disk_hits = stats["disk"]["hits"]
        again = caller_buffers(5)
        results = await store.get_many(keys, again)
        assert all(r is not None and torch.equal(r, make_chunk(i)) for i, r in enumerate(results))
        assert store.stats()["disk"]["hits"] == disk_hits  # served by DRAM: the disk was not asked
        outs[0].fill_(SENTINEL)  # the caller's buffers are the caller's: DRAM kept its own copy
        got = await store.get(keys[0])
        assert got is not None and torch.equal(got, make_chunk(0))


async def test_a_corrupt_chunk_read_into_outs_is_a_counted_miss(tmp_path: Path) -> None:
    keys = await stored(tmp_path, 3)
    async with KVStore(config(tmp_path), LAYOUT, namespace="test") as store:
        backend = store.tiers[0].backend
        assert isinstance(backend, DiskBackend)
        path = backend.path_for(keys[1])
        data = bytearray(path.read_bytes())
        data[-100] ^= 0xFF  # a payload byte: the layer's checksum no longer matches
        path.write_bytes(bytes(data))
        outs = caller_buffers(3)
        results = await store.get_many(keys, outs)
        assert results[1] is None  # never reported as data, whatever outs[1] now holds
        assert results[0] is not None and torch.equal(results[0], make_chunk(0))
        assert results[2] is not None and torch.equal(results[2], make_chunk(2))
        stats = store.stats()
        assert stats["disk"]["corrupt"] == 1 and stats["store"]["misses"] == 1 and not path.exists()
        await store.flush()
        assert not store.pool.contains(keys[1]) and store.stats()["store"]["admitted"] == 2


class HeldDisk(DiskBackend):
    """A disk whose next file open waits for ``go`` (a frozen device, before any byte is read)."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.go = threading.Event()
        self.closed = threading.Event()  # set when the held read has closed its file

    def open_reader(self, key: str, hit: bool = True) -> FileReader | None:
        self.go.wait(30)
        reader = super().open_reader(key, hit)
        if reader is None:
            return None
        backend, close = self, reader.close

        def closing() -> None:
            close()
            backend.closed.set()

        reader.close = closing  # type: ignore[method-assign]
        return reader


async def test_a_read_past_the_deadline_never_writes_into_outs_after_the_call(tmp_path: Path) -> None:
    keys = await stored(tmp_path, 1)
    cfg = config(tmp_path, timeouts={"get": 0.3, "put": 2.0, "close": 2.0})
    backend = HeldDisk(tmp_path / "disk", 1 << 30, namespace=namespace_dir("test"))
    tier = ChunkTier(backend, make_codec("identity"), LAYOUT, None)
    async with KVStore(cfg, LAYOUT, namespace="test", tiers=[tier]) as store:
        outs = caller_buffers(1)
        assert await store.get_many(keys, outs) == [None]  # one timeout: the open is still held
        assert tier.stats.timeouts == 1
        backend.go.set()  # the device wakes: the thread opens the file and would read into outs[0]
        assert await asyncio.to_thread(backend.closed.wait, 30)
        assert torch.all(outs[0] == SENTINEL)  # nothing landed: the buffer was closed to the thread


async def test_a_fence_waits_for_the_write_in_progress_then_refuses_more() -> None:
    fence = WriteFence()
    inside, finish = threading.Event(), threading.Event()
    buffer = bytearray(4)

    def writer() -> None:
        with fence:
            inside.set()
            finish.wait(30)
            buffer[0] = 1

    thread = threading.Thread(target=writer)
    thread.start()
    assert await asyncio.to_thread(inside.wait, 30)
    closing = asyncio.create_task(fence.close())
    await asyncio.sleep(0.05)
    assert not closing.done()  # the write under way must end first
    finish.set()
    await closing
    assert buffer[0] == 1  # it ended before close returned
    with pytest.raises(FenceClosed):
        with fence:
            buffer[1] = 1
    assert buffer[1] == 0
    thread.join()


async def test_fences_closed_together_leave_no_buffer_written_even_when_cancelled() -> None:
    """Two buffers, a write in progress in each: cancelling the close while it waits for the first
    must still wait for the second (closing one fence at a time left the second being written)."""
    fences = [WriteFence(), WriteFence()]
    inside = [threading.Event(), threading.Event()]
    finish = [threading.Event(), threading.Event()]
    buffers = [bytearray(1), bytearray(1)]

    def writer(i: int) -> None:
        with fences[i]:
            inside[i].set()
            finish[i].wait(30)
            buffers[i][0] = 1

    threads = [threading.Thread(target=writer, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    assert all([await asyncio.to_thread(event.wait, 30) for event in inside])
    closing = asyncio.create_task(close_fences(fences))
    await asyncio.sleep(0.05)
    closing.cancel()  # while it waits for the first write
    finish[0].set()
    await asyncio.sleep(0.05)
    assert not closing.done(), "the second buffer is still being written"
    finish[1].set()
    with pytest.raises(asyncio.CancelledError):
        await closing
    assert buffers == [bytearray(b"\x01"), bytearray(b"\x01")]  # both writes ended before it returned
    for thread in threads:
        thread.join()


async def test_get_many_with_non_contiguous_outs_still_goes_through_a_slot(tmp_path: Path) -> None:
    """Non-contiguous outs cannot be read into: the chunk goes through a slot and is copied, as before."""
    keys = await stored(tmp_path, 2)
    async with KVStore(config(tmp_path), LAYOUT, namespace="test") as store:
        wide = torch.zeros((2, *LAYOUT.chunk_shape[:-1], 2 * LAYOUT.chunk_shape[-1]), dtype=LAYOUT.dtype)
        outs = [wide[i, ..., : LAYOUT.chunk_shape[-1]] for i in range(2)]
        assert not outs[0].is_contiguous()
        results = await store.get_many(keys, outs)
        assert all(r is not None and torch.equal(r, make_chunk(i)) for i, r in enumerate(results))
        assert store.stats()["dram"]["chunks"] == 2 and store.stats()["store"]["admitted"] == 0  # promoted at once


# -- parallel writes ---------------------------------------------------------------------------------


async def test_a_batch_is_written_by_several_threads_at_once(tmp_path: Path) -> None:
    """Two writes of one batch meet inside the disk backend: they are in flight together (no timing)."""
    backend = DiskBackend(tmp_path / "disk", 1 << 30)
    await backend.open()
    meeting = threading.Barrier(2, timeout=30)  # one writer alone would wait out the timeout and break it
    calls = itertools.count()
    write_file = backend._write_file

    def meet_then_write(final: str, views: list[memoryview]) -> None:
        if next(calls) < 2:  # the first two writes of the batch
            meeting.wait()
        write_file(final, views)

    backend._write_file = meet_then_write  # type: ignore[method-assign]
    executor = ThreadPoolExecutor(4)
    tier = ChunkTier(backend, make_codec("identity"), LAYOUT, executor)
    chunks = [make_chunk(i) for i in range(4)]
    keys = keys_for(4)
    outcomes = await tier.write_many([(key, tensor_bytes(c)) for key, c in zip(keys, chunks, strict=True)])
    assert outcomes == [None] * 4 and not meeting.broken
    assert tier.stats.writes == 4
    executor.shutdown()


async def test_parallel_writes_never_take_the_disk_past_its_budget(tmp_path: Path) -> None:
    """12 chunks through 4 threads into a budget of 3 files: at every moment, the bytes on disk fit."""
    root = tmp_path / "disk"
    file_size = len(b"".join(bytes(p) for p in _encoded(0)))
    backend = DiskBackend(root, 3 * file_size)
    await backend.open()
    seen: list[int] = []
    write_file = backend._write_file

    def write_and_measure(final: str, views: list[memoryview]) -> None:
        write_file(final, views)
        seen.append(bytes_on_disk(root))

    backend._write_file = write_and_measure  # type: ignore[method-assign]
    executor = ThreadPoolExecutor(4)
    tier = ChunkTier(backend, make_codec("identity"), LAYOUT, executor, parallel_writes=4)
    keys = keys_for(12)
    chunks = [make_chunk(i) for i in range(12)]
    for first in range(0, 12, 4):  # two batches at once, as two cascade workers write them
        await asyncio.gather(
            tier.write_many([(keys[i], tensor_bytes(chunks[i])) for i in range(first, first + 2)]),
            tier.write_many([(keys[i], tensor_bytes(chunks[i])) for i in range(first + 2, first + 4)]),
        )
    assert len(seen) == 12 and max(seen) <= 3 * file_size
    files = chunk_files(root)
    assert len(files) == 3 and sum(p.stat().st_size for p in files) == 3 * file_size
    assert tier.stats.writes == 12 and backend.evictions == 9
    executor.shutdown()


def _encoded(seed: int) -> list[memoryview]:
    parts = encode_chunk(LAYOUT, keys_for(1)[0], tensor_bytes(make_chunk(seed)), make_codec("identity"), None)
    return [as_bytes_view(part) for part in parts]


@pytest.mark.parametrize("fsync", [False, True], ids=["no-fsync", "fsync"])
async def test_every_chunk_of_a_put_burst_lands_whole_and_private(tmp_path: Path, fsync: bool) -> None:
    keys = keys_for(24)
    cfg = config(tmp_path, slots=32, disk={"path": tmp_path / "disk", "fsync": fsync})
    async with KVStore(cfg, LAYOUT, namespace="test") as store:
        for i, key in enumerate(keys):
            assert await store.put(key, make_chunk(i))
        await store.flush()
        stats = store.stats()["disk"]
        assert stats["writes"] == 24 and stats["drops"] == 0 and stats["errors"] == 0
    files = chunk_files(tmp_path / "disk")
    assert len(files) == 24 and not [p for p in files if TMP_MARK in p.name]
    assert all(stat.S_IMODE(p.stat().st_mode) == 0o600 for p in files)
    assert len({p.stat().st_size for p in files}) == 1
    async with KVStore(config(tmp_path), LAYOUT, namespace="test") as store:  # every file reads back whole
        outs = caller_buffers(24)
        results = await store.get_many(keys, outs)
        assert all(r is not None and torch.equal(r, make_chunk(i)) for i, r in enumerate(results))


async def test_a_full_write_queue_still_drops_and_counts(tmp_path: Path) -> None:
    keys = keys_for(12)
    cfg = config(tmp_path, slots=16, queue_depth=2, tier_workers=1)
    async with KVStore(cfg, LAYOUT, namespace="test") as store:
        for i, key in enumerate(keys):
            assert await store.put(key, make_chunk(i))
        await store.flush()
        stats = store.stats()["disk"]
        assert stats["writes"] + stats["drops"] == 12  # each chunk written or counted as dropped
        assert len(chunk_files(tmp_path / "disk")) == stats["writes"]
