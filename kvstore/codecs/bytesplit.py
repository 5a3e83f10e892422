"""Byte-split: the lossless codec that works on bf16/fp16 KV.

The high byte of a 16-bit float holds the sign and exponent, which vary little across a layer
and compress well; the low byte is mantissa noise that no compressor shrinks. Splitting the
bytes into two planes and compressing only the high plane gives ~1.45x on real SmolLM2 KV at
zstd's speed on half the data. For 4-byte dtypes the top two bytes are compressed.
"""

from __future__ import annotations

import struct

import numpy as np

from kvstore.codecs.base import ArrayBytesCodec, SegmentSpec
from kvstore.codecs.zstd import ZstdContexts, zstd_decompress
from kvstore.errors import CodecError
from kvstore.util.buffers import Buffer

_PREFIX = struct.Struct("<I")  # length of the compressed high plane


class ByteSplitCodec(ArrayBytesCodec):
    """array→bytes: it must know each value's width to split its bytes into planes."""

    name = "bytesplit"
    default_level = 1

    def __init__(self, level: int | None = None) -> None:
        super().__init__(level)
        self._contexts = ZstdContexts(self.name, self.level)  # checks the level now, not at the first encode

    @staticmethod
    def _planes(buffer: np.ndarray, itemsize: int) -> tuple[np.ndarray, int]:
        """Rows of one element each, and how many low bytes per element stay uncompressed."""
        return buffer.reshape(-1, itemsize), itemsize // 2

    def encode(self, data: memoryview, spec: SegmentSpec) -> Buffer:
        rows, low_width = self._planes(np.frombuffer(data, dtype=np.uint8), spec.itemsize)
        high = np.ascontiguousarray(rows[:, low_width:])
        low = np.ascontiguousarray(rows[:, :low_width])
        compressed = self._contexts.compressor().compress(high)
        return b"".join((_PREFIX.pack(len(compressed)), compressed, low))

    def decode_into(self, data: memoryview, spec: SegmentSpec, out: memoryview) -> None:
        if len(data) < _PREFIX.size:
            raise CodecError("bytesplit: segment shorter than its header")
        if len(out) != spec.nbytes:
            raise CodecError(f"bytesplit: output buffer is {len(out)} bytes, expected {spec.nbytes}")
        (high_len,) = _PREFIX.unpack_from(data)
        rows, low_width = self._planes(np.frombuffer(out, dtype=np.uint8), spec.itemsize)
        n_elements = rows.shape[0]
        low_bytes = n_elements * low_width
        if _PREFIX.size + high_len + low_bytes != len(data):
            raise CodecError("bytesplit: plane lengths do not add up to the segment length")
        high = zstd_decompress(self._contexts.decompressor(), data[_PREFIX.size : _PREFIX.size + high_len], spec.nbytes)
        high_width = spec.itemsize - low_width
        if len(high) != n_elements * high_width:
            raise CodecError("bytesplit: high plane has the wrong length")
        rows[:, low_width:] = np.frombuffer(high, dtype=np.uint8).reshape(-1, high_width)
        if low_width:
            low = np.frombuffer(data[_PREFIX.size + high_len :], dtype=np.uint8)
            rows[:, :low_width] = low.reshape(-1, low_width)
