"""int8: KIVI-style group-wise 8-bit codes (keys per channel, values per token), fp16 scale and min per group.

Lossy, ~1.9x smaller (level = group size, default 64: 8.5 bits per value). Measured on the shared
SmolLM2 sample: rms relative error ~0.003, a tenth of fp8's, at about fp8's size. See
:mod:`kvstore.codecs.quantize` for the grouping and the layout.
"""

from __future__ import annotations

from kvstore.codecs.quantize import GroupQuantizedCodec


class Int8Codec(GroupQuantizedCodec):
    """array→bytes: one byte per value plus two fp16 numbers per group of ``level`` values."""

    name = "int8"
    bits = 8
