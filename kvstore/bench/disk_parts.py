"""Where a disk ``put`` + ``flush`` spends its time: each stage of the path timed alone, on the same chunks.

``kvstore bench --disk-parts`` prints this under its DRAM and disk table. Measured, per layout:

- the whole path through the public API: the ``put`` calls (each copies the caller's chunk into a
  DRAM slot and queues the tier's write), then ``flush`` (waits for the tier's writes);
- the stages of that path, each alone in one thread over the same chunks: the copy into a DRAM
  slot, the header, creating the temporary file, the checksums and the write as the tier does
  them (a run of layers at a time, each written right after its checksums, from the CPU's cache),
  fsync (when the tier fsyncs), close and the rename into place. These add up to the path, but
  for queueing and overlap (negative where the tier's writes ran while later puts copied);
- two details, not added: the checksums alone over bytes no longer in cache, and one gather
  write of ready-made bytes (what the tier's write cost before it went a run at a time);
- the baselines of ``kvstore bench``'s disk row: raw writes of the same bytes in one thread and
  in two (:data:`~kvstore.bench.local.RAW_THREADS`), and the work any store that returns before
  the I/O must do: a copy into memory the caller does not own, then the raw writes.

The file stages use the disk tier's own file steps (a private temporary, the run-at-a-time
write of :func:`~kvstore.backends.files.write_stream`, the rename), timed outside the tier.
"""

from __future__ import annotations

import asyncio
import os
import tempfile
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch

from kvstore.backends.base import StreamedObject
from kvstore.backends.files import write_fully, write_stream
from kvstore.codecs import make_codec
from kvstore.engine.store import KVStore
from kvstore.layout import KVLayout
from kvstore.storage.container import Segment, encode_header, encode_layers, header_size, stream_plain_chunk
from kvstore.util.buffers import tensor_bytes


@dataclass(frozen=True)
class Part:
    """One stage (or total, or baseline) of a disk put, over every chunk of the run: its best time."""

    layout: str
    stage: str
    nbytes: int
    seconds: float
    kind: str  # "path" (the API), "stage" (one thread; these add up), "detail" (not added), "rest", "baseline"


def _best(fn: Callable[[], float], repeats: int) -> float:
    return min(fn() for _ in range(repeats))


class _FileStages:
    """The disk tier's file work on ready-made objects, each step timed over every chunk."""

    def __init__(self, directory: Path, fsync: bool) -> None:
        self.directory, self.fsync = directory, fsync
        directory.mkdir(mode=0o700)

    def run(self, objects: Sequence[Callable[[int], None]]) -> dict[str, float]:
        """Each ``fill(fd)`` into its own temporary file, as the tier writes one (see DiskBackend._write_file)."""
        for old in self.directory.iterdir():  # write into pages the last round freed, as the tier does
            old.unlink()
        times = dict.fromkeys(("create", "write", "fsync", "close", "rename"), 0.0)
        for index, fill in enumerate(objects):
            final = str(self.directory / f"chunk-{index}")
            start = time.perf_counter()
            fd = os.open(f"{final}.tmp", os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
            created = time.perf_counter()
            fill(fd)
            written = time.perf_counter()
            if self.fsync:
                os.fsync(fd)
            synced = time.perf_counter()
            os.close(fd)
            closed = time.perf_counter()
            os.replace(f"{final}.tmp", final)
            renamed = time.perf_counter()
            for stage, seconds in zip(times, (created - start, written - created, synced - written, closed - synced,
                                               renamed - closed), strict=True):  # fmt: skip
                times[stage] += seconds
        return times


async def disk_put_parts(
    name: str, layout: KVLayout, chunks: int, repeats: int, directory: Path, fsync: bool
) -> list[Part]:
    """The stages of ``put`` + ``flush`` to the disk tier for ``chunks`` chunks (see the module docstring)."""
    from kvstore.bench.local import (
        RAW_THREADS,
        RawFiles,
        _copy_all,
        _raw_write,
        _run_share,
        _sample_chunks,
        _timed,
        bench_keys,
        disk_bench_config,
    )

    sources = _sample_chunks(layout, chunks, seed=2)  # distinct chunks: none is in cache when its turn comes
    total = chunks * layout.chunk_nbytes
    keys = bench_keys(layout, chunks, f"parts-{name}")
    parts: list[Part] = []
    async with KVStore(disk_bench_config(layout, chunks, directory, fsync), layout, f"parts-{name}") as store:
        tier = store.tiers[0]
        best_put, best_flush, best_total = float("inf"), float("inf"), float("inf")
        for _ in range(repeats):
            await store.flush()
            for key in keys:
                store.pool.discard(key)
                await tier.backend.delete(key)
            start = time.perf_counter()
            for key, source in zip(keys, sources, strict=True):
                if not await store.put(key, source):
                    raise RuntimeError("DRAM refused a put during the benchmark")
            put = time.perf_counter()
            await store.flush()
            end = time.perf_counter()
            if end - start < best_total:
                best_put, best_flush, best_total = put - start, end - put, end - start
    parts += [
        Part(name, "put + flush (the API)", total, best_total, "path"),
        Part(name, "  put calls", total, best_put, "path"),
        Part(name, "  flush, after the last put", total, best_flush, "path"),
    ]

    slots = [torch.zeros_like(source) for source in sources]  # pre-touched, like the pool's slab

    def copy() -> float:
        return _timed(lambda: _copy_all(slots, sources))

    identity = make_codec("identity")
    head_length = header_size(layout.num_layers, identity.id)
    encoded: list[list[tuple[memoryview, Segment]]] = []

    def checksums() -> float:
        encoded.clear()
        start = time.perf_counter()
        for source in sources:  # not in cache: the slots were written last
            encoded.append(encode_layers(layout, tensor_bytes(source), identity))
        return time.perf_counter() - start

    def header() -> float:
        start = time.perf_counter()
        for key, layers in zip(keys, encoded, strict=True):
            encode_header(layout, key, identity.id, [segment for _, segment in layers])
        return time.perf_counter() - start

    parts.append(Part(name, "copy into a DRAM slot (put)", total, _best(copy, repeats), "stage"))
    parts.append(
        Part(name, "checksums alone (xxh3 per layer, from memory)", total, _best(checksums, repeats), "detail")
    )
    parts.append(Part(name, "header", total, _best(header, repeats), "stage"))
    files = _FileStages(directory / "stages", fsync)
    whole = [
        partial(write_fully, views=[memoryview(bytes(head_length)), *(view for view, _ in layers)])
        for layers in encoded
    ]  # one gather write of ready-made bytes
    streamed = [
        partial(_fill, make=partial(stream_plain_chunk, layout, key, tensor_bytes(source)))
        for key, source in zip(keys, sources, strict=True)
    ]  # the tier's: each run checksummed, then written from cache
    alone = min((files.run(whole) for _ in range(repeats)), key=lambda times: sum(times.values()))
    path = min((files.run(streamed) for _ in range(repeats)), key=lambda times: sum(times.values()))
    parts.append(Part(name, "write alone (one gather write, from memory)", total, alone["write"], "detail"))
    parts.append(Part(name, "checksums + write, a run at a time (the tier)", total, path["write"], "stage"))
    labels = {"create": "create the temporary file", "fsync": "fsync", "close": "close", "rename": "rename"}
    for stage, label in labels.items():
        if stage != "fsync" or fsync:
            parts.append(Part(name, label, total, path[stage], "stage"))
    staged = sum(part.seconds for part in parts if part.kind == "stage")
    parts.append(Part(name, "not in the stages: queueing, overlap (-)", total, best_total - staged, "rest"))

    with ThreadPoolExecutor(RAW_THREADS, thread_name_prefix="raw-io") as executor:
        raw = RawFiles(directory / "raw", executor)
        source_bytes = [tensor_bytes(source) for source in sources]
        loop = asyncio.get_running_loop()

        async def raw_write(threads: int, copy_first: bool) -> float:
            if threads == 1:
                for old in raw.directory.iterdir():
                    old.unlink()
                one_by_one = partial(
                    _run_share, range(chunks), lambda i: _raw_write(raw.directory, i, source_bytes[i], fsync)
                )
                return await loop.run_in_executor(executor, _timed, one_by_one)
            if not copy_first:
                return await raw.write(source_bytes, chunks, fsync)
            start = time.perf_counter()  # the same work a store does: a copy the caller may not touch, then write
            copy()
            return time.perf_counter() - start + await raw.write([tensor_bytes(slot) for slot in slots], chunks, fsync)

        what = "write+fsync" if fsync else "write"
        for threads, copy_first, label in (
            (1, False, f"raw {what}, 1 thread"),
            (RAW_THREADS, False, f"raw {what}, {RAW_THREADS} threads (the disk row's baseline)"),
            (RAW_THREADS, True, f"copy, then raw {what} in {RAW_THREADS} threads (a store's work)"),
        ):
            seconds = min([await raw_write(threads, copy_first) for _ in range(repeats)])
            parts.append(Part(name, label, total, seconds, "baseline"))
    return parts


async def run_disk_parts(mib: int, repeats: int, directory: Path | None, fsync: bool) -> list[Part]:
    """:func:`disk_put_parts` for every layout of ``kvstore bench``, ``mib`` MiB each, in a temporary directory."""
    from kvstore.bench.local import LAYOUTS

    parts: list[Part] = []
    with tempfile.TemporaryDirectory(prefix="kvstore-parts-", dir=directory) as workdir:
        for name, layout in LAYOUTS.items():
            chunks = max(4, (mib << 20) // layout.chunk_nbytes)
            layout_dir = Path(workdir) / name
            layout_dir.mkdir()
            parts += await disk_put_parts(name, layout, chunks, repeats, layout_dir, fsync)
    return parts


def _fill(fd: int, make: Callable[[], StreamedObject]) -> None:
    write_stream(fd, make())
