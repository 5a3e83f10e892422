"""``kvstore bench``: tier throughput against raw baselines measured in the same run.

The measurements only: each function returns rows (:class:`Row`, :class:`CodecRow`), and
:mod:`kvstore.cli.bench` prints them. :mod:`kvstore.bench.remote` and
:mod:`kvstore.bench.prefetch` share this module's layouts, samples and row types.

Ratios, not absolute numbers, are what to compare: this machine is shared and noisy, so each
kvstore figure is printed beside a baseline that moves the same bytes right before it:

- DRAM put / get        vs  ``Tensor.copy_`` (torch's threads) into pre-allocated, pre-touched memory
- disk put + flush      vs  open + write (+ fsync when the tier fsyncs) + close of the same bytes, 2 threads
- disk get_many(outs)   vs  open + readinto a pre-allocated buffer + close, 2 threads, page cache warm or cold
- internal tier rows    the ChunkTier calls alone (no target), against the same raw baselines
- codecs                ratio and single-thread MB/s on real KV (the SmolLM2 sample) when available

Every timing goes through the public API (``put``, ``flush``, ``get``, ``get_many``) unless its
row says "internal".
"""

from __future__ import annotations

import asyncio
import math
import os
import shutil
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import numpy as np
import torch

from kvstore.backends.disk import DiskBackend
from kvstore.codecs import CodecPipeline, SegmentSpec, make_codec, roundtrip_error
from kvstore.config import StoreConfig
from kvstore.engine.cascade import WRITE_BATCH
from kvstore.engine.store import KVStore
from kvstore.keys import ChunkKey, chunk_keys
from kvstore.layout import KVLayout
from kvstore.util.buffers import Buffer, tensor_bytes
from kvstore.util.progress import Progress
from kvstore.util.units import MB, per_second

LAYOUTS: dict[str, KVLayout] = {
    "SmolLM2-135M": KVLayout(num_layers=30, num_kv_heads=3, head_dim=64, dtype=torch.bfloat16),
    "Llama-3-8B": KVLayout(num_layers=32, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16),
}
TARGETS = {
    "DRAM put": 0.7,
    "DRAM get": 0.7,
    "disk put+flush": 0.8,
    "disk get_many (warm)": 0.8,
    "disk get_many (cold)": 0.8,
    # kvstore bench --device (device.py)
    "put from the device + flush, DRAM": 0.85,
    "stream DRAM -> outs": 0.8,
    "stream disk -> outs (warm)": 0.8,
}
RAW_THREADS = 2  # the raw file baselines' threads: what a careful engineer would use on this 2-core machine
CODECS = ["zstd", "lz4", "byteplanes", "bytesplit", "fp8", "fp8+zstd"]
CODECS += ["int8", "int8+zstd", "int4", "int4+zstd", "int4:32", "hadamard+int4", "hadamard+int8+zstd"]  # lossy


@dataclass
class Row:
    """One operation of one layout: kvstore's best time beside its baseline's, moving the same bytes."""

    layout: str
    operation: str
    nbytes: int
    seconds: float
    baseline_seconds: float
    baseline: str  # what the baseline did ("memcpy", "readinto (warm)", "redis-py GET", ...)

    @property
    def gbps(self) -> float:
        """kvstore's throughput, GB/s."""
        return per_second(self.nbytes, self.seconds)

    @property
    def baseline_gbps(self) -> float:
        """The baseline's throughput, GB/s."""
        return per_second(self.nbytes, self.baseline_seconds)

    @property
    def ratio(self) -> float:
        """kvstore's speed as a share of the baseline's (1.0: as fast)."""
        return self.baseline_seconds / self.seconds

    @property
    def target(self) -> float | None:
        """The ratio this operation should reach, if it has one."""
        return TARGETS.get(self.operation)


@dataclass
class CodecRow:
    """A codec on real KV: how much it compresses, and logical (uncompressed) MB/s each way.

    In memory (``kvstore bench``), ``put`` is encoding and ``get`` decoding, in one thread, and
    ``server`` is empty; through a remote tier (``--remote``), a put and a get of whole chunks.
    """

    server: str
    codec: str
    nbytes: int  # logical: uncompressed chunk bytes
    stored: int
    put_mbps: float
    get_mbps: float
    lossless: bool
    error: str = ""  # a lossy codec's round-trip error on the sample (in memory only)

    @property
    def ratio(self) -> float:
        """Uncompressed bytes per stored byte."""
        return self.nbytes / self.stored


def _sample_chunks(layout: KVLayout, count: int, seed: int = 0) -> list[torch.Tensor]:
    """``count`` random chunks of ``layout`` (seeded: every run moves the same bytes)."""
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(layout.chunk_shape, generator=generator).to(layout.dtype) for _ in range(count)]


async def _best_pair(
    baseline: Callable[[], Awaitable[float]], mine: Callable[[], Awaitable[float]], repeats: int
) -> tuple[float, float]:
    """Best times of baseline and kvstore, run alternately so both see the same machine noise."""
    base_best = mine_best = float("inf")
    for _ in range(repeats):
        base_best = min(base_best, await baseline())
        mine_best = min(mine_best, await mine())
    return base_best, mine_best


def _timed(fn: Callable[[], object]) -> float:
    """Seconds ``fn()`` took."""
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


async def bench_dram(name: str, layout: KVLayout, chunks: int, repeats: int) -> list[Row]:
    """DRAM put and get of ``chunks`` chunks through a KVStore against memcpy into pre-touched memory."""
    sources = _sample_chunks(layout, min(chunks, 4))
    outputs = [torch.zeros(layout.chunk_shape, dtype=layout.dtype) for _ in range(chunks)]  # pre-touched
    staging = [torch.zeros(layout.chunk_shape, dtype=layout.dtype) for _ in range(chunks)]
    total = chunks * layout.chunk_nbytes

    # memcpy: Tensor.copy_ with torch's threads, as the engine's own copy of a chunk would run
    async def memcpy() -> float:
        return _timed(lambda: _copy_all(staging, [sources[i % len(sources)] for i in range(chunks)]))

    async def memcpy_out() -> float:
        return _timed(lambda: _copy_all(outputs, staging))

    config = StoreConfig(dram={"capacity": (chunks + 1) * layout.chunk_nbytes}, disk={"enabled": False})
    async with KVStore(config, layout, namespace=f"bench-{name}") as store:
        keys = bench_keys(layout, chunks, f"bench-{name}")

        async def put_all() -> float:
            for key in keys:  # start from an empty pool each round, so every put copies
                store.pool.discard(key)
            start = time.perf_counter()
            for i, key in enumerate(keys):
                await store.put(key, sources[i % len(sources)])
            return time.perf_counter() - start

        async def get_all() -> float:
            start = time.perf_counter()
            for i, key in enumerate(keys):
                await store.get(key, out=outputs[i])
            return time.perf_counter() - start

        put_base, put_time = await _best_pair(memcpy, put_all, repeats)
        get_base, get_time = await _best_pair(memcpy_out, get_all, repeats)
        for i, _key in enumerate(keys):
            assert torch.equal(outputs[i], sources[i % len(sources)]), "DRAM round trip changed the data"
    return [
        Row(name, "DRAM put", total, put_time, put_base, f"memcpy, {torch.get_num_threads()} threads"),
        Row(name, "DRAM get", total, get_time, get_base, f"memcpy, {torch.get_num_threads()} threads"),
    ]


def _copy_all(targets: Sequence[torch.Tensor], sources: Sequence[torch.Tensor]) -> None:
    """The memcpy baseline: each source into its target, ``Tensor.copy_`` with torch's threads."""
    for target, source in zip(targets, sources, strict=True):
        target.copy_(source)


def _raw_write(directory: Path, index: int, data: memoryview, fsync: bool) -> None:
    """The baseline write: open, write all of ``data`` (fsync if asked), close."""
    fd = os.open(directory / f"raw-{index}.bin", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        view = data
        while view:
            view = view[os.write(fd, view) :]
        if fsync:
            os.fsync(fd)
    finally:
        os.close(fd)


def _raw_read(directory: Path, index: int, into: memoryview) -> None:
    """The baseline read: open, readinto ``into`` until the file ends, close."""
    with open(directory / f"raw-{index}.bin", "rb", buffering=0) as file:
        view = into
        while view:
            got = file.readinto(view)
            if not got:
                break
            view = view[got:]


def _drop_cache(paths: list[Path]) -> None:
    """Make the kernel forget these files' cached pages: write them back, then drop them (no root needed)."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)  # dirty pages cannot be dropped
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


class RawFiles:
    """The baseline a careful engineer would write: plain files, :data:`RAW_THREADS` threads, half the files each."""

    def __init__(self, directory: Path, executor: ThreadPoolExecutor) -> None:
        self.directory, self._executor = directory, executor
        directory.mkdir()

    async def _each(self, count: int, work: Callable[[int], None]) -> float:
        """Seconds to run ``work(i)`` for each ``i < count``, in contiguous shares over the threads."""
        loop = asyncio.get_running_loop()
        shares = [range(t * count // RAW_THREADS, (t + 1) * count // RAW_THREADS) for t in range(RAW_THREADS)]
        start = time.perf_counter()
        await asyncio.gather(*(loop.run_in_executor(self._executor, _run_share, share, work) for share in shares))
        return time.perf_counter() - start

    async def write(self, sources: Sequence[memoryview], count: int, fsync: bool) -> float:
        """Write ``count`` files (chunk ``i`` is ``sources[i % len]``) after removing the last round's."""
        for old in self.directory.iterdir():  # both sides write into the pages the last round freed
            old.unlink()
        return await self._each(count, lambda i: _raw_write(self.directory, i, sources[i % len(sources)], fsync))

    async def read(self, outs: Sequence[memoryview], cold: bool) -> float:
        """Read each file into ``outs[i]``, the page cache dropped first when ``cold``."""
        if cold:
            _drop_cache([self.directory / f"raw-{i}.bin" for i in range(len(outs))])
        return await self._each(len(outs), lambda i: _raw_read(self.directory, i, outs[i]))


def _run_share(share: range, work: Callable[[int], None]) -> None:
    for i in share:
        work(i)


def bench_keys(layout: KVLayout, chunks: int, namespace: str) -> list[ChunkKey]:
    """One key for each of ``chunks`` distinct one-chunk prompts."""
    return [k for i in range(chunks) for k in chunk_keys([i] * layout.chunk_tokens, layout, namespace)]


def disk_bench_config(layout: KVLayout, chunks: int, directory: Path, fsync: bool) -> StoreConfig:
    """The disk benchmarks' store: DRAM for every chunk of a pass, a disk tier under ``directory`` that evicts none."""
    return StoreConfig(
        dram={"capacity": (chunks + 1) * layout.chunk_nbytes},
        disk={"path": directory / "tier", "capacity": 1 << 50, "fsync": fsync},
    )


async def bench_disk(name: str, layout: KVLayout, chunks: int, repeats: int, directory: Path, fsync: bool) -> list[Row]:
    """The disk tier through the public API against raw file I/O on the same bytes, alternating; checks the data.

    - ``put`` + ``flush`` of every chunk (DRAM emptied and the tier's files removed before each
      round, so every put copies and every chunk is written) against raw 2-thread writes. Each
      side removes its previous round's files first, so both write into pages just freed.
    - ``get_many(keys, outs)`` into pre-allocated, pre-touched tensors, with DRAM emptied before
      each round (every chunk comes from the disk; the admissions to DRAM that follow the call
      are waited for outside the timing), page cache warm, then cold (``posix_fadvise``), against
      raw 2-thread ``readinto``.
    - internal rows (no target): :class:`ChunkTier` ``write_many`` / ``read_many_into`` called
      directly, the figures earlier versions of this bench reported.
    """
    sources = _sample_chunks(layout, min(chunks, 4), seed=1)
    source_bytes = [tensor_bytes(s) for s in sources]
    outs = [torch.zeros(layout.chunk_shape, dtype=layout.dtype) for _ in range(chunks)]  # pre-touched
    out_bytes = [tensor_bytes(out) for out in outs]
    total = chunks * layout.chunk_nbytes
    keys = bench_keys(layout, chunks, f"bench-{name}")
    config = disk_bench_config(layout, chunks, directory, fsync)
    rows: list[Row] = []
    raw_label = f"{RAW_THREADS} threads, {'write+fsync' if fsync else 'write'}"
    with ThreadPoolExecutor(RAW_THREADS, thread_name_prefix="raw-io") as executor:
        raw = RawFiles(directory / "raw", executor)
        async with KVStore(config, layout, namespace=f"bench-{name}") as store:
            tier = store.tiers[0]
            files = tier.backend
            assert isinstance(files, DiskBackend)

            async def clear() -> None:
                await store.flush()  # admissions and writes of the last round: outside the timings
                for key in keys:
                    store.pool.discard(key)

            async def put_flush() -> float:
                await clear()
                for key in keys:  # or the tier would skip chunks it already holds
                    await tier.backend.delete(key)
                start = time.perf_counter()
                for i, key in enumerate(keys):
                    if not await store.put(key, sources[i % len(sources)]):
                        raise RuntimeError("DRAM refused a put during the benchmark")
                await store.flush()
                return time.perf_counter() - start

            async def get_many(cold: bool) -> float:
                await clear()
                if cold:
                    _drop_cache([files.path_for(key) for key in keys])
                start = time.perf_counter()
                results = await store.get_many(keys, outs)
                elapsed = time.perf_counter() - start
                if any(result is None for result in results):
                    raise RuntimeError("the disk tier lost chunks during the benchmark")
                return elapsed

            async def tier_write() -> float:
                for key in keys:
                    await tier.backend.delete(key)
                start = time.perf_counter()
                for first in range(0, len(keys), WRITE_BATCH):  # how the cascade writes when its queue backs up
                    batch = [
                        (keys[i], source_bytes[i % len(sources)])
                        for i in range(first, min(first + WRITE_BATCH, chunks))
                    ]
                    if any(outcome is not None for outcome in await tier.write_many(batch)):
                        raise RuntimeError("the disk tier failed a write during the benchmark")
                return time.perf_counter() - start

            async def tier_read(cold: bool) -> float:
                if cold:
                    _drop_cache([files.path_for(key) for key in keys])
                start = time.perf_counter()
                found = await tier.read_many_into(keys, out_bytes)
                elapsed = time.perf_counter() - start
                if not all(found):
                    raise RuntimeError("the disk tier lost chunks during the benchmark")
                return elapsed

            async def raw_write() -> float:
                return await raw.write(source_bytes, chunks, fsync)

            base, mine = await _best_pair(raw_write, put_flush, repeats)
            rows.append(Row(name, "disk put+flush", total, mine, base, f"{raw_label} (freed pages)"))

            async def read_rows(operation: str, read: Callable[[bool], Awaitable[float]]) -> None:
                """``read`` against raw reads of the same bytes, page cache warm then cold: two rows."""
                os.sync()  # let writeback finish: it would steal memory bandwidth from the read measurements
                for cold in (False, True):
                    label = "cold" if cold else "warm"
                    base, mine = await _best_pair(partial(raw.read, out_bytes, cold), partial(read, cold), repeats)
                    baseline = f"{RAW_THREADS} threads, readinto ({label})"
                    rows.append(Row(name, f"{operation} ({label})", total, mine, base, baseline))

            await read_rows("disk get_many", get_many)
            _check(outs, sources)
            await clear()
            base, mine = await _best_pair(raw_write, tier_write, repeats)
            rows.append(Row(name, "internal: tier write", total, mine, base, f"{raw_label} (freed pages)"))
            await read_rows("internal: tier read", tier_read)
            _check(outs, sources)
    return rows


def _check(outs: Sequence[torch.Tensor], sources: Sequence[torch.Tensor]) -> None:
    """Raise if a chunk read back differs from what was written."""
    for i, out in enumerate(outs):
        if not torch.equal(out.view(torch.uint8), sources[i % len(sources)].view(torch.uint8)):
            raise RuntimeError("disk round trip changed the data")


@contextmanager
def one_torch_thread() -> Iterator[None]:
    """torch's ops on one thread inside the block: codec rows are per core (fp8, int8, int4 run torch ops)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def bench_codecs(sample: torch.Tensor, repeats: int) -> list[CodecRow]:
    """Every codec on per-layer segments of the sample, one thread, like the tiers encode them (best of ``repeats``).

    The codecs take turns in each of the ``repeats`` rounds, so they all see the same machine noise.
    Raises RuntimeError if a lossless codec does not give back the sample bit for bit.
    """
    layers = [sample[i].contiguous() for i in range(sample.shape[0])]
    spec = SegmentSpec(sample.dtype, tuple(layers[0].shape))
    raw = [memoryview(layer.view(torch.uint8).reshape(-1).numpy()) for layer in layers]
    nbytes = sum(len(r) for r in raw)
    codecs = [make_codec(name) for name in CODECS]
    encoded = [[codec.encode(r, spec) for r in raw] for codec in codecs]
    outs = [torch.empty_like(sample) for _ in codecs]
    out_views = [[memoryview(out[i].view(torch.uint8).reshape(-1).numpy()) for i in range(len(layers))] for out in outs]
    encode_time = [math.inf] * len(codecs)
    decode_time = [math.inf] * len(codecs)
    with Progress("codecs", total=repeats, keep=False) as progress:  # a step per round, between the timed calls
        for _ in range(repeats):
            for i, codec in enumerate(codecs):
                encode_time[i] = min(encode_time[i], _timed(partial(_encode_all, codec, raw, spec)))
                decode_time[i] = min(
                    decode_time[i], _timed(partial(_decode_all, codec, encoded[i], spec, out_views[i]))
                )
            progress.step()
    results: list[CodecRow] = []
    for codec, segments, out, encode_s, decode_s in zip(codecs, encoded, outs, encode_time, decode_time, strict=True):
        stored = sum(len(memoryview(e).cast("B")) for e in segments)
        error = ""
        if codec.lossless:
            if not torch.equal(out.view(torch.uint8), sample.view(torch.uint8)):
                raise RuntimeError(f"{codec.id} is not bit-exact")
        else:
            measured = roundtrip_error(sample, out)
            error = f"rms rel {measured['rms_rel']:.4f}, cosine {measured['cosine']:.5f}"
            error += f", max abs {measured['max_abs']:.3f}"
        encode_mbps, decode_mbps = per_second(nbytes, encode_s, MB), per_second(nbytes, decode_s, MB)
        results.append(CodecRow("", codec.id, nbytes, stored, encode_mbps, decode_mbps, codec.lossless, error))
    return results


def _encode_all(codec: CodecPipeline, raw: list[memoryview], spec: SegmentSpec) -> None:
    """Encode every segment (what one timing of encoding runs)."""
    for segment in raw:
        codec.encode(segment, spec)


def _decode_all(codec: CodecPipeline, encoded: list[Buffer], spec: SegmentSpec, outs: list[memoryview]) -> None:
    """Decode every segment into its place (what one timing of decoding runs)."""
    for segment, out in zip(encoded, outs, strict=True):
        codec.decode_into(segment, spec, out)


def load_kv_sample(path: Path) -> torch.Tensor:
    """The shared real-KV sample: bf16 bit patterns saved as uint16 (loaded without pickle)."""
    array = np.load(path, allow_pickle=False)
    return torch.from_numpy(array).view(torch.bfloat16)


def default_sample_path() -> Path | None:
    """The shared real-KV sample beside the checkout (``../shared/``), if there is one.

    Looked for from the working directory, then from this checkout (kvstore/bench/ is two levels down).
    """
    for base in (Path.cwd(), Path(__file__).resolve().parents[2]):
        candidate = base.parent / "shared" / "kv_smollm2_512tok_bf16bits.npy"
        if candidate.is_file():
            return candidate
    return None


async def run(mib: int, repeats: int, directory: Path | None, fsync: bool) -> tuple[list[Row], int]:
    """DRAM and disk rows for every layout, ``mib`` MiB each; also ``mib``.

    The disk benchmark writes in a temporary directory under ``directory``, removed at the end.
    """
    rows: list[Row] = []
    workdir = Path(tempfile.mkdtemp(prefix="kvstore-bench-", dir=directory))
    try:
        # a step after each measurement, outside its timing
        with Progress("DRAM and disk", total=2 * len(LAYOUTS), keep=False) as progress:
            for name, layout in LAYOUTS.items():
                chunks = max(4, (mib << 20) // layout.chunk_nbytes)
                progress.doing(f"{name}, DRAM")
                rows += await bench_dram(name, layout, chunks, repeats)
                progress.step(f"{name}: DRAM done")
                layout_dir = workdir / name
                layout_dir.mkdir()
                progress.doing(f"{name}, disk")
                rows += await bench_disk(name, layout, chunks, repeats, layout_dir, fsync)
                shutil.rmtree(layout_dir)
                progress.step(f"{name}: disk done")
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return rows, mib


def parse_names(text: str, choices: Sequence[str], what: str) -> list[str]:
    """A comma-separated list of ``choices`` (or ``all``), for the bench's --remote and --prefetch options."""
    names = [name.strip() for name in text.split(",") if name.strip()]
    names = list(choices) if names == ["all"] else names
    unknown = [name for name in names if name not in choices]
    if unknown:
        raise ValueError(f"unknown {what} {', '.join(unknown)}; choose from {', '.join(choices)} or all")
    return names
