"""Admission policies: which chunk put is written to which tier below DRAM, and when (kvstore.admission).

Each policy alone, then through the store's public API: what a fresh store finds on the disk after
the first one closed is what the policy wrote there.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from pathlib import Path
from typing import get_args

import pytest
import torch

from kvstore import KVLayout, KVStore, StoreConfig
from kvstore.admission import (
    POLICIES,
    AdmissionName,
    AdmissionPolicy,
    HeldBack,
    SecondSighting,
    WriteThrough,
    make_admission,
)
from kvstore.admission.base import T
from kvstore.codecs import make_codec
from kvstore.errors import ConfigError
from kvstore.keys import ChunkKey
from kvstore.sizing.adaptive import make_tracker
from kvstore.storage.tier import ChunkTier
from kvstore.testing.memory import MemoryBackend

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=16, chunk_tokens=16)
KEYS = [hashlib.sha256(bytes([i])).hexdigest() for i in range(8)]  # ChunkKeys: as spread as real ones


def chunks(n: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(n)
    return [torch.randn(LAYOUT.chunk_shape, generator=generator).to(LAYOUT.dtype) for _ in range(n)]


def config(tmp_path: Path, policy: str, **adaptive: object) -> StoreConfig:
    return StoreConfig(
        dram={"capacity": 16 * LAYOUT.chunk_nbytes},
        disk={"path": tmp_path / "disk"},
        timeouts={"get": 2.0, "put": 2.0, "close": 2.0},
        adaptive={"policy": policy, **adaptive},
    )


async def on_disk(tmp_path: Path, keys: Sequence[ChunkKey]) -> list[bool]:
    """Which of ``keys`` a fresh store (its DRAM empty) finds: what the policy wrote to the disk."""
    async with KVStore(config(tmp_path, "write-through", track=False), LAYOUT, "admission") as fresh:
        return [await fresh.lookup([key]) == 1 for key in keys]


# -- the policies alone ----------------------------------------------------------------------------


def test_the_registry_and_the_config_literal_name_the_same_policies() -> None:
    assert get_args(AdmissionName) == tuple(POLICIES) == ("write-through", "second-sighting")
    assert {policy.name for policy in (WriteThrough, SecondSighting)} == set(POLICIES)
    with pytest.raises(
        ValueError, match="unknown admission policy 'lru'; choose one of: write-through, second-sighting"
    ):
        make_admission("lru", HeldBack(16))
    with pytest.raises(ConfigError, match=r"adaptive\.policy = 'always'"):
        StoreConfig(adaptive={"policy": "always"})
    assert StoreConfig().adaptive.policy == "write-through"


def test_write_through_admits_every_tier_without_asking_for_sightings() -> None:
    asked: list[ChunkKey] = []

    def seen_before(key: ChunkKey) -> bool:
        asked.append(key)
        return False

    policy = make_admission("write-through", HeldBack[str](16), seen_before)
    assert policy.admit(KEYS[0], ["disk", "redis"]) == ["disk", "redis"]
    assert asked == [] and not WriteThrough.uses_sightings


def test_second_sighting_holds_back_a_first_sighting_only() -> None:
    seen = {KEYS[1]}
    policy = make_admission("second-sighting", HeldBack[str](16), seen.__contains__)
    assert isinstance(policy, SecondSighting) and SecondSighting.uses_sightings
    assert policy.admit(KEYS[0], ["disk", "redis"]) == []
    assert policy.admit(KEYS[1], ["disk", "redis"]) == ["disk", "redis"]
    assert policy.admit(KEYS[0], []) == []  # nothing below: nothing held back


def test_a_held_back_chunk_is_released_once_to_the_tiers_it_was_held_back_from() -> None:
    policy = make_admission("second-sighting", HeldBack[str](16), lambda key: False)
    assert not policy.holding and policy.sighted(KEYS[0]) == ()
    policy.hold(KEYS[0], ["redis"])
    assert policy.holding
    assert policy.sighted(KEYS[1]) == ()
    assert policy.sighted(KEYS[0]) == ("redis",)
    assert policy.sighted(KEYS[0]) == ()  # once
    assert policy.counters() == {"held_back": 1, "released": 1}


def test_held_back_chunks_are_bounded_oldest_first() -> None:
    held: HeldBack[str] = HeldBack(16)
    for i in range(20):
        held.add(f"{i:064x}", ["disk"])
    assert len(held) == 16 and held.held_back == 20
    assert held.take(f"{0:064x}") == ()  # forgotten
    assert held.take(f"{19:064x}") == ("disk",)


def test_a_policy_that_reads_sightings_makes_the_store_track_lookups() -> None:
    for name, policy in POLICIES.items():
        settings = StoreConfig(adaptive={"policy": name, "track": False}).adaptive
        tracker = make_tracker(settings, LAYOUT, "admission", 1 << 20)
        assert (tracker is not None) == policy.uses_sightings


# -- through the store -----------------------------------------------------------------------------


async def test_write_through_writes_every_put_below_dram(tmp_path: Path) -> None:
    async with KVStore(config(tmp_path, "write-through"), LAYOUT, "admission") as store:
        assert await store.lookup(KEYS[:2]) == 0
        assert all(await store.put_many(KEYS[:2], chunks(2)))
        await store.flush()
        adaptive = store.stats()["adaptive"]
    assert (adaptive["policy"], adaptive["held_back"], adaptive["released"]) == ("write-through", 0, 0)
    assert await on_disk(tmp_path, KEYS[:2]) == [True, True]


async def test_second_sighting_writes_a_first_sighting_to_dram_only_until_a_dram_hit(tmp_path: Path) -> None:
    async with KVStore(config(tmp_path, "second-sighting"), LAYOUT, "admission") as store:
        assert await store.lookup(KEYS[:3]) == 0  # their first sighting
        assert all(await store.put_many(KEYS[:3], chunks(3)))
        await store.flush()
        assert store.stats()["adaptive"]["held_back"] == 3
        assert await store.get(KEYS[0]) is not None  # a DRAM hit: its second sighting sends it below
        await store.flush()
        adaptive = store.stats()["adaptive"]
    assert (adaptive["policy"], adaptive["held_back"], adaptive["released"]) == ("second-sighting", 3, 1)
    assert await on_disk(tmp_path, KEYS[:3]) == [True, False, False]


async def test_second_sighting_writes_a_prefix_looked_up_before_at_once(tmp_path: Path) -> None:
    async with KVStore(config(tmp_path, "second-sighting"), LAYOUT, "admission") as store:
        assert await store.lookup(KEYS[:2]) == 0
        assert await store.lookup(KEYS[:2]) == 0  # seen before now
        assert all(await store.put_many(KEYS[:2], chunks(2)))
        await store.flush()
        assert store.stats()["adaptive"]["held_back"] == 0
    assert await on_disk(tmp_path, KEYS[:2]) == [True, True]


async def test_a_policy_switch_keeps_the_chunks_held_back_so_far(tmp_path: Path) -> None:
    """Auto mode assigns ``store.policy``: the new policy admits by its rule and still releases the old holds."""
    async with KVStore(config(tmp_path, "second-sighting"), LAYOUT, "admission") as store:
        await store.lookup(KEYS[:1])
        assert await store.put(KEYS[0], chunks(1)[0])
        store.policy = "write-through"
        assert await store.put(KEYS[1], chunks(2)[1])  # never looked up: written through all the same
        assert await store.get(KEYS[0]) is not None  # released by the policy now in force
        await store.flush()
        adaptive = store.stats()["adaptive"]
    assert (adaptive["policy"], adaptive["held_back"], adaptive["released"]) == ("write-through", 1, 1)
    assert await on_disk(tmp_path, KEYS[:2]) == [True, True]


class FirstTierOnly(AdmissionPolicy[T]):
    """Writes the fastest tier below DRAM now and holds the others back (no built-in policy does)."""

    name = "first-tier-only"
    uses_sightings = False

    def admit(self, key: ChunkKey, below: Sequence[T]) -> Sequence[T]:
        return below[:1]


class Near(MemoryBackend):
    name = "near"


class Far(MemoryBackend):
    name = "far"


async def test_the_store_writes_a_held_back_chunk_to_the_tiers_it_skipped_only(tmp_path: Path) -> None:
    """The contract is per tier: a policy that admits a subset has the rest written at the chunk's DRAM hit."""
    near, far = Near(), Far()
    tiers = [ChunkTier(backend, make_codec("bytesplit"), LAYOUT, executor=None) for backend in (near, far)]
    async with KVStore(config(tmp_path, "write-through"), LAYOUT, "admission", tiers=tiers) as store:
        store._admission = FirstTierOnly(store._admission.held_back)  # no config name: installed by hand
        assert all(await store.put_many(KEYS[:2], chunks(2)))
        await store.flush()
        assert (len(near.objects), len(far.objects)) == (2, 0)
        near_writes = store.stats()["near"]["writes"]
        assert await store.get(KEYS[1]) is not None
        await store.flush()
        assert store.stats()["near"]["writes"] == near_writes  # not written to the near tier again
        assert len(far.objects) == 1 and store.stats()["adaptive"]["released"] == 1
