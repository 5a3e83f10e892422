"""KVStore orchestration: put, cascade, lookup, promotion, backpressure, timeouts, close."""

from __future__ import annotations

import asyncio
import logging
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch

from kvstore import (
    KVLayout,
    KVStore,
    StoreClosedError,
    StoreConfig,
    SyncKVStore,
    chunk_keys,
)
from kvstore.backends.base import ByteRange
from kvstore.backends.disk import DiskBackend
from kvstore.codecs import make_codec
from kvstore.engine.dram import SlabPool
from kvstore.errors import ConfigError
from kvstore.storage.tier import ChunkTier
from kvstore.testing.memory import MemoryBackend
from kvstore.util import memory
from kvstore.util.buffers import Buffer
from kvstore.util.threads import in_thread
from kvstore.util.units import human_bytes

LAYOUT = KVLayout(num_layers=4, num_kv_heads=2, head_dim=16, chunk_tokens=32)
REPO = Path(__file__).resolve().parents[1]


def make_chunk(seed: int, layout: KVLayout = LAYOUT) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(layout.chunk_shape, generator=generator).to(layout.dtype)


def tokens(n_chunks: int, variant: int = 0) -> list[int]:
    return [(variant * 1000 + i) % 50000 for i in range(n_chunks * LAYOUT.chunk_tokens)]


def config(tmp_path: Path, slots: int = 16, **overrides: object) -> StoreConfig:
    values: dict[str, object] = {
        "dram": {"capacity": slots * LAYOUT.chunk_nbytes},
        "disk": {"path": tmp_path / "disk"},
        "timeouts": {"get": 0.5, "put": 0.5, "close": 1.0},
    }
    values.update(overrides)
    return StoreConfig(**values)


class ControlledBackend(MemoryBackend):
    """In-memory objects whose reads and writes can be held in a (non-cancellable) thread."""

    name = "controlled"

    def __init__(self) -> None:
        super().__init__()
        self.release_reads = threading.Event()
        self.release_writes = threading.Event()
        self.release_reads.set()
        self.release_writes.set()
        self.fail_writes = False

    async def get(self, key: str, byte_range: ByteRange | None = None) -> bytes | None:
        await in_thread(None, self.release_reads.wait, 10)
        return await super().get(key, byte_range)

    async def set(self, key: str, parts: Sequence[Buffer]) -> None:
        await in_thread(None, self.release_writes.wait, 10)
        if self.fail_writes:
            raise OSError(28, "No space left on device")
        await super().set(key, parts)


def controlled_store(tmp_path: Path, backend: ControlledBackend, **overrides: object) -> KVStore:
    tier = ChunkTier(backend, make_codec("bytesplit"), LAYOUT, executor=None)
    return KVStore(config(tmp_path, **overrides), LAYOUT, "test", tiers=[tier])


async def test_put_lookup_get_round_trip(tmp_path: Path) -> None:
    async with KVStore(config(tmp_path), LAYOUT, namespace="test") as store:
        keys = store.chunk_keys(tokens(3))
        chunks = [make_chunk(i) for i in range(3)]
        for key, chunk in zip(keys, chunks, strict=True):
            assert await store.put(key, chunk)
        assert await store.lookup(keys) == 3
        out = torch.empty(LAYOUT.chunk_shape, dtype=LAYOUT.dtype)
        assert await store.get(keys[1], out=out) is out
        assert torch.equal(out, chunks[1])
        copy = await store.get(keys[2])
        assert copy is not None and torch.equal(copy, chunks[2])
        copy.zero_()  # the returned tensor is the caller's, not a view of a DRAM slot
        again = await store.get(keys[2])
        assert again is not None and torch.equal(again, chunks[2])
        assert store.stats()["store"]["hits"] == 3


async def test_keys_match_the_public_function(tmp_path: Path) -> None:
    async with KVStore(config(tmp_path), LAYOUT, namespace="ns", salt="tenant-a") as store:
        assert store.chunk_keys(tokens(2)) == chunk_keys(tokens(2), LAYOUT, "ns", salt="tenant-a")
        assert store.chunk_keys(tokens(2)) != chunk_keys(tokens(2), LAYOUT, "ns")


async def test_bad_input_is_rejected_with_a_clear_error(tmp_path: Path) -> None:
    async with KVStore(config(tmp_path), LAYOUT, namespace="test") as store:
        key = store.chunk_keys(tokens(1))[0]
        with pytest.raises(ValueError, match="shape"):
            await store.put(key, torch.zeros(2, 2, dtype=LAYOUT.dtype))
        with pytest.raises(ValueError, match="bfloat16"):
            await store.put(key, make_chunk(0).float())
        with pytest.raises(ValueError, match="hex"):
            await store.put("not-a-key", make_chunk(0))
        with pytest.raises(ValueError, match="shape"):
            await store.get(key, out=torch.empty(3))
        assert store.stats()["store"]["puts"] == 0


async def test_arguments_of_the_wrong_type_name_the_call_and_the_argument(tmp_path: Path) -> None:
    """A non-tensor raised a bare AttributeError from deep inside; a single key was read as its characters."""
    async with KVStore(config(tmp_path), LAYOUT, namespace="test") as store:
        keys = store.chunk_keys(tokens(2))
        with pytest.raises(TypeError, match="put: kv must be a torch.Tensor, got list"):
            await store.put(keys[0], [[0.0]])
        with pytest.raises(TypeError, match=r"put_many: kvs\[0\] must be a torch.Tensor, got ndarray"):
            await store.put_many(keys[:1], [make_chunk(0).float().numpy()])
        with pytest.raises(TypeError, match=r"get: out must be a torch.Tensor, got list"):
            await store.get(keys[0], out=[])
        with pytest.raises(TypeError, match=r"get_many: outs\[1\] must be a torch.Tensor, got str"):
            await store.get_many(keys, [make_chunk(0), "buffer"])
        with pytest.raises(TypeError, match=r"get_many: outs must be a sequence of torch.Tensor, got int"):
            await store.get_many(keys, 2)
        with pytest.raises(TypeError, match=r"prefetch: outs\[0\] must be a torch.Tensor, got NoneType"):
            store.prefetch(keys, outs=[None])
        with pytest.raises(TypeError, match="prefetch: depth must be an int, got str"):
            store.prefetch(keys, depth="2")
        for call in ("lookup", "plan", "get_many"):
            with pytest.raises(TypeError, match=rf"{call}: keys must be a sequence of chunk keys \(str\), got str"):
                await getattr(store, call)(keys[0])  # one key, not a list of them
        with pytest.raises(TypeError, match=r"prefetch: keys .* got str \(one key: pass \[key\]\)"):
            store.prefetch(keys[0])
        assert store.stats()["store"]["puts"] == 0 and store.stats()["store"]["gets"] == 0


async def test_outputs_that_share_memory_are_refused_naming_both_indices(tmp_path: Path) -> None:
    """The same tensor twice in outs was accepted: both results were one buffer holding the last chunk."""
    async with KVStore(config(tmp_path), LAYOUT, namespace="test") as store:
        keys = store.chunk_keys(tokens(3))
        for i, key in enumerate(keys):
            await store.put(key, make_chunk(i))
        out = torch.empty(LAYOUT.chunk_shape, dtype=LAYOUT.dtype)
        with pytest.raises(ValueError, match=r"get_many: outs\[0\] and outs\[2\] share memory"):
            await store.get_many(keys, [out, torch.empty_like(out), out])
        elements = out.numel()
        flat = torch.empty(3 * elements, dtype=LAYOUT.dtype)  # views overlapping by half a chunk
        overlapping = [flat[i * elements // 2 :][:elements].view(LAYOUT.chunk_shape) for i in range(3)]
        with pytest.raises(ValueError, match=r"get_many: outs\[0\] and outs\[1\] share memory"):
            await store.get_many(keys, overlapping)
        layer = torch.empty(LAYOUT.kv_planes, 3 * LAYOUT.chunk_tokens, LAYOUT.num_kv_heads, LAYOUT.head_dim)
        layer = layer.to(LAYOUT.dtype)
        with pytest.raises(ValueError, match=r"prefetch: outs\[1\] and outs\[3\] share memory"):
            store.prefetch(keys, outs=[torch.empty_like(layer), layer, torch.empty_like(layer), layer])
        with pytest.raises(ValueError, match=r"prefetch: outs\[0\] and outs\[1\] share memory"):
            store.prefetch(keys, outs=[layer, layer[:, :1]])  # a ring of two slots, one inside the other
        assert store.stats()["store"]["gets"] == 0 and store.stats()["store"]["streamed"] == 0


async def test_outputs_interleaved_in_one_tensor_share_no_byte_and_are_filled(tmp_path: Path) -> None:
    """Views of one tensor that interleave without sharing a byte (a layer-first pool's pages) are fine."""
    async with KVStore(config(tmp_path), LAYOUT, namespace="test") as store:
        keys = store.chunk_keys(tokens(2))
        for i, key in enumerate(keys):
            await store.put(key, make_chunk(i))
        pool = torch.zeros((LAYOUT.num_layers, LAYOUT.kv_planes, 2 * LAYOUT.chunk_tokens, *LAYOUT.chunk_shape[3:]))
        pool = pool.to(LAYOUT.dtype)
        pages = [pool[:, :, i * LAYOUT.chunk_tokens : (i + 1) * LAYOUT.chunk_tokens] for i in range(2)]
        assert await store.get_many(keys, pages) == pages
        assert all(torch.equal(page, make_chunk(i)) for i, page in enumerate(pages))
        shape = (LAYOUT.kv_planes, LAYOUT.num_layers, 2 * LAYOUT.chunk_tokens, *LAYOUT.chunk_shape[3:])
        layers = torch.zeros(shape, dtype=LAYOUT.dtype)
        outs = [layers[:, i] for i in range(LAYOUT.num_layers)]  # each layer's planes lie apart
        async with store.prefetch(keys, outs=outs) as stream:
            for i in range(LAYOUT.num_layers):
                assert torch.equal(await stream.layer(i), torch.cat([make_chunk(0)[i], make_chunk(1)[i]], dim=1))


def test_a_dram_capacity_above_the_memory_available_is_refused_before_anything_is_allocated(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Opening a store whose pool cannot fit raised OverflowError, an empty MemoryError, or used up the memory."""

    def allocate(self: SlabPool, segments: int) -> None:
        raise AssertionError("the pool allocated memory it was refused")

    monkeypatch.setattr(SlabPool, "_grow", allocate)
    monkeypatch.setattr(memory, "available_memory", lambda: 4 * LAYOUT.chunk_nbytes)
    with pytest.raises(ConfigError) as excinfo:
        KVStore(config(tmp_path, slots=16), LAYOUT, namespace="test")
    text = str(excinfo.value)
    for part in ("dram.capacity", human_bytes(16 * LAYOUT.chunk_nbytes), human_bytes(4 * LAYOUT.chunk_nbytes)):
        assert part in text, text
    assert "lower dram.capacity" in text and "\n" not in text
    auto = config(tmp_path, slots=4, adaptive={"auto": True, "dram_max": 64 * LAYOUT.chunk_nbytes})
    monkeypatch.setattr(memory, "machine_memory", lambda: 32 * LAYOUT.chunk_nbytes)  # the config came from elsewhere
    with pytest.raises(ConfigError, match=r"adaptive.dram_max .* lower adaptive.dram_max"):
        KVStore(auto, LAYOUT, namespace="test")


async def test_cascade_reaches_disk_and_survives_a_restart(tmp_path: Path) -> None:
    keys = chunk_keys(tokens(5), LAYOUT, "test")
    chunks = [make_chunk(10 + i) for i in range(5)]
    async with KVStore(config(tmp_path), LAYOUT, namespace="test") as store:
        for key, chunk in zip(keys, chunks, strict=True):
            await store.put(key, chunk)
        await store.flush()
        assert store.stats()["disk"]["writes"] == 5
    files = sorted((tmp_path / "disk").rglob("*.kvc"))
    assert len(files) == 5
    assert all(f.stat().st_mode & 0o777 == 0o600 for f in files)

    async with KVStore(config(tmp_path), LAYOUT, namespace="test") as store:
        assert store.stats()["dram"]["chunks"] == 0
        assert await store.lookup(keys) == 5
        for key, chunk in zip(keys, chunks, strict=True):
            got = await store.get(key)
            assert got is not None and torch.equal(got, chunk)
        stats = store.stats()
        assert stats["disk"]["hits"] == 5
        assert stats["dram"]["chunks"] == 5  # promoted
        await store.get(keys[0])
        assert store.stats()["disk"]["hits"] == 5  # the second read came from DRAM


async def test_lookup_stops_at_the_first_gap_and_spans_tiers(tmp_path: Path) -> None:
    keys = chunk_keys(tokens(6), LAYOUT, "test")
    async with KVStore(config(tmp_path, slots=2), LAYOUT, namespace="test") as store:
        for i in (0, 1, 2, 4, 5):  # chunk 3 never computed
            await store.put(keys[i], make_chunk(i))
            await store.flush()  # keep slots free: the pool holds only 2 chunks
        assert store.stats()["dram"]["chunks"] == 2  # the rest live only on disk now
        assert await store.lookup(keys) == 3
        assert await store.lookup(keys[4:]) == 2
        assert await store.lookup([]) == 0
        other = chunk_keys(tokens(6, variant=9), LAYOUT, "test")
        assert await store.lookup(other) == 0


async def test_put_fails_fast_when_every_slot_is_in_flight(tmp_path: Path) -> None:
    backend = ControlledBackend()
    backend.release_writes.clear()  # writes hang: each queued write holds its slot
    store = controlled_store(tmp_path, backend, slots=2, timeouts={"get": 0.5, "put": 30.0, "close": 0.5})
    async with store:
        keys = store.chunk_keys(tokens(3))
        assert await store.put(keys[0], make_chunk(0))
        assert await store.put(keys[1], make_chunk(1))
        start = time.perf_counter()
        assert await store.put(keys[2], make_chunk(2)) is False
        assert time.perf_counter() - start < 0.5
        assert store.stats()["store"]["put_rejected"] == 1
        backend.release_writes.set()
        await store.flush()
        assert await store.put(keys[2], make_chunk(2))  # slots came back once the writes ended
        await store.flush()
        assert store.stats()["controlled"]["writes"] == 3


async def test_a_full_queue_drops_that_tiers_write_and_counts_it(tmp_path: Path) -> None:
    backend = ControlledBackend()
    backend.release_writes.clear()
    store = controlled_store(
        tmp_path, backend, slots=8, queue_depth=1, tier_workers=1, timeouts={"get": 0.5, "put": 30.0, "close": 0.5}
    )
    async with store:
        keys = store.chunk_keys(tokens(4))
        for i, key in enumerate(keys):
            assert await store.put(key, make_chunk(i))  # DRAM takes every chunk
        stats = store.stats()["controlled"]
        assert stats["drops"] == 2  # one write in progress, one queued, two dropped
        backend.release_writes.set()
        await store.flush()
        assert store.stats()["controlled"]["writes"] == 2
        assert store.stats()["dram"]["chunks"] == 4


async def test_a_slow_tier_costs_at_most_its_timeout_and_keeps_the_slot_safe(tmp_path: Path) -> None:
    backend = ControlledBackend()
    store = controlled_store(tmp_path, backend, slots=4, timeouts={"get": 0.3, "put": 5.0, "close": 1.0})
    async with store:
        key = store.chunk_keys(tokens(1))[0]
        chunk = make_chunk(3)
        await store.put(key, chunk)
        await store.flush()
        store.pool.discard(key)  # only the slow tier has it now
        backend.release_reads.clear()
        start = time.perf_counter()
        assert await store.get(key) is None
        assert time.perf_counter() - start < 1.5
        stats = store.stats()
        assert stats["controlled"]["timeouts"] == 1
        assert stats["dram"]["referenced"] == 1  # the stuck read still owns its slot
        backend.release_reads.set()
        for _ in range(1500):  # up to 30 s: the worker thread must get the CPU
            if store.stats()["dram"]["referenced"] == 0:
                break
            await asyncio.sleep(0.02)
        assert store.stats()["dram"]["referenced"] == 0
        got = await store.get(key)  # the tier answers again once it is fast
        assert got is not None and torch.equal(got, chunk)


async def test_write_errors_are_counted_and_never_reach_the_engine(tmp_path: Path) -> None:
    backend = ControlledBackend()
    backend.fail_writes = True
    async with controlled_store(tmp_path, backend) as store:
        key = store.chunk_keys(tokens(1))[0]
        assert await store.put(key, make_chunk(0))
        await store.flush()
        stats = store.stats()
        assert stats["controlled"]["errors"] == 1 and stats["controlled"]["writes"] == 0
        assert stats["dram"]["referenced"] == 0
        assert await store.get(key) is not None  # DRAM still serves it


async def test_close_is_bounded_even_when_a_tier_hangs(tmp_path: Path) -> None:
    backend = ControlledBackend()
    backend.release_writes.clear()
    store = controlled_store(
        tmp_path, backend, slots=8, tier_workers=1, timeouts={"get": 0.5, "put": 30.0, "close": 0.5}
    )
    await store.open()
    for i, key in enumerate(store.chunk_keys(tokens(4))):
        await store.put(key, make_chunk(i))
    start = time.perf_counter()
    await store.close()
    assert time.perf_counter() - start < 3.0
    assert store.stats()["controlled"]["drops"] == 3  # queued writes abandoned, counted
    with pytest.raises(StoreClosedError):
        await store.put(store.chunk_keys(tokens(1))[0], make_chunk(0))
    backend.release_writes.set()


async def test_concurrent_gets_of_one_chunk_share_one_read(tmp_path: Path) -> None:
    backend = ControlledBackend()
    async with controlled_store(tmp_path, backend) as store:
        key = store.chunk_keys(tokens(1))[0]
        chunk = make_chunk(5)
        await store.put(key, chunk)
        await store.flush()
        store.pool.discard(key)
        backend.gets = 0
        results = await asyncio.gather(*(store.get(key) for _ in range(8)))
        assert all(r is not None and torch.equal(r, chunk) for r in results)
        assert backend.gets == 1


async def test_corrupt_disk_file_is_a_counted_miss_and_removed(tmp_path: Path) -> None:
    keys = chunk_keys(tokens(2), LAYOUT, "test")
    async with KVStore(config(tmp_path), LAYOUT, namespace="test") as store:
        for i, key in enumerate(keys):
            await store.put(key, make_chunk(i))
    backend = DiskBackend(tmp_path / "disk", 1 << 30, namespace="test")
    path = backend.path_for(keys[1])
    data = bytearray(path.read_bytes())
    data[-7] ^= 0x10  # a bit flip in the last layer's bytes
    path.write_bytes(bytes(data))
    async with KVStore(config(tmp_path), LAYOUT, namespace="test") as store:
        assert await store.lookup(keys) == 2  # lookup trusts existence ...
        assert await store.get(keys[1]) is None  # ... the read checks every byte
        stats = store.stats()
        assert stats["disk"]["corrupt"] == 1 and stats["store"]["misses"] == 1
        assert not path.exists()
        assert await store.lookup(keys) == 1
        got = await store.get(keys[0])
        assert got is not None and torch.equal(got, make_chunk(0))


async def test_a_chunk_for_another_layout_is_never_returned(tmp_path: Path) -> None:
    other = KVLayout(num_layers=4, num_kv_heads=2, head_dim=16, chunk_tokens=32, dtype=torch.float16)
    assert other.chunk_nbytes == LAYOUT.chunk_nbytes
    key = chunk_keys(tokens(1), LAYOUT, "test")[0]
    async with KVStore(config(tmp_path), other, namespace="test") as store:
        await store.put(key, make_chunk(1, other))  # a foreign writer using our key's name
    async with KVStore(config(tmp_path), LAYOUT, namespace="test") as store:
        assert await store.get(key) is None
        assert store.stats()["disk"]["foreign"] == 1 and store.stats()["disk"]["corrupt"] == 0
    async with KVStore(config(tmp_path), other, namespace="test") as store:  # its owner still has it
        got = await store.get(key)
        assert got is not None and torch.equal(got, make_chunk(1, other))


def test_sync_facade_from_an_engine_thread(tmp_path: Path) -> None:
    results: list[bool] = []

    def engine() -> None:
        with SyncKVStore(config(tmp_path), LAYOUT, "test") as store:
            keys = store.chunk_keys(tokens(2))
            for i, key in enumerate(keys):
                store.put(key, make_chunk(i))
            store.flush()
            results.append(store.lookup(keys) == 2)
            got = store.get(keys[1])
            results.append(got is not None and torch.equal(got, make_chunk(1)))
            results.append(store.stats()["disk"]["writes"] == 2)

    thread = threading.Thread(target=engine)
    thread.start()
    thread.join(30)
    assert results == [True, True, True]


def test_another_process_reads_what_this_one_wrote(tmp_path: Path) -> None:
    keys = chunk_keys(tokens(3), LAYOUT, "test")

    async def write() -> None:
        async with KVStore(config(tmp_path), LAYOUT, namespace="test") as store:
            for i, key in enumerate(keys):
                await store.put(key, make_chunk(i))

    asyncio.run(write())
    script = textwrap.dedent(
        f"""
        import asyncio, sys, torch
        sys.path.insert(0, {str(REPO)!r})
        sys.path.insert(0, {str(REPO / "tests")!r})
        from test_store import LAYOUT, config, make_chunk, tokens
        from pathlib import Path
        from kvstore import KVStore, chunk_keys

        async def main():
            keys = chunk_keys(tokens(3), LAYOUT, "test")
            async with KVStore(config(Path({str(tmp_path)!r})), LAYOUT, namespace="test") as store:
                assert await store.lookup(keys) == 3
                for i, key in enumerate(keys):
                    got = await store.get(key)
                    assert got is not None and torch.equal(got, make_chunk(i)), i
                assert store.stats()["disk"]["hits"] == 3
            print("ok")

        asyncio.run(main())
        """
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


async def test_a_chunk_already_on_disk_is_not_written_again(tmp_path: Path) -> None:
    async with KVStore(config(tmp_path), LAYOUT, namespace="test") as store:
        key = store.chunk_keys(tokens(1))[0]
        await store.put(key, make_chunk(0))
        await store.flush()
        store.pool.discard(key)  # evicted from DRAM, still on disk
        assert await store.put(key, make_chunk(0))
        await store.flush()
        stats = store.stats()["disk"]
        assert stats["writes"] == 1 and stats["skipped"] == 1
        path = store.tiers[0].backend.path_for(key)
        path.unlink()  # another process evicted it: the next put writes it again
        store.pool.discard(key)
        await store.put(key, make_chunk(0))
        await store.flush()
        assert store.stats()["disk"]["writes"] == 2 and path.exists()


async def test_get_many_serves_dram_and_disk_in_one_call(tmp_path: Path) -> None:
    keys = chunk_keys(tokens(6), LAYOUT, "test")
    async with KVStore(config(tmp_path), LAYOUT, namespace="test") as store:
        for i, key in enumerate(keys[:5]):  # chunk 5 never stored
            await store.put(key, make_chunk(i))
    async with KVStore(config(tmp_path), LAYOUT, namespace="test") as store:
        await store.get(keys[0])  # one chunk already back in DRAM
        outs = [torch.empty(LAYOUT.chunk_shape, dtype=LAYOUT.dtype) for _ in keys]
        results = await store.get_many(keys, outs)
        assert [r is not None for r in results] == [True] * 5 + [False]
        for i in range(5):
            assert results[i] is outs[i] and torch.equal(outs[i], make_chunk(i))
        stats = store.stats()
        assert stats["disk"]["hits"] == 5  # 1 for the single get, 4 in the batch
        assert stats["disk"]["misses"] == 1
        assert stats["store"]["hits"] == 6 and stats["store"]["misses"] == 1
        await store.flush()  # read straight into outs, the chunks are admitted to DRAM after the call
        stats = store.stats()
        assert stats["dram"]["chunks"] == 5 and stats["dram"]["referenced"] == 0
        duplicated = await store.get_many([keys[1], keys[1]])
        assert all(r is not None and torch.equal(r, make_chunk(1)) for r in duplicated)
        with pytest.raises(ValueError, match="2 keys but 1 output"):
            await store.get_many(keys[:2], outs[:1])


@pytest.mark.parametrize("with_outs", [True, False], ids=["outs", "new-tensors"])
async def test_get_many_loads_as_many_chunks_as_lookup_finds_with_a_small_pool(tmp_path: Path, with_outs: bool) -> None:
    """4 DRAM slots, 6 chunks on disk; lookup says 6, so get_many returns 6 (staged in rounds)."""
    keys = chunk_keys(tokens(6), LAYOUT, "test")
    async with KVStore(config(tmp_path), LAYOUT, namespace="test") as store:
        for i, key in enumerate(keys):
            await store.put(key, make_chunk(i))
    async with KVStore(config(tmp_path, slots=4), LAYOUT, namespace="test") as store:
        assert await store.lookup(keys) == 6
        outs = [torch.empty(LAYOUT.chunk_shape, dtype=LAYOUT.dtype) for _ in keys] if with_outs else None
        results = await store.get_many(keys, outs)
        assert all(r is not None and torch.equal(r, make_chunk(i)) for i, r in enumerate(results))
        if outs is not None:
            assert all(r is out for r, out in zip(results, outs, strict=True))
        assert store.stats()["dram"]["referenced"] == 0
        assert store.stats()["disk"]["hits"] == 6  # each chunk read once


async def test_get_many_never_waits_for_memory(tmp_path: Path) -> None:
    """Every slot held by someone else (in-flight transfers): the tiers' chunks are misses at once."""
    keys = chunk_keys(tokens(3), LAYOUT, "test")
    async with KVStore(config(tmp_path), LAYOUT, namespace="test") as store:
        for i, key in enumerate(keys):
            await store.put(key, make_chunk(i))
    async with KVStore(config(tmp_path, slots=2), LAYOUT, namespace="test") as store:
        held = [store.pool.reserve() for _ in range(2)]
        assert await store.get_many(keys) == [None, None, None]
        for slot in held:
            store.pool.release(slot)
        later = await store.get_many(keys)  # the slots are free again
        assert all(r is not None and torch.equal(r, make_chunk(i)) for i, r in enumerate(later))


async def test_a_store_is_usable_only_between_open_and_close(tmp_path: Path) -> None:
    store = KVStore(config(tmp_path), LAYOUT, namespace="test")
    key = store.chunk_keys(tokens(1))[0]
    with pytest.raises(StoreClosedError, match="new"):
        await store.put(key, make_chunk(0))
    async with store:
        assert await store.put(key, make_chunk(0))
        with pytest.raises(RuntimeError, match="open"):
            await store.open()
    await store.close()  # a second close is a no-op
    for operation in (store.lookup([key]), store.get(key)):
        with pytest.raises(StoreClosedError, match="closed"):
            await operation


def test_sync_facade_after_close_raises_instead_of_hanging(tmp_path: Path) -> None:
    store = SyncKVStore(config(tmp_path), LAYOUT, "test")
    key = store.chunk_keys(tokens(1))[0]
    assert store.put(key, make_chunk(0))
    store.close()
    store.close()
    with pytest.raises(StoreClosedError):
        store.get(key)
    with pytest.raises(StoreClosedError):
        store.put(key, make_chunk(0))


async def test_close_after_a_failed_open_does_not_raise(tmp_path: Path) -> None:
    class Unreachable(MemoryBackend):
        async def open(self) -> None:
            raise OSError("no such bucket")

    tier = ChunkTier(Unreachable(), make_codec("identity"), LAYOUT, None)
    store = KVStore(config(tmp_path), LAYOUT, namespace="test", tiers=[tier])
    with pytest.raises(OSError, match="no such bucket"):
        await store.open()
    await store.close()  # an engine's cleanup path: must not raise a second error
    with pytest.raises(StoreClosedError):
        await store.lookup([])


async def test_a_lossy_tier_is_logged_at_open_and_its_stats_say_so(tmp_path: Path, caplog: pytest.LogCaptureFixture):
    lossy = config(tmp_path, disk={"path": tmp_path / "disk", "codec": "int8+zstd", "allow_lossy": True})
    with caplog.at_level(logging.INFO, logger="kvstore"):
        async with KVStore(lossy, LAYOUT, namespace="test") as store:
            stats = store.stats()
    assert stats["disk"]["codec"] == "int8+zstd" and stats["disk"]["lossless"] is False
    said = [record.getMessage() for record in caplog.records if "lossy codec" in record.getMessage()]
    assert said == ["kvstore: the disk tier stores KV with the lossy codec 'int8+zstd' (allow_lossy)"]
    caplog.clear()
    lossless = config(tmp_path, disk={"path": tmp_path / "other", "codec": "bytesplit"})
    with caplog.at_level(logging.INFO, logger="kvstore"):
        async with KVStore(lossless, LAYOUT, namespace="test") as store:
            assert store.stats()["disk"]["lossless"] is True
    assert not [record for record in caplog.records if "lossy codec" in record.getMessage()]
