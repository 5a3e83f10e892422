"""SlabPool: the pre-allocated DRAM primary tier (slots, LRU, ref-counts, zero-copy views)."""

from __future__ import annotations

import hashlib
import os
import random
import sys
import threading
import time
from unittest import mock

import pytest
import torch

from kvstore.engine import dram
from kvstore.engine.dram import SlabPool
from kvstore.layout import KVLayout

LAYOUT = KVLayout(num_layers=2, num_kv_heads=1, head_dim=8, chunk_tokens=16)
SLOT = LAYOUT.chunk_nbytes  # 2 layers x 2 planes x 16 tokens x 1 head x 8 x 2 bytes = 1024


def key(name: object) -> str:
    return hashlib.sha256(str(name).encode()).hexdigest()


def make_pool(slots: int, **kwargs) -> SlabPool:
    return SlabPool(LAYOUT, slots * SLOT, **kwargs)


def put(pool: SlabPool, name: object, value: float | None = None) -> int:
    """Reserve, fill, publish and release one chunk the way the store does; returns its slot."""
    slot = pool.reserve()
    assert slot is not None
    if value is not None:
        pool.tensor(slot).fill_(value)
    assert pool.publish(slot, key(name))
    pool.release(slot)
    return slot


# -- sizing ------------------------------------------------------------------------------------


def run_racing_threads(worker, count: int) -> None:
    """Run ``worker(seed)`` in ``count`` threads that switch very often, so unlocked races happen."""
    threads = [threading.Thread(target=worker, args=(seed,)) for seed in range(count)]
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=30)
    finally:
        sys.setswitchinterval(interval)
    assert not any(thread.is_alive() for thread in threads)


def test_slot_size_matches_layout():
    assert SLOT == 1024


def test_capacity_smaller_than_one_chunk_is_a_clear_error():
    with pytest.raises(ValueError, match=r"dram\.capacity"):
        SlabPool(LAYOUT, SLOT - 1)
    with pytest.raises(ValueError, match=r"dram\.capacity"):
        SlabPool(LAYOUT, 0)


def test_capacity_rounds_down_to_whole_slots():
    pool = SlabPool(LAYOUT, 3 * SLOT + SLOT // 2)
    assert pool.num_slots == 3
    stats = pool.stats()
    assert stats["slots"] == 3
    assert stats["slot_bytes"] == SLOT
    assert stats["chunks"] == 0
    assert stats["referenced"] == 0
    assert stats["evictions"] == 0


def test_exactly_one_chunk_is_enough():
    pool = SlabPool(LAYOUT, SLOT)
    assert pool.num_slots == 1
    assert pool.reserve() is not None
    assert pool.reserve() is None


# -- reserve / publish / acquire / release ----------------------------------------------------


def test_reserve_publish_acquire_release_roundtrip():
    pool = make_pool(4)
    slot = pool.reserve()
    assert slot is not None
    assert pool.stats()["referenced"] == 1
    assert not pool.contains(key("a"))
    assert pool.acquire(key("a")) is None  # reserved but not published: not findable

    pool.tensor(slot).fill_(3.0)
    assert pool.publish(slot, key("a")) is True
    assert pool.contains(key("a"))
    pool.release(slot)
    stats = pool.stats()
    assert stats["referenced"] == 0
    assert stats["chunks"] == 1

    got = pool.acquire(key("a"))
    assert got == slot
    assert pool.stats()["referenced"] == 1
    assert torch.equal(pool.tensor(got), torch.full(LAYOUT.chunk_shape, 3.0, dtype=torch.bfloat16))
    pool.release(got)
    assert pool.stats()["referenced"] == 0
    # still published after the last release: a released chunk stays cached
    assert pool.contains(key("a"))


def test_reserved_slots_are_distinct_until_the_pool_is_exhausted():
    pool = make_pool(5)
    slots = [pool.reserve() for _ in range(5)]
    assert None not in slots
    assert sorted(slots) == list(range(5))
    assert pool.reserve() is None


def test_publish_of_an_existing_key_is_refused_and_the_loser_slot_is_not_lost():
    pool = make_pool(2)
    first = put(pool, "a", 1.0)
    second = pool.reserve()
    assert second is not None and second != first
    pool.tensor(second).fill_(2.0)
    assert pool.publish(second, key("a")) is False
    # the published chunk is untouched and still the one found
    got = pool.acquire(key("a"))
    assert got == first
    assert float(pool.tensor(got)[0, 0, 0, 0, 0]) == 1.0
    pool.release(got)
    pool.release(second)  # unpublished slot goes back to the free list
    assert pool.stats()["chunks"] == 1
    # the loser's slot can be reserved again without evicting "a"
    again = pool.reserve()
    assert again == second
    assert pool.contains(key("a"))
    assert pool.stats()["evictions"] == 0


def test_retain_adds_a_reference_and_needs_one():
    pool = make_pool(1)
    slot = pool.reserve()
    pool.retain(slot)
    pool.release(slot)
    pool.release(slot)
    with pytest.raises(RuntimeError, match="unreferenced"):
        pool.retain(slot)


def test_release_of_an_unreferenced_slot_raises():
    pool = make_pool(2)
    with pytest.raises(RuntimeError, match="unreferenced"):
        pool.release(0)
    slot = pool.reserve()
    pool.release(slot)
    with pytest.raises(RuntimeError, match="unreferenced"):
        pool.release(slot)
    # the failed releases changed nothing: both slots are still available exactly once
    assert {pool.reserve(), pool.reserve()} == {0, 1}
    assert pool.reserve() is None


# -- LRU eviction ------------------------------------------------------------------------------


def test_eviction_is_least_recently_used_first():
    pool = make_pool(3)
    for name in "abc":
        put(pool, name)
    slot = pool.reserve()  # evicts "a", the oldest
    assert slot is not None
    assert not pool.contains(key("a"))
    assert pool.contains(key("b")) and pool.contains(key("c"))
    assert pool.stats()["evictions"] == 1
    pool.release(slot)


def test_acquire_refreshes_recency():
    pool = make_pool(3)
    slots = {name: put(pool, name) for name in "abc"}
    got = pool.acquire(key("a"))  # "a" becomes the most recent
    pool.release(got)

    evicted_order = []
    for new in "xyz":
        slot = pool.reserve()
        gone = [name for name in "abc" if name not in evicted_order and not pool.contains(key(name))]
        assert len(gone) == 1
        evicted_order.extend(gone)
        assert slot == slots[gone[0]]  # the victim's slot is the one handed out
        assert pool.publish(slot, key(new))
        pool.release(slot)
    assert evicted_order == ["b", "c", "a"]
    assert pool.stats()["evictions"] == 3


def test_contains_does_not_refresh_recency():
    pool = make_pool(2)
    put(pool, "a")
    put(pool, "b")
    assert pool.contains(key("a"))
    slot = pool.reserve()
    assert not pool.contains(key("a"))  # contains() is a peek, "a" was still the oldest
    assert pool.contains(key("b"))
    pool.release(slot)


def test_a_referenced_slot_is_never_evicted():
    pool = make_pool(3)
    for name in "abc":
        put(pool, name, value=float(ord(name)))
    held = pool.acquire(key("a"))  # oldest, but referenced
    # make "a" the least recent again by refreshing the others
    for name in "bc":
        pool.release(pool.acquire(key(name)))
    slot = pool.reserve()
    assert slot is not None and slot != held
    assert pool.contains(key("a"))
    assert not pool.contains(key("b"))
    pool.release(slot)
    # keep evicting: "a" survives as long as it is held
    for _ in range(5):
        slot = pool.reserve()
        assert slot is not None and slot != held
        pool.release(slot)
    assert pool.contains(key("a"))
    assert torch.all(pool.tensor(held) == float(ord("a")))
    pool.release(held)
    # once released it is evictable again
    reserved = [pool.reserve() for _ in range(3)]
    assert held in reserved
    assert not pool.contains(key("a"))


def test_reserve_fails_fast_when_every_slot_is_referenced():
    pool = make_pool(4)
    held = [pool.reserve() for _ in range(2)]  # private, unpublished
    for name in "ab":  # published and acquired
        put(pool, name)
        held.append(pool.acquire(key(name)))
    assert None not in held
    assert pool.stats()["referenced"] == 4

    start = time.perf_counter()
    results = [pool.reserve() for _ in range(1000)]
    elapsed = time.perf_counter() - start
    assert results == [None] * 1000
    assert elapsed < 0.5, f"1000 failing reserve() calls took {elapsed:.3f}s: it must not wait"
    assert pool.stats()["evictions"] == 0
    assert pool.contains(key("a")) and pool.contains(key("b"))

    pool.release(held[-1])  # "b" becomes evictable
    slot = pool.reserve()
    assert slot == held[-1]
    assert not pool.contains(key("b"))


def test_reserve_returns_none_at_once_while_another_thread_holds_everything():
    pool = make_pool(2)
    held = [pool.reserve(), pool.reserve()]
    result: list[object] = []

    def worker() -> None:
        start = time.perf_counter()
        result.append(pool.reserve())
        result.append(time.perf_counter() - start)

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join(timeout=5)
    assert not thread.is_alive()
    assert result[0] is None
    assert result[1] < 0.5
    for slot in held:
        pool.release(slot)


# -- discard -----------------------------------------------------------------------------------


def test_discard_of_an_unreferenced_chunk_frees_its_slot():
    pool = make_pool(2)
    slot_a = put(pool, "a")
    put(pool, "b")
    assert pool.discard(key("a")) is True
    assert not pool.contains(key("a"))
    assert pool.acquire(key("a")) is None
    assert pool.discard(key("a")) is False
    # the freed slot is reused without evicting "b"
    assert pool.reserve() == slot_a
    assert pool.contains(key("b"))
    assert pool.stats()["evictions"] == 0


def test_discard_of_a_referenced_chunk_keeps_the_slot_until_released():
    pool = make_pool(2)
    put(pool, "a", 5.0)
    held = pool.acquire(key("a"))
    assert pool.discard(key("a")) is True
    assert not pool.contains(key("a"))
    assert pool.stats()["chunks"] == 0

    other = pool.reserve()
    assert other is not None and other != held
    assert pool.reserve() is None  # the discarded slot is still in use by its holder
    assert torch.all(pool.tensor(held) == 5.0)  # and its bytes were not reused

    pool.release(held)
    assert pool.reserve() == held
    assert pool.stats()["evictions"] == 0


def test_discard_of_an_unknown_key_is_false():
    pool = make_pool(1)
    assert pool.discard(key("nothing")) is False


# -- pinning -----------------------------------------------------------------------------------


def test_stats_say_whether_the_slab_is_pinned():
    cuda = torch.cuda.is_available()
    pool = make_pool(2)  # pin_memory="auto": on a CPU-only torch it falls back, it does not raise
    assert pool.stats()["pinned"] is cuda
    assert pool.pinned is cuda
    assert pool.tensor(0).is_pinned() is cuda
    assert make_pool(2, pin_memory="never").stats()["pinned"] is False


def test_pin_memory_always_without_cuda_is_a_clear_error():
    if torch.cuda.is_available():  # pragma: no cover - this suite runs on CPU-only torch
        assert make_pool(1, pin_memory="always").stats()["pinned"] is True
        return
    with pytest.raises(RuntimeError, match="CUDA"):
        make_pool(1, pin_memory="always")


# -- zero-copy views ---------------------------------------------------------------------------


def test_tensor_and_buffer_views_share_memory():
    pool = make_pool(3)
    slot = pool.reserve()
    tensor, buffer = pool.tensor(slot), pool.buffer(slot)
    assert tensor.shape == LAYOUT.chunk_shape
    assert tensor.dtype == torch.bfloat16
    assert len(buffer) == SLOT
    assert not buffer.readonly

    # write through the tensor, read through the buffer
    tensor.fill_(1.0)  # bf16 1.0 is 0x3F80, little-endian bytes 80 3F
    assert bytes(buffer[:4]) == b"\x80\x3f\x80\x3f"
    assert bytes(buffer) == b"\x80\x3f" * (SLOT // 2)

    # write through the buffer, read through the tensor
    buffer[:] = b"\x00\x40" * (SLOT // 2)  # bf16 2.0
    assert torch.all(tensor == 2.0)
    buffer[0:2] = b"\x40\xc0"  # bf16 -3.0 = 0xC040
    assert float(tensor.flatten()[0]) == -3.0

    # a fresh call gives views of the same memory too
    assert pool.tensor(slot).data_ptr() == tensor.data_ptr()
    assert bytes(pool.buffer(slot)[:2]) == b"\x40\xc0"


def test_slots_do_not_overlap():
    pool = make_pool(3)
    for slot in range(3):
        pool.tensor(slot).fill_(float(slot + 1))
    for slot in range(3):
        assert torch.all(pool.tensor(slot) == float(slot + 1))
        assert bytes(pool.buffer(slot)) == bytes(pool.tensor(slot).view(torch.uint8).flatten().numpy())
    pointers = sorted(pool.tensor(slot).data_ptr() for slot in range(3))
    assert all(b - a >= SLOT for a, b in zip(pointers, pointers[1:], strict=False))


def test_fresh_pool_is_zeroed():
    pool = make_pool(2)
    assert bytes(pool.buffer(0)) == bytes(SLOT)
    assert bytes(pool.buffer(1)) == bytes(SLOT)


# -- threads -----------------------------------------------------------------------------------


def test_concurrent_use_keeps_the_pool_consistent():
    pool = make_pool(6)
    names = list(range(12))
    errors: list[BaseException] = []
    counters = {"published": 0, "rejected": 0, "hits": 0}
    counter_lock = threading.Lock()
    stop = time.perf_counter() + 1.5

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        try:
            for _ in range(3000):
                if time.perf_counter() > stop:
                    break
                name = rng.choice(names)
                action = rng.random()
                if action < 0.45:
                    slot = pool.reserve()
                    if slot is None:
                        with counter_lock:
                            counters["rejected"] += 1
                        continue
                    pool.tensor(slot).fill_(float(name))
                    published = pool.publish(slot, key(name))
                    pool.release(slot)
                    with counter_lock:
                        counters["published"] += published
                elif action < 0.95:
                    slot = pool.acquire(key(name))
                    if slot is None:
                        continue
                    # while we hold it, nobody may evict or overwrite it
                    tensor = pool.tensor(slot)
                    first = float(tensor.flatten()[0])
                    assert first == float(name), f"slot {slot} holds {first}, expected {name}"
                    if rng.random() < 0.3:
                        time.sleep(0)  # let other threads run while we hold the reference
                    assert torch.all(tensor == float(name))
                    pool.release(slot)
                    with counter_lock:
                        counters["hits"] += 1
                else:
                    pool.discard(key(name))
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    run_racing_threads(worker, 6)
    assert not errors, errors[0]
    assert counters["published"] > 0 and counters["hits"] > 0

    stats = pool.stats()
    assert stats["referenced"] == 0
    assert 0 <= stats["chunks"] <= pool.num_slots
    # every published chunk is consistent with its slot
    for name in names:
        slot = pool.acquire(key(name))
        if slot is not None:
            assert torch.all(pool.tensor(slot) == float(name))
            pool.release(slot)
    # no slot was lost: all of them can be reserved again, each exactly once
    slots = [pool.reserve() for _ in range(pool.num_slots)]
    assert None not in slots
    assert sorted(slots) == list(range(pool.num_slots))
    assert pool.reserve() is None
    assert pool.stats()["chunks"] == 0


def test_concurrent_bookkeeping_hammer_loses_no_slot_and_no_reference():
    # Only pool calls (no tensor work between them), so the threads interleave inside the pool.
    pool = make_pool(4)
    names = [key(i) for i in range(8)]
    errors: list[BaseException] = []
    held_ok = [0]

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        mine: list[int] = []
        try:
            for _ in range(20000):
                action = rng.random()
                if action < 0.3:
                    slot = pool.reserve()
                    if slot is not None:
                        pool.publish(slot, rng.choice(names))  # False if the key is taken
                        mine.append(slot)
                elif action < 0.6:
                    slot = pool.acquire(rng.choice(names))
                    if slot is not None:
                        mine.append(slot)
                elif action < 0.65:
                    pool.discard(rng.choice(names))
                elif mine:
                    pool.release(mine.pop(rng.randrange(len(mine))))
                if len(mine) > 1:  # hold at most one reference across iterations
                    pool.release(mine.pop(0))
            for slot in mine:
                pool.release(slot)
            held_ok[0] += 1
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    run_racing_threads(worker, 4)
    assert not errors, repr(errors[0])
    assert held_ok[0] == 4
    stats = pool.stats()
    assert stats["referenced"] == 0
    assert stats["chunks"] <= pool.num_slots
    slots = [pool.reserve() for _ in range(pool.num_slots)]
    assert sorted(slots) == list(range(pool.num_slots))
    assert pool.reserve() is None


# -- segments and resizing -----------------------------------------------------------------------


def make_resizable(slots: int, max_slots: int, **kwargs) -> SlabPool:
    """A resizable pool cut into 16 segments (not dram.SEGMENTS), so the arithmetic below stays small."""
    with mock.patch.object(dram, "SEGMENTS", 16):
        return SlabPool(LAYOUT, slots * SLOT, max_bytes=max_slots * SLOT, **kwargs)


def reserve_all(pool: SlabPool) -> list[int]:
    """Reserve until the pool says no; the slots it handed out."""
    slots = []
    while (slot := pool.reserve()) is not None:
        slots.append(slot)
    return slots


def check_invariants(pool: SlabPool) -> None:
    """The bookkeeping agrees with itself once nobody holds a slot."""
    stats = pool.stats()
    assert stats["referenced"] == 0
    assert all(refs == 0 for refs in pool._refs)
    published = set(pool._index.values())
    assert not published & set(pool._free), "a slot is both free and published"
    assert len(pool._free) == len(set(pool._free)), "a slot is free twice"
    assert all(slot < pool.num_slots for slot in published | set(pool._free))
    assert all(pool._key_of[slot] == key for key, slot in pool._index.items())
    assert stats["chunks"] <= pool.num_slots
    # nothing held: no segment is left retiring, and every usable slot is free or published
    assert stats["segments"] == -(-pool.num_slots // pool.seg_slots)
    assert len(published) + len(pool._free) == pool.num_slots


def test_max_bytes_below_capacity_is_an_error():
    with pytest.raises(ValueError, match="max_bytes must be at least capacity_bytes"):
        SlabPool(LAYOUT, 4 * SLOT, max_bytes=3 * SLOT)


def test_default_pool_is_one_segment_that_does_not_resize():
    pool = make_pool(5)
    assert pool.seg_slots == 5 and pool.max_slots == 5 and pool.max_bytes == 5 * SLOT
    stats = pool.stats()
    assert stats["segments"] == 1
    assert stats["capacity_bytes"] == stats["max_bytes"] == 5 * SLOT
    assert stats["resize_evictions"] == 0
    for name in "abcde":
        put(pool, name)
    # one segment is the floor and the ceiling: any resize leaves the pool as it was
    assert pool.resize(SLOT) == 5
    assert pool.resize(100 * SLOT) == 5
    assert all(pool.contains(key(name)) for name in "abcde")
    assert pool.stats()["segments"] == 1
    assert pool.stats()["resize_evictions"] == 0


def test_capacity_rounds_up_to_whole_segments():
    pool = make_resizable(5, 64)  # 16 segments of 4 slots
    assert pool.seg_slots == 4
    assert pool.num_slots == 8
    assert pool.capacity_bytes == 8 * SLOT
    assert pool.stats()["segments"] == 2
    assert pool.resize(9 * SLOT) == 12
    assert pool.resize(12 * SLOT) == 12  # the current size: nothing changes
    assert pool.stats()["segments"] == 3


def test_the_last_segment_may_be_shorter():
    pool = make_resizable(1, 100)  # 6 slots a segment: 16 of them, then one of 4
    assert pool.seg_slots == 6
    assert pool.resize(1000 * SLOT) == 100
    assert pool.stats()["segments"] == 17
    assert sorted(reserve_all(pool)) == list(range(100))


def test_resize_clamps_to_one_segment_and_to_max_bytes():
    pool = make_resizable(16, 64)
    assert pool.resize(0) == 4
    assert pool.resize(-5) == 4
    assert pool.resize(SLOT // 2) == 4
    assert pool.stats()["segments"] == 1
    assert pool.resize(1 << 40) == 64
    assert pool.max_slots == 64
    assert pool.stats()["segments"] == 16


def test_grow_fits_more_chunks_without_evictions():
    pool = make_resizable(4, 64)
    slots = {name: put(pool, name, float(name)) for name in range(4)}
    assert pool.resize(16 * SLOT) == 16
    stats = pool.stats()
    assert stats["slots"] == 16
    assert stats["capacity_bytes"] == 16 * SLOT
    assert stats["segments"] == 4
    for name in range(4, 16):
        put(pool, name, float(name))
    assert pool.stats()["evictions"] == 0
    assert pool.stats()["chunks"] == 16
    for name in range(16):
        slot = pool.acquire(key(name))
        assert slot is not None
        assert name >= 4 or slot == slots[name]  # the old chunks kept their slot ids
        assert torch.all(pool.tensor(slot) == float(name))
        pool.release(slot)
    put(pool, 16)  # full now: LRU eviction as before
    assert pool.stats()["evictions"] == 1


def test_reserve_fills_the_pool_from_the_lowest_slots():
    pool = make_resizable(16, 64)
    assert [pool.reserve() for _ in range(16)] == list(range(16))


def test_shrink_drops_the_chunks_of_retired_segments():
    pool = make_resizable(16, 64)
    slots = {name: put(pool, name, float(name)) for name in range(16)}
    assert pool.resize(4 * SLOT) == 4
    stats = pool.stats()
    assert stats["slots"] == 4
    assert stats["capacity_bytes"] == 4 * SLOT
    assert stats["segments"] == 1
    assert stats["chunks"] == 4
    assert stats["resize_evictions"] == 12
    assert stats["evictions"] == 0
    for name, slot in slots.items():
        if slot < 4:
            got = pool.acquire(key(name))
            assert got == slot and torch.all(pool.tensor(got) == float(name))
            pool.release(got)
        else:
            assert not pool.contains(key(name))
            assert pool.acquire(key(name)) is None
            assert pool.discard(key(name)) is False
    # reserve only hands out the remaining segment's slots, evicting there
    reserved = reserve_all(pool)
    assert sorted(reserved) == [0, 1, 2, 3]
    assert pool.stats()["evictions"] == 4
    with pytest.raises(IndexError):
        pool.tensor(40)  # its segment is gone
    for slot in reserved:
        pool.release(slot)
    check_invariants(pool)


def test_shrink_keeps_a_held_slot_valid_until_its_release():
    pool = make_resizable(16, 64)
    for name in range(16):
        put(pool, name, float(name))
    held = pool.acquire(key(14))  # in the last segment
    private = pool.reserve()  # evicts the oldest chunk, 0, and gets its slot
    assert held == 14 and private == 0
    pool.tensor(private).fill_(-1.0)

    assert pool.resize(8 * SLOT) == 8
    stats = pool.stats()
    assert stats["segments"] == 3  # two usable, the held one retiring
    assert stats["referenced"] == 2
    assert stats["resize_evictions"] == 8  # chunks 8..15, the held 14 included: it is no longer findable
    assert not pool.contains(key(14)) and pool.acquire(key(14)) is None
    # the holder still reads its data, through new and old views alike
    assert torch.all(pool.tensor(held) == 14.0)
    assert bytes(pool.buffer(held)) == bytes(pool.tensor(held).view(torch.uint8).flatten().numpy())
    pool.retain(held)
    pool.release(held)

    reserved = reserve_all(pool)
    assert held not in reserved and all(slot < 8 for slot in reserved)
    assert private not in reserved
    pool.release(held)  # the last reference: the retired segment goes
    assert pool.stats()["segments"] == 2
    assert pool.stats()["referenced"] == len(reserved) + 1
    with pytest.raises(IndexError):
        pool.buffer(held)
    for slot in [*reserved, private]:
        pool.release(slot)
    check_invariants(pool)
    assert held not in reserve_all(pool)


def test_a_slot_published_after_its_segment_retired_is_dropped_not_indexed():
    pool = make_resizable(8, 64)
    for name in range(7):
        put(pool, name)
    slot = pool.reserve()
    assert slot == 7
    pool.resize(4 * SLOT)
    pool.tensor(slot).fill_(1.0)
    assert pool.publish(slot, key("late")) is True  # taken, so the caller still cascades it
    assert not pool.contains(key("late"))
    assert pool.stats()["resize_evictions"] == 4
    pool.release(slot)
    assert pool.stats()["segments"] == 1
    check_invariants(pool)


def test_grow_after_shrink_reuses_a_retiring_segment_and_reallocates_freed_ones():
    pool = make_resizable(16, 64)
    for name in range(16):
        put(pool, name, float(name))
    held = pool.acquire(key(13))
    pool.resize(4 * SLOT)
    assert pool.stats()["segments"] == 2  # segment 3 waits for its holder
    segment = pool._segments[3]
    assert pool.resize(16 * SLOT) == 16
    assert pool._segments[3] is segment  # un-retired, not reallocated
    assert pool.stats()["segments"] == 4
    assert torch.all(pool.tensor(held) == 13.0)  # still the holder's data

    assert bytes(pool.buffer(5)) == bytes(SLOT)  # a reallocated segment comes back zeroed
    reserved = reserve_all(pool)
    assert held not in reserved
    assert sorted(reserved + [held]) == list(range(16))
    assert pool.stats()["evictions"] == 4  # the chunks kept in segment 0, once the free slots ran out
    for name, slot in enumerate(reserved):
        pool.tensor(slot).fill_(float(name))
        assert pool.publish(slot, key(("new", name)))
        pool.release(slot)
    pool.release(held)
    assert pool.stats()["chunks"] == 15
    held_again = pool.reserve()  # the free slot comes first, nothing evicted
    assert held_again == held and pool.stats()["evictions"] == 4
    pool.release(held_again)
    check_invariants(pool)


def rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_shrinking_gives_the_memory_back():
    layout = KVLayout(num_layers=2, num_kv_heads=8, head_dim=128, chunk_tokens=16)  # 128 KiB chunks
    max_bytes = 256 << 20
    pool = SlabPool(layout, max_bytes, pin_memory="never", max_bytes=max_bytes)
    slots = reserve_all(pool)
    last = slots.pop()
    assert last == pool.max_slots - 1
    pool.tensor(last).fill_(1.0)
    for slot in slots:
        pool.release(slot)

    before = rss_bytes()
    assert pool.resize(0) == pool.seg_slots
    assert pool.stats()["segments"] == 2  # the last segment waits for its holder
    pool.release(last)
    assert pool.stats()["segments"] == 1
    freed = max_bytes - pool.capacity_bytes
    after = rss_bytes()
    assert before - after >= freed // 2, f"RSS dropped by {(before - after) >> 20} MiB, {freed >> 20} MiB were freed"

    assert pool.resize(max_bytes) == pool.max_slots  # and it comes back, pre-touched
    assert rss_bytes() - after >= freed // 2
    assert sorted(reserve_all(pool)) == list(range(pool.max_slots))


def test_resizing_while_other_threads_use_the_pool_keeps_it_consistent():
    pool = make_resizable(16, 64)  # 16 segments of 4 slots
    names = list(range(40))
    errors: list[BaseException] = []
    counters = {"published": 0, "hits": 0, "resizes": 0}
    counter_lock = threading.Lock()
    # Until enough has happened, not for a while: a loaded machine runs the threads longer, never less.
    done, deadline = threading.Event(), time.perf_counter() + 25  # within run_racing_threads' joins

    def resizer() -> None:
        rng = random.Random(-1)
        try:
            while time.perf_counter() < deadline:
                slots = pool.resize(rng.randrange(0, 70) * SLOT)
                assert 4 <= slots <= 64 and slots % 4 == 0
                with counter_lock:
                    counters["resizes"] += 1
                    enough = counters["resizes"] >= 500 and counters["published"] > 0 and counters["hits"] > 0
                if enough and pool.stats()["resize_evictions"] > 0:
                    return
                time.sleep(0)
        finally:
            done.set()

    def worker(seed: int) -> None:
        if seed == 0:
            return resizer()
        rng = random.Random(seed)
        held: list[tuple[int, float]] = []
        while not done.is_set():
            name = rng.choice(names)
            action = rng.random()
            if action < 0.4:
                slot = pool.reserve()
                if slot is None:
                    continue
                pool.tensor(slot).fill_(float(name))
                published = pool.publish(slot, key(name))
                if rng.random() < 0.3:
                    held.append((slot, float(name)))  # keep the reservation's reference a while
                else:
                    pool.release(slot)
                with counter_lock:
                    counters["published"] += published
            elif action < 0.9:
                slot = pool.acquire(key(name))
                if slot is None:
                    continue
                assert torch.all(pool.tensor(slot) == float(name)), f"slot {slot} does not hold {name}"
                held.append((slot, float(name)))
                with counter_lock:
                    counters["hits"] += 1
            else:
                pool.discard(key(name))
            while len(held) > 2 or (held and rng.random() < 0.3):
                slot, value = held.pop(0)
                # a held slot keeps its data, whatever the resizer did meanwhile
                assert torch.all(pool.tensor(slot) == value), f"held slot {slot} lost {value}"
                assert bytes(pool.buffer(slot)[:2]) == bytes(pool.tensor(slot).view(torch.uint8).flatten()[:2])
                pool.release(slot)
        for slot, _ in held:
            pool.release(slot)

    def guarded(seed: int) -> None:
        try:
            worker(seed)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    run_racing_threads(guarded, 6)
    assert not errors, repr(errors[0])
    assert counters["resizes"] >= 500 and counters["published"] > 0 and counters["hits"] > 0
    assert pool.stats()["resize_evictions"] > 0
    check_invariants(pool)
    for size in (64, 4, 64):  # it still resizes, and every usable slot can be had exactly once
        pool.resize(size * SLOT)
        check_invariants(pool)
        slots = reserve_all(pool)
        assert sorted(slots) == list(range(pool.num_slots))
        for slot in slots:
            pool.release(slot)
