"""Byte buffers shared by codecs, the container format and the tiers, viewed without copies."""

from __future__ import annotations

import re
import warnings
from concurrent.futures import Executor
from typing import TypeAlias

import numpy as np
import torch

from kvstore.util.copy_kernels import copy_array
from kvstore.util.threads import map_with_helpers, usable_cores

Buffer: TypeAlias = bytes | bytearray | memoryview | np.ndarray
"""Anything with the buffer protocol that we pass around (``collections.abc.Buffer`` is 3.12+)."""

# torch.frombuffer warns "The given buffer is not writable" on every read-only buffer; tensor_view's
# read-only inputs (stored bytes) are only ever read. One filter, installed once and limited to
# this module's calls, instead of ``warnings.catch_warnings()`` around each call: that is not
# thread-safe (two codec threads leaving it out of order can leave the process's filters changed,
# e.g. every UserWarning silenced), and it cost ~20 µs a call, slower still with a second thread.
warnings.filterwarnings(
    "ignore", message="The given buffer is not writable", category=UserWarning, module=re.escape(__name__) + "$"
)


def as_bytes_view(data: Buffer) -> memoryview:
    """A flat unsigned-byte view of any contiguous buffer, without copying."""
    view = memoryview(data)
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous CPU tensor's memory (pinned or not)."""
    if tensor.device.type != "cpu" or not tensor.is_contiguous():
        raise ValueError("tensor_bytes needs a contiguous CPU tensor")
    return memoryview(tensor.view(torch.uint8).reshape(-1).numpy())


def tensor_view(data: Buffer, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """A tensor over ``data``'s memory (no copy); read-only buffers are only ever read."""
    return torch.frombuffer(as_bytes_view(data), dtype=torch.uint8).view(dtype).view(shape)


_SAME_SIZE_INTS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


PARALLEL_COPY_BYTES = 4 << 20  # a copy this large is split over the calling thread and idle helper threads
PARALLEL_COPY_PIECE = 2 << 20  # at least this much a piece: a helper's wake-up costs tens of microseconds


def copy_between(target: torch.Tensor, source: torch.Tensor, helpers: Executor | None = None) -> None:
    """``target.copy_(source)`` for the store's own threads: CPU tensors of one dtype go through numpy, with
    the kernel this process measured faster for the block size (:func:`~kvstore.util.copy_kernels.copy_array`:
    glibc's memmove or a plain vector loop).

    Measured here (2 cores): torch's copy_ of 200 KB pieces runs an OpenMP team per calling
    thread, whose workers spin after each copy and steal the engine's cores; from the loop
    thread 240 such copies took 19-24 ms, ``numpy.copyto`` (one thread, GIL released) 7 ms,
    strided targets included. Anything else (CUDA, a dtype change) is left to torch.

    One thread does not reach the memory's speed, though: a whole 32 MiB chunk copied at 0.64x of
    a two-thread ``Tensor.copy_`` (this 2-core Xeon). So with
    ``helpers`` (the store's pool of copy threads), a copy of at least :data:`PARALLEL_COPY_BYTES`
    is cut into runs of its first dimension, one per usable core, and the calling thread copies
    runs while the helpers that are idle take the others (:func:`map_with_helpers`: it never waits
    for a helper that has not started, and returns only once every run is copied).
    """
    if (
        target.device.type == "cpu"
        and source.device.type == "cpu"
        and target.dtype == source.dtype
        and target.shape == source.shape
        and target.dtype.itemsize in _SAME_SIZE_INTS
    ):
        bits = _SAME_SIZE_INTS[target.dtype.itemsize]
        into, out_of = target.view(bits).numpy(), source.view(bits).numpy()
        nbytes = target.numel() * target.dtype.itemsize
        small = helpers is None or nbytes < PARALLEL_COPY_BYTES or target.dim() == 0  # most copies: no syscall
        pieces = 1 if small else min(usable_cores(), nbytes // PARALLEL_COPY_PIECE, target.shape[0])
        if pieces < 2:
            copy_array(into, out_of)
            return
        rows = target.shape[0]
        bounds = [rows * index // pieces for index in range(pieces + 1)]

        def run(index: int) -> None:
            copy_array(into[bounds[index] : bounds[index + 1]], out_of[bounds[index] : bounds[index + 1]])

        map_with_helpers(run, pieces, helpers, pieces - 1)
    else:
        target.copy_(source)
