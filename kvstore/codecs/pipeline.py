"""A codec pipeline: typed stages in an order checked when it is built, run in order on encode."""

from __future__ import annotations

from collections.abc import Sequence

from kvstore.codecs.base import Codec, SegmentSpec, StageKind, stage_kind
from kvstore.errors import CodecError
from kvstore.util.buffers import Buffer, as_bytes_view

ORDER_RULE = "a pipeline runs array→array stages, then at most one array→bytes stage, then bytes→bytes stages"


def _check_order(stages: Sequence[Codec]) -> None:
    """Raise a ValueError naming the first stage out of place, and the rule it breaks."""
    if not stages:
        raise ValueError("a codec pipeline needs at least one stage")
    serializer: Codec | None = None
    previous: Codec | None = None
    for stage in stages:
        kind = stage_kind(stage)
        if previous is not None and kind < stage_kind(previous):
            raise ValueError(
                f"codec {stage.name!r} ({kind}) reads values, so it must come first, before the "
                f"{stage_kind(previous)} stage {previous.name!r}: {ORDER_RULE}"
            )
        if kind is StageKind.ARRAY_BYTES:
            if serializer is not None:
                raise ValueError(
                    f"codec {stage.name!r} ({kind}) reads values, so it must come first, but codecs "
                    f"{serializer.name!r} and {stage.name!r} both turn values into bytes, and after "
                    f"{serializer.name!r} there are no values left to read: {ORDER_RULE}"
                )
            serializer = stage
        previous = stage


class CodecPipeline:
    """Stages applied in order on encode and in reverse on decode."""

    def __init__(self, stages: Sequence[Codec]) -> None:
        _check_order(stages)
        self.stages = list(stages)
        self.id = "+".join(stage.id for stage in self.stages)
        self.lossless = all(stage.lossless for stage in self.stages)
        self.is_identity = self.id == "identity"

    def _specs(self, spec: SegmentSpec) -> list[SegmentSpec]:
        """The spec each stage is given: array→array stages may change it for the stages after them."""
        specs = [spec]
        for stage in self.stages[:-1]:
            specs.append(stage.encoded_spec(specs[-1]))
        return specs

    def encode(self, data: Buffer, spec: SegmentSpec) -> Buffer:
        """Encode one segment: :meth:`encode_batch` of one."""
        return self.encode_batch([data], spec)[0]

    def encode_batch(self, segments: Sequence[Buffer], spec: SegmentSpec) -> list[Buffer]:
        """Encode segments of one spec (a chunk's layers): the same bytes as :meth:`encode` of each,
        each stage called once for all of them (see :meth:`Codec.encode_batch`)."""
        outs: list[Buffer] = [as_bytes_view(segment) for segment in segments]
        for stage, stage_spec in zip(self.stages, self._specs(spec), strict=True):
            outs = stage.encode_batch([as_bytes_view(out) for out in outs], stage_spec)
        return outs

    def decode_into(self, data: Buffer, spec: SegmentSpec, out: memoryview) -> None:
        """Decode one segment into ``out``: :meth:`decode_batch_into` of one; any defect raises CodecError."""
        self.decode_batch_into([data], spec, [out])

    def decode_batch_into(self, datas: Sequence[Buffer], spec: SegmentSpec, outs: Sequence[memoryview]) -> None:
        """:meth:`decode_into` of every segment; the first stage decodes them all in one call. Any
        defect raises CodecError, without saying which segment (decode them one by one for that).

        Whatever a stage raises (an Exception, not a cancellation) is the stored bytes' fault, never
        the tier's: the container makes it a corrupt object (counted, removed), not a tier failure.
        """
        try:
            specs = self._specs(spec)
            views = [as_bytes_view(data) for data in datas]
            for stage, stage_spec in zip(reversed(self.stages[1:]), reversed(specs[1:]), strict=True):
                views = [as_bytes_view(stage.decode(view, stage_spec)) for view in views]
            self.stages[0].decode_batch_into(views, spec, outs)
        except CodecError:
            raise
        except Exception as exc:  # a plugin stage may raise anything (struct.error, IndexError): the bytes' defect
            raise CodecError(f"{self.id}: {type(exc).__name__}: {exc}") from exc

    def __repr__(self) -> str:
        return f"CodecPipeline({self.id!r})"
