"""Prefix links: each chunk's parent is recorded where it is stored, and retention removes a prefix tail first."""

from __future__ import annotations

import random
import uuid
from pathlib import Path

import pytest
import torch

from kvstore import KVLayout, KVStore, StoreConfig
from kvstore.keys import chain_parents, chunk_keys
from kvstore.storage.container import Segment, encode_header, header_records, parse_header
from kvstore.storage.links import PrefixLinks, tail_first

LAYOUT = KVLayout(num_layers=2, num_kv_heads=1, head_dim=8, chunk_tokens=16)


def test_chain_parents_name_the_chunk_before_each() -> None:
    assert chain_parents(["a", "b", "c"]) == [None, "a", "b"]
    assert chain_parents(["c", "d"], before="b") == ["b", "c"]
    assert chain_parents([]) == []


@pytest.mark.parametrize("name", [None, b"block-hash", 2**63 + 5])
def test_a_header_keeps_the_parent_beside_the_engines_name(name: bytes | int | None) -> None:
    key, parent = chunk_keys(list(range(32)), LAYOUT, "links")
    segments = [Segment(i * LAYOUT.layer_nbytes, LAYOUT.layer_nbytes, LAYOUT.layer_nbytes, 0) for i in range(2)]
    head = encode_header(LAYOUT, key, "identity", segments, name=name, parent=parent)
    assert header_records(head) == (name, parent)
    assert parse_header(head, LAYOUT, key).parent == parent
    assert header_records(encode_header(LAYOUT, key, "identity", segments, name=name)) == (name, None)


def test_a_header_without_room_for_the_records_keeps_none_and_stays_its_usual_length() -> None:
    layout = KVLayout(num_layers=125, num_kv_heads=1, head_dim=8, chunk_tokens=16)  # 38 bytes of padding short
    key, parent = chunk_keys(list(range(32)), layout, "links")
    segments = [Segment(i * layout.layer_nbytes, layout.layer_nbytes, layout.layer_nbytes, 0) for i in range(125)]
    plain = encode_header(layout, key, "identity", segments)
    head = encode_header(layout, key, "identity", segments, name=b"x" * 32, parent=parent)
    assert len(head) == len(plain)
    assert parse_header(head, layout, key).parent in (None, parent)


def forest(rng: random.Random, size: int) -> tuple[list[int], dict[int, int], dict[int, float]]:
    """Random prefixes sharing heads: each node's parent is an earlier node (or none); random recencies."""
    parents = {node: rng.randrange(node) for node in range(1, size) if rng.random() < 0.8}
    return list(range(size)), parents, {node: float(rng.randrange(20)) for node in range(size)}


@pytest.mark.parametrize("seed", range(20))
def test_tail_first_puts_every_chunk_after_all_its_descendants(seed: int) -> None:
    rng = random.Random(seed)
    nodes, parents, recency = forest(rng, 200)
    order, effective = tail_first(nodes, parents, recency)
    position = {node: index for index, node in enumerate(order)}
    assert sorted(order) == nodes
    for child, parent in parents.items():
        assert position[child] < position[parent], "a parent before its child: removing it strands the child"
        assert effective[parent] >= effective[child] >= recency[child]


def test_tail_first_survives_a_loop_and_links_out_of_the_set() -> None:
    order, _ = tail_first([1, 2, 3], {1: 2, 2: 1, 3: 99}, {1: 0.0, 2: 0.0, 3: 0.0})
    assert sorted(order) == [1, 2, 3]


def test_the_links_map_forgets_the_least_recently_noted_first() -> None:
    links = PrefixLinks(remembered=2)
    links.note("b", "a")
    links.note("c", "b")
    links.note("d", "c")
    links.note("e", None)  # nothing to note
    assert (links.parent_of("b"), links.parent_of("c"), links.parent_of("d"), len(links)) == (None, "b", "c", 2)


async def test_every_tier_records_the_parent_and_a_promotion_carries_it_on(tmp_path: Path, redis_server) -> None:
    """A chunk put with its parent has it in its disk and Redis headers; a store that reads it back from Redis
    (its disk copy gone) notes the parent and writes it into the disk copy the promotion makes."""
    config = StoreConfig(
        dram={"capacity": 16 * LAYOUT.chunk_nbytes, "pin_memory": "never"},
        disk={"path": tmp_path / "disk"},
        redis={"enabled": True, "url": redis_server.url, "prefix": f"links-{uuid.uuid4().hex[:8]}"},
    )
    chunk = torch.ones(LAYOUT.chunk_shape, dtype=LAYOUT.dtype)
    async with KVStore(config, LAYOUT, "links") as store:
        keys = store.chunk_keys(list(range(3 * LAYOUT.chunk_tokens)))
        assert all(await store.put_many(keys, [chunk] * 3, parents=chain_parents(keys)))
        await store.flush()
        disk, redis = store.tiers
        for key, parent in zip(keys, chain_parents(keys), strict=True):
            head = await redis.backend.get(key, (0, 4096))
            assert header_records(head).parent == parent
            assert header_records(disk.backend.path_for(key).read_bytes()[:4096]).parent == parent
        for key in keys:
            await disk.backend.delete(key)
    async with KVStore(config, LAYOUT, "links") as store:  # a restart: nothing in DRAM, nothing noted
        assert all(result is not None for result in await store.get_many(keys))
        await store.flush()
        disk = store.tiers[0]
        for key, parent in zip(keys, chain_parents(keys), strict=True):
            assert header_records(disk.backend.path_for(key).read_bytes()[:4096]).parent == parent
