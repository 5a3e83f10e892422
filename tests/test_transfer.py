"""The device path: copies to and from device memory are queued with a completion, the memory
under a copy is held until it is done, and streams and puts give the same bytes through it.

Every test runs on the CPU, where ``DeviceTransfers(host_as_device=True)`` sends CPU tensors down the
device path (staging in host memory, deferred releases, completions), and, where CUDA is available,
on the GPU as well."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import pytest
import torch
from test_prefetch import LAYOUT, chunk, config, expected_layer, keys_of, same

from kvstore import KVStore, SyncKVStore
from kvstore.engine.transfer import DONE, Completion, DeviceTransfers
from kvstore.errors import LayerTimeout

DEVICES = ["cpu", *(["cuda"] if torch.cuda.is_available() else [])]


class HeldEvent:
    """A copy that has not completed until the test says so (what a CUDA event is to Completion)."""

    def __init__(self) -> None:
        self.finished = threading.Event()

    def query(self) -> bool:
        return self.finished.is_set()

    def synchronize(self) -> None:
        self.finished.wait(10)

    def wait(self) -> None:
        """A stream's wait: nothing to do on the CPU."""


def device_store(tmp_path: Path, device: str, **sections: dict) -> KVStore:
    store = KVStore(config(tmp_path, **sections), LAYOUT, "transfer")
    if device == "cpu":
        store.transfers.host_as_device = True  # the device path, with CPU tensors
    return store


def model_order_outs(count: int, device: str) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Prompt-long buffers in a model's ``[planes, 1, heads, tokens, dim]`` order, and the stream's views of them."""
    shape = (LAYOUT.kv_planes, 1, LAYOUT.num_kv_heads, count * LAYOUT.chunk_tokens, LAYOUT.head_dim)
    buffers = [torch.zeros(shape, dtype=LAYOUT.dtype, device=device) for _ in range(LAYOUT.num_layers)]
    return buffers, [buffer[:, 0].permute(0, 2, 1, 3) for buffer in buffers]


@pytest.mark.parametrize("device", DEVICES)
def test_runs_of_layers_land_in_strided_outputs(device):
    transfers = DeviceTransfers()
    chunks = [chunk(i) for i in range(3)]
    _, outs = model_order_outs(3, device)
    sources = [c[1:4].pin_memory() if device == "cuda" else c[1:4] for c in chunks]  # layers 1 to 3
    scratch = transfers.scratch_for(outs[1], 3, layers=4)
    completions = transfers.upload_layers(outs[1:4], sources, scratch)
    assert len(completions) == 3
    completions[-1].wait_on_current_stream()
    for layer in (1, 2, 3):
        assert same(outs[layer].cpu(), expected_layer(chunks, layer))
    assert not outs[0].any() and not outs[4].any()
    done = transfers.upload_layers(
        outs[4:5], [c[4:5].pin_memory() if device == "cuda" else c[4:5] for c in chunks], scratch
    )[0]  # reused scratch
    done.wait_on_current_stream()
    assert same(outs[4].cpu(), expected_layer(chunks, 4))
    landing = [torch.empty(LAYOUT.layer_shape, dtype=LAYOUT.dtype) for _ in range(3)]
    back = transfers.download([(landing[i], outs[1][:, i * 32 : (i + 1) * 32]) for i in range(3)])
    back.synchronize()
    assert all(same(landing[i], chunks[i][1]) for i in range(3))
    assert (done is DONE) == (device == "cpu")


async def test_a_callback_waits_for_its_copy_and_runs_on_the_loop():
    transfers, held = DeviceTransfers(), HeldEvent()
    ran: list[threading.Thread] = []
    loop = asyncio.get_running_loop()
    finished = loop.create_future()

    def callback() -> None:
        ran.append(threading.current_thread())
        finished.set_result(None)

    transfers.after(Completion(held), callback, loop)  # type: ignore[arg-type]
    await asyncio.sleep(0.05)
    assert not ran, "the callback ran before its copy completed"
    held.finished.set()
    await asyncio.wait_for(finished, 10)
    assert ran == [threading.current_thread()], "the callback runs on the loop's thread"
    transfers.after(DONE, lambda: ran.append(threading.current_thread()), loop)
    assert len(ran) == 2, "a completed copy's callback runs at once"
    transfers.close()


@pytest.mark.parametrize("device", DEVICES)
async def test_puts_from_the_device_land_in_dram_and_on_disk(tmp_path, device):
    chunks = [chunk(i) for i in range(4)]
    async with device_store(tmp_path, device) as store:
        keys = keys_of(store, 4)
        assert await store.put_many(keys[:3] + keys[:1], [c.to(device) for c in chunks[:3] + chunks[:1]]) == [True] * 4
        assert await store.put(keys[3], chunks[3].to(device))
        await store.flush()  # waits for the copies, then the cascade
        assert all(store.pool.contains(key) for key in keys)
        assert store.stats()["store"]["put_duplicate"] == 1  # the same key twice in one batch
        assert store.stats()["disk"]["writes"] == 4
        assert store.pool.stats()["referenced"] == 0
        for key, kv in zip(keys, chunks, strict=True):
            assert same(await store.get(key), kv)


@pytest.mark.parametrize("device", DEVICES)
async def test_streams_into_device_buffers_from_dram_and_disk_are_exact(tmp_path, device):
    chunks = [chunk(i) for i in range(4)]
    async with device_store(tmp_path, device) as store:
        keys = keys_of(store, 4)
        await store.put_many(keys, chunks)
        await store.flush()
        for key in keys[2:]:
            store.pool.discard(key)  # chunks 2 and 3 come from the disk tier, staged in DRAM slots
        buffers, outs = model_order_outs(4, device)
        async with store.prefetch(keys, depth=2, outs=outs) as stream:
            async for layer, kv in stream:
                assert kv is outs[layer]
                assert same(kv.cpu(), expected_layer(chunks, layer))
        await store.flush()
        stats = store.stats()["store"]
        assert stats["streamed_from_dram"] == 2 and stats["stream_promoted"] == 2
        assert all(store.pool.contains(key) for key in keys)
        assert store.pool.stats()["referenced"] == 0, "every slot is released once its copies are done"
        assert same(buffers[0][0, 0].transpose(0, 1).cpu(), expected_layer(chunks, 0)[0])


async def test_a_streams_slots_stay_held_until_its_last_copy_completes(tmp_path):
    held = HeldEvent()

    class Slow(DeviceTransfers):
        def upload_layers(self, outs, sources, scratch, before=None):  # the copies are queued, not done
            super().upload_layers(outs, sources, scratch, before)
            return [Completion(held) for _ in outs]  # type: ignore[arg-type]

    chunks = [chunk(i) for i in range(2)]
    async with KVStore(config(tmp_path), LAYOUT, "transfer") as store:
        store.transfers = Slow(host_as_device=True)
        object.__setattr__(store._stream_resources, "transfers", store.transfers)
        keys = keys_of(store, 2)
        await store.put_many(keys, chunks)
        _, outs = model_order_outs(2, "cpu")
        stream = store.prefetch(keys, depth=LAYOUT.num_layers, outs=outs)
        for layer in range(LAYOUT.num_layers):  # every layer arrives: its copies are queued, not done
            await stream.layer(layer)
        closing = asyncio.create_task(stream.close())  # (idempotent) waits for the copies into outs
        for _ in range(20):
            await asyncio.sleep(0)
        assert not closing.done(), "close() returned with copies into the caller's buffers in flight"
        assert store.pool.stats()["referenced"] == 2, "the slots were released under a copy in flight"
        held.finished.set()
        await closing
        for _ in range(1500):  # up to 30 s: the worker thread must get the CPU
            if store.pool.stats()["referenced"] == 0:
                break
            await asyncio.sleep(0.02)
        assert store.pool.stats()["referenced"] == 0


async def on_disk_only(store: KVStore, chunks: list[torch.Tensor]) -> tuple[list[str], list[torch.Tensor]]:
    """``chunks`` put, written to disk and dropped from DRAM; their keys, and contiguous CPU outputs for them."""
    keys = keys_of(store, len(chunks))
    await store.put_many(keys, chunks)
    await store.flush()
    for key in keys:
        store.pool.discard(key)
    shape = (LAYOUT.kv_planes, len(chunks) * LAYOUT.chunk_tokens, LAYOUT.num_kv_heads, LAYOUT.head_dim)
    return keys, [torch.zeros(shape, dtype=LAYOUT.dtype) for _ in range(LAYOUT.num_layers)]


async def test_a_stream_from_disk_into_cpu_outputs_reads_in_place_and_admits_after(tmp_path):
    chunks = [chunk(i) for i in range(3)]
    async with KVStore(config(tmp_path), LAYOUT, "transfer") as store:
        keys, outs = await on_disk_only(store, chunks)
        async for layer, kv in store.prefetch(keys, depth=3, outs=outs):
            assert kv is outs[layer] and same(kv, expected_layer(chunks, layer))
        await store.flush()  # the admissions to DRAM that follow the stream
        stats = store.stats()["store"]
        assert stats["admitted"] == 3 and stats["stream_promoted"] == 0
        assert all(store.pool.contains(key) for key in keys)
        for key, kv in zip(keys, chunks, strict=True):
            assert same(await store.get(key), kv)


@pytest.mark.parametrize("device", DEVICES)
def test_the_sync_facade_streams_into_device_buffers(tmp_path, device):
    chunks = [chunk(i) for i in range(2)]
    with SyncKVStore(config(tmp_path, disk={"enabled": False}), LAYOUT, "transfer") as store:
        if device == "cpu":
            store._store.transfers.host_as_device = True
        keys = store.chunk_keys(keys_tokens())
        assert store.put_many(keys, [c.to(device) for c in chunks]) == [True, True]
        store.flush()
        _, outs = model_order_outs(2, device)
        with store.prefetch(keys, depth=2, outs=outs) as stream:
            for layer in range(LAYOUT.num_layers):
                kv = stream.wait_layer(layer, timeout=10)  # the current stream waits for the copies
                assert same(kv.cpu(), expected_layer(chunks, layer))


@pytest.mark.parametrize("device", [*DEVICES, "cpu-in-place"])
@pytest.mark.parametrize("source", ["dram", "disk"])
async def test_a_ring_of_outputs_takes_every_layer_in_turn_exactly(tmp_path, device, source):
    """Two buffers for six layers (an engine that copies each layer on, into paged blocks): layer i lands in
    ``outs[i % 2]``, exact, whether staged and uploaded or read in place from disk ("cpu-in-place")."""
    chunks = [chunk(i) for i in range(3)]
    async with device_store(tmp_path, device.removesuffix("-in-place")) as store:
        store.transfers.host_as_device = device == "cpu"
        keys = keys_of(store, 3)
        await store.put_many(keys, chunks)
        await store.flush()
        if source == "disk":
            for key in keys:
                store.pool.discard(key)
        if device == "cpu-in-place":  # contiguous CPU outputs: a local tier reads straight into them
            shape = (LAYOUT.kv_planes, 3 * LAYOUT.chunk_tokens, LAYOUT.num_kv_heads, LAYOUT.head_dim)
            ring = [torch.zeros(shape, dtype=LAYOUT.dtype) for _ in range(2)]
        else:
            ring = model_order_outs(3, device)[1][:2]
        async with store.prefetch(keys, depth=4, outs=ring) as stream:
            async for layer, kv in stream:
                assert kv is ring[layer % 2]
                assert same(kv.cpu(), expected_layer(chunks, layer))
        await store.flush()
        assert store.pool.stats()["referenced"] == 0
        assert all(store.pool.contains(key) for key in keys), "chunks streamed from disk are promoted or admitted"
        with pytest.raises(ValueError, match="one per layer, or from 1 to 5"):
            store.prefetch(keys, outs=[])


@pytest.mark.parametrize("device", DEVICES)
def test_a_ring_buffer_takes_its_next_layer_only_once_released(tmp_path, device):
    chunks = [chunk(i) for i in range(2)]
    with SyncKVStore(config(tmp_path, disk={"enabled": False}), LAYOUT, "transfer") as store:
        store._store.transfers.host_as_device = device == "cpu"
        keys = store.chunk_keys(keys_tokens())
        store.put_many(keys, chunks)
        store.flush()
        _, outs = model_order_outs(2, device)
        ring = outs[:2]
        with store.prefetch(keys, depth=6, outs=ring) as stream:
            for layer in (0, 1):
                assert same(stream.wait_layer(layer, timeout=10).cpu(), expected_layer(chunks, layer))
            with pytest.raises(LayerTimeout):
                stream.wait_layer(2, timeout=0.2)  # its buffer still holds layer 0, unreleased
            assert same(ring[0].cpu(), expected_layer(chunks, 0)), "an unreleased buffer is never overwritten"
            for layer in range(2, LAYOUT.num_layers):
                stream.release(layer - 2)
                kv = stream.wait_layer(layer, timeout=10)
                assert kv is ring[layer % 2] and same(kv.cpu(), expected_layer(chunks, layer))


async def test_a_ring_released_ahead_never_reads_two_layers_into_one_buffer(tmp_path):
    """A restart at layer 3 (the vLLM connector's, after a bad chunk) releases layers 0-2 unread: the layers in
    flight still fit the ring. More would read two layers into one buffer in place, fail their checksum, and
    delete a sound file."""
    chunks = [chunk(i) for i in range(2)]
    async with KVStore(config(tmp_path), LAYOUT, "transfer") as store:
        keys, outs = await on_disk_only(store, chunks)
        ring = outs[:2]
        async with store.prefetch(keys, depth=LAYOUT.num_layers, outs=ring) as stream:
            stream.release(2)
            for layer in range(3, LAYOUT.num_layers):
                kv = await stream.layer(layer)
                assert kv is ring[layer % 2] and same(kv, expected_layer(chunks, layer))
                stream.release(layer)
        assert store.stats()["disk"]["corrupt"] == 0
        assert all(store.tiers[0].backend.path_for(key).exists() for key in keys)


async def test_a_release_that_skips_layers_covers_every_one_it_skipped():
    """Copies into a ring buffer wait for the consumer's work on its last layer, even where the consumer released
    several layers at once: every layer skipped ends with the same completion."""
    from kvstore.engine.streams.pace import StreamPace

    pace, held, later = StreamPace(depth=2, ring=2, num_layers=6), Completion(HeldEvent()), Completion(HeldEvent())
    assert pace.allowed() == 2
    pace.release_from_thread(2, held)  # layers 0 to 2 at once, from an engine thread
    assert pace.allowed() == 2 and [pace.before_writing(layer) for layer in (2, 3, 4)] == [held] * 3
    pace.request(3)
    assert pace.allowed() == 5
    pace.release(3, later)  # on the loop
    assert pace.before_writing(5) is later and pace.before_writing(4) is held and pace.allowed() == 6


def keys_tokens() -> list[int]:
    return list(range(2 * LAYOUT.chunk_tokens))


def test_the_device_benchmarks_run_on_the_cpu(tmp_path):
    """``kvstore bench --device``'s code, on small shapes: every row measured, every loaded byte checked."""
    from kvstore.bench.device import bench_paths
    from kvstore.bench.ttft import bench_ttft, parse_cases

    rows = asyncio.run(bench_paths("cpu", "SmolLM2-135M", chunks=2, repeats=1, directory=tmp_path))
    operations = [row.operation for row in rows]
    assert operations[4] == "stream disk -> outs (warm)"
    kernels = [
        f"{kernel}, {what}" for kernel in ("memmove", "vector loop") for what in ("whole chunks", "chunk layers")
    ]
    assert operations[5:] == kernels
    assert all(row.seconds > 0 and row.baseline_seconds > 0 for row in rows)
    (row,) = bench_ttft(parse_cases("tiny:512"), "cpu", repeats=1, directory=tmp_path)
    assert (row.chunks, row.loaded_dram) == (2, 2)  # the planner loads from DRAM until it measures it slower
    with pytest.raises(ValueError, match="MODEL:TOKENS"):
        parse_cases("70B:8192")


async def test_a_stream_from_redis_into_device_buffers_is_exact_and_promoted(tmp_path, request, monkeypatch):
    """A remote tier's layers are read one by one into the promotion slot, then cross the bus."""
    from test_prefetch_promotion import remote_only, remote_section

    section = remote_section(request, monkeypatch, "redis")
    keys, chunks = await remote_only(tmp_path, section, 3)
    async with KVStore(config(tmp_path, **section), LAYOUT, "prefetch") as store:  # the namespace fill() wrote
        store.transfers.host_as_device = True
        _, outs = model_order_outs(3, "cpu")
        async with store.prefetch(keys, depth=3, outs=outs) as stream:
            async for layer, kv in stream:
                assert same(kv, expected_layer(chunks, layer))
        stats = store.stats()
        assert stats["redis"]["hits"] == 3 and stats["store"]["stream_promoted"] == 3
        await store.flush()
        assert store.pool.stats()["referenced"] == 0


async def test_a_corrupt_layer_read_in_place_fails_from_that_layer_only(tmp_path):
    """Layers read in runs (one vectored read per chunk): those before the bad one still arrive, exact."""
    from test_prefetch_failed_chunk import flip_layer

    from kvstore.errors import PrefetchError

    chunks = [chunk(i) for i in range(2)]
    async with KVStore(config(tmp_path), LAYOUT, "transfer") as store:
        keys, outs = await on_disk_only(store, chunks)
        path = store.tiers[0].backend.path_for(keys[1])
        path.write_bytes(flip_layer(bytearray(path.read_bytes()), keys[1], 4))  # layer 4 of chunk 1
        async with store.prefetch(keys, depth=LAYOUT.num_layers, outs=outs) as stream:
            for layer in range(4):
                assert same(await stream.layer(layer), expected_layer(chunks, layer))
            for layer in (4, 5):
                with pytest.raises(PrefetchError, match="layer 4 of chunk") as failed:
                    await stream.layer(layer)
                assert failed.value.chunk == 1 and failed.value.layer == 4
        assert store.stats()["disk"]["corrupt"] == 1
        assert not path.exists(), "the corrupt chunk is removed"


async def test_a_layer_changed_in_the_callers_memory_under_its_read_is_read_again_not_deleted(
    tmp_path, monkeypatch, caplog
):
    """A checksum that fails on a read in place is confirmed by a read into the reader's own memory: the file
    is sound, so it stays, and the layer arrives exact."""
    import kvstore.storage.layer_reader as layer_reader

    verify, changed = layer_reader.verify_segment, []

    def changed_under_the_read(header, layer, stored):  # the caller writes into its buffer once, at layer 2
        if isinstance(stored, list) and layer == 2 and not changed:
            changed.append(layer)
            stored[0][0] ^= 0xFF
        return verify(header, layer, stored)

    monkeypatch.setattr(layer_reader, "verify_segment", changed_under_the_read)
    chunks = [chunk(i) for i in range(2)]
    async with KVStore(config(tmp_path), LAYOUT, "transfer") as store:
        keys, outs = await on_disk_only(store, chunks)
        async with store.prefetch(keys, depth=LAYOUT.num_layers, outs=outs) as stream:
            async for layer, kv in stream:
                assert same(kv, expected_layer(chunks, layer))
        assert changed == [2] and "changed in the caller's memory" in caplog.text
        assert store.stats()["disk"]["corrupt"] == 0
        assert all(store.tiers[0].backend.path_for(key).exists() for key in keys)


class FailedEvent(HeldEvent):
    """A copy that fails on the device."""

    def query(self) -> bool:
        return False

    def synchronize(self) -> None:
        raise RuntimeError("CUDA error: an illegal memory access was encountered (a test's)")


def held_downloads(store: KVStore, event: HeldEvent) -> None:
    """The store's puts of device chunks end when ``event`` says so (queued, then done or failed)."""

    class Held(DeviceTransfers):
        def download(self, pairs, ready=None):  # the copies are made, their completion is the test's
            super().download(pairs, ready)
            return Completion(event)  # type: ignore[arg-type]

    store.transfers = Held(host_as_device=True)


async def test_a_put_is_found_once_its_copy_completes_and_a_cancelled_flush_loses_nothing(tmp_path):
    held = HeldEvent()
    async with KVStore(config(tmp_path, disk={"enabled": False}), LAYOUT, "transfer") as store:
        held_downloads(store, held)
        keys = keys_of(store, 2)
        assert await store.put_many(keys, [chunk(0), chunk(1)]) == [True, True]
        assert not store.pool.contains(keys[0]), "published before its copy completed"
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(store.flush(), 0.05)  # a caller that gives up on the flush
        held.finished.set()
        await asyncio.wait_for(store.flush(), 10)
        assert all(store.pool.contains(key) for key in keys) and store.pool.stats()["referenced"] == 0
        assert same(await store.get(keys[1]), chunk(1))


async def test_a_failed_device_copy_publishes_nothing_and_keeps_its_slots(tmp_path, caplog):
    async with KVStore(config(tmp_path, disk={"enabled": False}), LAYOUT, "transfer") as store:
        held_downloads(store, FailedEvent())
        keys = keys_of(store, 2)
        assert await store.put_many(keys, [chunk(0), chunk(1)]) == [True, True]
        await asyncio.wait_for(store.flush(), 10)  # told of the failure: it does not wait forever
        assert not any(store.pool.contains(key) for key in keys)
        assert store.stats()["store"]["put_rejected"] == 2
        assert store.pool.stats()["referenced"] == 2, "memory under a failed copy is never handed back"
        assert "a device copy failed" in caplog.text
