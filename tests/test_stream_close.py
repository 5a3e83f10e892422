"""Closing a layer stream ends it: once ``close()`` returns or raises, cancelled or not, nothing of the
stream writes into the caller's buffers again, and every layer that never arrived has failed.

An engine reuses its buffers (a ring of a few layers' room, or its paged blocks) for the next request as
soon as the stream is closed; a copy landing there afterwards is corrupted KV for that request. Each
trial cancels ``close()`` while the producer's copies or reads into the ring are in flight, overwrites
the ring as an engine would, waits for the producer to have ended entirely, and checks the ring.
"""

from __future__ import annotations

import asyncio
import gc
from pathlib import Path

import pytest
import torch

from kvstore import KVLayout, KVStore, StoreConfig, SyncKVStore
from kvstore.engine.streams import LayerStream
from kvstore.errors import LayerTimeout, PrefetchError

# Layers of 1 MiB (8 chunks of 128 KiB): a copy or read of one is long enough to be in flight when close() starts.
LAYOUT = KVLayout(num_layers=12, num_kv_heads=4, head_dim=64, chunk_tokens=128, dtype=torch.bfloat16)
CHUNKS = 8
RING = 3
REUSED = -7.0  # what the engine writes into its buffers once the stream is closed


def config(tmp_path: Path, disk: bool) -> StoreConfig:
    return StoreConfig(
        dram={"capacity": LAYOUT.chunk_nbytes * 4 * CHUNKS},
        disk={"path": tmp_path / "disk", "enabled": disk},
    )


async def stored_prefix(store: KVStore) -> list[str]:
    keys = store.chunk_keys(list(range(CHUNKS * LAYOUT.chunk_tokens)))
    generator = torch.Generator().manual_seed(0)
    chunks = [torch.randn(LAYOUT.chunk_shape, generator=generator).to(LAYOUT.dtype) for _ in keys]
    assert all(await store.put_many(keys, chunks))
    await store.flush()
    return keys


def ring() -> list[torch.Tensor]:
    shape = (LAYOUT.kv_planes, CHUNKS * LAYOUT.chunk_tokens, LAYOUT.num_kv_heads, LAYOUT.head_dim)
    return [torch.zeros(shape, dtype=LAYOUT.dtype) for _ in range(RING)]


async def cancel_close_midway(store: KVStore, keys: list[str], taken: int) -> tuple[LayerStream, list[torch.Tensor]]:
    """Open a stream into a ring, take ``taken`` layers, then cancel its ``close()`` at its first wait, as a
    consumer task cancelled while ``async with store.prefetch(...)`` exits. Returns once close() has raised."""
    outs = ring()
    stream = store.prefetch(keys, depth=4, outs=outs)
    for layer in range(taken):
        await stream.layer(layer)
        stream.release(layer)
    closing = asyncio.create_task(stream.close())
    await asyncio.sleep(0)  # close() runs to its first wait: the producer is told to stop, not yet stopped
    closing.cancel()
    with pytest.raises(asyncio.CancelledError):
        await closing
    return stream, outs


async def producer_ended(stream: LayerStream) -> None:
    """Wait until nothing of the stream runs any more (its producer, and the threads it waits for)."""
    await asyncio.wait({stream._task})


@pytest.mark.parametrize("source", ["dram", "disk"])
async def test_a_cancelled_close_leaves_nothing_writing_into_the_callers_buffers(tmp_path, source):
    """200 trials (50 from disk, read in place into the ring): the ring, overwritten once close() raised,
    keeps what the engine wrote, and every layer not delivered has failed (a waiter wakes with an error)."""
    unretrieved: list[dict] = []
    asyncio.get_running_loop().set_exception_handler(lambda loop, context: unretrieved.append(context))
    trials = 200 if source == "dram" else 50
    async with KVStore(config(tmp_path, disk=source == "disk"), LAYOUT, "close") as store:
        keys = await stored_prefix(store)
        for trial in range(trials):
            if source == "disk":
                for key in keys:
                    store.pool.discard(key)  # read from the files, straight into the ring
            stream, outs = await cancel_close_midway(store, keys, trial % RING)
            for out in outs:
                out.fill_(REUSED)
            await producer_ended(stream)
            late = [i for i, out in enumerate(outs) if not bool((out == REUSED).all())]
            assert not late, f"trial {trial}: the stream wrote into buffers {late} after close() raised"
            assert all(arrived.is_set() for arrived in stream.arrived), f"trial {trial}: a layer never ended"
            assert all(isinstance(outcome, torch.Tensor | PrefetchError) for outcome in stream.outcomes), (
                f"trial {trial}: a layer ended neither arrived nor failed"
            )
            assert isinstance(stream.outcomes[-1], PrefetchError), f"trial {trial}: the last layer came"
        await store.flush()
        assert store.pool.stats()["referenced"] == 0
        assert store.stats()["disk"]["corrupt"] == 0 if source == "disk" else True
    gc.collect()
    assert not [c for c in unretrieved if "never retrieved" in str(c.get("message"))], unretrieved[:3]


def test_an_engine_thread_waiting_on_a_layer_wakes_when_a_cancelled_close_ends_the_stream(tmp_path):
    """After a close cancelled midway, a wait on a layer that never came fails at once (not a LayerTimeout)."""
    with SyncKVStore(config(tmp_path, disk=False), LAYOUT, "close") as store:
        keys = store.chunk_keys(list(range(CHUNKS * LAYOUT.chunk_tokens)))
        assert all(store.put_many(keys, [torch.ones(LAYOUT.chunk_shape, dtype=LAYOUT.dtype) for _ in keys]))
        store.flush()
        stream = store.prefetch(keys, depth=4, outs=ring())
        stream.wait_layer(0)
        stream.release(0)

        async def cancelled_close() -> None:
            closing = asyncio.create_task(stream._stream.close())
            await asyncio.sleep(0)
            closing.cancel()
            await asyncio.wait({closing})

        store._submit(cancelled_close()).result()
        with pytest.raises(PrefetchError) as failed:
            stream.wait_layer(LAYOUT.num_layers - 1, timeout=30)
        assert not isinstance(failed.value, LayerTimeout), "the layer's wait ran to its timeout"
