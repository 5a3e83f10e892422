"""No compression: the disk tier's default, where read bandwidth beats saving space."""

from __future__ import annotations

from kvstore.codecs.base import BytesBytesCodec, SegmentSpec
from kvstore.util.buffers import Buffer


class IdentityCodec(BytesBytesCodec):
    name = "identity"

    def encode(self, data: memoryview, spec: SegmentSpec) -> Buffer:
        return data

    def decode(self, data: memoryview, spec: SegmentSpec) -> Buffer:
        return data
