"""Layer streams promote: a chunk streamed from a slower tier is put in DRAM and
queued for the faster tiers behind the stream, so an engine (whose connectors load only through
streams) does not fetch the same prefix from S3 again. Only a chunk read whole and verified is
promoted; no DRAM slot or a full queue drops the promotion and counts it. Streams stage in at most
half the pool across all of them: puts go on while they run."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest
import torch
from support import TEST_BUCKET
from test_prefetch import LAYOUT, chunk, config, expected_layer, fill, keys_of, same
from test_prefetch_failed_chunk import flip_layer

from kvstore import KVStore, StoreConfig
from kvstore.errors import PrefetchError


def remote_section(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch, remote: str) -> dict:
    prefix = f"promote-{uuid.uuid4().hex[:8]}"
    if remote == "redis":
        server = request.getfixturevalue("redis_server")
        return {"redis": {"enabled": True, "url": server.url, "prefix": prefix}}
    server = request.getfixturevalue("moto_server")
    for name, value in server.credentials_env().items():
        monkeypatch.setenv(name, value)
    return {"s3": {"enabled": True, "bucket": TEST_BUCKET, "prefix": prefix}}


async def stream_all(store: KVStore, keys: list[str], chunks: list[torch.Tensor]) -> None:
    """Stream every layer of ``keys`` and check each one bit-exact."""
    async for layer, kv in store.prefetch(keys, depth=2):
        assert same(kv, expected_layer(chunks, layer))


async def remote_only(tmp_path: Path, section: dict, count: int) -> tuple[list[str], list[torch.Tensor]]:
    """``count`` chunks on the remote tier only (written by a store without a disk tier)."""
    return await fill(config(tmp_path, disk={"enabled": False}, **section), count)


@pytest.mark.parametrize("remote", ["s3", "redis"])
async def test_a_prefix_streamed_from_a_remote_tier_is_streamed_from_dram_then_disk(
    tmp_path, request, monkeypatch, remote
):
    section = remote_section(request, monkeypatch, remote)
    keys, chunks = await remote_only(tmp_path, section, 3)
    cfg = config(tmp_path, **section)  # disk (empty) above the remote tier
    async with KVStore(cfg, LAYOUT, "prefetch") as store:
        await stream_all(store, keys, chunks)
        stats = store.stats()
        assert stats[remote]["hits"] == 3 and stats["disk"]["hits"] == 0 and stats["store"]["streamed_from_dram"] == 0
        assert stats["store"]["stream_promoted"] == 3 and stats["store"]["stream_promotions_dropped"] == 0
        assert all(store.pool.contains(key) for key in keys)
        read_before = stats[remote]["bytes_read"]
        await stream_all(store, keys, chunks)  # the second time: from DRAM, bit-exact
        stats = store.stats()
        assert stats["store"]["streamed_from_dram"] == 3
        assert stats[remote]["bytes_read"] == read_before and stats[remote]["hits"] == 3
        await store.flush()
        assert store.stats()["disk"]["writes"] == 3
        assert store.pool.stats()["referenced"] == 0
    async with KVStore(cfg, LAYOUT, "prefetch") as fresh:  # the same disk directory, an empty DRAM
        await stream_all(fresh, keys, chunks)
        stats = fresh.stats()
        assert stats["disk"]["hits"] == 3 and stats[remote]["hits"] == 0 and stats[remote]["bytes_read"] == 0
        assert stats["store"]["stream_promoted"] == 3, "disk chunks are promoted into DRAM"
        await fresh.flush()
        assert fresh.stats()["disk"]["writes"] == 0, "nothing is written back to the tier it came from"


async def test_promoted_chunks_are_bit_exact_in_dram(tmp_path):
    cfg = config(tmp_path)
    keys, chunks = await fill(cfg, 2)
    async with KVStore(cfg, LAYOUT, "prefetch") as store:  # empty DRAM: from disk
        shape = (LAYOUT.kv_planes, 2 * LAYOUT.chunk_tokens, LAYOUT.num_kv_heads, LAYOUT.head_dim)
        outs = [torch.zeros(shape, dtype=LAYOUT.dtype) for _ in range(LAYOUT.num_layers)]
        async for layer, kv in store.prefetch(keys, outs=outs):
            assert kv is outs[layer] and same(kv, expected_layer(chunks, layer))
        await store.flush()  # read in place into outs, the chunks are admitted to DRAM after the stream
        gets_before = store.stats()["disk"]["hits"]
        for key, kv in zip(keys, chunks, strict=True):
            got = await store.get(key)
            assert got is not None and torch.equal(got.view(torch.int16), kv.view(torch.int16))
        assert store.stats()["disk"]["hits"] == gets_before, "served from the promoted DRAM copies"


async def test_a_full_queue_drops_the_promotion_and_counts_it(tmp_path, request, monkeypatch):
    section = remote_section(request, monkeypatch, "s3")
    keys, chunks = await remote_only(tmp_path, section, 3)
    cfg = config(tmp_path, queue_depth=1, **section)
    async with KVStore(cfg, LAYOUT, "prefetch") as store:
        # The stream promotes its chunks in one step on the loop: the disk queue (depth 1) takes the
        # first and is full for the other two, whatever the disk worker does.
        await stream_all(store, keys, chunks)
        stats = store.stats()
        assert stats["store"]["stream_promoted"] == 3, "DRAM took all three"
        assert stats["store"]["stream_promotions_dropped"] == 2 and stats["disk"]["drops"] == 2
        await store.flush()
        assert store.stats()["disk"]["writes"] == 1


def with_slots(cfg: StoreConfig, slots: int) -> StoreConfig:
    return StoreConfig(**{**cfg.model_dump(), "dram": {"capacity": LAYOUT.chunk_nbytes * slots}})


async def test_promotions_past_half_the_pool_are_dropped_and_counted(tmp_path):
    cfg = config(tmp_path)
    keys, chunks = await fill(cfg, 3)
    async with KVStore(with_slots(cfg, 2), LAYOUT, "prefetch") as store:  # staging: at most one slot of two
        await stream_all(store, keys, chunks)  # still bit-exact: the chunks without a slot need none
        stats = store.stats()["store"]
        assert stats["stream_promoted"] == 1 and stats["stream_promotions_dropped"] == 2
        assert sum(store.pool.contains(key) for key in keys) == 1
        assert store.pool.stats()["referenced"] == 0


async def test_streams_over_as_many_chunks_as_slots_leave_half_the_pool_to_puts(tmp_path):
    cfg = config(tmp_path)
    keys, chunks = await fill(cfg, 4)
    async with KVStore(with_slots(cfg, 4), LAYOUT, "prefetch") as store:  # empty DRAM, four slots
        async with store.prefetch(keys[:2], depth=1) as first, store.prefetch(keys[2:], depth=1) as second:
            assert same(await first.layer(0), expected_layer(chunks[:2], 0))
            assert same(await second.layer(0), expected_layer(chunks[2:], 0))
            assert store.pool.stats()["referenced"] == 2, "both streams together stage in half the pool"
            hot = keys_of(store, 2, seed=1)
            for index, key in enumerate(hot):
                assert await store.put(key, chunk(10 + index)), "a put while the streams run finds a slot"
            for layer in range(1, LAYOUT.num_layers):
                assert same(await first.layer(layer), expected_layer(chunks[:2], layer))
                assert same(await second.layer(layer), expected_layer(chunks[2:], layer))
        await store.flush()  # the puts' disk writes hold their slots until done
        stats = store.stats()["store"]
        assert stats["stream_promoted"] == 2 and stats["stream_promotions_dropped"] == 2
        assert all(store.pool.contains(key) for key in hot) and sum(store.pool.contains(key) for key in keys) == 2
        assert store.pool.stats()["referenced"] == 0 and store._stream_resources.staging.held == 0


async def test_a_full_pool_still_promotes_evicting_within_half_of_it(tmp_path):
    cfg = config(tmp_path)
    keys, chunks = await fill(cfg, 3)
    async with KVStore(with_slots(cfg, 4), LAYOUT, "prefetch") as store:
        hot = keys_of(store, 3, seed=1)
        for index, key in enumerate(hot):  # three published chunks, one free slot
            assert await store.put(key, chunk(10 + index))
        await store.flush()  # their disk writes done: none is referenced, each may be evicted
        await stream_all(store, keys, chunks)  # the free slot, then one eviction: half the pool
        stats = store.stats()["store"]
        assert stats["stream_promoted"] == 2 and stats["stream_promotions_dropped"] == 1
        assert sum(store.pool.contains(key) for key in hot) == 2 and store.pool.stats()["evictions"] == 1
        assert sum(store.pool.contains(key) for key in keys) == 2
        assert store.pool.stats()["referenced"] == 0


async def test_a_failed_chunk_and_an_unfinished_stream_promote_nothing(tmp_path):
    cfg = config(tmp_path)
    keys, chunks = await fill(cfg, 2)
    async with KVStore(cfg, LAYOUT, "prefetch") as store:
        path = store.tiers[0].backend.path_for(keys[1])
        path.write_bytes(flip_layer(bytearray(path.read_bytes()), keys[1], 4))  # layer 4 of chunk 1
        async with store.prefetch(keys) as stream:
            for layer in range(4):
                assert same(await stream.layer(layer), expected_layer(chunks, layer))
            with pytest.raises(PrefetchError, match="layer 4"):
                await stream.layer(4)
        async with store.prefetch(keys[:1], depth=1) as stream:  # closed after layer 0 of 6
            await stream.layer(0)
        stats = store.stats()["store"]
        assert stats["stream_promoted"] == 0 and stats["stream_promotions_dropped"] == 0
        assert not any(store.pool.contains(key) for key in keys)
        assert store.pool.stats()["referenced"] == 0
