"""After ``get_many(keys, outs)`` read the disk into the caller's buffers: admissions to DRAM, and cancelled calls.

A cancelled call must never make a good file look corrupt (its buffer is the
caller's again), admissions must leave the engine slots for its own puts, the disk's counters
must count each chunk asked for once, and no admission may start once the store is closing.
"""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import pytest
import torch
from test_disk_direct import LAYOUT, caller_buffers, config, make_chunk, stored

import kvstore.storage.chunk_reads as chunk_reads
from kvstore import KVStore, chunk_keys
from kvstore.backends.disk import DiskBackend
from kvstore.engine.dram import SlabPool
from kvstore.util.threads import FenceClosed


async def test_a_cancelled_call_never_discards_a_good_file_as_corrupt(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The caller reuses its buffer as soon as the cancelled call returns; the file's check must not see that."""
    keys = await stored(tmp_path, 1)
    entered, gate = threading.Event(), threading.Event()
    verify = chunk_reads.verify_segments

    def held_verify(*args: object, **kwargs: object) -> None:
        entered.set()
        gate.wait(30)
        verify(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(chunk_reads, "verify_segments", held_verify)
    cfg = config(tmp_path, timeouts={"get": 30.0, "put": 2.0, "close": 2.0})
    async with KVStore(cfg, LAYOUT, namespace="test") as store:
        backend = store.tiers[0].backend
        assert isinstance(backend, DiskBackend)
        path = backend.path_for(keys[0])
        outs = caller_buffers(1)
        call = asyncio.create_task(store.get_many(keys, outs))
        assert await asyncio.to_thread(entered.wait, 30)  # the thread is checking what it read into outs[0]
        call.cancel()
        done, _ = await asyncio.wait({call}, timeout=0.5)  # (no assertion on it: either order must be safe)
        if done:
            outs[0].zero_()  # the call has returned: the caller may reuse its buffer at once
        gate.set()
        with pytest.raises(asyncio.CancelledError):
            await call
        outs[0].zero_()
        monkeypatch.setattr(chunk_reads, "verify_segments", verify)
        while running := store.tiers[0].health.running:  # every tier operation still running, the call's read too
            await asyncio.wait(running)
        await store.flush()
        disk = store.stats()["disk"]
        assert path.exists() and disk["corrupt"] == 0 and disk["errors"] == 0
        assert store.tiers[0].breaker.state == "closed"
        results = await store.get_many(keys, caller_buffers(1))  # and the file still reads back whole
        assert results[0] is not None and torch.equal(results[0], make_chunk(0))


async def test_a_closed_fence_is_a_miss_counted_nowhere(tmp_path: Path) -> None:
    async with KVStore(config(tmp_path), LAYOUT, namespace="test") as store:
        tier = store.tiers[0]
        before = tier.stats_dict()
        assert (
            await tier.account(chunk_keys(list(range(LAYOUT.chunk_tokens)), LAYOUT, "test")[0], FenceClosed()) is False
        )
        assert tier.stats_dict() == before


async def test_admissions_leave_a_slot_for_the_next_put(tmp_path: Path) -> None:
    """Four chunks read into outs with a pool of four slots: the put right after still finds a slot."""
    keys = await stored(tmp_path, 4)
    async with KVStore(config(tmp_path, slots=4), LAYOUT, namespace="test") as store:
        results = await store.get_many(keys, caller_buffers(4))
        assert all(r is not None for r in results)
        await asyncio.sleep(0)  # the engine goes on; the admissions start
        new = chunk_keys(list(range(1000, 1000 + LAYOUT.chunk_tokens)), LAYOUT, "test")[0]
        assert await store.put(new, make_chunk(99))
        assert store.stats()["store"]["put_rejected"] == 0
        await store.flush()
        stats = store.stats()["store"]
        assert stats["admitted"] + stats["admissions_dropped"] == 4


async def test_admissions_never_take_the_pools_last_spare_slots(tmp_path: Path) -> None:
    """Two of four slots held elsewhere: admissions may not take the other two (a quarter stays spare)."""
    keys = await stored(tmp_path, 4)
    async with KVStore(config(tmp_path, slots=4), LAYOUT, namespace="test") as store:
        held = [store.pool.reserve(), store.pool.reserve()]
        results = await store.get_many(keys, caller_buffers(4))
        assert all(r is not None for r in results)
        await asyncio.sleep(0)  # the admissions start
        new = chunk_keys(list(range(1000, 1000 + LAYOUT.chunk_tokens)), LAYOUT, "test")[0]
        assert await store.put(new, make_chunk(99))  # without the reserve, two admissions held both free slots
        assert store.stats()["store"]["put_rejected"] == 0
        await store.flush()
        assert store.stats()["store"]["admissions_dropped"] >= 1  # the one that would have gone under the reserve
        for slot in held:
            assert slot is not None
            store.pool.release(slot)


def test_has_spare_counts_free_and_evictable_slots() -> None:
    pool = SlabPool(LAYOUT, 4 * LAYOUT.chunk_nbytes, pin_memory="never")
    key = chunk_keys(list(range(LAYOUT.chunk_tokens)), LAYOUT, "test")[0]
    slots = [pool.reserve() for _ in range(4)]
    assert None not in slots and not pool.has_spare(0)
    assert slots[0] is not None and pool.publish(slots[0], key)
    assert not pool.has_spare(0)  # published but still referenced
    pool.release(slots[0])
    assert pool.has_spare(0) and not pool.has_spare(1)  # evictable now
    assert slots[1] is not None
    pool.release(slots[1])
    assert pool.has_spare(1) and not pool.has_spare(2)


async def test_each_chunk_read_into_outs_is_counted_once_by_the_disk(tmp_path: Path) -> None:
    keys = await stored(tmp_path, 5)
    async with KVStore(config(tmp_path), LAYOUT, namespace="test") as store:
        await store.get_many(keys, caller_buffers(5))
        read_once = store.stats()["disk"]
        reads_timed = sum(store.tiers[0].latency.read.counts)
        await store.flush()  # the admissions re-read each file
        disk = store.stats()["disk"]
        assert store.stats()["store"]["admitted"] == 5
        assert disk["hits"] == 5 and disk["bytes_read"] == read_once["bytes_read"]
        assert sum(store.tiers[0].latency.read.counts) == reads_timed


async def test_a_file_found_corrupt_by_its_admission_is_counted_and_removed(tmp_path: Path) -> None:
    keys = await stored(tmp_path, 1)
    async with KVStore(config(tmp_path), LAYOUT, namespace="test") as store:
        backend = store.tiers[0].backend
        assert isinstance(backend, DiskBackend)
        path = backend.path_for(keys[0])
        results = await store.get_many(keys, caller_buffers(1))
        assert results[0] is not None and torch.equal(results[0], make_chunk(0))
        data = bytearray(path.read_bytes())  # damaged after the call, before its admission reads it
        data[-100] ^= 0xFF
        path.write_bytes(bytes(data))
        await store.flush()
        stats = store.stats()
        assert stats["disk"]["corrupt"] == 1 and not path.exists()
        assert stats["store"]["admitted"] == 0 and not store.pool.contains(keys[0])
        assert stats["disk"]["hits"] == 1 and stats["disk"]["errors"] == 0


async def test_no_admission_starts_once_the_store_is_closing(tmp_path: Path) -> None:
    keys = await stored(tmp_path, 1)
    async with KVStore(config(tmp_path), LAYOUT, namespace="test") as store:
        loader = store._loader
        loader.cancel_admissions()  # what close() does first
        loader.admit(0, keys[0], 1.0)  # a get_many that was still reading when close began
        assert not loader._admissions
        await store.flush()
        assert not store.pool.contains(keys[0])
