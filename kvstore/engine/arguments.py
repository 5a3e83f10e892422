"""The checks of what an engine hands the store's public methods: keys, tensors, and output buffers.

A wrong argument fails at the call, naming the call and the argument (``get_many: outs[2] must be a
torch.Tensor, got list``), never as an AttributeError from deep inside a tier. As elsewhere in kvstore,
a programming error raises the built-in kind (:mod:`kvstore.errors`): TypeError for a wrong type,
ValueError for a wrong value.

Output buffers must not share memory: two results written into one buffer would both hold the last
chunk written. :func:`refuse_shared_memory` compares the bytes each tensor covers exactly (a view
interleaved with another, such as two pages of a layer-first host pool, shares nothing), as runs of
contiguous memory: a tensor's innermost dims that are laid out densely form one run, its other dims
repeat it. Views that would need more than :data:`MAX_RUNS` runs to compare (rare, highly strided
ones whose byte ranges overlap) are compared by identity only, as torch itself gives up on them.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import numpy as np
import torch

MAX_RUNS = 1 << 20  # runs of contiguous memory compared at most, per call


def check_keys(keys: object, call: str) -> None:
    """``keys`` is a collection of chunk keys, not one key (a str would be read as its characters)."""
    if isinstance(keys, str | bytes | bytearray) or not isinstance(keys, Iterable):
        single = " (one key: pass [key])" if isinstance(keys, str | bytes | bytearray) else ""
        raise TypeError(f"{call}: keys must be a sequence of chunk keys (str), got {type(keys).__name__}{single}")


def check_tensor(value: object, name: str) -> torch.Tensor:
    """``value`` is a dense (strided) torch tensor; a TypeError naming ``name`` if not."""
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    if value.layout != torch.strided:
        raise TypeError(f"{name} must be a dense (strided) tensor, got a {value.layout} one")
    return value


def check_tensors(values: object, name: str) -> None:
    """``values`` is a sequence (list, tuple) of tensors, each checked by :func:`check_tensor` as ``name[i]``."""
    if isinstance(values, str | bytes | bytearray) or not isinstance(values, Sequence | torch.Tensor):
        raise TypeError(f"{name} must be a sequence of torch.Tensor, got {type(values).__name__}")
    for i, value in enumerate(values):
        check_tensor(value, f"{name}[{i}]")


def refuse_shared_memory(tensors: Sequence[torch.Tensor], call: str, name: str, why: str) -> None:
    """A ValueError naming ``call``, the argument ``name`` and the two indices when two of ``tensors`` cover
    one byte (the same tensor twice, or overlapping views of one storage), or one covers a byte twice."""
    spans: dict[tuple[str, int | None], list[tuple[int, int, int]]] = {}  # per device: (first, end, index)
    for i, tensor in enumerate(tensors):
        if tensor.device.type == "meta":  # no memory at all (refused for that where it matters)
            continue
        span = _byte_span(tensor)
        if span is not None:
            spans.setdefault((tensor.device.type, tensor.device.index), []).append((*span, i))
    for group in spans.values():
        for cluster in _overlapping_spans(group):
            pair = _shared(tensors, cluster)
            if pair is not None:
                first, second = sorted(pair)
                if first == second:
                    what = f"{name}[{first}] covers some bytes twice"
                else:
                    what = f"{name}[{first}] and {name}[{second}] share memory"
                raise ValueError(f"{call}: {what} (the same tensor, or views of the same bytes): {why}")


def _byte_span(tensor: torch.Tensor) -> tuple[int, int] | None:
    """The addresses ``[first, end)`` the tensor's elements lie within; None for an empty tensor."""
    if tensor.numel() == 0:
        return None
    size = tensor.element_size()
    last = sum((length - 1) * stride for length, stride in zip(tensor.shape, tensor.stride(), strict=True))
    start = tensor.data_ptr()
    return start, start + (last + 1) * size


def _overlapping_spans(spans: list[tuple[int, int, int]]) -> list[list[int]]:
    """The indices of tensors whose spans overlap, in clusters of two or more (disjoint spans share nothing)."""
    clusters: list[list[int]] = []
    current: list[int] = []
    reach = -1
    for first, end, index in sorted(spans):
        if first >= reach:
            if len(current) > 1:
                clusters.append(current)
            current = []
        current.append(index)
        reach = max(reach, end)
    if len(current) > 1:
        clusters.append(current)
    return clusters


def _shared(tensors: Sequence[torch.Tensor], cluster: list[int]) -> tuple[int, int] | None:
    """Two indices in ``cluster`` whose tensors cover a common byte (equal where one covers a byte twice)."""
    runs: list[tuple[np.ndarray, int]] = []
    for i in cluster:
        run = _runs(tensors[i])
        if run is None or sum(len(starts) for starts, _ in runs) + len(run[0]) > MAX_RUNS:
            return _identical(tensors, cluster)  # too many runs to compare: only the same view twice
        runs.append(run)
    starts = np.concatenate([starts for starts, _ in runs])
    ends = np.concatenate([starts + length for starts, length in runs])
    owners = np.concatenate([np.full(len(run[0]), i) for i, run in zip(cluster, runs, strict=True)])
    order = np.argsort(starts, kind="stable")
    starts, ends, owners = starts[order], ends[order], owners[order]
    reach = np.maximum.accumulate(ends)
    overlapping = np.flatnonzero(starts[1:] < reach[:-1])
    if not len(overlapping):
        return None
    at = int(overlapping[0]) + 1  # this run starts before an earlier one ends: the one reaching furthest
    return int(owners[int(np.argmax(ends[:at]))]), int(owners[at])


def _identical(tensors: Sequence[torch.Tensor], cluster: list[int]) -> tuple[int, int] | None:
    """Two indices whose tensors are the same view of the same memory, if any."""
    seen: dict[tuple[int, tuple[int, ...], tuple[int, ...]], int] = {}
    for i in cluster:
        view = (tensors[i].data_ptr(), tuple(tensors[i].shape), tuple(tensors[i].stride()))
        if view in seen:
            return seen[view], i
        seen[view] = i
    return None


def _runs(tensor: torch.Tensor) -> tuple[np.ndarray, int] | None:
    """The tensor's memory as runs of contiguous bytes: their start addresses, and the bytes in each; None
    where there would be more than :data:`MAX_RUNS` of them."""
    size = tensor.element_size()
    dims = sorted((stride, length) for length, stride in zip(tensor.shape, tensor.stride(), strict=True) if length > 1)
    run, inner = 1, 0  # elements in a run; dims laid out densely inside it
    while inner < len(dims) and dims[inner][0] == run:
        run *= dims[inner][1]
        inner += 1
    outer = dims[inner:]
    if math.prod(length for _, length in outer) > MAX_RUNS:
        return None
    starts = np.array([tensor.data_ptr()], dtype=np.int64)
    for stride, length in outer:
        starts = (starts[:, None] + np.arange(length, dtype=np.int64) * (stride * size)).ravel()
    return starts, run * size
