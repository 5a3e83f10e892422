"""Codecs: lossless ones are bit-exact, lossy ones (fp8, int8, int4, hadamard) have a measured error
on real KV, and any defect in encoded bytes is a CodecError (never another exception, never a huge
allocation)."""

from __future__ import annotations

import importlib
import struct
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvstore.codecs import (
    CODECS,
    DEFAULT_REMOTE_CODEC,
    ENTRY_POINT_GROUP,
    MAX_CODEC_NAME,
    ArrayArrayCodec,
    ArrayBytesCodec,
    BytesBytesCodec,
    Codec,
    CodecPipeline,
    CodecRegistry,
    SegmentSpec,
    StageKind,
    available_codecs,
    make_codec,
    register_codec,
    roundtrip_error,
)
from kvstore.codecs import registry as codec_registry
from kvstore.errors import CodecError
from kvstore.util.buffers import Buffer, tensor_bytes, tensor_view

LOSSLESS = [
    "identity",
    "zstd",
    "zstd:3",
    "zstd:-5",
    "lz4",
    "bytesplit",
    "bytesplit:3",
    "bytesplit+lz4",
    "bytesplit+zstd",
    "byteplanes",
    "byteplanes+lz4",
    "byteplanes+zstd",
    "zstd+lz4",
    "identity+zstd",
    "zstd+zstd",
]
LOSSY = [
    "fp8",
    "fp8+zstd",
    "fp8+lz4",
    "fp8+zstd:3",
    "int8",
    "int8+zstd",
    "int8:7",  # groups that divide neither the tokens nor head_dim: every part has a short tail
    "int4",
    "int4+zstd",
    "int4:32",
    "int4:7",
    "hadamard",
    "hadamard+int4",
    "hadamard+int8+zstd",
]
ALL = LOSSLESS + LOSSY
FLOAT_DTYPES = [torch.bfloat16, torch.float16, torch.float32]
INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32}
SMALL_SHAPE = (2, 16, 2, 8)  # [planes, tokens, heads, head_dim]


# ---------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------


def spec_of(tensor: torch.Tensor) -> SegmentSpec:
    return SegmentSpec(tensor.dtype, tuple(tensor.shape))


def encode(codec: CodecPipeline, tensor: torch.Tensor) -> bytes:
    return bytes(codec.encode(tensor_bytes(tensor.contiguous()), spec_of(tensor)))


def decode(codec: CodecPipeline, data: bytes, spec: SegmentSpec) -> torch.Tensor:
    out = torch.empty(spec.shape, dtype=spec.dtype)
    codec.decode_into(data, spec, tensor_bytes(out))
    return out


def bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().view(INT_VIEW[tensor.element_size()])


def assert_bit_exact(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape
    assert torch.equal(bits(a), bits(b)), "lossless round trip changed some bits"


def random_bits(dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """Uniform random bit patterns: every kind of value (NaN payloads, inf, subnormals, -0.0) appears."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    raw = np.random.default_rng(seed).integers(0, 256, size=int(np.prod(shape)) * itemsize, dtype=np.uint8)
    return torch.from_numpy(raw).view(dtype).view(shape).clone()


def special_values(dtype: torch.dtype, shape: tuple[int, ...] = SMALL_SHAPE) -> torch.Tensor:
    """NaN (quiet, signalling, negative), +-inf, +-0.0, subnormals, extremes, tiled into a segment."""
    finfo = torch.finfo(dtype)
    int_dtype = INT_VIEW[finfo.bits // 8]
    mantissa_bits = {torch.bfloat16: 7, torch.float16: 10, torch.float32: 23}[dtype]
    sign = -(1 << (finfo.bits - 1))  # as a signed integer
    patterns = [
        1,  # smallest positive subnormal
        (1 << mantissa_bits) - 1,  # largest subnormal
        sign | 1,  # negative subnormal
        sign,  # -0.0
        0,  # +0.0
    ]
    values = torch.tensor(patterns, dtype=int_dtype).view(dtype)
    floats = torch.tensor(
        [
            float("nan"),
            -float("nan"),
            float("inf"),
            -float("inf"),
            finfo.max,
            finfo.min,
            finfo.tiny,
            finfo.eps,
            1.0,
            -1.5,
            3.140625,
        ],
        dtype=torch.float32,
    ).to(dtype)
    mixed = torch.cat([values, floats])
    assert torch.isnan(mixed).any() and torch.isinf(mixed).any()
    assert (torch.signbit(mixed) & (mixed == 0)).any(), "-0.0 must be among the values"
    n = int(np.prod(shape))
    return mixed.repeat(n // len(mixed) + 1)[:n].view(shape).clone()


def all_16bit_patterns(dtype: torch.dtype) -> torch.Tensor:
    """Every one of the 65,536 bit patterns once, as a [2, 256, 2, 64] segment."""
    return torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16).view(dtype).view(2, 256, 2, 64)


# ---------------------------------------------------------------------------------------------
# Lossless round trips
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", LOSSLESS)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_lossless_round_trip_on_real_kv(real_kv, name, dtype):
    codec = make_codec(name)
    assert codec.lossless
    for layer in (0, 13, 29):
        segment = real_kv[layer].to(dtype).contiguous()  # [2, 512, 3, 64]
        assert_bit_exact(decode(codec, encode(codec, segment), spec_of(segment)), segment)


@pytest.mark.parametrize("name", LOSSLESS)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_lossless_round_trip_on_random_bit_patterns(name, dtype):
    codec = make_codec(name)
    for seed, shape in enumerate([SMALL_SHAPE, (1, 7, 1, 3), (2, 256, 3, 64)]):
        segment = random_bits(dtype, shape, seed)
        assert_bit_exact(decode(codec, encode(codec, segment), spec_of(segment)), segment)


@pytest.mark.parametrize("name", LOSSLESS)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_lossless_round_trip_keeps_special_values(name, dtype):
    codec = make_codec(name)
    segment = special_values(dtype)
    decoded = decode(codec, encode(codec, segment), spec_of(segment))
    assert_bit_exact(decoded, segment)
    assert torch.equal(torch.isnan(decoded), torch.isnan(segment))
    assert torch.equal(torch.signbit(decoded), torch.signbit(segment))


@pytest.mark.parametrize("name", LOSSLESS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_lossless_round_trip_of_every_16bit_pattern(name, dtype):
    codec = make_codec(name)
    segment = all_16bit_patterns(dtype)
    assert_bit_exact(decode(codec, encode(codec, segment), spec_of(segment)), segment)


@pytest.mark.parametrize("name", ["identity", "zstd", "lz4", "bytesplit", "bytesplit+lz4", "byteplanes"])
def test_lossless_round_trip_on_one_byte_dtypes(name):
    """Layouts may hold fp8 KV: byte-split has no low plane then, and must still round-trip."""
    codec = make_codec(name)
    segment = random_bits(torch.float8_e4m3fn, SMALL_SHAPE, 3)
    assert_bit_exact(decode(codec, encode(codec, segment), spec_of(segment)), segment)


@settings(max_examples=80, deadline=None, database=None)
@given(
    name=st.sampled_from(LOSSLESS),
    dtype=st.sampled_from(FLOAT_DTYPES),
    tokens=st.integers(1, 9),
    payload=st.binary(min_size=4 * 2 * 9 * 2 * 4, max_size=4 * 2 * 9 * 2 * 4),
)
def test_lossless_round_trip_property(name, dtype, tokens, payload):
    shape = (2, tokens, 2, 4)
    itemsize = torch.empty((), dtype=dtype).element_size()
    raw = payload[: 2 * tokens * 2 * 4 * itemsize]
    segment = torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dtype).view(shape)
    codec = make_codec(name)
    assert_bit_exact(decode(codec, encode(codec, segment), spec_of(segment)), segment)


def test_encode_is_deterministic():
    segment = random_bits(torch.bfloat16, SMALL_SHAPE, 11)
    for name in ALL:
        assert encode(make_codec(name), segment) == encode(make_codec(name), segment), name


def test_shared_codec_objects_are_safe_across_threads(real_kv):
    """Compressor objects are per thread: one codec used from many workers stays correct."""
    segments = [real_kv[layer, :, half * 256 : (half + 1) * 256].contiguous() for layer in range(30) for half in (0, 1)]
    for name in ("zstd", "bytesplit", "bytesplit+lz4", "byteplanes"):
        codec = make_codec(name)

        def round_trip(segment: torch.Tensor, codec: CodecPipeline = codec) -> torch.Tensor:
            return decode(codec, encode(codec, segment), spec_of(segment))

        with ThreadPoolExecutor(max_workers=4) as pool:
            results = list(pool.map(round_trip, segments))
        for segment, decoded in zip(segments, results, strict=False):
            assert_bit_exact(decoded, segment)


# ---------------------------------------------------------------------------------------------
# Compression ratios on real KV
# ---------------------------------------------------------------------------------------------


def real_ratio(real_kv: torch.Tensor, name: str) -> float:
    codec = make_codec(name)
    raw = stored = 0
    for layer in range(real_kv.shape[0]):
        for half in (0, 1):  # two 256-token chunks
            segment = real_kv[layer, :, half * 256 : (half + 1) * 256].contiguous()
            raw += segment.numel() * segment.element_size()
            stored += len(encode(codec, segment))
    return raw / stored


def test_bytesplit_beats_plain_zstd_and_lz4_on_real_kv(real_kv):
    bytesplit, zstd, lz4 = (real_ratio(real_kv, name) for name in ("bytesplit", "zstd", "lz4"))
    assert bytesplit > 1.3, bytesplit  # measured 1.44
    assert bytesplit > zstd + 0.1, (bytesplit, zstd)  # measured 1.44 vs 1.27
    assert zstd > 1.15, zstd
    assert lz4 < 1.1, lz4  # lz4 on raw bf16 is useless (1.00): the table in DESIGN.md says so
    assert real_ratio(real_kv, DEFAULT_REMOTE_CODEC) > 1.3


def test_byteplanes_compresses_as_well_as_bytesplit_on_real_kv(real_kv):
    """The default remote codec keeps the lossless ratio of the codec it replaced (>= 1.44x)."""
    byteplanes, bytesplit = real_ratio(real_kv, "byteplanes"), real_ratio(real_kv, "bytesplit")
    assert byteplanes >= 1.44, byteplanes  # measured 1.456 (bytesplit 1.439)
    assert byteplanes >= bytesplit, (byteplanes, bytesplit)
    assert DEFAULT_REMOTE_CODEC == "byteplanes"


@pytest.mark.parametrize(
    "dtype",
    [torch.float8_e4m3fn, torch.float8_e5m2, torch.bfloat16, torch.float16, torch.float32, torch.float64],
    ids=str,
)
@pytest.mark.parametrize("shape", [(1, 1, 1, 1), (1, 7, 1, 3), (2, 13, 3, 5), (2, 256, 3, 64)], ids=str)
def test_byteplanes_round_trips_every_float_width_and_odd_sizes(dtype, shape):
    codec = make_codec("byteplanes")
    segment = random_bits(dtype, shape, seed=sum(shape))
    encoded = encode(codec, segment)
    itemsize = segment.element_size()
    # the low planes are stored raw, first: itemsize // 2 bytes per value, then one zstd frame
    assert encoded[segment.numel() * (itemsize // 2) :][:4] == b"\x28\xb5\x2f\xfd"
    decoded = decode(codec, encoded, spec_of(segment))
    assert torch.equal(decoded.view(torch.uint8), segment.view(torch.uint8))


def test_identity_stores_the_raw_bytes(real_kv):
    segment = real_kv[0, :, :256].contiguous()
    assert encode(make_codec("identity"), segment) == bytes(tensor_bytes(segment))


# ---------------------------------------------------------------------------------------------
# fp8 (lossy)
# ---------------------------------------------------------------------------------------------


# Error bounds on the shared real-KV sample, 256-token chunks of all 30 layers: (worst segment's rms
# relative error, worst segment's cosine, all segments' rms relative error), about 2x looser than
# measured (in the comments) in rms, and 5-10x in 1 - cosine. roundtrip_error computes the cosine in
# float32: about 1e-5 of it is rounding, so no bound is tighter than 0.9999.
ERROR_BOUNDS: dict[str, tuple[float, float, float]] = {
    "fp8": (0.05, 0.998, 0.05),  # worst segment rms 0.027, cosine 0.99962; all 0.0265
    "int8": (0.01, 0.9999, 0.008),  # 0.0046, 0.999986; all 0.0035
    "int8:7": (0.005, 0.9999, 0.004),  # 0.0023, 0.999991; all 0.0016
    "int4": (0.15, 0.99, 0.10),  # 0.075, 0.99719; all 0.058
    "int4:32": (0.13, 0.99, 0.09),  # 0.064, 0.99795; all 0.049
    "int4:7": (0.08, 0.995, 0.06),  # 0.037, 0.99933; all 0.027
    "hadamard+int4": (0.15, 0.99, 0.10),  # 0.072, 0.99741; all 0.058
    "hadamard+int8": (0.01, 0.9999, 0.008),  # 0.0044, 0.999986; all 0.0035
    "hadamard": (1e-5, 0.9999, 1e-5),  # float32 rounding only: see test_hadamard_round_trip_is_float32_exact
}


def error_bounds(name: str) -> tuple[float, float, float]:
    """The bounds of a pipeline's value-reading stages (compressors after them change no value)."""
    stages = [stage.id for stage in make_codec(name).stages if stage.kind is not StageKind.BYTES_BYTES]
    return ERROR_BOUNDS["+".join(stages)]


@pytest.mark.parametrize("name", LOSSY)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_lossy_error_on_real_kv(real_kv, name, dtype):
    codec = make_codec(name)
    assert not codec.lossless
    segment_rms, segment_cosine, total_rms = error_bounds(name)
    originals, decoded = [], []
    for layer in range(real_kv.shape[0]):
        for half in (0, 1):
            segment = real_kv[layer, :, half * 256 : (half + 1) * 256].to(dtype).contiguous()
            out = decode(codec, encode(codec, segment), spec_of(segment))
            assert out.dtype == dtype
            error = roundtrip_error(segment, out)
            assert error["rms_rel"] < segment_rms and error["cosine"] > segment_cosine, (layer, half, error)
            originals.append(segment)
            decoded.append(out)
    error = roundtrip_error(torch.stack(originals), torch.stack(decoded))
    assert error["rms_rel"] < total_rms, error
    if name != "hadamard":
        assert error["rms_rel"] > 1e-4, f"{name} cannot be this accurate: is it quantizing at all?"


def test_fp8_sizes_on_real_kv(real_kv):
    fp8, fp8_zstd = make_codec("fp8"), make_codec("fp8+zstd")
    raw = stored = 0
    for layer in range(real_kv.shape[0]):
        segment = real_kv[layer, :, :256].contiguous()
        planes, tokens, heads, head_dim = segment.shape
        # one byte per value plus one float32 scale per channel and a 4-byte count
        assert len(encode(fp8, segment)) == 4 + 4 * planes * heads * head_dim + segment.numel()
        raw += segment.numel() * segment.element_size()
        stored += len(encode(fp8_zstd, segment))
    assert stored < 0.5 * raw, stored / raw  # measured 0.42


def test_fp8_keeps_zero_channels_exact_and_is_not_poisoned_by_inf_or_nan():
    rng = np.random.default_rng(5)
    magnitudes = rng.uniform(1.0, 2.0, size=SMALL_SHAPE).astype(np.float32)
    signs = rng.choice([-1.0, 1.0], size=SMALL_SHAPE).astype(np.float32)
    values = torch.from_numpy(magnitudes * signs)
    values[0, :, 0, 0] = 0.0  # an all-zero channel
    values[1, 3, 1, 2] = float("inf")  # one inf in one channel
    values[0, 5, 1, 5] = float("nan")  # one NaN in another
    segment = values.to(torch.bfloat16)
    out = decode(make_codec("fp8"), encode(make_codec("fp8"), segment), spec_of(segment)).float()
    assert torch.equal(out[0, :, 0, 0], torch.zeros(SMALL_SHAPE[1]))
    finite = torch.isfinite(segment.float())
    relative = ((out - segment.float()).abs() / segment.float().abs().clamp_min(1e-30))[finite & (segment != 0)]
    # e4m3 keeps 3 mantissa bits: half an ulp is 2^-4 relative; the channel scale is unharmed by inf/NaN
    assert float(relative.max()) <= 2**-4 + 1e-3, float(relative.max())


@pytest.mark.parametrize(
    "dtype",
    [torch.int16, torch.int32, torch.uint8, torch.int8, torch.bool, torch.float8_e4m3fn, torch.float8_e5m2],
    ids=str,
)
@pytest.mark.parametrize("name", ["fp8", "fp8+zstd"])
def test_fp8_rejects_what_it_cannot_quantize(dtype, name):
    codec = make_codec(name)
    spec = SegmentSpec(dtype, SMALL_SHAPE)
    data = bytes(spec.nbytes)
    with pytest.raises(CodecError, match="fp8"):
        codec.encode(memoryview(data), spec)
    with pytest.raises(CodecError, match="fp8"):
        make_codec("fp8").decode_into(data, spec, memoryview(bytearray(spec.nbytes)))
    with pytest.raises(CodecError):
        codec.decode_into(data, spec, memoryview(bytearray(spec.nbytes)))


def test_fp8_rejects_segments_that_are_not_four_dimensional():
    codec = make_codec("fp8")
    spec = SegmentSpec(torch.bfloat16, (2, 16, 16))
    with pytest.raises(CodecError, match="fp8"):
        codec.encode(memoryview(bytes(spec.nbytes)), spec)


# ---------------------------------------------------------------------------------------------
# int8 and int4 (lossy, group-wise), and the hadamard rotation
# ---------------------------------------------------------------------------------------------

QUANTIZERS = ["int8", "int4"]


def groups_of(spec: SegmentSpec, group: int) -> int:
    """Groups in a segment: keys per channel in runs of ``group`` tokens, values per token in runs of ``group``
    channels."""
    planes, tokens, heads, head_dim = spec.shape
    return -(-tokens // group) * heads * head_dim + (planes - 1) * tokens * heads * -(-head_dim // group)


def test_quantizer_sizes_on_real_kv(real_kv):
    """Exact sizes (codes plus an fp16 scale and min per group), and the issue's targets: int8 >= 1.9x
    with zstd after it, int4 >= 3.5x."""
    raw = 0
    stored = dict.fromkeys(["int8", "int8+zstd", "int4", "int4+zstd"], 0)
    for layer in range(real_kv.shape[0]):
        segment = real_kv[layer, :, :256].contiguous()
        spec = spec_of(segment)
        raw += spec.nbytes
        for name in stored:
            stored[name] += len(encode(make_codec(name), segment))
        assert len(encode(make_codec("int8"), segment)) == segment.numel() + 4 * groups_of(spec, 64)
        assert len(encode(make_codec("int4"), segment)) == segment.numel() // 2 + 4 * groups_of(spec, 64)
        assert len(encode(make_codec("int4:32"), segment)) == segment.numel() // 2 + 4 * groups_of(spec, 32)
    ratios = {name: raw / size for name, size in stored.items()}
    # measured: int8 1.882, int8+zstd 1.935, int4 3.556, int4+zstd 3.75
    assert ratios["int8+zstd"] >= 1.9 and ratios["int4"] >= 3.5 and ratios["int4+zstd"] > ratios["int4"], ratios


@pytest.mark.parametrize("name", QUANTIZERS)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_quantizers_keep_constant_groups_exact_and_are_not_poisoned_by_inf_or_nan(name, dtype):
    rng = np.random.default_rng(5)
    values = torch.from_numpy(rng.uniform(-2.0, 2.0, size=SMALL_SHAPE).astype(np.float32))
    values[0, :, 0, 0] = 0.0  # an all-zero key channel (one whole group at the default size)
    values[0, :, 1, 3] = 1.5  # a constant key channel: scale 0, decoded to its min exactly
    values[1, 7, 0, :] = -2.25  # a constant value group (one token's head)
    values[0, 3, 1, 2] = float("inf")  # one inf in one key channel
    values[1, 5, 1, 5] = float("nan")  # one NaN in one token's values
    values[1, 9, 0, 1] = -float("inf")
    segment = values.to(dtype)
    codec = make_codec(name)
    out = decode(codec, encode(codec, segment), spec_of(segment)).float()
    assert torch.equal(out[0, :, 0, 0], torch.zeros(SMALL_SHAPE[1]))
    assert torch.equal(out[0, :, 1, 3], torch.full((SMALL_SHAPE[1],), 1.5))
    assert torch.equal(out[1, 7, 0, :], torch.full((SMALL_SHAPE[3],), -2.25))
    finite = torch.isfinite(segment.float())
    step = 4.0 / (255 if name == "int8" else 15)  # the values span [-2, 2]
    error = (out - segment.float()).abs()[finite]
    # half a step of the group's range, plus the fp16 rounding of the min and scale, plus the output
    # dtype's rounding (values up to 2): the groups holding inf and NaN keep the range of their finite values
    assert float(error.max()) <= 0.5 * step + 4e-3 + torch.finfo(dtype).eps, float(error.max())
    assert torch.isfinite(out).all()
    assert float(out[0, 3, 1, 2]) == float(out[0, :, 1, 2].max()), "+inf decodes to its group's max"
    assert float(out[1, 9, 0, 1]) == float(out[1, 9, 0].min()), "-inf decodes to its group's min"


@pytest.mark.parametrize("name", ["hadamard", "hadamard+int4", "hadamard+int8"])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_hadamard_confines_a_nan_or_an_inf_to_its_own_value(name, dtype):
    """A rotation mixes a head vector's channels: one NaN or inf must not reach the other 63 (nor the
    quantizer's groups after it). NaN stands in as 0, +inf as its head vector's largest finite value:
    everything decodes exactly as the segment holding those stand-ins does."""
    segment = torch.randn((2, 16, 2, 64), generator=torch.Generator().manual_seed(11)).to(dtype)
    stand_ins = segment.clone()
    segment[0, 3, 1, 5], stand_ins[0, 3, 1, 5] = float("nan"), 0.0
    segment[1, 9, 0, 17] = float("inf")
    stand_ins[1, 9, 0, 17] = stand_ins[1, 9, 0, torch.arange(64) != 17].max()
    codec = make_codec(name)
    out = decode(codec, encode(codec, segment), spec_of(segment))
    assert torch.equal(out, decode(codec, encode(codec, stand_ins), spec_of(stand_ins)))
    if name == "hadamard":  # the rotation's own error only: float32 rounding, then the dtype's
        finite = torch.isfinite(segment)
        error = (out.float() - segment.float()).abs()[finite]
        bound = torch.finfo(dtype).eps * segment.float().abs()[finite] + 1e-5
        assert bool((error <= bound).all()), float((error - bound).max())


def test_hadamard_refuses_head_vectors_whose_rotation_overflows():
    segment = torch.full((2, 4, 1, 64), 3e38, dtype=torch.float32)
    with pytest.raises(CodecError, match="overflows float32"):
        encode(make_codec("hadamard"), segment)


@pytest.mark.parametrize("name", ["int8", "int4", "int4:32", "int8:5", "int4:1", "hadamard+int4", "int4+zstd"])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize(
    "shape",
    [(2, 1, 1, 1), (2, 7, 3, 5), (2, 65, 1, 63), (2, 257, 3, 64), (1, 13, 2, 8), (2, 33, 2, 16)],
    ids=str,
)
def test_quantizers_take_any_token_count_and_head_dim(name, dtype, shape):
    """Odd token counts and head_dims: the last group of a run is shorter; int4 packs an odd count too."""
    generator = torch.Generator().manual_seed(sum(shape))
    segment = torch.randn(shape, generator=generator).to(dtype)
    codec = make_codec(name)
    if name.startswith("hadamard") and shape[-1] & (shape[-1] - 1):
        with pytest.raises(CodecError, match="power of two"):  # the rotation needs a power-of-two head_dim
            encode(codec, segment)
        return
    encoded = encode(codec, segment)
    out = decode(codec, encoded, spec_of(segment))
    assert out.shape == segment.shape and out.dtype == dtype
    error = roundtrip_error(segment, out)
    bound = 0.01 if "int8" in name else 0.15  # uniform codes over a normal sample: ~0.004 and ~0.08 measured
    assert error["rms_rel"] < bound, error
    if name in ("int4", "int4:1"):
        group = make_codec(name).stages[0].level
        assert len(encoded) == (segment.numel() + 1) // 2 + 4 * groups_of(spec_of(segment), group)


@pytest.mark.parametrize("name", QUANTIZERS)
def test_keys_are_grouped_per_channel_and_values_per_token(name):
    """KIVI's grouping: an outlier key channel widens only its own channel's groups (runs of ``group``
    tokens); an outlier token's values widen only that token's groups."""
    codec = make_codec(f"{name}:4")  # groups of 4: tokens 0-3, 4-7, ... and channels 0-3, 4-7
    generator = torch.Generator().manual_seed(3)
    base = torch.randn(SMALL_SHAPE, generator=generator)
    spiked = base.clone()
    spiked[0, 6, 1, 5] = 100.0  # key: token 6 (group 4-7) of channel (head 1, dim 5)
    spiked[1, 2, 0, :] *= 50.0  # values: every channel of token 2, head 0
    plain = decode(codec, encode(codec, base), spec_of(base))
    out = decode(codec, encode(codec, spiked), spec_of(spiked))
    changed = out != plain
    changed[0, 6, 1, 5] = changed[1, 2, 0, :] = False  # the spiked values themselves
    keys_group = torch.zeros_like(changed[0])
    keys_group[4:8, 1, 5] = True
    assert not changed[0][~keys_group].any(), "a key outlier reached another channel or token run"
    assert changed[0][keys_group].any(), "the outlier's own key group must be quantized with the wider range"
    assert not changed[1, torch.arange(16) != 2].any(), "a value outlier reached another token"


@pytest.mark.parametrize("name", ["int8", "int4", "hadamard", "hadamard+int4"])
@pytest.mark.parametrize("dtype", [torch.int16, torch.int32, torch.uint8, torch.bool, torch.float8_e4m3fn], ids=str)
def test_quantizers_and_hadamard_reject_what_they_cannot_read(name, dtype):
    codec = make_codec(name)
    spec = SegmentSpec(dtype, SMALL_SHAPE)
    data = bytes(spec.nbytes)
    with pytest.raises(CodecError, match=name.split("+")[0]):
        codec.encode(memoryview(data), spec)
    with pytest.raises(CodecError):
        codec.decode_into(data, spec, memoryview(bytearray(spec.nbytes)))


@pytest.mark.parametrize("name", QUANTIZERS)
@pytest.mark.parametrize("shape", [(2, 16, 16), (3, 4, 2, 8), (2, 2, 4, 2, 8)], ids=str)
def test_quantizers_reject_segments_that_are_not_kv_shaped(name, shape):
    spec = SegmentSpec(torch.bfloat16, shape)
    with pytest.raises(CodecError, match=f"{name} expects segments shaped \\[planes"):
        make_codec(name).encode(memoryview(bytes(spec.nbytes)), spec)


def test_hadamard_matrix_is_orthonormal_and_its_own_inverse():
    from kvstore.codecs.hadamard import hadamard_matrix

    for size in (1, 2, 8, 64, 128):
        matrix = hadamard_matrix(size).double()
        assert torch.allclose(matrix @ matrix, torch.eye(size, dtype=torch.float64), atol=1e-6)
        assert torch.equal(matrix, matrix.T)
        assert torch.equal(matrix.abs(), torch.full((size, size), size**-0.5, dtype=torch.float64).float().double())


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_hadamard_round_trip_is_float32_exact(real_kv, dtype):
    """The rotation's output is float32, so it loses only float32 rounding: ~1e-7 relative."""
    codec = make_codec("hadamard")
    segment = real_kv[13].to(dtype).contiguous()
    encoded = encode(codec, segment)
    assert len(encoded) == segment.numel() * 4, "hadamard's output is float32"
    assert codec.stages[0].encoded_spec(spec_of(segment)) == SegmentSpec(torch.float32, tuple(segment.shape))
    rotated = torch.frombuffer(bytearray(encoded), dtype=torch.float32).view(-1, 64)
    assert not torch.allclose(rotated, segment.float().reshape(-1, 64)), "the values must be rotated"
    # energy is kept per (token, head) row: the transform is orthonormal
    assert torch.allclose(rotated.norm(dim=1), segment.float().reshape(-1, 64).norm(dim=1), rtol=1e-5)
    out = decode(codec, encoded, spec_of(segment))
    error = roundtrip_error(segment, out)
    assert error["rms_rel"] < (1e-6 if dtype == torch.float32 else 1e-3), error  # measured 2e-7 (float32)
    wide = real_kv[13].float().mul(3.7).contiguous()  # values that are not 16-bit numbers
    assert roundtrip_error(wide, decode(codec, encode(codec, wide), spec_of(wide)))["rms_rel"] < 1e-6


@pytest.mark.parametrize("head_dim", [80, 96, 3, 6])
@pytest.mark.parametrize("name", ["hadamard", "hadamard+int4", "hadamard+int8+zstd"])
def test_hadamard_needs_a_power_of_two_head_dim(name, head_dim):
    spec = SegmentSpec(torch.bfloat16, (2, 4, 2, head_dim))
    codec = make_codec(name)
    with pytest.raises(CodecError, match=f"power of two .* this segment's is {head_dim}"):
        codec.encode(memoryview(bytes(spec.nbytes)), spec)
    with pytest.raises(CodecError, match="power of two" if name == "hadamard" else None):
        codec.decode_into(bytes(2 * spec.nbytes), spec, memoryview(bytearray(spec.nbytes)))


def test_the_pipeline_gives_a_rotated_float32_segment_to_the_quantizer_and_undoes_it_into_the_output(real_kv):
    """hadamard+int4: int4 is given hadamard's float32 spec on encode; on decode int4 decodes that
    float32 segment, and hadamard (the first stage) writes the caller's buffer in the original dtype."""
    segment = real_kv[7, :, :256].contiguous()
    spec = spec_of(segment)
    hadamard, int4 = make_codec("hadamard").stages[0], make_codec("int4").stages[0]
    wide_spec = SegmentSpec(torch.float32, spec.shape)
    rotated = hadamard.encode(tensor_bytes(segment), spec)
    encoded = encode(make_codec("hadamard+int4"), segment)
    assert encoded == bytes(int4.encode(memoryview(rotated), wide_spec))
    by_hand = torch.empty_like(segment)
    hadamard.decode_into(memoryview(int4.decode(memoryview(encoded), wide_spec)), spec, tensor_bytes(by_hand))
    out = decode(make_codec("hadamard+int4"), encoded, spec)
    assert out.dtype == torch.bfloat16 and torch.equal(bits(out), bits(by_hand))
    assert roundtrip_error(segment, out)["rms_rel"] < 0.1


# ---------------------------------------------------------------------------------------------
# Names, levels and composition
# ---------------------------------------------------------------------------------------------


def test_every_built_in_stage_declares_its_kind():
    kinds = {name: codec.kind for name, codec in CODECS.items()}
    assert kinds == {
        "bytesplit": StageKind.ARRAY_BYTES,
        "byteplanes": StageKind.ARRAY_BYTES,
        "fp8": StageKind.ARRAY_BYTES,
        "hadamard": StageKind.ARRAY_ARRAY,
        "identity": StageKind.BYTES_BYTES,
        "int4": StageKind.ARRAY_BYTES,
        "int8": StageKind.ARRAY_BYTES,
        "lz4": StageKind.BYTES_BYTES,
        "zstd": StageKind.BYTES_BYTES,
    }
    assert all(issubclass(codec, (ArrayArrayCodec, ArrayBytesCodec, BytesBytesCodec)) for codec in CODECS.values())
    assert str(StageKind.ARRAY_BYTES) == "array→bytes"


@pytest.mark.parametrize(
    "name",
    [
        "zstd+bytesplit",
        "lz4+fp8",
        "fp8+bytesplit",
        "bytesplit+fp8",
        "bytesplit+bytesplit",
        "identity+fp8",
        "zstd:3+bytesplit:3",
    ],
)
def test_transform_stages_must_come_first(name):
    with pytest.raises(ValueError, match="must come first"):
        make_codec(name)


@pytest.mark.parametrize(
    "name, fragments",
    [
        ("zstd+bytesplit", ["'bytesplit' (array→bytes)", "must come first", "bytes→bytes stage 'zstd'"]),
        ("lz4+fp8", ["'fp8' (array→bytes)", "must come first", "bytes→bytes stage 'lz4'"]),
        ("identity+fp8", ["'fp8'", "must come first", "stage 'identity'"]),
        ("zstd:3+bytesplit:3", ["'bytesplit'", "must come first", "stage 'zstd'"]),
        ("bytesplit+zstd+fp8", ["'fp8'", "must come first", "stage 'zstd'"]),
        ("fp8+bytesplit", ["'fp8' and 'bytesplit' both turn values into bytes", "at most one array→bytes stage"]),
        ("bytesplit+fp8", ["'bytesplit' and 'fp8' both turn values into bytes"]),
        ("bytesplit+bytesplit", ["'bytesplit' and 'bytesplit' both turn values into bytes"]),
    ],
)
def test_stage_order_is_checked_when_the_pipeline_is_built(name, fragments):
    with pytest.raises(ValueError) as excinfo:
        make_codec(name)
    for fragment in fragments + ["a pipeline runs array→array stages"]:
        assert fragment in str(excinfo.value)


def test_a_pipeline_of_something_other_than_stages_is_a_type_error():
    class Untyped(Codec):  # subclasses the common base, not one of the three kinds
        name = "untyped"

        def encode(self, data: memoryview, spec: SegmentSpec) -> Buffer:
            return data

        def decode(self, data: memoryview, spec: SegmentSpec) -> Buffer:
            return data

    for stages in ([Untyped()], [make_codec("zstd").stages[0], object()]):
        with pytest.raises(TypeError, match="subclass ArrayArrayCodec, ArrayBytesCodec or BytesBytesCodec"):
            CodecPipeline(stages)


@pytest.mark.parametrize("name", ["snappy", "zstd+snappy", "Zstd", "bytesplit+", "+zstd", "zstd++lz4", "fp8 zstd"])
def test_unknown_codec_lists_valid_names(name):
    with pytest.raises(ValueError, match="unknown codec") as excinfo:
        make_codec(name)
    for valid in CODECS:
        assert valid in str(excinfo.value)


@pytest.mark.parametrize(
    "name, fragment",
    [
        ("zstd:23", "between -7 and 22"),
        ("zstd:-8", "between -7 and 22"),
        ("bytesplit:23", "between -7 and 22"),
        ("bytesplit:-100", "between -7 and 22"),
        ("zstd:fast", "must be an integer"),
        ("zstd:1.5", "must be an integer"),
        ("bytesplit:x", "must be an integer"),
        ("lz4:1", "takes no level"),
        ("identity:0", "takes no level"),
        ("fp8:3", "takes no level"),
        ("fp8+zstd:99", "between -7 and 22"),
        ("int4:0", "group size, between 1 and 65536"),
        ("int8:-3", "group size, between 1 and 65536"),
        ("int8:65537", "group size, between 1 and 65536"),
        ("hadamard:2", "takes no level"),
    ],
)
def test_bad_levels(name, fragment):
    with pytest.raises(ValueError, match=fragment):
        make_codec(name)


@pytest.mark.parametrize("name", ["", "   ", None, 3, b"zstd", "zstd+" * 20 + "zstd"])
def test_empty_non_string_and_overlong_names(name):
    with pytest.raises(ValueError):
        make_codec(name)
    assert len("zstd+" * 20 + "zstd") > MAX_CODEC_NAME


def test_a_pipeline_needs_a_stage():
    with pytest.raises(ValueError):
        CodecPipeline([])


@pytest.mark.parametrize(
    "name, canonical",
    [
        ("zstd:1", "zstd"),
        ("bytesplit:1", "bytesplit"),
        (" zstd:3 + lz4 ", "zstd:3+lz4"),
        ("fp8+zstd:1", "fp8+zstd"),
        ("identity", "identity"),
        ("bytesplit", "bytesplit"),
        ("fp8+zstd", "fp8+zstd"),
        ("zstd:3", "zstd:3"),
        ("bytesplit:3", "bytesplit:3"),
        ("zstd:-5", "zstd:-5"),
        ("bytesplit+lz4", "bytesplit+lz4"),
        ("identity+zstd", "identity+zstd"),
        ("int4:64", "int4"),
        ("int8:64+zstd", "int8+zstd"),
        ("hadamard+int4:32", "hadamard+int4:32"),
    ],
)
def test_pipeline_ids_are_canonical_and_parse_back(name, canonical):
    """The id is what chunk headers store: the same as before stages were typed, and it names the same
    pipeline again."""
    codec = make_codec(name)
    assert codec.id == canonical
    assert make_codec(codec.id).id == canonical


def test_every_valid_pipeline_id_parses_back_to_itself():
    for name in ALL:
        codec = make_codec(name)
        again = make_codec(codec.id)
        assert again.id == codec.id
        assert [stage.level for stage in again.stages] == [stage.level for stage in codec.stages]


def test_lossless_flags_and_default():
    assert make_codec(DEFAULT_REMOTE_CODEC).lossless
    assert make_codec("bytesplit+lz4").lossless
    assert not make_codec("fp8").lossless
    assert not make_codec("fp8+zstd").lossless
    for name in ("int8", "int4+zstd", "hadamard", "hadamard+int8"):
        assert not make_codec(name).lossless, name
    assert make_codec("identity").is_identity
    assert not make_codec("identity+zstd").is_identity


def test_roundtrip_error_measures_what_it_says():
    a = torch.randn(1000)
    assert roundtrip_error(a, a) == {"max_abs": 0.0, "rms_rel": 0.0, "cosine": pytest.approx(1.0)}
    error = roundtrip_error(a, a * 1.01)
    assert error["rms_rel"] == pytest.approx(0.01, rel=1e-3)
    assert error["cosine"] == pytest.approx(1.0)
    assert roundtrip_error(a, -a)["cosine"] == pytest.approx(-1.0)


# ---------------------------------------------------------------------------------------------
# Defective input: always CodecError
# ---------------------------------------------------------------------------------------------

DEFECT_SEGMENT = random_bits(torch.bfloat16, SMALL_SHAPE, 99).clamp(-4, 4).nan_to_num(0.0)
DEFECT_SPEC = spec_of(DEFECT_SEGMENT)
ENCODED = {name: encode(make_codec(name), DEFECT_SEGMENT) for name in ALL}


def decode_or_codec_error(name: str, data: bytes, spec: SegmentSpec = DEFECT_SPEC) -> torch.Tensor | None:
    """Decode; a CodecError is an allowed answer, any other exception fails the test."""
    try:
        return decode(make_codec(name), data, spec)
    except CodecError:
        return None


@pytest.mark.parametrize("name", ALL)
def test_every_truncation_is_a_codec_error(name):
    encoded = ENCODED[name]
    for length in range(len(encoded)):
        with pytest.raises(CodecError):
            decode(make_codec(name), encoded[:length], DEFECT_SPEC)


@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize("junk", [b"\x00", b"\xff" * 7, "whole-copy"])
def test_trailing_bytes_are_a_codec_error(name, junk):
    encoded = ENCODED[name]
    extra = encoded if junk == "whole-copy" else junk
    with pytest.raises(CodecError):
        decode(make_codec(name), encoded + extra, DEFECT_SPEC)


@pytest.mark.parametrize("name", ALL)
def test_wrong_output_size_or_shape_is_a_codec_error(name):
    codec = make_codec(name)
    encoded = ENCODED[name]
    with pytest.raises(CodecError):
        codec.decode_into(encoded, DEFECT_SPEC, memoryview(bytearray(DEFECT_SPEC.nbytes - 2)))
    other = SegmentSpec(torch.bfloat16, (2, 8, 2, 8))  # half the tokens
    with pytest.raises(CodecError):
        decode(codec, encoded, other)


@pytest.mark.parametrize("name", ALL)
def test_empty_input_is_a_codec_error(name):
    with pytest.raises(CodecError):
        decode(make_codec(name), b"", DEFECT_SPEC)


def _mutations(encoded: bytes) -> st.SearchStrategy[bytes]:
    def apply(edits: list[tuple[int, int]]) -> bytes:
        data = bytearray(encoded)
        for position, value in edits:
            data[position % len(data)] = value
        return bytes(data)

    return st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 255)), min_size=1, max_size=6).map(apply)


@st.composite
def garbage_for_codec(draw: st.DrawFn) -> tuple[str, bytes]:
    name = draw(st.sampled_from(ALL))
    encoded = ENCODED[name]
    data = draw(
        st.one_of(
            st.binary(max_size=2 * DEFECT_SPEC.nbytes),
            st.binary(max_size=600).map(lambda b: b"\x28\xb5\x2f\xfd" + b),  # zstd magic
            st.binary(max_size=600).map(lambda b: struct.pack("<I", len(b)) + b),  # plausible prefix
            _mutations(encoded),
            st.binary(min_size=1, max_size=64).map(lambda b: encoded[: len(encoded) // 2] + b),
        )
    )
    return name, data


@settings(max_examples=1000, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=garbage_for_codec())
def test_garbage_is_a_codec_error_never_another_exception(case):
    name, data = case
    decoded = decode_or_codec_error(name, data)
    if decoded is not None:  # some garbage is a valid encoding (identity: any right-sized bytes)
        assert decoded.shape == DEFECT_SPEC.shape and decoded.dtype == DEFECT_SPEC.dtype


# ---------------------------------------------------------------------------------------------
# Hostile size fields: rejected before anything big is allocated
# ---------------------------------------------------------------------------------------------

ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"


def zstd_frame_declaring(size: int, payload: bytes = b"") -> bytes:
    """A single-segment frame whose header claims ``size`` bytes of content (8-byte size field)."""
    block_header = struct.pack("<I", (len(payload) << 3) | 1)[:3]  # last block, raw
    return ZSTD_MAGIC + b"\xe0" + struct.pack("<Q", size) + block_header + payload


def zstd_small_frame(declared: int, payload: bytes) -> bytes:
    """A frame with a 1-byte content-size field: lets a test lie about the size by a little."""
    return ZSTD_MAGIC + b"\x20" + bytes([declared]) + struct.pack("<I", (len(payload) << 3) | 1)[:3] + payload


def test_crafted_frames_are_real_zstd():
    """The hand-made frames below are valid zstd when they tell the truth."""
    assert zstandard.ZstdDecompressor().decompress(zstd_small_frame(100, b"a" * 100)) == b"a" * 100
    assert zstandard.frame_content_size(zstd_frame_declaring(1 << 40)) == 1 << 40


@pytest.mark.parametrize("declared", [1 << 40, 1 << 62, 2**64 - 2, DEFECT_SPEC.decode_limit + 1])
def test_zstd_frame_declaring_a_huge_size_is_rejected_quickly(declared):
    started = time.perf_counter()
    with pytest.raises(CodecError, match="zstd"):
        decode(make_codec("zstd"), zstd_frame_declaring(declared), DEFECT_SPEC)
    assert time.perf_counter() - started < 0.5


def test_zstd_frames_that_lie_or_omit_their_size_are_rejected():
    spec = SegmentSpec(torch.uint8, (1, 1, 1, 100))
    assert torch.equal(
        decode(make_codec("zstd"), zstd_small_frame(100, b"a" * 100), spec),
        torch.full((1, 1, 1, 100), 97, dtype=torch.uint8),
    )
    for frame in (zstd_small_frame(10, b"a" * 100), zstd_small_frame(200, b"a" * 100)):
        with pytest.raises(CodecError):
            decode(make_codec("zstd"), frame, spec)
    streamed = zstandard.ZstdCompressor(write_content_size=False).compress(b"a" * 100)
    with pytest.raises(CodecError):
        decode(make_codec("zstd"), streamed, spec)


def test_bytesplit_with_hostile_high_plane_is_rejected_quickly():
    low = bytes(DEFECT_SPEC.nbytes // 2)
    codec = make_codec("bytesplit")
    started = time.perf_counter()
    for frame in (zstd_frame_declaring(1 << 40), zstd_frame_declaring(DEFECT_SPEC.nbytes + 1)):
        with pytest.raises(CodecError):
            decode(codec, struct.pack("<I", len(frame)) + frame + low, DEFECT_SPEC)
    with pytest.raises(CodecError, match="add up"):
        decode(codec, struct.pack("<I", 0xFFFFFFFF) + low, DEFECT_SPEC)
    assert time.perf_counter() - started < 0.5


def test_byteplanes_with_hostile_high_planes_is_rejected_quickly():
    """The high planes' frame must declare exactly their size: more, less, or none is a CodecError."""
    codec = make_codec("byteplanes")
    low = bytes(DEFECT_SPEC.nbytes // 2)
    for declared in (1 << 40, 2**64 - 2, DEFECT_SPEC.nbytes // 2 + 1):
        with pytest.raises(CodecError, match="^zstd"):  # refused by the frame header check, before any allocation
            decode(codec, low + zstd_frame_declaring(declared), DEFECT_SPEC)
    short = zstandard.ZstdCompressor().compress(bytes(DEFECT_SPEC.nbytes // 2 - 1))
    with pytest.raises(CodecError, match="high planes are"):
        decode(codec, low + short, DEFECT_SPEC)
    unsized = zstandard.ZstdCompressor(write_content_size=False).compress(bytes(DEFECT_SPEC.nbytes // 2))
    with pytest.raises(CodecError):
        decode(codec, low + unsized, DEFECT_SPEC)
    with pytest.raises(CodecError, match="shorter than"):
        decode(codec, low, DEFECT_SPEC)  # the raw planes and no frame


def test_lz4_block_declaring_a_huge_size_is_rejected_quickly():
    started = time.perf_counter()
    for size in (0x7FFFFFFF, 0xFFFFFFFF, DEFECT_SPEC.decode_limit + 1):
        with pytest.raises(CodecError, match="declares"):
            decode(make_codec("lz4"), struct.pack("<I", size) + b"\x00" * 16, DEFECT_SPEC)
    assert time.perf_counter() - started < 0.5


def test_fp8_with_a_wrong_scale_count_is_rejected():
    encoded = bytearray(ENCODED["fp8"])
    struct.pack_into("<I", encoded, 0, struct.unpack_from("<I", encoded)[0] + 1)
    with pytest.raises(CodecError, match="fp8"):
        decode(make_codec("fp8"), bytes(encoded), DEFECT_SPEC)


# ---------------------------------------------------------------------------------------------
# Segments written before the stages were typed still decode
# ---------------------------------------------------------------------------------------------

OLD_SEGMENT = (torch.arange(32, dtype=torch.float32).reshape(2, 4, 1, 4) / 4 - 3).to(torch.bfloat16)
# (chunk-header id, segment bytes), both written by the codecs before the typed stages and the registry
WRITTEN_BEFORE = {
    "identity": (
        "40c030c020c010c000c0e0bfc0bfa0bf80bf40bf00bf80be0000803e003f403f803fa03fc03fe03f0040104020403040"
        "40405040604070408040884090409840"
    ),
    "zstd:3": (
        "28b52ffd2040dd010002c40d18b025e90cc5c936dc602432160f4820429ae0eca2650b97010b0e0c982e261efe32793c"
        "1e9686c43981b601d5eaa232d53a5d47494b0f00"
    ),
    "bytesplit": (
        "1c00000028b52ffd20209d000058c0c0c0c0c0bfbe003e3f40031000268eb4454030201000e0c0a08040008000800040"
        "80a0c0e0001020304050607080889098"
    ),
    "bytesplit:3": (
        "1c00000028b52ffd20209d000058c0c0c0c0c0bfbe003e3f40031000268eb4454030201000e0c0a08040008000800040"
        "80a0c0e0001020304050607080889098"
    ),
    "bytesplit+lz4": (
        "40000000f0311c00000028b52ffd20209d000058c0c0c0c0c0bfbe003e3f40031000268eb4454030201000e0c0a08040"
        "00800080004080a0c0e0001020304050607080889098"
    ),
    "fp8+zstd": (
        "28b52ffd204421020008000000b76ddb3b9224c93b6edbb63b4992a43b2549123cb76d1b3c4992243cdbb62d3cfefefe"
        "fef9f9f8f8f1efebe400626b716e707172767778787a7b7b7b7e7e7e7e"
    ),
    # written when byteplanes was added: its byte format must never change under its name
    "byteplanes": (
        "4030201000e0c0a0804000800080004080a0c0e000102030405060708088909828b52ffd20209d000058c0c0c0c0c0bf"
        "be003e3f40031000268eb445"
    ),
    "byteplanes+lz4": (
        "3c000000f02d4030201000e0c0a0804000800080004080a0c0e000102030405060708088909828b52ffd20209d000058"
        "c0c0c0c0c0bfbe003e3f40031000268eb445"
    ),
}
# The lossy integer codecs' formats as first written (2026-11): group sizes with full groups and short tails.
WRITTEN_BY_QUANTIZERS = {
    "int8": (
        "0622062206220622061a061a061a061a00c280c100c180c0003c0040004200440000000055555555aaaaaaaaffffffff"
        "0055aaff0055aaff0055aaff0055aaff"
    ),
    "int8:3": (
        "042004200420042000000000000000000418041804180418000000000000000000c280c100c180c0000000340038003a"
        "003c004000420044003f80418043c0440000000080808080ffffffff000000000080ff000080ff000080ff000080ff00"
    ),
    "int4": "6632663266326632662a662a662a662a00c280c100c180c0003c0040004200440050a0f00555a5f50a5aaafa0f5fafff",
    "int4:3": (
        "443044304430443000000000000000004428442844284428000000000000000000c280c100c180c0000000340038003a"
        "003c004000420044003f80418043c0440080f0000888f8080f8fff0f0080f000"
    ),
    "hadamard+int4:2": (
        "44300000000000004430000000000000663244285535442877374428cd38442840c500b400b8000000bd00b400b80000"
        "00b400b800b400b800b400b800b400b8f00000f0ff0000f0f00000f0ff0000f0"
    ),
}


@pytest.mark.parametrize("stored_id, encoded", WRITTEN_BEFORE.items(), ids=list(WRITTEN_BEFORE))
def test_segments_written_before_still_decode(stored_id, encoded):
    codec = make_codec(stored_id)
    assert codec.id == stored_id
    decoded = decode(codec, bytes.fromhex(encoded), spec_of(OLD_SEGMENT))
    if codec.lossless:
        assert_bit_exact(decoded, OLD_SEGMENT)
    else:
        assert roundtrip_error(OLD_SEGMENT, decoded)["rms_rel"] < 2**-4


@pytest.mark.parametrize("stored_id, encoded", WRITTEN_BY_QUANTIZERS.items(), ids=list(WRITTEN_BY_QUANTIZERS))
def test_quantizer_formats_never_change(stored_id, encoded):
    """A codec name is written into chunks: its byte format is frozen (a new format takes a new name)."""
    codec = make_codec(stored_id)
    assert codec.id == stored_id
    assert encode(codec, OLD_SEGMENT).hex() == encoded
    decoded = decode(codec, bytes.fromhex(encoded), spec_of(OLD_SEGMENT))
    assert roundtrip_error(OLD_SEGMENT, decoded)["rms_rel"] < 0.1


# ---------------------------------------------------------------------------------------------
# The registry: stages registered in code, and third-party ones from the entry-point group
# ---------------------------------------------------------------------------------------------


class WidenCodec(ArrayArrayCodec):
    """An array→array stage that changes the spec: 16-bit floats become float32 (exactly) for the stages after it."""

    name = "widen"

    def encoded_spec(self, spec: SegmentSpec) -> SegmentSpec:
        return SegmentSpec(torch.float32, spec.shape)

    def encode(self, data: memoryview, spec: SegmentSpec) -> Buffer:
        return tensor_view(data, spec.dtype, spec.shape).float().view(torch.uint8).numpy().tobytes()

    def decode(self, data: memoryview, spec: SegmentSpec) -> Buffer:
        wide = tensor_view(data, torch.float32, spec.shape)  # the wrong length raises: the pipeline's CodecError
        return wide.to(spec.dtype).view(torch.uint8).numpy().tobytes()


@pytest.fixture
def registry(monkeypatch: pytest.MonkeyPatch) -> CodecRegistry:
    """A fresh registry (built-ins only, entry points not read yet) in place of the default one for one test."""
    fresh = CodecRegistry()
    monkeypatch.setattr(codec_registry, "default_registry", fresh)
    return fresh


PLUGIN_SOURCE = '''
import numpy as np

from kvstore.codecs import BytesBytesCodec


class XorCodec(BytesBytesCodec):
    """A stand-in for a third-party compressor: flips every bit."""

    name = "xor"

    def encode(self, data, spec):
        return (np.frombuffer(data, dtype=np.uint8) ^ 0xFF).tobytes()

    def decode(self, data, spec):
        return self.encode(data, spec)


class NotAStage:
    name = "notastage"
'''


@pytest.fixture
def install(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, registry: CodecRegistry) -> Iterator[Callable[..., None]]:
    """Install a distribution the way pip does (a module beside a ``*.dist-info`` folder) on a
    sys.path entry of its own; sys.path, the modules it imported and the registry are restored after."""
    site = tmp_path / "site-packages"
    site.mkdir()
    monkeypatch.syspath_prepend(str(site))
    modules: list[str] = []

    def install_distribution(dist: str, entry_points: dict[str, str], module_sources: dict[str, str]) -> None:
        for module, source in module_sources.items():
            (site / f"{module}.py").write_text(textwrap.dedent(source))
            modules.append(module)
        info = site / f"{dist.replace('-', '_')}-1.0.dist-info"  # as pip names it: the name ends at the first '-'
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 1.0\n")
        lines = "".join(f"{name} = {target}\n" for name, target in entry_points.items())
        (info / "entry_points.txt").write_text(f"[{ENTRY_POINT_GROUP}]\n{lines}")
        importlib.invalidate_caches()

    yield install_distribution
    for module in modules:
        sys.modules.pop(module, None)


def test_register_codec_adds_a_typed_stage_usable_in_pipelines(registry):
    assert register_codec(WidenCodec) is WidenCodec
    assert register_codec(WidenCodec) is WidenCodec  # the same class again is no clash
    assert "widen" in available_codecs() and "widen" not in CODECS
    segment = real_values(torch.bfloat16)
    for name in ("widen", "widen+bytesplit", "widen+fp8+zstd", "widen+zstd:3"):
        codec = make_codec(name)
        assert codec.id == name
        decoded = decode(codec, encode(codec, segment), spec_of(segment))
        if codec.lossless:
            assert_bit_exact(decoded, segment)
        else:
            assert roundtrip_error(segment, decoded)["rms_rel"] < 0.05
    # the stages after widen are given float32 (bytesplit and fp8 above decode to float32's size, or fail)
    assert len(encode(make_codec("widen"), segment)) == segment.numel() * 4
    with pytest.raises(CodecError):  # a defect met by an array→array stage is a CodecError too
        decode(make_codec("widen+zstd"), encode(make_codec("zstd"), segment), spec_of(segment))


def real_values(dtype: torch.dtype) -> torch.Tensor:
    """Finite values of a plausible KV magnitude (widen is exact on them, NaN payloads aside)."""
    return torch.from_numpy(np.random.default_rng(7).standard_normal(SMALL_SHAPE).astype(np.float32)).to(dtype)


@pytest.mark.parametrize(
    "name, fragment",
    [
        ("bytesplit+widen", "before the array→bytes stage 'bytesplit'"),
        ("zstd+widen", "before the bytes→bytes stage 'zstd'"),
        ("fp8+widen+zstd", "before the array→bytes stage 'fp8'"),
    ],
)
def test_array_array_stages_come_before_every_other_kind(registry, name, fragment):
    register_codec(WidenCodec)
    with pytest.raises(ValueError, match="'widen' \\(array→array\\) reads values, so it must come first") as excinfo:
        make_codec(name)
    assert fragment in str(excinfo.value)


def test_register_codec_refuses_a_taken_name_a_bad_name_and_an_untyped_class(registry):
    class OtherZstd(BytesBytesCodec):
        name = "zstd"

        def encode(self, data: memoryview, spec: SegmentSpec) -> Buffer:
            return data

        def decode(self, data: memoryview, spec: SegmentSpec) -> Buffer:
            return data

    with pytest.raises(ValueError, match="'zstd' is taken by kvstore.codecs.zstd.ZstdCodec"):
        register_codec(OtherZstd)
    for bad in ("Zstd2", "my+codec", "lz:4", "", "x" * (MAX_CODEC_NAME + 1), "fp8 zstd", "é"):
        renamed = type("Renamed", (OtherZstd,), {"name": bad})
        with pytest.raises(ValueError, match="lowercase ASCII"):
            register_codec(renamed)
    with pytest.raises(TypeError, match="not a codec stage"):
        register_codec(type("Plain", (), {"name": "plain"}))
    assert make_codec("zstd").stages[0].__class__ is CODECS["zstd"]


def test_a_third_party_codec_is_found_through_its_entry_point(install, registry):
    install("kvstore-xor", {"xor": "kvstore_test_xor:XorCodec"}, {"kvstore_test_xor": PLUGIN_SOURCE})
    assert "xor" in available_codecs()
    assert "kvstore_test_xor" not in sys.modules, "listing names must not import plugins"
    segment = random_bits(torch.bfloat16, SMALL_SHAPE, 21)
    for name in ("xor", "bytesplit+xor", "fp8+zstd+xor"):
        codec = make_codec(name)
        assert codec.id == name
        encoded = encode(codec, segment)
        decoded = decode(make_codec(codec.id), encoded, spec_of(segment))  # as a reader of the chunk header would
        if codec.lossless:
            assert_bit_exact(decoded, segment)
    assert encode(make_codec("xor"), segment) == bytes(b ^ 0xFF for b in bytes(tensor_bytes(segment)))
    plugin = sys.modules["kvstore_test_xor"].XorCodec
    assert registry.lookup("xor") is plugin and make_codec("xor").stages[0].kind is StageKind.BYTES_BYTES
    with pytest.raises(ValueError, match="'bytesplit' \\(array→bytes\\) reads values, so it must come first"):
        make_codec("xor+bytesplit")  # a plugin's stage is typed like any other


@pytest.mark.parametrize(
    "target, modules, fragments",
    [
        ("kvstore_test_absent:XorCodec", {}, ["ModuleNotFoundError", "kvstore_test_absent"]),
        ("kvstore_test_plugin:Missing", {"kvstore_test_plugin": PLUGIN_SOURCE}, ["AttributeError", "Missing"]),
        ("kvstore_test_plugin:NotAStage", {"kvstore_test_plugin": PLUGIN_SOURCE}, ["TypeError", "not a codec stage"]),
        ("kvstore_test_plugin:XorCodec", {"kvstore_test_plugin": PLUGIN_SOURCE}, ["whose name is 'xor', not 'broken'"]),
        ("kvstore_test_boom:XorCodec", {"kvstore_test_boom": "raise RuntimeError('boom')\n"}, ["RuntimeError: boom"]),
    ],
    ids=["no-module", "no-attribute", "not-a-stage", "wrong-name", "import-raises"],
)
def test_a_broken_entry_point_is_reported_by_name_and_breaks_nothing_else(install, target, modules, fragments):
    install("kvstore-broken", {"broken": target}, modules)
    for _ in range(2):  # the same clear error each time it is asked for, never a half-registered codec
        with pytest.raises(ValueError) as excinfo:
            make_codec("fp8+broken")
        text = str(excinfo.value)
        for fragment in [f"'broken = {target}'", "kvstore-broken 1.0", f"group {ENTRY_POINT_GROUP!r}", *fragments]:
            assert fragment in text, (fragment, text)
    for name in ALL:  # every other name still works
        make_codec(name)
    assert "broken" in available_codecs()
    with pytest.raises(ValueError, match="unknown codec 'snappy'.*'broken'"):
        make_codec("snappy")


def test_two_entry_points_for_one_name_are_an_error_naming_both(install, registry):
    install("kvstore-xor-a", {"xor": "kvstore_test_xor_a:XorCodec"}, {"kvstore_test_xor_a": PLUGIN_SOURCE})
    install("kvstore-xor-b", {"xor": "kvstore_test_xor_b:XorCodec"}, {"kvstore_test_xor_b": PLUGIN_SOURCE})
    with pytest.raises(ValueError, match="several entry points") as excinfo:
        make_codec("xor")
    assert "kvstore-xor-a 1.0" in str(excinfo.value) and "kvstore-xor-b 1.0" in str(excinfo.value)


def test_an_entry_point_cannot_take_a_built_in_name(install, registry):
    install("kvstore-fake-zstd", {"zstd": "kvstore_test_fake:XorCodec"}, {"kvstore_test_fake": PLUGIN_SOURCE})
    with pytest.warns(UserWarning, match="'zstd = kvstore_test_fake:XorCodec'.* is ignored"):
        names = available_codecs()
    assert names.count("zstd") == 1
    assert isinstance(make_codec("zstd").stages[0], CODECS["zstd"])
    assert "kvstore_test_fake" not in sys.modules


def test_entry_points_are_read_once_and_only_when_needed(install, registry):
    assert make_codec("zstd").id == "zstd"  # a built-in name does not read the group...
    install("kvstore-early", {"early": "kvstore_test_early:XorCodec"}, {"kvstore_test_early": PLUGIN_SOURCE})
    assert "early" in available_codecs()  # ...so a plugin installed since is found
    install("kvstore-late", {"late": "kvstore_test_late:XorCodec"}, {"kvstore_test_late": PLUGIN_SOURCE})
    assert "late" not in available_codecs(), "the group is read once, not at every lookup"


def test_tensor_view_of_stored_bytes_leaves_the_process_warnings_alone():
    """Viewing read-only bytes (what a tier reads back) warns nothing, and changes no warning filter
    beyond its own calls: a user's UserWarning still raises under -W error. (It used to wrap each
    call in ``warnings.catch_warnings()``, which is not thread-safe with codec threads.)"""
    code = textwrap.dedent(
        """
        import warnings, torch
        from kvstore.util.buffers import tensor_view
        assert tensor_view(bytes(8), torch.float32, (2,)).tolist() == [0.0, 0.0]  # would raise if it warned
        try:
            warnings.warn("the user's own warning", UserWarning)  # still an error: no filter leaked
        except UserWarning:
            print("user warning raised")
        """
    )
    result = subprocess.run([sys.executable, "-W", "error", "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "user warning raised"


# ---------------------------------------------------------------------------------------------
# Batch hooks: a chunk's layers in one call give exactly what one call per layer gives
# ---------------------------------------------------------------------------------------------

BATCH_SHAPES = [
    (2, 16, 2, 8),  # groups of 4 and 8 divide the tokens: the quantizers' batch path
    (2, 16, 2, 12),  # head_dim 12 with groups of 8: every value row has a short tail
    (1, 16, 1, 8),  # one plane (an MLA latent)
    (2, 12, 2, 8),  # tokens the group does not divide: one encode per layer
]


def batch_of(dtype: torch.dtype, shape: tuple[int, ...], count: int, seed: int) -> list[torch.Tensor]:
    """``count`` segments: real-looking values, one layer with NaN and +-inf in it."""
    generator = torch.Generator().manual_seed(seed)
    layers = [(torch.randn(shape, generator=generator) * (1 + 3 * index)).to(dtype) for index in range(count)]
    layers[1].view(-1)[[0, 5, 9]] = torch.tensor([float("nan"), float("inf"), -float("inf")]).to(dtype)
    return layers


BATCH_CASES = [
    (name, shape)
    for name in ("int8:8", "int4:4", "int4:8+zstd", "hadamard+int8:8", "int8", "byteplanes", "fp8")
    for shape in BATCH_SHAPES
    if not name.startswith("hadamard") or shape[-1] & (shape[-1] - 1) == 0  # hadamard: power-of-two head_dim
]


@pytest.mark.parametrize("name,shape", BATCH_CASES)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_encode_batch_and_decode_batch_give_each_layers_own_bytes(name, shape, dtype):
    codec = make_codec(name)
    layers = batch_of(dtype, shape, 3, seed=len(name) + shape[-1])
    spec = spec_of(layers[0])
    views = [tensor_bytes(layer) for layer in layers]
    one_by_one = [encode(codec, layer) for layer in layers]
    assert [bytes(memoryview(out).cast("B")) for out in codec.encode_batch(views, spec)] == one_by_one
    outs = [torch.empty(shape, dtype=dtype) for _ in layers]
    codec.decode_batch_into(one_by_one, spec, [tensor_bytes(out) for out in outs])
    for out, stored in zip(outs, one_by_one, strict=True):
        assert torch.equal(bits(out), bits(decode(codec, stored, spec)))


def test_a_batch_decode_with_one_bad_segment_is_a_codec_error():
    codec = make_codec("int8:8")
    layers = batch_of(torch.bfloat16, SMALL_SHAPE, 3, seed=1)
    stored = [encode(codec, layer) for layer in layers]
    outs = [tensor_bytes(torch.empty(SMALL_SHAPE, dtype=torch.bfloat16)) for _ in layers]
    with pytest.raises(CodecError, match="segment length does not match"):
        codec.decode_batch_into([stored[0], stored[1][:-1], stored[2]], spec_of(layers[0]), outs)


def test_an_fp8_kv_cache_is_stored_exactly_by_lossless_codecs_and_a_lossy_codec_is_refused_at_start(tmp_path):
    """An engine's fp8 KV (one byte per value) is kept byte for byte; the lossy
    codecs quantize 16- and 32-bit floats, so a tier configured with one stops the store at start
    (else every put to it would fail, one counted error at a time)."""
    from kvstore import KVLayout, StoreConfig, SyncKVStore
    from kvstore.errors import ConfigError

    layout = KVLayout(num_layers=2, num_kv_heads=2, head_dim=32, dtype=torch.float8_e4m3fn)
    chunk = torch.randn(layout.chunk_shape).to(torch.float8_e4m3fn)
    for codec in ("identity", "byteplanes", "bytesplit+zstd"):
        config = StoreConfig(dram={"capacity": "16MiB"}, disk={"path": tmp_path / codec, "codec": codec})
        with SyncKVStore(config, layout, namespace="fp8") as store:
            key = store.chunk_keys(list(range(256)))[0]
            assert store.put(key, chunk)
            store.flush()
        with SyncKVStore(config, layout, namespace="fp8") as fresh:  # from the disk, decoded
            got = fresh.get(key)
        assert got is not None and got.dtype == torch.float8_e4m3fn
        assert torch.equal(got.view(torch.uint8), chunk.view(torch.uint8)), codec
    lossy = StoreConfig(disk={"path": tmp_path / "lossy", "codec": "fp8+zstd", "allow_lossy": True})
    with pytest.raises(ConfigError, match=r"disk.codec 'fp8\+zstd' cannot store this model's KV .*float8_e4m3fn"):
        SyncKVStore(lossy, layout, namespace="fp8")
