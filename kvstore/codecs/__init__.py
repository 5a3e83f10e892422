"""Codecs, selected by name in config: ``"identity"``, ``"zstd:3"``, ``"bytesplit"``, ``"fp8+zstd"``.

Lossless: identity, zstd, lz4, bytesplit (bit-exact). Lossy: fp8 (per-channel e4m3), int8 and
int4 (group-wise integer codes, keys per channel, values per token), and the hadamard rotation
that may come before them. A lossy codec is never a default: a tier stores with one only when its
configuration says ``allow_lossy``. The default for remote tiers is ``bytesplit``, the best
lossless codec measured on real KV.

- :mod:`~kvstore.codecs.base`: the typed stages (array→array, array→bytes, bytes→bytes) and ``SegmentSpec``;
- :mod:`~kvstore.codecs.pipeline`: ``CodecPipeline``, whose stage order is checked when it is built;
- :mod:`~kvstore.codecs.registry`: names to stages, ``make_codec``, and third-party stages from the
  ``kvstore.codecs`` entry-point group;
- :mod:`~kvstore.codecs.quantize`: the group-wise quantization ``int8`` and ``int4`` share;
- one module per built-in stage.
"""

from __future__ import annotations

from kvstore.codecs.base import (
    ArrayArrayCodec,
    ArrayBytesCodec,
    BytesBytesCodec,
    Codec,
    SegmentSpec,
    StageKind,
    roundtrip_error,
)
from kvstore.codecs.bytesplit import ByteSplitCodec
from kvstore.codecs.fp8 import Fp8Codec
from kvstore.codecs.hadamard import HadamardCodec
from kvstore.codecs.identity import IdentityCodec
from kvstore.codecs.int4 import Int4Codec
from kvstore.codecs.int8 import Int8Codec
from kvstore.codecs.lz4 import Lz4Codec
from kvstore.codecs.pipeline import CodecPipeline
from kvstore.codecs.registry import (
    CODECS,
    DEFAULT_REMOTE_CODEC,
    ENTRY_POINT_GROUP,
    MAX_CODEC_NAME,
    CodecRegistry,
    available_codecs,
    make_codec,
    register_codec,
)
from kvstore.codecs.zstd import ZstdCodec
from kvstore.errors import CodecError

__all__ = [
    "CODECS",
    "DEFAULT_REMOTE_CODEC",
    "ENTRY_POINT_GROUP",
    "MAX_CODEC_NAME",
    "ArrayArrayCodec",
    "ArrayBytesCodec",
    "ByteSplitCodec",
    "BytesBytesCodec",
    "Codec",
    "CodecError",
    "CodecPipeline",
    "CodecRegistry",
    "Fp8Codec",
    "HadamardCodec",
    "IdentityCodec",
    "Int4Codec",
    "Int8Codec",
    "Lz4Codec",
    "SegmentSpec",
    "StageKind",
    "ZstdCodec",
    "available_codecs",
    "make_codec",
    "register_codec",
    "roundtrip_error",
]
