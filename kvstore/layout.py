"""The shape of one model's KV cache, and the fingerprint that keeps layouts apart.

A chunk is stored in canonical TP-1 layout, ``[num_layers, kv_planes, tokens, num_kv_heads,
head_dim]``, whatever the engine's tensor-parallel degree, so a cache written by one
deployment is readable by another. Everything that changes the meaning of the bytes goes
into the fingerprint: a chunk written under another layout is never returned.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from functools import cached_property

import torch

_DTYPES: dict[str, torch.dtype] = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e4m3fnuz": torch.float8_e4m3fnuz,  # AMD MI300's fp8 KV cache
    "float8_e5m2": torch.float8_e5m2,
}


def dtype_from_name(name: str | torch.dtype) -> torch.dtype:
    """Accept ``torch.bfloat16``, ``"bfloat16"`` or ``"torch.bfloat16"``."""
    if isinstance(name, torch.dtype):
        if name not in _DTYPES.values():
            raise ValueError(f"dtype {name} is not supported; use one of {sorted(_DTYPES)}")
        return name
    key = str(name).removeprefix("torch.")
    if key not in _DTYPES:
        raise ValueError(f"dtype {name!r} is not supported; use one of {sorted(_DTYPES)}")
    return _DTYPES[key]


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class KVLayout:
    """Model fingerprint: what one chunk of KV looks like in memory."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype = torch.bfloat16
    kv_planes: int = 2  # 2 for K and V, 1 for MLA latents
    chunk_tokens: int = 256
    _fingerprint: bytes = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", dtype_from_name(self.dtype))
        for name in ("num_layers", "num_kv_heads", "head_dim", "kv_planes", "chunk_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"KVLayout.{name} must be a positive integer, got {value!r}")
        if self.kv_planes not in (1, 2):
            raise ValueError(f"KVLayout.kv_planes must be 1 (MLA) or 2 (K and V), got {self.kv_planes}")
        text = (
            f"kvstore-layout-v1;layers={self.num_layers};planes={self.kv_planes};"
            f"tokens={self.chunk_tokens};heads={self.num_kv_heads};head_dim={self.head_dim};"
            f"dtype={dtype_name(self.dtype)}"
        )
        object.__setattr__(self, "_fingerprint", hashlib.sha256(text.encode()).digest()[:16])

    @property
    def fingerprint(self) -> bytes:
        """16 bytes that change whenever the meaning of a chunk's bytes would."""
        return self._fingerprint

    @cached_property
    def itemsize(self) -> int:
        return self.dtype.itemsize

    @cached_property
    def layer_shape(self) -> tuple[int, int, int, int]:
        return (self.kv_planes, self.chunk_tokens, self.num_kv_heads, self.head_dim)

    @cached_property
    def chunk_shape(self) -> tuple[int, int, int, int, int]:
        return (self.num_layers, *self.layer_shape)

    @cached_property
    def layer_nbytes(self) -> int:
        p, t, h, d = self.layer_shape
        return p * t * h * d * self.itemsize

    @cached_property
    def chunk_nbytes(self) -> int:
        return self.num_layers * self.layer_nbytes

    def describe(self) -> str:
        return (
            f"{self.num_layers} layers x {self.kv_planes} planes x {self.chunk_tokens} tokens x "
            f"{self.num_kv_heads} heads x {self.head_dim} ({dtype_name(self.dtype)}), "
            f"{self.chunk_nbytes / 2**20:.2f} MiB per chunk"
        )
