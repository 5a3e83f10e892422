"""Two ways to copy a block of CPU memory, and which one this process uses for each block size.

``numpy.copyto`` between arrays of one type calls glibc's ``memmove``, which picks its own way by size
and CPU vendor: ``rep movsb``, an ordinary vector loop, or non-temporal stores that bypass the caches.
A copy between integer types of one size (``int16`` into ``uint16``: the same bits) makes numpy run its
own loop of plain vector loads and stores instead, as ``Tensor.copy_`` copies. Which is faster depends
on the CPU. On this project's Xeon, ``memmove`` by 1.10-1.18x (one thread, whole chunks and a chunk's
layer); on an AVX2 EPYC, kvstore's ``memmove`` copies measured 0.60-0.65x of ``Tensor.copy_``'s loop.

So each block size class (powers of 4 from :data:`SMALLEST_MEASURED`; a block is the run contiguous in
both C-ordered arrays, what numpy hands ``memmove`` at a time) times its first :data:`TRIAL_COPIES`
copies with each kernel, in turn, and from then on uses the vector loop only if it was clearly faster
(:data:`MARGIN`) by both its best and its median time: other work running at the same moment only ever
slows a copy, so the best times compare the kernels themselves, and the medians keep one lucky copy
from deciding. Otherwise, and for smaller blocks or anything but two native integer arrays of one
type and shape, ``memmove``. The choice is the process's, like glibc's own. Both kernels copy the same
bits, so the choice only ever changes speed; a trial costs nothing beyond timing the copy it makes anyway.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Callable

import numpy as np

from kvstore.util.units import human_bytes

MEMMOVE, VECTOR = "memmove", "vector"
SMALLEST_MEASURED = 64 << 10  # smaller blocks always go through memmove: there the call costs more than the bytes
TRIAL_COPIES = 6  # timed copies per kernel and size class before the choice
MARGIN = 0.8  # the vector loop is kept where its best and median times per byte are under this fraction of memmove's


def copy_array(into: np.ndarray, out_of: np.ndarray) -> None:
    """``into[...] = out_of`` for arrays of one shape and one integer dtype, with this size's kernel.

    Blocking; numpy releases the GIL for the copy, so other threads run meanwhile.
    """
    if (
        into.nbytes < SMALLEST_MEASURED  # no block of it can be measured
        or into.dtype != out_of.dtype
        or into.dtype.kind not in "iu"
        or not into.dtype.isnative  # the cast would swap the bytes
        or into.shape != out_of.shape
    ):
        np.copyto(into, out_of)
        return
    both = into.flags.c_contiguous and out_of.flags.c_contiguous
    block = into.nbytes if both else contiguous_block(into, out_of)
    if block < SMALLEST_MEASURED:
        np.copyto(into, out_of)
        return
    size_class = (block.bit_length() - SMALLEST_MEASURED.bit_length()) // 2
    kernel = CHOICE.chosen.get(size_class)
    if kernel is not None:
        KERNELS[kernel](into, out_of)
        return
    kernel = CHOICE.next_trial(size_class)
    start = time.perf_counter()
    KERNELS[kernel](into, out_of)
    CHOICE.record(size_class, kernel, (time.perf_counter() - start) / into.nbytes)  # at least SMALLEST_MEASURED


def copy_memmove(into: np.ndarray, out_of: np.ndarray) -> None:
    """glibc's ``memmove``, one call per contiguous block."""
    np.copyto(into, out_of)


def copy_vector_loop(into: np.ndarray, out_of: np.ndarray) -> None:
    """numpy's own loop of vector loads and stores: a cast into the other signedness, which keeps every bit."""
    other = np.dtype(f"{'u' if into.dtype.kind == 'i' else 'i'}{into.dtype.itemsize}")
    np.copyto(into.view(other), out_of, casting="unsafe")


KERNELS: dict[str, Callable[[np.ndarray, np.ndarray], None]] = {MEMMOVE: copy_memmove, VECTOR: copy_vector_loop}


def contiguous_block(into: np.ndarray, out_of: np.ndarray) -> int:
    """Bytes of the longest run that is contiguous in both arrays: what numpy copies per inner call."""
    block, shape, into_strides, out_of_strides = into.itemsize, into.shape, into.strides, out_of.strides
    for dimension in range(len(shape) - 1, -1, -1):  # innermost first; an index loop: this runs on every copy
        if shape[dimension] == 1:
            continue
        if into_strides[dimension] != block or out_of_strides[dimension] != block:
            break
        block *= shape[dimension]
    return block


class KernelChoice:
    """Per size class, the trials so far and, once made, the choice. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._trials: dict[int, dict[str, list[float]]] = {}
        self.chosen: dict[int, str] = {}  # read without the lock: a dict lookup is atomic

    def next_trial(self, size_class: int) -> str:
        """The kernel with fewer trials in ``size_class`` (memmove first)."""
        with self._lock:
            trials = self._trials.setdefault(size_class, {MEMMOVE: [], VECTOR: []})
            return VECTOR if len(trials[VECTOR]) < len(trials[MEMMOVE]) else MEMMOVE

    def record(self, size_class: int, kernel: str, seconds_per_byte: float) -> None:
        """One trial's time; the choice is made once both kernels have :data:`TRIAL_COPIES`."""
        with self._lock:
            if size_class in self.chosen:
                return
            trials = self._trials.setdefault(size_class, {MEMMOVE: [], VECTOR: []})
            trials[kernel].append(seconds_per_byte)
            if min(len(times) for times in trials.values()) < TRIAL_COPIES:
                return
            vector, memmove = trials[VECTOR], trials[MEMMOVE]
            faster = min(vector) < MARGIN * min(memmove) and statistics.median(vector) < MARGIN * statistics.median(
                memmove
            )
            self.chosen[size_class] = VECTOR if faster else MEMMOVE

    def describe(self) -> str:
        """The choices made so far, e.g. "memmove for blocks of 1.0 MiB to 4.0 MiB; vector for blocks of ..."."""
        with self._lock:
            chosen = sorted(self.chosen.items())
        if not chosen:
            return "none yet"
        return "; ".join(f"{kernel} for blocks of {_size_class_range(size_class)}" for size_class, kernel in chosen)


def _size_class_range(size_class: int) -> str:
    low = SMALLEST_MEASURED << (2 * size_class)
    return f"{human_bytes(low)} to {human_bytes(low << 2)}"


CHOICE = KernelChoice()  # the process's
