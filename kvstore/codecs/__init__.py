"""Codecs, selected by name in config: ``"identity"``, ``"zstd:3"``, ``"bytesplit"``, ``"fp8+zstd"``.

Lossless: identity, zstd, lz4, bytesplit (bit-exact). Lossy: fp8 (per-channel e4m3).
The default for remote tiers is ``bytesplit``, the best lossless codec measured on real KV.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvstore.codecs.base import Codec, SegmentSpec, roundtrip_error
from kvstore.codecs.bytesplit import ByteSplitCodec
from kvstore.codecs.fp8 import Fp8Codec
from kvstore.codecs.identity import IdentityCodec
from kvstore.codecs.lz4 import Lz4Codec
from kvstore.codecs.zstd import ZstdCodec
from kvstore.errors import CodecError
from kvstore.util.buffers import Buffer, as_bytes_view

CODECS: dict[str, type[Codec]] = {
    codec.name: codec for codec in (IdentityCodec, ZstdCodec, Lz4Codec, ByteSplitCodec, Fp8Codec)
}
DEFAULT_REMOTE_CODEC = "bytesplit"
MAX_CODEC_NAME = 64


class CodecPipeline:
    """Stages applied in order on encode and in reverse on decode."""

    def __init__(self, stages: Sequence[Codec]) -> None:
        if not stages:
            raise ValueError("a codec pipeline needs at least one stage")
        for position, stage in enumerate(stages):
            if stage.transform and position > 0:
                raise ValueError(f"codec {stage.name!r} reads values, so it must come first in the pipeline")
        self.stages = list(stages)
        self.id = "+".join(stage.id for stage in self.stages)
        self.lossless = all(stage.lossless for stage in self.stages)
        self.is_identity = self.id == "identity"

    def encode(self, data: Buffer, spec: SegmentSpec) -> Buffer:
        out: Buffer = as_bytes_view(data)
        for stage in self.stages:
            out = stage.encode(as_bytes_view(out), spec)
        return out

    def decode_into(self, data: Buffer, spec: SegmentSpec, out: memoryview) -> None:
        """Decode one segment into ``out``; any defect raises CodecError."""
        view = as_bytes_view(data)
        try:
            for stage in reversed(self.stages[1:]):
                view = as_bytes_view(stage.decode(view, spec))
            self.stages[0].decode_into(view, spec, out)
        except CodecError:
            raise
        except (ValueError, TypeError, RuntimeError, OverflowError, MemoryError) as exc:
            raise CodecError(f"{self.id}: {exc}") from exc

    def __repr__(self) -> str:
        return f"CodecPipeline({self.id!r})"


def make_codec(name: str) -> CodecPipeline:
    """Parse ``"stage[:level]+stage[:level]..."``; unknown names fail with the valid ones listed."""
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"codec must be a name like 'bytesplit' or 'fp8+zstd:3'; valid stages: {sorted(CODECS)}")
    if len(name) > MAX_CODEC_NAME:
        raise ValueError(f"codec name is longer than {MAX_CODEC_NAME} characters: {name!r}")
    stages: list[Codec] = []
    for part in name.strip().split("+"):
        stage_name, _, level_text = part.strip().partition(":")
        if stage_name not in CODECS:
            raise ValueError(f"unknown codec {stage_name!r} in {name!r}; valid stages: {sorted(CODECS)}")
        try:
            level = int(level_text) if level_text else None
        except ValueError:
            raise ValueError(f"codec level must be an integer, got {level_text!r} in {name!r}") from None
        stages.append(CODECS[stage_name](level))
    return CodecPipeline(stages)


__all__ = [
    "CODECS",
    "DEFAULT_REMOTE_CODEC",
    "Codec",
    "CodecError",
    "CodecPipeline",
    "SegmentSpec",
    "make_codec",
    "roundtrip_error",
]
