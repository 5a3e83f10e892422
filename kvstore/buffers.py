"""Byte buffers shared by codecs, the container format and the tiers, viewed without copies."""

from __future__ import annotations

import warnings
from typing import TypeAlias

import numpy as np
import torch

Buffer: TypeAlias = bytes | bytearray | memoryview | np.ndarray
"""Anything with the buffer protocol that we pass around (``collections.abc.Buffer`` is 3.12+)."""


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
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "The given buffer is not writable"
        return torch.frombuffer(as_bytes_view(data), dtype=torch.uint8).view(dtype).view(shape)
