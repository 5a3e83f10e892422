"""Eviction policies: the contract every policy keeps, scan resistance on the real DRAM pool and disk budget, config."""

from __future__ import annotations

import asyncio
import hashlib
import math
import random
from pathlib import Path
from typing import get_args

import numpy as np
import pytest
import torch

from benchmarks import eviction as bench_eviction
from kvstore.backends.disk import DiskBackend
from kvstore.config import StoreConfig
from kvstore.engine.dram import SlabPool
from kvstore.engine.store import KVStore
from kvstore.errors import ConfigError
from kvstore.eviction import POLICIES, EvictionName, make_policy
from kvstore.layout import KVLayout

LAYOUT = KVLayout(num_layers=1, num_kv_heads=1, head_dim=8, chunk_tokens=16)
SCAN_RESISTANT = [name for name, policy in POLICIES.items() if policy.scan_resistant]


def key(name: object) -> str:
    return hashlib.sha256(str(name).encode()).hexdigest()


# -- the contract, for every policy --------------------------------------------------------------


@pytest.mark.parametrize("name", list(POLICIES))
def test_evict_returns_a_cached_key_and_forgets_it(name: str) -> None:
    policy = make_policy(name, 4)
    assert policy.evict() is None
    for item in "abcd":
        policy.insert(item)
    victim = policy.evict()
    assert victim in set("abcd") and victim not in policy and len(policy) == 3


@pytest.mark.parametrize("name", list(POLICIES))
def test_held_keys_are_never_evicted_and_stay_cached(name: str) -> None:
    policy = make_policy(name, 4)
    for item in "abcd":
        policy.insert(item)
    policy.touch("c")
    held = {"a", "b", "c"}
    assert policy.evict(lambda k: k in held) == "d"
    assert policy.evict(lambda k: k in held) is None  # only held keys left
    assert all(item in policy for item in held) and len(policy) == 3


@pytest.mark.parametrize("name", list(POLICIES))
def test_remove_forgets_and_unknown_keys_are_ignored(name: str) -> None:
    policy = make_policy(name, 4)
    policy.insert("a")
    policy.insert("b")
    policy.touch("a")
    policy.remove("a")
    policy.remove("never")
    policy.touch("never")
    assert "a" not in policy and len(policy) == 1 and policy.evict() == "b" and policy.evict() is None


@pytest.mark.parametrize("name", list(POLICIES))
def test_inserting_a_cached_key_again_keeps_one_entry(name: str) -> None:
    policy = make_policy(name, 4)
    policy.insert("a", 10)
    policy.insert("a", 20)
    assert len(policy) == 1 and policy.evict() == "a" and policy.evict() is None


@pytest.mark.parametrize("name", list(POLICIES))
def test_random_operations_agree_with_a_plain_set(name: str) -> None:
    """Whatever the order of calls, the policy caches exactly the keys inserted and not yet removed or evicted."""
    rng = random.Random(name)
    capacity = 16
    policy = make_policy(name, capacity)
    cached: set[int] = set()
    for _ in range(3000):
        item, action = rng.randrange(64), rng.random()
        if action < 0.5:
            if item not in cached and len(cached) >= capacity:
                held = set(rng.sample(sorted(cached), 4))
                victim = policy.evict(lambda k, held=held: k in held)
                assert victim in cached and victim not in held
                cached.discard(victim)
            policy.insert(item, rng.randrange(1, 4))
            cached.add(item)
        elif action < 0.8:
            policy.touch(item)
        elif action < 0.9:
            policy.remove(item)
            cached.discard(item)
        else:
            policy.resize(rng.randrange(8, 32))
            policy.resize(capacity)
        assert len(policy) == len(cached) and all(k in policy for k in cached)


def test_lru_evicts_least_recently_used_first_stepping_over_held_keys_in_place() -> None:
    policy = make_policy("lru", 4)
    for item in "abcd":
        policy.insert(item)
    policy.touch("a")  # order now b c d a
    assert policy.evict(lambda k: k == "b") == "c"
    assert policy.evict() == "b"  # b kept its place while held
    assert [policy.evict(), policy.evict(), policy.evict()] == ["d", "a", None]


def replay_scan(name: str, capacity: int, scan: int) -> set[str]:
    """Insert a reused prefix (each key hit once), then a scan of one-off keys; the prefix keys still cached."""
    policy = make_policy(name, capacity)
    prefix = [f"prefix{i}" for i in range(capacity // 4)]
    for item in prefix:
        policy.insert(item)
    for item in prefix:
        policy.touch(item)
    for i in range(scan):
        if len(policy) >= capacity:
            policy.evict()
        policy.insert(f"scan{i}")
    return {item for item in prefix if item in policy}


@pytest.mark.parametrize("name", SCAN_RESISTANT)
def test_a_scan_resistant_policy_keeps_a_reused_prefix_through_a_scan_that_flushes_lru(name: str) -> None:
    assert replay_scan("lru", 40, scan=200) == set()
    assert len(replay_scan(name, 40, scan=200)) == 10


def test_the_registry_and_the_config_literal_name_the_same_policies() -> None:
    assert set(get_args(EvictionName)) == set(POLICIES)
    assert SCAN_RESISTANT  # at least one policy a RAG burst cannot flush
    with pytest.raises(ValueError, match="unknown eviction policy 'lfu'; choose one of: lru, s3fifo, arc"):
        make_policy("lfu", 4)


# -- the DRAM pool -------------------------------------------------------------------------------


def put(pool: SlabPool, name: object) -> None:
    slot = pool.reserve()
    assert slot is not None
    assert pool.publish(slot, key(name))
    pool.release(slot)


def hit(pool: SlabPool, name: object) -> None:
    slot = pool.acquire(key(name))
    assert slot is not None
    pool.release(slot)


@pytest.mark.parametrize("name", ["lru", *SCAN_RESISTANT])
def test_the_dram_pool_evicts_through_its_policy(name: str) -> None:
    pool = SlabPool(LAYOUT, 16 * LAYOUT.chunk_nbytes, pin_memory="never", eviction=name)
    for i in range(4):
        put(pool, f"prefix{i}")
    for i in range(4):
        hit(pool, f"prefix{i}")
    for i in range(64):  # a burst of one-off chunks, four times the pool
        put(pool, f"scan{i}")
    kept = sum(pool.contains(key(f"prefix{i}")) for i in range(4))
    assert pool.eviction == name and pool.stats()["eviction"] == name
    assert kept == (0 if name == "lru" else 4)


@pytest.mark.parametrize("name", list(POLICIES))
def test_the_dram_pool_never_evicts_a_referenced_slot_and_fails_fast_when_all_are(name: str) -> None:
    pool = SlabPool(LAYOUT, 4 * LAYOUT.chunk_nbytes, pin_memory="never", eviction=name)
    for i in range(4):
        put(pool, i)
    held = [pool.acquire(key(i)) for i in range(3)]
    put(pool, "new")  # only chunk 3 is free to go
    assert all(pool.contains(key(i)) for i in range(3)) and not pool.contains(key(3))
    held.append(pool.acquire(key("new")))
    assert pool.reserve() is None
    for slot in held:
        assert slot is not None
        pool.release(slot)
    assert pool.reserve() is not None


def test_a_shrink_drops_chunks_from_the_pools_policy_too() -> None:
    pool = SlabPool(LAYOUT, 64 * LAYOUT.chunk_nbytes, pin_memory="never", max_bytes=64 * LAYOUT.chunk_nbytes)
    for i in range(64):
        put(pool, i)
    pool.resize(8 * LAYOUT.chunk_nbytes)
    for i in range(64, 200):
        put(pool, i)  # evicts only chunks the pool still has: a dropped one would raise KeyError
    assert pool.stats()["chunks"] == pool.num_slots


# -- the disk budget -----------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["lru", *SCAN_RESISTANT])
async def test_the_disk_budget_evicts_through_its_policy(tmp_path: Path, name: str) -> None:
    size = 1000
    backend = DiskBackend(tmp_path, 40 * size, eviction=name)
    await backend.open()
    prefix = [key(f"prefix{i}") for i in range(4)]
    for item in prefix:
        backend.write(item, [b"p" * size])
    for item in prefix:
        assert backend.read(item) == b"p" * size  # a hit
    for i in range(200):  # one-off documents, five times the budget
        backend.write(key(f"scan{i}"), [b"s" * size])
    kept = [item for item in prefix if backend.path_for(item).exists()]
    assert backend.stats()["eviction"] == name and backend.stats()["bytes_used"] <= 40 * size
    assert len(kept) == (0 if name == "lru" else 4)
    await backend.close()


async def test_the_disk_budget_evicts_by_bytes_with_files_of_different_sizes(tmp_path: Path) -> None:
    backend = DiskBackend(tmp_path, 10_000, eviction="s3fifo")
    await backend.open()
    rng = random.Random(0)
    for i in range(100):
        backend.write(key(i), [b"x" * rng.randrange(100, 3000)])
        files = sum(path.stat().st_size for path in tmp_path.rglob("*.kvc"))
        assert files == backend.stats()["bytes_used"] <= 10_000
    await backend.close()


# -- config and the store ------------------------------------------------------------------------


@pytest.mark.parametrize("section", ["dram", "disk"])
def test_an_unknown_policy_is_a_config_error_naming_the_key_and_the_choices(section: str) -> None:
    with pytest.raises(ConfigError, match=rf"{section}\.eviction = 'lfu'.*'lru', 's3fifo' or 'arc'"):
        StoreConfig(**{section: {"eviction": "lfu"}})
    assert getattr(StoreConfig(), section).eviction == "lru"


async def test_the_store_evicts_dram_and_disk_by_the_configured_policies(tmp_path: Path) -> None:
    config = StoreConfig(
        dram={"capacity": 8 * LAYOUT.chunk_nbytes, "pin_memory": "never", "eviction": "s3fifo"},
        disk={"path": tmp_path, "eviction": "arc"},
    )
    chunk = torch.zeros(LAYOUT.chunk_shape, dtype=LAYOUT.dtype)
    async with KVStore(config, LAYOUT, "eviction") as store:
        disk = next(tier for tier in store.tiers if tier.name == "disk")
        assert store.pool.eviction == "s3fifo" and disk.stats_dict()["eviction"] == "arc"
        prefix = [key(f"prefix{i}") for i in range(2)]
        for item in prefix:
            await store.put(item, chunk)
        assert all(result is not None for result in await store.get_many(prefix))
        for i in range(32):
            await store.put(key(f"scan{i}"), chunk)
            await store.flush()  # its write to disk done: no slot is held when the next put evicts
        assert all(store.pool.contains(item) for item in prefix)


def test_a_replay_through_the_store_hits_as_the_simulation_of_its_policy() -> None:
    chains = bench_eviction.prefixes_with_scans(120, burst=20, every=20)
    for name in ("lru", "s3fifo"):
        simulated = bench_eviction.simulate(chains, name, 60)
        assert simulated.usable > 0 and simulated.hits >= simulated.usable
        assert asyncio.run(bench_eviction.replay_store(chains, name, 60)) == simulated


# -- a prefix goes tail first ------------------------------------------------------------------------


def test_a_full_pool_drops_a_prefix_tail_first_after_its_put_and_its_load(tmp_path: Path) -> None:
    """A prefix put in one batch, then loaded in one batch: each time its tail is the least recent of it, so the
    pool evicts chunk 2 (then 1), never chunk 0 while keeping the rest: the part left is one a lookup reaches."""

    async def scenario() -> tuple[bool, int]:
        config = StoreConfig(dram={"capacity": 4 * LAYOUT.chunk_nbytes, "pin_memory": "never"}, disk={"enabled": False})
        chunk = torch.zeros(LAYOUT.chunk_shape, dtype=LAYOUT.dtype)
        async with KVStore(config, LAYOUT, "eviction") as store:
            prefix = store.chunk_keys(list(range(3 * LAYOUT.chunk_tokens)))
            await store.put(key("older"), chunk)
            assert all(await store.put_many(prefix, [chunk] * 3))
            await store.put(key("new0"), chunk)  # evicts "older": the prefix is more recent
            await store.put(key("new1"), chunk)  # evicts the prefix's tail
            after_put = [store.pool.contains(item) for item in prefix]
            assert all(result is not None for result in await store.get_many(prefix[:2]))  # loaded again
            await store.put(key("new2"), chunk)  # evicts new0, the least recent
            await store.put(key("new3"), chunk)  # evicts new1
            await store.put(key("new4"), chunk)  # then the prefix's tail again: chunk 1
            return after_put == [True, True, False], await store.lookup(prefix)

    tail_went_first, reachable = asyncio.run(scenario())
    assert tail_went_first, "the pool evicted the prefix's head (or middle) before its tail"
    assert reachable == 1


async def test_the_disk_budget_drops_a_prefix_tail_first_after_a_batch_read(tmp_path: Path) -> None:
    """A prefix read from disk in one batch (``get_many``, in parallel slices) is told to the budget's policy tail
    first once the batch is in: its head is the most recent of them, so a full budget deletes its tail first."""
    config = StoreConfig(dram={"capacity": 8 * LAYOUT.chunk_nbytes, "pin_memory": "never"}, disk={"path": tmp_path})
    chunk = torch.zeros(LAYOUT.chunk_shape, dtype=LAYOUT.dtype)
    async with KVStore(config, LAYOUT, "eviction") as store:
        prefix = store.chunk_keys(list(range(3 * LAYOUT.chunk_tokens)))
        for item in prefix:  # written head first, one at a time: the head is the oldest file
            assert await store.put(item, chunk)
            await store.flush()
        tier = store.tiers[0]
        budget = tier.backend._budget
        budget.capacity = 4 * tier.backend.path_for(prefix[0]).stat().st_size  # room for four files
        for item in prefix:
            store.pool.discard(item)
        assert all(result is not None for result in await store.get_many(prefix))  # one batch, from disk
        for name in ("new0", "new1"):
            assert await store.put(key(name), chunk)
            await store.flush()
        on_disk = [tier.backend.path_for(item).exists() for item in prefix]
    assert on_disk == [True, True, False], "the disk budget deleted the prefix's head before its tail"


def test_tail_first_usable_hits_beat_head_first_on_prefix_traffic() -> None:
    """What the order buys: with LRU on shared prefixes, more of the chunks found are a leading run an engine uses."""
    chains = bench_eviction.prefixes_with_scans(600, burst=20, every=50)
    size = bench_eviction.sizes_for(chains, (0.05,))[0]
    tail_first = bench_eviction.simulate(chains, "lru", size)
    head_first = bench_eviction.simulate(chains, "lru", size, tail_first=False)
    assert tail_first.usable > head_first.usable


# -- the vendored public trace -------------------------------------------------------------------


def test_the_vendored_mooncake_slice_reads_back_as_published() -> None:
    """Each request has ceil(input_length / 512) block ids, and ids come in order of first use, as in the source."""
    requests = bench_eviction.read_mooncake()
    assert len(requests) == 328
    largest = -1
    for _, input_length, ids in requests:
        assert len(ids) == math.ceil(input_length / bench_eviction.MOONCAKE_BLOCK_TOKENS)
        for block in ids:
            assert block <= largest + 1
            largest = max(largest, block)
    chains = bench_eviction.mooncake_chains()
    assert sum(len(c) for c in chains) == 9390 and len(np.unique(np.concatenate(chains))) == 8365
