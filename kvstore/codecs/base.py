"""The codec interface: one segment (one layer of one chunk) in, bytes out.

Codecs run in worker threads, never on the event loop. Each is a stage; stages compose into
a pipeline written ``"fp8+zstd"`` or ``"bytesplit:3"`` (``name[:level]``, joined by ``+``).
A *transform* stage (byte-split, fp8) understands the values and must come first; the
stages after it see plain bytes.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch

from kvstore.errors import CodecError
from kvstore.util.buffers import Buffer, as_bytes_view


@dataclass(frozen=True)
class SegmentSpec:
    """What the raw bytes of one segment are: needed by codecs that look at values."""

    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape)) * self.itemsize

    @property
    def decode_limit(self) -> int:
        """Upper bound for any intermediate stage's output; guards against hostile size fields."""
        return 2 * self.nbytes + (1 << 20)


class Codec(ABC):
    """One stage of a codec pipeline."""

    name: ClassVar[str]
    lossless: ClassVar[bool] = True
    transform: ClassVar[bool] = False  # reads values, so it must be the first stage
    default_level: ClassVar[int | None] = None

    def __init__(self, level: int | None = None) -> None:
        if level is not None and self.default_level is None:
            raise ValueError(f"codec {self.name!r} takes no level")
        self.level = self.default_level if level is None else level

    @property
    def id(self) -> str:
        return self.name if self.level in (None, self.default_level) else f"{self.name}:{self.level}"

    @abstractmethod
    def encode(self, data: memoryview, spec: SegmentSpec) -> Buffer: ...

    @abstractmethod
    def decode(self, data: memoryview, spec: SegmentSpec) -> Buffer: ...

    def decode_into(self, data: memoryview, spec: SegmentSpec, out: memoryview) -> None:
        """Decode straight into ``out`` (``spec.nbytes`` long); override to skip a copy."""
        decoded = as_bytes_view(self.decode(data, spec))
        if len(decoded) != len(out):
            raise CodecError(f"{self.name}: decoded {len(decoded)} bytes, expected {len(out)}")
        out[:] = decoded


def roundtrip_error(original: torch.Tensor, decoded: torch.Tensor) -> dict[str, float]:
    """How far a lossy round trip moved the values (reported by tests and the benchmark)."""
    a, b = original.float(), decoded.float()
    diff = (a - b).abs()
    return {
        "max_abs": float(diff.max()),
        "rms_rel": float(diff.pow(2).mean().sqrt() / a.pow(2).mean().sqrt().clamp_min(1e-30)),
        "cosine": float(torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), dim=0)),
    }
