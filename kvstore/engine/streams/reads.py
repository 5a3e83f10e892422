"""How one run of a layer stream's layers is read: the work its chunks give, run at once, failures judged.

Each chunk of the run adds its work to a :class:`RunReads` (see :mod:`kvstore.engine.streams.sources`):
DRAM copies (:class:`DramCopy`) and file reads (:class:`FileRead`) go to the store's I/O threads, spread
over as many thread calls as the stream allows, a chunk's layers in one call; reads from remote tiers run
on the loop.
:meth:`RunReads.run` runs them all and raises the failure of the first layer (then chunk) that failed:
the layers before it are sound.

In a thread, :func:`read_files` reads a chunk's consecutive layers straight into the caller's memory as
one vectored read, then checks a checksum per layer; a layer read there that fails its checksum is read
again into memory of the reader's own before the file is judged corrupt (and removed): the caller's
memory may have changed under the first read. Every write into the caller's memory is made under the
stream's :class:`~kvstore.util.threads.WriteFence`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import NamedTuple

import torch

from kvstore.engine.streams.outputs import LayerRun
from kvstore.engine.streams.resources import StreamResources
from kvstore.errors import ChunkFormatError, PrefetchError
from kvstore.layout import KVLayout
from kvstore.storage.layer_reader import LayerReader
from kvstore.util.buffers import copy_between, tensor_bytes
from kvstore.util.threads import WriteFence, in_thread

log = logging.getLogger("kvstore.prefetch")


class FileRead(NamedTuple):
    """One layer of a chunk on a local tier, to be read into ``target``."""

    reader: LayerReader
    layer: int
    target: torch.Tensor  # where the layer goes (a chunk's share of an output, or host memory of the stream's)
    stage: torch.Tensor | None  # also into this (its promotion slot's layer): read there, then copied to target
    planes: list[memoryview] | None  # target's planes as bytes: read straight into them
    chunk: int  # the chunk's index in the stream, for the error


class DramCopy(NamedTuple):
    """One chunk's layers of a run, from its DRAM slot into its shares of the run's outputs.

    The views of each layer (its share, the slot's layer) are made by the thread that copies: made on the
    loop, 16 chunks x 5 layers of them held both copy threads idle ~0.9 ms between runs (2 cores).
    """

    run: LayerRun  # read only (its layers and sizes, fixed when the run was made)
    chunk: int  # the chunk's index in the stream
    layers: torch.Tensor  # the slot's layers of the run, [count, *layer_shape]


class RunReads:
    """The reads of one run of layers: collected from its chunks (on the loop), then :meth:`run`.

    ``threads``: the thread calls the copies and file reads are spread over; ``accounted``: the readers
    whose failure a tier has counted already (shared by a stream's runs: a chunk's failure counts once).
    """

    def __init__(self, resources: StreamResources, fence: WriteFence, threads: int, accounted: set[int]) -> None:
        self._resources, self._fence, self._threads, self._accounted = resources, fence, threads, accounted
        self.copies: list[DramCopy] = []  # per chunk in DRAM: its layers' copies
        self.files: list[list[FileRead]] = []  # per chunk on a local tier: its layers' reads, in order
        self.remote: list[Callable[[], Awaitable[None]]] = []  # per layer of a remote chunk: its read

    async def run(self) -> None:
        """Run every read; raises the failure of the first layer, then chunk, that failed (PrefetchError, or
        what a read raised: FenceClosed once the stream closed the fence)."""
        calls = [read() for read in self.remote]
        groups = max(1, min(self._threads, len(self.files) + len(self.copies)))
        if self.files or self.copies:  # a chunk's file reads in one call, the chunks and copies dealt out among them
            for group in range(groups):
                items = [item for chunk in self.files[group::groups] for item in chunk]
                calls.append(self._in_thread(items, self.copies[group::groups]))
        errors = [error for error in await asyncio.gather(*calls, return_exceptions=True) if error is not None]
        if errors:
            raise min(errors, key=failed_where)

    async def _in_thread(self, items: list[FileRead], copies: list[DramCopy]) -> None:
        """DRAM copies and file reads, in one worker-thread call; then each failed chunk counted by its tier.

        In a worker, not on the loop: the loop thread then sits in ``select`` while the bytes move,
        and an engine thread woken by the previous layer gets the GIL at once instead of waiting
        up to a switch interval (5 ms) for a loop thread that copies layer after layer.
        """
        resources = self._resources
        outcomes = await in_thread(resources.executor, read_files, items, copies, resources.layout, self._fence)
        failed: FileRead | None = None  # the first (layer, chunk) that failed
        for item, outcome in zip(items, outcomes, strict=True):
            if outcome is None:
                item.reader.count(item.layer)
                continue
            if id(item.reader) not in self._accounted:  # a chunk's failure counts once (runs in flight may both see it)
                self._accounted.add(id(item.reader))
                await item.reader.tier.account(item.reader.key, outcome)  # counted; a corrupt file is removed
            if failed is None or (item.layer, item.chunk) < (failed.layer, failed.chunk):
                failed = item
        if failed is not None:
            message = f"layer {failed.layer} of chunk {failed.reader.key[:16]}... could not be read from disk"
            raise PrefetchError(message, chunk=failed.chunk, layer=failed.layer)


def failed_where(error: BaseException) -> tuple[int, int]:
    """The (layer, chunk) a failure names (unknown parts first: they are reported as they are)."""
    if isinstance(error, PrefetchError):
        return (-1 if error.layer is None else error.layer, -1 if error.chunk is None else error.chunk)
    return (-1, -1)


def read_files(
    items: list[FileRead], copies: list[DramCopy], layout: KVLayout, fence: WriteFence
) -> list[Exception | None]:
    """DRAM copies and reads of open files (blocking: a worker thread's); per read, the error or None.

    Consecutive items of one reader read straight into the caller's memory are one vectored read.
    Every write into a target is made under ``fence`` (the stream's, over the caller's outputs):
    once the stream has closed it, the next write raises :class:`FenceClosed` out of this call.
    """
    for copy in copies:
        for j in range(copy.run.count):
            target, source = copy.run.share(copy.chunk, j), copy.layers[j]
            with fence:
                copy_between(target, source)
    outcomes: list[Exception | None] = []
    start = 0
    while start < len(items):
        first = items[start]
        end = start + 1
        while (
            first.planes is not None
            and end < len(items)
            and items[end].reader is first.reader
            and items[end].planes is not None
            and items[end].layer == items[end - 1].layer + 1
        ):
            end += 1
        with fence:
            if end - start > 1:
                run = [item.planes for item in items[start:end] if item.planes is not None]  # (every one: see above)
                outcomes.extend(_read_run(first.reader, first.layer, run))
            else:
                outcomes.append(_read_one(first, layout))
        start = end
    return outcomes


def _read_run(reader: LayerReader, first: int, run: list[list[memoryview]]) -> list[Exception | None]:
    """Layers ``first``, ``first + 1``, ... of one chunk read in place into ``run``; per layer, the error or None."""
    results: list[Exception | None]
    try:
        results = reader.read_local_run(first, run)
    except Exception as exc:  # the read itself failed (an I/O error): every layer of the run with it
        results = [exc] * len(run)
    return [_confirmed(reader, first + k, run[k], result) for k, result in enumerate(results)]


def _read_one(item: FileRead, layout: KVLayout) -> Exception | None:
    """One layer of one chunk into its target: in place into ``planes`` if given, else through contiguous memory
    (the promotion slot's layer, else the target itself if contiguous, else a temporary), then copied."""
    reader, layer, target = item.reader, item.layer, item.target
    if item.planes is not None:
        try:
            reader.read_local(layer, item.planes)
        except Exception as exc:
            return _confirmed(reader, layer, item.planes, exc)
        return None
    if item.stage is not None:
        contiguous = item.stage
    else:
        contiguous = target if target.is_contiguous() else torch.empty(layout.layer_shape, dtype=layout.dtype)
    try:
        reader.read_local(layer, [tensor_bytes(contiguous)])
    except Exception as exc:
        return exc
    if contiguous is not target:
        copy_between(target, contiguous)
    return None


def _confirmed(reader: LayerReader, layer: int, parts: list[memoryview], outcome: Exception | None) -> Exception | None:
    """The outcome of a read in place into ``parts``; a failed checksum is confirmed by a read into memory of
    our own (a file is removed as corrupt only on that), and if that one passes its bytes are put in place."""
    if not isinstance(outcome, ChunkFormatError):
        return outcome
    own = memoryview(bytearray(sum(len(part) for part in parts)))
    try:
        reader.read_local(layer, [own])
    except Exception as again:
        return again
    log.warning("layer %d of chunk %s... changed in the caller's memory while it was read there; read again",
                layer, reader.key[:16])  # fmt: skip
    offset = 0
    for part in parts:
        part[:] = own[offset : offset + len(part)]
        offset += len(part)
    return None
