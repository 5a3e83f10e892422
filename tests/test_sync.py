"""SyncKVStore (kvstore.engine.sync): the store's methods for engine threads, and calls that end early.

A call an engine thread gives up on (a ``submit()`` future it cancels) must never write into the
caller's buffers once ``cancel()`` has returned: the engine reuses them at once. The reads here
are held on events the test controls (a disk whose file open waits, a loop held by a coroutine),
never on sleeps.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from pathlib import Path

import pytest
import torch

from kvstore import KVLayout, KVStore, StoreConfig, SyncKVStore, chunk_keys
from kvstore.backends.disk import DiskBackend
from kvstore.backends.files import FileReader
from kvstore.codecs import make_codec
from kvstore.keys import namespace_dir
from kvstore.storage.tier import ChunkTier

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=16, chunk_tokens=32)
SENTINEL = 7.0  # what the caller's buffers hold before a call (no chunk here is all 7s)


def make_chunk(seed: int) -> torch.Tensor:
    return torch.randn(LAYOUT.chunk_shape, generator=torch.Generator().manual_seed(seed)).to(LAYOUT.dtype)


def caller_buffers(n: int) -> list[torch.Tensor]:
    return [torch.full(LAYOUT.chunk_shape, SENTINEL, dtype=LAYOUT.dtype) for _ in range(n)]


def config(tmp_path: Path, disk: bool = True) -> StoreConfig:
    return StoreConfig(
        dram={"capacity": 8 * LAYOUT.chunk_nbytes},
        disk={"enabled": disk, "path": tmp_path / "disk"},
        timeouts={"get": 30.0, "put": 30.0, "close": 5.0},  # no deadline is reached: the tests cancel
    )


def keys_for(n: int) -> list[str]:
    return chunk_keys(list(range(n * LAYOUT.chunk_tokens)), LAYOUT, "test")


async def stored_on_disk(tmp_path: Path, n: int) -> list[str]:
    """``n`` chunks written to the disk tier by a store that is then closed (its DRAM gone with it)."""
    keys = keys_for(n)
    async with KVStore(config(tmp_path), LAYOUT, namespace="test") as store:
        for i, key in enumerate(keys):
            assert await store.put(key, make_chunk(i))
    return keys


class HeldDisk(DiskBackend):
    """A disk whose file opens wait for ``go`` (a frozen device, before any byte is read)."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.entered, self.go = threading.Event(), threading.Event()
        self.closed = threading.Event()  # the held read has closed its file: it is over

    def open_reader(self, key: str, hit: bool = True) -> FileReader | None:
        self.entered.set()
        self.go.wait(30)
        reader = super().open_reader(key, hit)
        if reader is None:
            return None
        close, closed = reader.close, self.closed

        def closing() -> None:
            close()
            closed.set()

        reader.close = closing  # type: ignore[method-assign]
        return reader


async def test_get_many_is_the_async_stores_from_a_thread(tmp_path: Path) -> None:
    keys = await stored_on_disk(tmp_path, 3)
    missing = keys_for(4)[3]

    def engine_thread() -> None:
        with SyncKVStore(config(tmp_path), LAYOUT, namespace="test") as store:
            outs = caller_buffers(4)
            results = store.get_many([*keys, missing], outs)  # from the disk, straight into outs
            assert results[3] is None
            assert all(result is out for result, out in zip(results[:3], outs, strict=False))
            assert all(torch.equal(out, make_chunk(i)) for i, out in enumerate(outs[:3]))
            store.flush()  # the chunks are admitted to DRAM after the call
            again = store.get_many(keys)  # new tensors, from DRAM
            assert all(r is not None and torch.equal(r, make_chunk(i)) for i, r in enumerate(again))
            assert store.stats()["store"]["hits"] == 6

    await asyncio.to_thread(engine_thread)


def test_wrong_arguments_name_the_call_and_the_argument_before_anything_runs(tmp_path: Path) -> None:
    """The facade read ``kv.device`` and ``outs[0].device`` itself: a non-tensor was a bare AttributeError."""
    with SyncKVStore(config(tmp_path), LAYOUT, namespace="test") as store:
        keys = keys_for(2)
        with pytest.raises(TypeError, match="put: kv must be a torch.Tensor, got list"):
            store.put(keys[0], [0.0])
        with pytest.raises(TypeError, match=r"put_many: kvs\[1\] must be a torch.Tensor, got NoneType"):
            store.put_many(keys, [make_chunk(0), None])
        with pytest.raises(TypeError, match=r"prefetch: outs\[0\] must be a torch.Tensor, got str"):
            store.prefetch(keys, outs=["layer 0"])
        with pytest.raises(TypeError, match="lookup: keys must be a sequence of chunk keys"):
            store.lookup(keys[0])
        out = caller_buffers(1)[0]
        with pytest.raises(ValueError, match=r"get_many: outs\[0\] and outs\[1\] share memory"):
            store.get_many(keys, [out, out])
        assert store.stats()["store"]["puts"] == 0 and store.stats()["store"]["gets"] == 0


async def test_a_cancelled_get_many_writes_nothing_into_outs_once_cancel_returned(tmp_path: Path) -> None:
    """The disk read into the caller's buffer is held before its first byte; the engine cancels
    the call's future, then the disk wakes: the read finds the buffer closed to it."""
    keys = await stored_on_disk(tmp_path, 1)
    backend = HeldDisk(tmp_path / "disk", 1 << 30, namespace=namespace_dir("test"))
    tier = ChunkTier(backend, make_codec("identity"), LAYOUT, None)

    def engine_thread() -> None:
        with SyncKVStore(config(tmp_path), LAYOUT, namespace="test", tiers=[tier]) as store:
            outs = caller_buffers(1)
            call = store.get_many_future(keys, outs)
            assert backend.entered.wait(30)
            assert call.cancel() and call.cancelled()
            done, _ = concurrent.futures.wait([call], timeout=30)  # a waiter on it is woken too
            assert done == {call}
            backend.go.set()  # the device wakes: the thread opens the file and would read into outs[0]
            assert backend.closed.wait(30)
            assert torch.all(outs[0] == SENTINEL), "the cancelled read wrote into the caller's buffer"

    await asyncio.to_thread(engine_thread)


async def test_a_call_cancelled_before_its_coroutine_started_never_runs(tmp_path: Path) -> None:
    """The loop is busy (a coroutine holds it); a get_many of a DRAM chunk is submitted behind it and
    cancelled. Started late, it would copy the chunk into ``outs`` in its first step."""
    key = keys_for(1)[0]

    def engine_thread() -> None:
        with SyncKVStore(config(tmp_path, disk=False), LAYOUT, namespace="test") as store:
            assert store.put(key, make_chunk(0))
            holding, release = threading.Event(), threading.Event()

            async def hold_the_loop() -> None:
                holding.set()
                release.wait(30)  # blocks the loop thread itself

            held = store._submit(hold_the_loop())
            assert holding.wait(30)
            outs = caller_buffers(1)
            call = store.get_many_future([key], outs)
            assert call.cancel() and call.cancelled()
            assert concurrent.futures.wait([call], timeout=30).done == {call}  # its waiters are woken
            release.set()
            held.result(30)
            store.stats()  # a round trip through the loop: whatever was queued before it has run
            assert torch.all(outs[0] == SENTINEL), "the cancelled call ran after cancel() returned"
            assert store.get_many([key])[0] is not None  # the store goes on serving

    await asyncio.to_thread(engine_thread)
