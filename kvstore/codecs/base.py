"""The codec interface: one segment (one layer of one chunk) in, bytes out, in typed stages.

Codecs run in worker threads, never on the event loop. Each codec is a *stage*; stages compose
into a pipeline written ``"fp8+zstd"`` or ``"bytesplit:3"`` (``name[:level]``, joined by ``+``).
As in zarr v3, a stage is typed by what it takes and what it gives:

- :class:`ArrayArrayCodec`, array→array: reads the segment's values and gives values again, of
  the same or another dtype and shape (:meth:`Codec.encoded_spec` says which): ``hadamard``
  (a rotation over head_dim, float32 out), or a third-party transform (a delta, a cast) that a
  serializer or compressor should see as values.
- :class:`ArrayBytesCodec`, array→bytes, a *serializer*: reads values and gives an opaque byte
  layout (byte-split's two planes, fp8's and int8/int4's scales and codes). Its output is no
  longer values, so no stage that reads values can follow it, and a pipeline has at most one.
  Without one, the values' raw memory layout is the serialization.
- :class:`BytesBytesCodec`, bytes→bytes: a compressor that never looks at values (zstd, lz4,
  identity), so any number of them may follow, in any order.

fp8 is a serializer rather than an array→array cast because its output carries per-channel
scales next to the codes, which no single dtype and shape describes. The pipeline
(:mod:`kvstore.codecs.pipeline`) checks the order array→array*, array→bytes?, bytes→bytes*
when it is built.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from enum import IntEnum
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


class StageKind(IntEnum):
    """What a stage takes and gives; in a pipeline the kinds never decrease."""

    ARRAY_ARRAY = 0
    ARRAY_BYTES = 1
    BYTES_BYTES = 2

    def __str__(self) -> str:
        return self.name.lower().replace("_", "→")


class Codec(ABC):
    """One stage of a codec pipeline. Subclass one of the three kinds below, not this class."""

    name: ClassVar[str]  # what configs and chunk headers call it: written to disk, so never rename one
    kind: ClassVar[StageKind]
    lossless: ClassVar[bool] = True
    default_level: ClassVar[int | None] = None  # None: the stage takes no level

    def __init__(self, level: int | None = None) -> None:
        if level is not None and self.default_level is None:
            raise ValueError(f"codec {self.name!r} takes no level")
        self.level = self.default_level if level is None else level

    @property
    def id(self) -> str:
        return self.name if self.level in (None, self.default_level) else f"{self.name}:{self.level}"

    def encoded_spec(self, spec: SegmentSpec) -> SegmentSpec:
        """The spec that the next stage is given; an array→array stage that changes dtype or shape says so."""
        return spec

    @abstractmethod
    def encode(self, data: memoryview, spec: SegmentSpec) -> Buffer: ...

    @abstractmethod
    def decode(self, data: memoryview, spec: SegmentSpec) -> Buffer: ...

    def encode_batch(self, segments: Sequence[memoryview], spec: SegmentSpec) -> list[Buffer]:
        """Encode several segments of one spec (a chunk's layers), in order (blocking).

        The result is exactly ``[self.encode(s, spec) for s in segments]``, which this default
        is. A stage whose cost is per call rather than per byte overrides it: the quantizers
        make ~25 torch calls per segment, and each call hands the GIL over and back, so encoding
        a chunk's layers one by one neither reaches the per-byte speed nor scales over threads.
        """
        return [self.encode(segment, spec) for segment in segments]

    def decode_batch_into(self, datas: Sequence[memoryview], spec: SegmentSpec, outs: Sequence[memoryview]) -> None:
        """:meth:`decode_into` of each of ``datas`` into the matching ``outs`` (blocking); the batch
        counterpart of :meth:`encode_batch`, overridden by the same stages. A defect in any
        segment raises CodecError (which one is the caller's to find: decode them one by one)."""
        for data, out in zip(datas, outs, strict=True):
            self.decode_into(data, spec, out)

    def decode_into(self, data: memoryview, spec: SegmentSpec, out: memoryview) -> None:
        """Decode straight into ``out`` (``spec.nbytes`` long); override to skip a copy."""
        decoded = as_bytes_view(self.decode(data, spec))
        if len(decoded) != len(out):
            raise CodecError(f"{self.name}: decoded {len(decoded)} bytes, expected {len(out)}")
        out[:] = decoded


class _DecodesToValues(Codec):
    """A stage whose decode gives the segment's values (``spec.nbytes`` long): it implements
    :meth:`decode_into` (straight into the destination) and inherits :meth:`decode` from it."""

    def decode(self, data: memoryview, spec: SegmentSpec) -> Buffer:
        """The values in a fresh buffer, through :meth:`decode_into` (blocking)."""
        if type(self).decode_into is Codec.decode_into:
            raise NotImplementedError(f"codec {self.name!r}: a stage that gives values implements decode_into")
        out = bytearray(spec.nbytes)
        self.decode_into(data, spec, memoryview(out))
        return out


class ArrayArrayCodec(_DecodesToValues):
    """Values in (``spec``), values out (``encoded_spec(spec)``): runs before any other kind."""

    kind = StageKind.ARRAY_ARRAY


class ArrayBytesCodec(_DecodesToValues):
    """Values in, an opaque byte layout out: at most one per pipeline, after array→array stages only."""

    kind = StageKind.ARRAY_BYTES


class BytesBytesCodec(Codec):
    """Bytes in, bytes out, values never read: runs after every stage of the other two kinds."""

    kind = StageKind.BYTES_BYTES


def stage_kind(codec: type[Codec] | Codec) -> StageKind:
    """The kind a codec class (or stage) declares; anything else is a TypeError saying what to subclass."""
    cls = codec if isinstance(codec, type) else type(codec)
    kind = getattr(cls, "kind", None) if issubclass(cls, Codec) else None
    if not isinstance(kind, StageKind):
        raise TypeError(
            f"{codec!r} is not a codec stage: subclass ArrayArrayCodec, ArrayBytesCodec or BytesBytesCodec "
            "from kvstore.codecs"
        )
    return kind


def roundtrip_error(original: torch.Tensor, decoded: torch.Tensor) -> dict[str, float]:
    """How far a lossy round trip moved the values (reported by tests and the benchmark)."""
    a, b = original.float(), decoded.float()
    diff = (a - b).abs()
    return {
        "max_abs": float(diff.max()),
        "rms_rel": float(diff.pow(2).mean().sqrt() / a.pow(2).mean().sqrt().clamp_min(1e-30)),
        "cosine": float(torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), dim=0)),
    }
