"""What a layer stream's reads of local sources are: DRAM copies and file reads of runs of layers.

:class:`kvstore.engine.prefetch.LayerStream` builds the work (one :data:`LocalRead` per chunk and
layer) on the loop and runs :func:`read_files` in the store's I/O threads. A chunk's consecutive
layers read straight into the caller's memory are one vectored read, then a checksum per layer; a
layer read there that fails its checksum is read again into memory of the reader's own before the
file is judged corrupt (and removed): the caller's memory may have changed under the first read.
Every write into the caller's memory is made under the stream's :class:`~kvstore.util.threads.WriteFence`.
Blocking; no state of its own.
"""

from __future__ import annotations

import logging

import torch

from kvstore.errors import ChunkFormatError, PrefetchError
from kvstore.layout import KVLayout
from kvstore.storage.layer_reader import LayerReader
from kvstore.util.buffers import copy_between, tensor_bytes
from kvstore.util.threads import WriteFence

log = logging.getLogger("kvstore.prefetch")

# reader, layer, target, promotion slot's layer, the target's planes as bytes (read straight into them) or None
LocalRead = tuple[LayerReader, int, torch.Tensor, "torch.Tensor | None", "list[memoryview] | None"]


class RunFailed(Exception):
    """A run of layers failed at ``error``'s layer; ``good`` are the outputs of the layers before it, complete."""

    def __init__(self, error: Exception, good: list[torch.Tensor]) -> None:
        super().__init__(error)
        self.error, self.good = error, good


def failed_where(error: BaseException) -> tuple[int, int]:
    """The (layer, chunk) a failure names (unknown parts first: they are reported as they are)."""
    if isinstance(error, PrefetchError):
        return (-1 if error.layer is None else error.layer, -1 if error.chunk is None else error.chunk)
    return (-1, -1)


def chunk_parts(out: torch.Tensor, chunks: int) -> list[list[memoryview]] | None:
    """Per chunk, its planes' bytes in ``out`` (``[planes, chunks * tokens, ...]``) if that is contiguous CPU memory.

    One byte view of the layer, sliced: each chunk's share of a plane is a contiguous run of it.
    """
    if out.device.type != "cpu" or not out.is_contiguous():
        return None
    whole = tensor_bytes(out)
    plane = len(whole) // out.shape[0]
    share = plane // chunks
    return [
        [whole[p * plane + i * share : p * plane + (i + 1) * share] for p in range(out.shape[0])] for i in range(chunks)
    ]


def contiguous_for(target: torch.Tensor, stage: torch.Tensor | None, layout: KVLayout) -> torch.Tensor:
    """Where a layer is read to: the promotion slot's layer, else ``target`` itself if contiguous, else a temporary."""
    if stage is not None:
        return stage
    return target if target.is_contiguous() else torch.empty(layout.layer_shape, dtype=layout.dtype)


def read_files(
    items: list[LocalRead], copies: list[tuple[torch.Tensor, torch.Tensor]], layout: KVLayout, fence: WriteFence
) -> list[Exception | None]:
    """DRAM copies and reads of open files (in a worker thread); per read, the error or None.

    Consecutive items of one reader read straight into the caller's memory are one vectored read.
    Every write into a target is made under ``fence`` (the stream's, over the caller's outputs):
    once the stream has closed it, the next write raises :class:`FenceClosed` out of this call.
    """
    for target, source in copies:
        with fence:
            copy_between(target, source)
    outcomes: list[Exception | None] = []
    start = 0
    while start < len(items):
        reader, layer, target, stage, parts = items[start]
        end = start + 1
        while parts is not None and end < len(items) and items[end][0] is reader and items[end][4] is not None:
            if items[end][1] != items[end - 1][1] + 1:
                break
            end += 1
        with fence:
            if end - start > 1:
                run = [item[4] for item in items[start:end] if item[4] is not None]  # (every one: see the loop above)
                outcomes.extend(_read_run(reader, layer, run))
            else:
                outcomes.append(_read_one(reader, layer, target, stage, parts, layout))
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


def _read_one(
    reader: LayerReader,
    layer: int,
    target: torch.Tensor,
    stage: torch.Tensor | None,
    parts: list[memoryview] | None,
    layout: KVLayout,
) -> Exception | None:
    """One layer of one chunk into ``target`` (in place into ``parts`` if given, else through ``stage``)."""
    contiguous = target if parts is not None else contiguous_for(target, stage, layout)
    try:
        reader.read_local(layer, parts if parts is not None else [tensor_bytes(contiguous)])
    except Exception as exc:
        return _confirmed(reader, layer, parts, exc) if parts is not None else exc
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
