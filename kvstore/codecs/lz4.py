"""lz4 block compression: very fast, but ~1.01x on bf16 KV; useful after fp8 quantization."""

from __future__ import annotations

import struct

import lz4.block

from kvstore.codecs.base import BytesBytesCodec, SegmentSpec
from kvstore.errors import CodecError
from kvstore.util.buffers import Buffer


class Lz4Codec(BytesBytesCodec):
    name = "lz4"

    def encode(self, data: memoryview, spec: SegmentSpec) -> Buffer:
        return lz4.block.compress(data, store_size=True)

    def decode(self, data: memoryview, spec: SegmentSpec) -> Buffer:
        if len(data) < 4:
            raise CodecError("lz4: block shorter than its size prefix")
        (size,) = struct.unpack_from("<I", data)
        if size > spec.decode_limit:
            raise CodecError(f"lz4 block declares {size} bytes (limit {spec.decode_limit})")
        try:
            return lz4.block.decompress(data)
        except lz4.block.LZ4BlockError as exc:
            raise CodecError(f"lz4: {exc}") from exc
