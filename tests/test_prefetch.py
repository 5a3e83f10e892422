"""Layerwise prefetch: layers arrive in order, bit-exact, from DRAM, disk, Redis and S3, never more
than `depth` layers ahead of the consumer; a layer that cannot be loaded is an error the engine
can act on, never wrong KV."""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path

import pytest
import torch
from support import TEST_BUCKET

from kvstore import KVLayout, KVStore, StoreConfig, SyncKVStore
from kvstore.engine.streams import reads
from kvstore.engine.streams.stream import _thread_share
from kvstore.errors import PrefetchError
from kvstore.storage.container import parse_header
from kvstore.util.buffers import copy_between
from kvstore.util.threads import usable_cores

LAYOUT = KVLayout(num_layers=6, num_kv_heads=2, head_dim=16, chunk_tokens=32, dtype=torch.bfloat16)


def chunk(seed: int) -> torch.Tensor:
    return torch.randn(LAYOUT.chunk_shape, generator=torch.Generator().manual_seed(seed)).to(LAYOUT.dtype)


def expected_layer(chunks: list[torch.Tensor], layer: int) -> torch.Tensor:
    return torch.cat([c[layer] for c in chunks], dim=1)  # [planes, n * tokens, heads, head_dim]


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.view(torch.int16), b.view(torch.int16))


def config(tmp_path: Path, **sections) -> StoreConfig:
    base = {"dram": {"capacity": LAYOUT.chunk_nbytes * 16}, "disk": {"path": tmp_path / "disk"}}
    return StoreConfig(**{**base, **sections})


def keys_of(store: KVStore, count: int, seed: int = 0) -> list[str]:
    tokens = torch.randint(0, 30_000, (count * LAYOUT.chunk_tokens,), generator=torch.Generator().manual_seed(seed))
    return store.chunk_keys(tokens.tolist())


async def fill(cfg: StoreConfig, count: int) -> tuple[list[str], list[torch.Tensor]]:
    """Put ``count`` chunks and let them reach every tier; returns keys and chunks."""
    async with KVStore(cfg, LAYOUT, "prefetch") as store:
        keys, chunks = keys_of(store, count), [chunk(i) for i in range(count)]
        for key, kv in zip(keys, chunks, strict=True):
            assert await store.put(key, kv)
        await store.flush()
    return keys, chunks


async def test_layers_from_dram_arrive_in_order_and_exact(tmp_path):
    async with KVStore(config(tmp_path, disk={"enabled": False}), LAYOUT, "prefetch") as store:
        keys, chunks = keys_of(store, 3), [chunk(i) for i in range(3)]
        for key, kv in zip(keys, chunks, strict=True):
            await store.put(key, kv)
        seen = []
        async for layer, kv in store.prefetch(keys):
            assert same(kv, expected_layer(chunks, layer))
            seen.append(layer)
        assert seen == list(range(LAYOUT.num_layers))
        assert store.pool.stats()["referenced"] == 0, "the stream released its slots"


@pytest.mark.parametrize("codec", ["identity", "bytesplit"])
@pytest.mark.parametrize("encrypted", [False, True], ids=["plain", "aes-gcm"])
async def test_layers_from_disk_after_a_restart(tmp_path, codec, encrypted):
    sections = {"disk": {"path": tmp_path / "disk", "codec": codec}}
    if encrypted:
        sections["encryption"] = {"key": "11" * 32}
    cfg = config(tmp_path, **sections)
    keys, chunks = await fill(cfg, 4)
    async with KVStore(cfg, LAYOUT, "prefetch") as store:  # empty DRAM: every layer comes from disk
        async for layer, kv in store.prefetch(keys):
            assert same(kv, expected_layer(chunks, layer))
        disk = store.stats()["disk"]
        assert disk["hits"] == 4 and disk["corrupt"] == 0 and disk["bytes_read"] > 0


async def test_mixed_sources_and_caller_outputs(tmp_path):
    cfg = config(tmp_path)
    keys, chunks = await fill(cfg, 3)
    async with KVStore(cfg, LAYOUT, "prefetch") as store:
        await store.put(keys[1], chunks[1])  # the middle chunk is in DRAM, the others only on disk
        shape = (LAYOUT.kv_planes, 3 * LAYOUT.chunk_tokens, LAYOUT.num_kv_heads, LAYOUT.head_dim)
        outs = [torch.zeros(shape, dtype=LAYOUT.dtype) for _ in range(LAYOUT.num_layers)]
        async with store.prefetch(keys, outs=outs) as stream:
            for layer in range(LAYOUT.num_layers):
                kv = await stream.layer(layer)
                assert kv is outs[layer] and same(kv, expected_layer(chunks, layer))
        assert store.stats()["disk"]["hits"] == 2


async def test_the_stream_runs_at_most_depth_layers_ahead(tmp_path):
    cfg = config(tmp_path)
    keys, _ = await fill(cfg, 2)
    async with KVStore(cfg, LAYOUT, "prefetch") as store:

        async def read_ahead_reaches(nbytes: int) -> int:
            """Bytes read once the read-ahead got to ``nbytes`` (waited for, up to 30 s), and 0.3 s more."""
            for _ in range(1500):
                if store.stats()["disk"]["bytes_read"] >= nbytes:
                    break
                await asyncio.sleep(0.02)
            await asyncio.sleep(0.3)  # time enough to fetch everything, were it allowed to
            return store.stats()["disk"]["bytes_read"]

        async with store.prefetch(keys, depth=2) as stream:
            await stream.layer(0)
            per_layer = 2 * LAYOUT.layer_nbytes
            assert await read_ahead_reaches(3 * per_layer) == 3 * per_layer  # layer 0, and 2 ahead: not more
            await stream.layer(2)
            assert await read_ahead_reaches(5 * per_layer) == 5 * per_layer  # up to layer 2 + depth


def test_runs_in_flight_share_the_read_threads():
    assert _thread_share(2, 2, 1) == 2, "one run in flight: every thread"
    assert _thread_share(2, 2, 2) == 1, "two runs on two cores: one thread each"
    assert _thread_share(8, 4, 1) == 4, "never more than read_threads"
    assert _thread_share(2, 2, 3) == 1, "at least one"


async def test_a_run_alone_in_flight_is_read_over_every_read_thread(tmp_path, monkeypatch):
    """Depth 1 leaves room for one run at a time: its chunks are dealt out over every read thread, not one."""
    cfg = config(tmp_path, io_threads=2)
    keys, chunks = await fill(cfg, 4)
    calls: list[tuple[int, int]] = []  # per thread call: (the first layer it read, chunks it read)
    real_read_files = reads.read_files

    def recorded(items, copies, layout, fence):
        calls.append((min(item.layer for item in items), len({id(item.reader) for item in items})))
        return real_read_files(items, copies, layout, fence)

    monkeypatch.setattr(reads, "read_files", recorded)
    outs = [torch.zeros((LAYOUT.kv_planes, 4 * LAYOUT.chunk_tokens, *LAYOUT.layer_shape[2:]), dtype=LAYOUT.dtype)
            for _ in range(LAYOUT.num_layers)]  # fmt: skip
    async with KVStore(cfg, LAYOUT, "prefetch") as store:  # empty DRAM: every layer comes from disk
        async for layer, kv in store.prefetch(keys, depth=1, outs=outs):
            assert same(kv, expected_layer(chunks, layer))
    threads = min(2, usable_cores())
    first_run = [count for layer, count in calls if layer == 0]
    assert len(first_run) == threads and sum(first_run) == 4, calls


async def test_a_missing_chunk_fails_the_stream_at_once(tmp_path):
    cfg = config(tmp_path)
    keys, _ = await fill(cfg, 2)
    async with KVStore(cfg, LAYOUT, "prefetch") as store:
        stranger = keys_of(store, 1, seed=99)[0]
        async with store.prefetch([keys[0], stranger]) as stream:
            with pytest.raises(PrefetchError, match="in no tier"):
                await stream.layer(0)
            with pytest.raises(PrefetchError):
                await stream.layer(LAYOUT.num_layers - 1)
        assert store.pool.stats()["referenced"] == 0


async def test_a_corrupt_layer_stops_the_stream_there(tmp_path):
    cfg = config(tmp_path)
    keys, chunks = await fill(cfg, 2)
    async with KVStore(cfg, LAYOUT, "prefetch") as store:
        path = store.tiers[0].backend.path_for(keys[1])
        data = bytearray(path.read_bytes())
        header = parse_header(data, LAYOUT, keys[1])
        data[header.header_len + header.segments[4].offset + 7] ^= 0x10  # layer 4 of chunk 1
        path.write_bytes(bytes(data))
        async with store.prefetch(keys) as stream:
            for layer in range(4):
                assert same(await stream.layer(layer), expected_layer(chunks, layer))
            with pytest.raises(PrefetchError, match="layer 4"):
                await stream.layer(4)
            with pytest.raises(PrefetchError):
                await stream.layer(5)
        assert store.stats()["disk"]["corrupt"] == 1
        assert not path.exists(), "the corrupt chunk was removed"


async def test_leaving_the_loop_early_releases_everything(tmp_path):
    async with KVStore(config(tmp_path, disk={"enabled": False}), LAYOUT, "prefetch") as store:
        keys = keys_of(store, 2)
        for i, key in enumerate(keys):
            await store.put(key, chunk(i))
        async for layer, _ in store.prefetch(keys):
            if layer == 1:
                break
        # The abandoned iterator is closed by the loop's async-generator finalizer within a few
        # loop turns (`async with store.prefetch(...)` closes at a point of your choosing).
        for _ in range(100):
            if store.pool.stats()["referenced"] == 0:
                break
            await asyncio.sleep(0.01)
        assert store.pool.stats()["referenced"] == 0


@pytest.mark.parametrize("remote", ["redis", "s3"])
async def test_layers_from_remote_tiers(tmp_path, request, monkeypatch, remote):
    prefix = f"prefetch-{uuid.uuid4().hex[:8]}"
    if remote == "redis":
        server = request.getfixturevalue("redis_server")
        section = {"redis": {"enabled": True, "url": server.url, "prefix": prefix}}
    else:
        server = request.getfixturevalue("moto_server")
        for name, value in server.credentials_env().items():
            monkeypatch.setenv(name, value)
        section = {"s3": {"enabled": True, "bucket": TEST_BUCKET, "prefix": prefix}}
    cfg = config(tmp_path, disk={"enabled": False}, **section)
    keys, chunks = await fill(cfg, 3)
    async with KVStore(cfg, LAYOUT, "prefetch") as store:
        async for layer, kv in store.prefetch(keys, depth=3):
            assert same(kv, expected_layer(chunks, layer))
        assert store.stats()[remote]["hits"] == 3
    async with KVStore(cfg, LAYOUT, "prefetch") as store:  # a fresh store: the first one promoted them into DRAM
        before = store.stats()[remote]["requests"]
        async for layer, kv in store.prefetch(keys, depth=LAYOUT.num_layers):
            assert same(kv, expected_layer(chunks, layer))
        # Per chunk: its header with layer 0, then on S3 spans of 2 and 3 layers (doubling, cut at
        # the last layer); on Redis, where a round trip is cheap, one request per later layer.
        per_chunk = 1 + (2 if remote == "s3" else LAYOUT.num_layers - 1)
        assert store.stats()[remote]["requests"] - before == 3 * per_chunk


def test_engine_threads_wait_for_layers(tmp_path):
    cfg = config(tmp_path)
    with SyncKVStore(cfg, LAYOUT, "prefetch") as store:
        keys = store.chunk_keys(list(range(2 * LAYOUT.chunk_tokens)))
        chunks = [chunk(10), chunk(11)]
        for key, kv in zip(keys, chunks, strict=True):
            store.put(key, kv)
        with store.prefetch(keys) as stream:
            for layer in range(LAYOUT.num_layers):
                assert same(stream.wait_layer(layer, timeout=10), expected_layer(chunks, layer))
        assert [layer for layer, _ in store.prefetch(keys)] == list(range(LAYOUT.num_layers))
        stream = store.prefetch(keys, depth=1)
        stream.close()
        with pytest.raises(PrefetchError, match="closed"):  # a waiting engine thread is released, not hung
            stream.wait_layer(LAYOUT.num_layers - 1, timeout=10)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float8_e4m3fn])
def test_copy_between_matches_torch_copy_for_strided_targets(dtype):
    source = torch.randn((2, 32, 3, 8), generator=torch.Generator().manual_seed(1)).to(dtype)
    backing = torch.zeros((2, 1, 3, 64, 8), dtype=dtype)
    target = backing[:, 0, :, 16:48].permute(0, 2, 1, 3)  # a [2, 32, 3, 8] view with other strides
    copy_between(target, source)
    assert torch.equal(target.view(torch.uint8), source.view(torch.uint8))
    assert not backing[:, 0, :, :16].view(torch.uint8).any(), "nothing written outside the target"
    widened = torch.empty((2, 32, 3, 8), dtype=torch.float32)
    copy_between(widened, source)  # another dtype: torch converts
    assert torch.equal(widened, source.float())


def test_a_large_copy_is_shared_with_idle_helpers_and_never_waits_for_busy_ones(monkeypatch):
    """A chunk-sized copy (>= PARALLEL_COPY_BYTES) is cut into runs of its first dimension: an idle helper takes
    part (the caller copies what is left); with the only helper busy, the caller copies all of it, not waiting."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    import kvstore.util.buffers as buffers

    monkeypatch.setattr(buffers, "usable_cores", lambda: 2)
    source = torch.randn((32, 2, 256, 8, 64), generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    backing = torch.zeros((32, 2, 8, 300, 64), dtype=torch.bfloat16)
    target = backing[:, :, :, 10:266].permute(0, 1, 3, 2, 4)  # 16 MiB, heads before tokens in memory
    copiers: set[str] = set()
    real_copyto, helper_copied, waiting = buffers.np.copyto, threading.Event(), [True]

    def copyto(into, out_of):
        name = threading.current_thread().name
        copiers.add(name)
        if name.startswith("helper"):
            helper_copied.set()
        elif waiting[0]:  # the caller's first run ends only once the idle helper has taken the other one
            assert helper_copied.wait(60), "the idle helper never took a run"
        real_copyto(into, out_of)

    monkeypatch.setattr(buffers.np, "copyto", copyto)
    with ThreadPoolExecutor(1, thread_name_prefix="helper") as helpers:
        buffers.copy_between(target, source, helpers)
        assert torch.equal(target.view(torch.int16), source.view(torch.int16))
        assert any(name.startswith("helper") for name in copiers), copiers  # (it may have taken both runs)
        assert not backing[:, :, :, :10].view(torch.int16).any() and not backing[:, :, :, 266:].view(torch.int16).any()

        waiting[0] = False
        release = threading.Event()
        helpers.submit(release.wait)  # the one helper is busy: the caller copies every run itself
        copiers.clear()
        target.zero_()
        buffers.copy_between(target, source, helpers)
        assert copiers == {threading.current_thread().name}
        assert torch.equal(target.view(torch.int16), source.view(torch.int16))
        release.set()


async def test_layers_land_in_caller_views_with_other_strides(tmp_path):
    """An engine may hand in views of its own cache (heads before tokens), as the HF connector does."""
    cfg = config(tmp_path)
    keys, chunks = await fill(cfg, 3)
    async with KVStore(cfg, LAYOUT, "prefetch") as store:
        await store.put(keys[0], chunks[0])  # one chunk from DRAM, two from disk
        tokens = 3 * LAYOUT.chunk_tokens + 5  # the engine's tensors are longer than the prefix
        shape = (LAYOUT.kv_planes, 1, LAYOUT.num_kv_heads, tokens, LAYOUT.head_dim)
        buffers = [torch.zeros(shape, dtype=LAYOUT.dtype) for _ in range(LAYOUT.num_layers)]
        outs = [b[:, 0, :, : 3 * LAYOUT.chunk_tokens].permute(0, 2, 1, 3) for b in buffers]
        async for layer, kv in store.prefetch(keys, outs=outs):
            assert kv is outs[layer] and same(outs[layer], expected_layer(chunks, layer))
            assert not buffers[layer][:, 0, :, 3 * LAYOUT.chunk_tokens :].view(torch.int16).any()
        assert store.stats()["store"]["streamed"] == 3 and store.stats()["store"]["streamed_from_dram"] == 1


async def test_an_s3_object_gone_mid_stream_fails_the_layers_read_ahead(tmp_path, moto_server, monkeypatch):
    """Remote readers request the next span early (read-ahead); one that finds the object gone fails
    the stream with PrefetchError at the first layer it carried, and closing leaves no request behind."""
    for name, value in moto_server.credentials_env().items():
        monkeypatch.setenv(name, value)
    section = {"s3": {"enabled": True, "bucket": TEST_BUCKET, "prefix": f"ahead-{uuid.uuid4().hex[:8]}"}}
    cfg = config(tmp_path, disk={"enabled": False}, **section)
    keys, chunks = await fill(cfg, 1)
    async with KVStore(cfg, LAYOUT, "prefetch") as store:
        async with store.prefetch(keys, depth=2) as stream:
            assert same(await stream.layer(0), expected_layer(chunks, 0))
            # Layers 0-2 may be in hand by now, 3-4 in flight; layer 5's request starts only once layer 2
            # is asked for, so it finds the object gone whatever the timing.
            s3 = store.tiers[0].backend
            await s3.delete(keys[0])
            failed = None
            for layer in range(1, LAYOUT.num_layers):
                try:
                    assert same(await stream.layer(layer), expected_layer(chunks, layer))
                except PrefetchError:
                    failed = layer
                    break
            assert failed is not None, "a layer requested after the object was gone cannot arrive"

        def reading_ahead() -> list[asyncio.Task]:
            return [task for task in asyncio.all_tasks() if task.get_name() == "kvstore-read-ahead"]

        for _ in range(100):  # a cancelled request ends within a few loop turns
            if not reading_ahead():
                break
            await asyncio.sleep(0.01)
        assert not reading_ahead()
        assert store.pool.stats()["referenced"] == 0
