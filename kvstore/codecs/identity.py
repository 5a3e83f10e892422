"""No compression: the disk tier's default, where read bandwidth beats saving space."""

from __future__ import annotations

from kvstore.codecs.base import Codec, SegmentSpec
from kvstore.util.buffers import Buffer


class IdentityCodec(Codec):
    name = "identity"

    def encode(self, data: memoryview, spec: SegmentSpec) -> Buffer:
        return data

    def decode(self, data: memoryview, spec: SegmentSpec) -> Buffer:
        return data
