"""The chunk container: header + per-layer segments, every byte checked before the engine sees it."""

from __future__ import annotations

import struct

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from kvstore import ChunkFormatError, KVLayout, chunk_keys
from kvstore.codecs import make_codec, roundtrip_error
from kvstore.errors import ForeignChunkError
from kvstore.storage.container import (
    HEADER_ALIGN,
    MAGIC,
    VERSION,
    check_stored_chunk,
    checksum,
    decode_chunk,
    decode_layer,
    decode_payload,
    encode_chunk,
    encode_header,
    header_length,
    header_size,
    parse_header,
)
from kvstore.util.buffers import tensor_bytes

LAYOUT = KVLayout(num_layers=3, num_kv_heads=2, head_dim=8, chunk_tokens=16)  # 1 KiB per layer
KEY, OTHER_KEY = chunk_keys(list(range(32)), LAYOUT, "format-tests")
LOSSLESS = ["identity", "zstd", "zstd:3", "lz4", "bytesplit", "bytesplit:3", "bytesplit+lz4", "zstd+lz4", "byteplanes"]
FUZZ_CODECS = ["identity", "zstd", "lz4", "bytesplit", "bytesplit+lz4", "byteplanes", "fp8+zstd"]

# The documented fixed part: magic, version, flags, header_len, fingerprint, key, tokens, layers, codec length.
FIXED = struct.Struct("<8sHHI16s32sIIH")
SEGMENT = struct.Struct("<QQQQ")  # offset, stored_len, raw_len, xxh3-64
CHECKSUM = struct.Struct("<Q")
# then zero padding so the header (checksum included) fills whole 4 KiB pages: payloads start page-aligned
PAGE = 4096


def padded(unpadded: int) -> int:
    return -(-unpadded // PAGE) * PAGE


# ---------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------


def make_chunk(layout: KVLayout, seed: int = 0) -> torch.Tensor:
    """KV-like values (normal, a few large channels) in the layout's dtype and canonical shape."""
    rng = np.random.default_rng(seed)
    values = rng.standard_normal(layout.chunk_shape).astype(np.float32)
    values[..., 0] *= 20.0  # an outlier channel, like real K
    return torch.from_numpy(values).to(layout.dtype).contiguous()


def container(chunk: torch.Tensor, codec: str, layout: KVLayout = LAYOUT, key: str = KEY) -> bytes:
    parts = encode_chunk(layout, key, tensor_bytes(chunk), make_codec(codec))
    return b"".join(bytes(part) for part in parts)


def decode(data, layout: KVLayout = LAYOUT, key: str = KEY) -> torch.Tensor:
    out = torch.empty(layout.chunk_shape, dtype=layout.dtype)
    decode_chunk(data, layout, key, tensor_bytes(out))
    return out


def bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[tensor.element_size()])


def assert_bit_exact(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape
    assert torch.equal(bits(a), bits(b))


def split_header(data: bytes) -> tuple[list, bytes, list[list[int]], bytes]:
    """Unpack a container's header by the documented layout: (fixed fields, codec, segments, payload)."""
    fixed = list(FIXED.unpack_from(data))
    codec_len, n_layers = fixed[8], fixed[7]
    codec = data[FIXED.size : FIXED.size + codec_len]
    table = FIXED.size + codec_len
    segments = [list(SEGMENT.unpack_from(data, table + i * SEGMENT.size)) for i in range(n_layers)]
    return fixed, codec, segments, data[fixed[3] :]


def forge(fixed: list, codec: bytes, segments: list[list[int]], payload: bytes, fix_len: bool = True) -> bytes:
    """Build a header with a *valid* checksum: tests what is checked beyond the checksum."""
    fixed = list(fixed)
    unpadded = FIXED.size + len(codec) + len(segments) * SEGMENT.size + CHECKSUM.size
    if fix_len:
        fixed[8] = len(codec)
        fixed[3] = padded(unpadded)
    body = FIXED.pack(*fixed) + codec + b"".join(SEGMENT.pack(*s) for s in segments)
    body += bytes(max(0, fixed[3] - CHECKSUM.size - len(body)))
    return body + CHECKSUM.pack(checksum(body)) + payload


CHUNK = make_chunk(LAYOUT)
CONTAINERS = {name: container(CHUNK, name) for name in set(LOSSLESS + FUZZ_CODECS)}
CLEAN = {name: decode(data) for name, data in CONTAINERS.items()}


# ---------------------------------------------------------------------------------------------
# Round trips
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", LOSSLESS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_round_trip_is_bit_exact(name, dtype):
    layout = KVLayout(num_layers=3, num_kv_heads=2, head_dim=8, chunk_tokens=16, dtype=dtype)
    chunk = make_chunk(layout, seed=1)
    chunk.view(-1)[:4] = torch.tensor([float("nan"), float("inf"), -0.0, -float("inf")]).to(dtype)
    data = container(chunk, name, layout)
    out = torch.empty(layout.chunk_shape, dtype=dtype)
    header = decode_chunk(data, layout, KEY, tensor_bytes(out))
    assert_bit_exact(out, chunk)
    assert header.total_len == len(data)
    assert header.codec.id == make_codec(name).id
    assert header.token_count == layout.chunk_tokens


@pytest.mark.parametrize(
    "wrap",
    [bytes, bytearray, memoryview, lambda b: np.frombuffer(b, dtype=np.uint8)],
    ids=["bytes", "bytearray", "memoryview", "ndarray"],
)
def test_decode_accepts_any_buffer(wrap):
    assert_bit_exact(decode(wrap(CONTAINERS["bytesplit"])), CHUNK)


def test_lossy_round_trip_matches_the_codec():
    out = decode(CONTAINERS["fp8+zstd"])
    error = roundtrip_error(CHUNK, out)
    assert error["cosine"] > 0.998 and error["rms_rel"] < 0.05, error
    assert not torch.equal(bits(out), bits(CHUNK)), "fp8 is lossy: a bit-exact result means it did nothing"


@pytest.mark.parametrize("name", ["identity", "bytesplit", "zstd", "bytesplit+lz4", "byteplanes"])
def test_round_trip_of_a_real_chunk(real_kv, name):
    layout = KVLayout(num_layers=30, num_kv_heads=3, head_dim=64, dtype=torch.bfloat16)  # SmolLM2-135M
    key = chunk_keys(list(range(256)), layout, "smollm2")[0]
    chunk = real_kv[:, :, 256:512].contiguous()
    data = container(chunk, name, layout, key)
    assert_bit_exact(decode(data, layout, key), chunk)
    if name.startswith("bytesplit"):
        assert len(data) < layout.chunk_nbytes / 1.3


def test_round_trip_with_one_plane_mla_layout():
    layout = KVLayout(num_layers=2, num_kv_heads=1, head_dim=32, kv_planes=1, chunk_tokens=8)
    chunk = make_chunk(layout, seed=4)
    for name in ("identity", "bytesplit", "fp8+zstd"):
        out = decode(container(chunk, name, layout), layout)
        if name == "fp8+zstd":
            assert roundtrip_error(chunk, out)["cosine"] > 0.998
        else:
            assert_bit_exact(out, chunk)


def test_encode_chunk_is_a_gather_list_and_identity_is_zero_copy():
    codec = make_codec("identity")
    raw = tensor_bytes(CHUNK)
    parts = encode_chunk(LAYOUT, KEY, raw, codec)
    assert len(parts) == 1 + LAYOUT.num_layers
    header = parse_header(parts[0], LAYOUT, KEY)
    assert len(parts[0]) == header.header_len
    chunk_memory = np.frombuffer(raw, dtype=np.uint8)
    for layer, part in enumerate(parts[1:]):
        view = np.frombuffer(part, dtype=np.uint8)
        assert np.shares_memory(view, chunk_memory), "identity segments must be views of the chunk"
        assert bytes(part) == bytes(raw[layer * LAYOUT.layer_nbytes : (layer + 1) * LAYOUT.layer_nbytes])


def test_encode_chunk_rejects_a_chunk_of_the_wrong_size():
    with pytest.raises(ValueError, match="layout needs"):
        encode_chunk(LAYOUT, KEY, bytes(LAYOUT.chunk_nbytes - 2), make_codec("identity"))


def test_decode_into_a_buffer_of_the_wrong_size_is_a_caller_error():
    with pytest.raises(ValueError):
        decode_chunk(CONTAINERS["identity"], LAYOUT, KEY, bytearray(LAYOUT.chunk_nbytes + 2))


# ---------------------------------------------------------------------------------------------
# The header
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", LOSSLESS + ["fp8+zstd"])
def test_header_fields(name):
    data = CONTAINERS[name]
    header = parse_header(data, LAYOUT, KEY)
    codec_id = make_codec(name).id
    assert header.header_len == header_size(LAYOUT.num_layers, codec_id)
    assert header.codec.id == codec_id
    assert header.token_count == LAYOUT.chunk_tokens
    assert len(header.segments) == LAYOUT.num_layers
    assert header.total_len == len(data)
    offset = 0
    for segment in header.segments:
        assert segment.offset == offset
        assert segment.raw_len == LAYOUT.layer_nbytes
        start = header.header_len + segment.offset
        assert segment.checksum == checksum(data[start : start + segment.stored_len])
        offset += segment.stored_len
    assert header.header_len + offset == len(data)
    # the documented byte layout
    fixed, codec, segments, payload = split_header(data)
    assert fixed[0] == MAGIC == b"KVSTCHNK" and fixed[1] == VERSION and fixed[2] == 0
    assert fixed[3] == header.header_len and fixed[4] == LAYOUT.fingerprint and fixed[5] == bytes.fromhex(KEY)
    assert (fixed[6], fixed[7]) == (LAYOUT.chunk_tokens, LAYOUT.num_layers)
    assert codec == codec_id.encode("ascii")
    assert [s[:3] for s in segments] == [[s.offset, s.stored_len, s.raw_len] for s in header.segments]
    assert len(payload) == header.payload_len
    body_end = header.header_len - CHECKSUM.size
    assert CHECKSUM.unpack_from(data, body_end)[0] == checksum(data[:body_end])
    # page-aligned payload: zero padding between the segment table and the header checksum
    table_end = FIXED.size + len(codec) + LAYOUT.num_layers * SEGMENT.size
    assert header.header_len == padded(table_end + CHECKSUM.size) == HEADER_ALIGN == PAGE
    assert data[table_end:body_end] == bytes(body_end - table_end)
    assert header_length(data[: FIXED.size]) == header.header_len


def test_headers_of_many_layers_span_several_pages():
    layout = KVLayout(num_layers=200, num_kv_heads=1, head_dim=4, chunk_tokens=2)
    chunk = make_chunk(layout)
    data = container(chunk, "identity", layout)
    header = parse_header(data, layout, KEY)
    assert header.header_len == padded(FIXED.size + len("identity") + 200 * SEGMENT.size + CHECKSUM.size) == 2 * PAGE
    assert header.header_len == header_size(200, "identity")
    assert_bit_exact(decode(data, layout), chunk)


def test_header_length_from_the_first_bytes():
    data = CONTAINERS["zstd"]
    assert header_length(data[: FIXED.size]) == parse_header(data, LAYOUT, KEY).header_len
    with pytest.raises(ChunkFormatError):
        header_length(data[: FIXED.size - 1])
    with pytest.raises(ChunkFormatError, match="magic"):
        header_length(b"X" + data[1 : FIXED.size])
    for bogus in (0, FIXED.size, 2**32 - 1):
        forged = bytearray(data[: FIXED.size])
        struct.pack_into("<I", forged, 12, bogus)
        with pytest.raises(ChunkFormatError):
            header_length(forged)


def test_header_parses_from_the_header_bytes_alone():
    data = CONTAINERS["bytesplit"]
    header = parse_header(data, LAYOUT, KEY)
    assert parse_header(data[: header.header_len], LAYOUT, KEY) == header
    for cut in (0, 1, FIXED.size - 1, FIXED.size, 300, header.header_len - 1):
        with pytest.raises(ChunkFormatError):
            parse_header(data[:cut], LAYOUT, KEY)


@pytest.mark.parametrize("name", ["identity", "bytesplit+lz4", "fp8+zstd"])
def test_every_bit_flip_in_the_header_is_caught(name):
    data = CONTAINERS[name]
    header_len = parse_header(data, LAYOUT, KEY).header_len
    fields_end = FIXED.size + len(make_codec(name).id) + LAYOUT.num_layers * SEGMENT.size
    positions = [*range(fields_end), *range(fields_end, header_len - 8, 61), *range(header_len - 8, header_len)]
    for position in positions:  # every field bit, a sample of the padding, the checksum
        for bit in range(8):
            corrupted = bytearray(data)
            corrupted[position] ^= 1 << bit
            with pytest.raises(ChunkFormatError):
                parse_header(corrupted, LAYOUT, KEY)
            with pytest.raises(ChunkFormatError):
                decode(corrupted)


def test_header_checksum_covers_the_codec_name_and_segment_table():
    data = CONTAINERS["zstd"]
    header_len = parse_header(data, LAYOUT, KEY).header_len
    for position in (FIXED.size, FIXED.size + 4 + 3, FIXED.size + 4 + 3 * SEGMENT.size - 1, header_len - 9, 1000):
        corrupted = bytearray(data)
        corrupted[position] ^= 0x01
        with pytest.raises(ChunkFormatError, match="checksum"):
            parse_header(corrupted, LAYOUT, KEY)


@pytest.mark.parametrize(
    "other",
    [
        KVLayout(num_layers=3, num_kv_heads=2, head_dim=8, chunk_tokens=16, dtype=torch.float16),  # same bytes
        KVLayout(num_layers=3, num_kv_heads=1, head_dim=16, chunk_tokens=16),  # same bytes per layer
        KVLayout(num_layers=3, num_kv_heads=4, head_dim=8, chunk_tokens=16, kv_planes=1),  # same bytes
        KVLayout(num_layers=3, num_kv_heads=2, head_dim=8, chunk_tokens=32),
        KVLayout(num_layers=4, num_kv_heads=2, head_dim=8, chunk_tokens=16),
    ],
    ids=["fp16", "heads-x-dim", "mla", "tokens", "layers"],
)
@pytest.mark.parametrize("name", ["identity", "bytesplit"])
def test_a_foreign_layout_is_never_decoded(other, name):
    data = CONTAINERS[name]
    with pytest.raises(ForeignChunkError, match="another model layout"):  # foreign: left for its owner
        parse_header(data, other, KEY)
    out = bytearray(other.chunk_nbytes)
    with pytest.raises(ForeignChunkError, match="another model layout"):
        decode_chunk(data, other, KEY, out)


@pytest.mark.parametrize("name", ["identity", "bytesplit", "fp8+zstd"])
def test_a_chunk_under_another_key_is_never_decoded(name):
    with pytest.raises(ChunkFormatError, match="another key"):
        decode(CONTAINERS[name], key=OTHER_KEY)
    with pytest.raises(ChunkFormatError, match="another key"):
        parse_header(CONTAINERS[name], LAYOUT, OTHER_KEY)


@pytest.mark.parametrize("name", ["identity", "bytesplit", "lz4"])
@pytest.mark.parametrize("extra", [b"\x00", b"garbage", "copy"])
def test_trailing_garbage_is_an_error(name, extra):
    data = CONTAINERS[name]
    with pytest.raises(ChunkFormatError):
        decode(data + (data if extra == "copy" else extra))


def test_missing_bytes_are_an_error():
    data = CONTAINERS["identity"]
    for cut in (1, 2, LAYOUT.layer_nbytes, LAYOUT.layer_nbytes + 1):
        with pytest.raises(ChunkFormatError):
            decode(data[:-cut])


# Headers with a *valid* checksum but wrong content: what parse_header checks beyond the checksum.


def _forged(mutate) -> bytes:
    fixed, codec, segments, payload = split_header(CONTAINERS["identity"])
    fixed, codec, segments = list(fixed), codec, [list(s) for s in segments]
    result = mutate(fixed, codec, segments, payload)
    return forge(*result) if isinstance(result, tuple) else result


def _set(index: int, value):
    def mutate(fixed, codec, segments, payload):
        fixed[index] = value
        return fixed, codec, segments, payload

    return mutate


@pytest.mark.parametrize(
    "mutate, message",
    [
        (_set(0, b"KVSTCHNX"), "magic"),
        (_set(1, VERSION + 1), "version"),
        (_set(2, 2), "flags"),  # an unknown flag (1 is ENCRYPTED)
        (_set(4, KVLayout(num_layers=3, num_kv_heads=2, head_dim=8, chunk_tokens=32).fingerprint), "layout"),
        (_set(5, bytes(32)), "another key"),
        (_set(6, 32), "shape"),
        (lambda f, c, s, p: (f, c, s[:2], p), "inconsistent"),  # a table of two, a count of three
        (lambda f, c, s, p: (_with(f, 7, 2), c, s[:2], p), "shape"),
        (lambda f, c, s, p: (_with(f, 7, 0), c, [], p), "out of range"),
        (lambda f, c, s, p: (_with(f, 7, 5000), c, s, p), "out of range"),
        (lambda f, c, s, p: (f, b"", s, p), "out of range"),
        (lambda f, c, s, p: (f, b"x" * 65, s, p), "out of range"),
        (lambda f, c, s, p: (f, b"snappy", s, p), "unknown codec"),
        (lambda f, c, s, p: (f, b"zstd:99", s, p), "unknown codec"),
        (lambda f, c, s, p: (f, b"zstd+bytesplit", s, p), "unknown codec"),
        (lambda f, c, s, p: (f, "identit\u00e9".encode(), s, p), "unknown codec"),
        (lambda f, c, s, p: (f, c, _seg(s, 1, 0, s[1][0] + 1), p), "segment table"),
        (lambda f, c, s, p: (f, c, _seg(s, 0, 0, 1), p), "segment table"),
        (lambda f, c, s, p: (f, c, _seg(s, 2, 2, s[2][2] - 2), p), "segment table"),
        (lambda f, c, s, p: (f, c, _seg(s, 2, 1, 2**63), p), "header says"),
        (lambda f, c, s, p: (f, c, _shrink_first(s), p), "header says"),  # consistent table, 1 byte short
        (lambda f, c, s, p: (f, c, _seg(s, 1, 3, s[1][3] ^ 1), p), "checksum"),
        (lambda f, c, s, p: (_with(f, 3, f[3] + 1), c, s, p, False), "inconsistent"),
    ],
)
def test_forged_headers_with_valid_checksums_are_rejected(mutate, message):
    data = _forged(mutate)
    with pytest.raises(ChunkFormatError, match=message):
        decode(data)


@pytest.mark.parametrize("name", [b"snappy", b"zstd:99", b"zstd+bytesplit"])
def test_a_codec_this_process_lacks_makes_a_foreign_chunk_that_verify_accepts(name):
    """A plugin's codec, say, not installed here: the chunk is someone else's (left in place), not damaged."""
    data = _forged(lambda f, c, s, p: (f, name, s, p))
    with pytest.raises(ForeignChunkError, match="unknown codec"):
        parse_header(data, LAYOUT, KEY)
    assert check_stored_chunk(data, KEY).codec == name.decode()
    damaged = _forged(lambda f, c, s, p: (f, "identit\u00e9".encode(), s, p))
    with pytest.raises(ChunkFormatError, match="unknown codec") as excinfo:
        check_stored_chunk(damaged, KEY)
    assert not isinstance(excinfo.value, ForeignChunkError)


def _with(fixed: list, index: int, value) -> list:
    fixed = list(fixed)
    fixed[index] = value
    return fixed


def _shrink_first(segments: list[list[int]]) -> list[list[int]]:
    segments = _seg(segments, 0, 1, segments[0][1] - 1)
    for layer in range(1, len(segments)):
        segments = _seg(segments, layer, 0, segments[layer][0] - 1)
    return segments


def _seg(segments: list[list[int]], layer: int, field: int, value: int) -> list[list[int]]:
    segments = [list(s) for s in segments]
    segments[layer][field] = value
    return segments


def test_header_naming_another_codec_than_the_payload_is_an_error_not_garbage():
    """A valid header (real encoder, valid checksums) whose codec does not match the stored bytes."""
    data = CONTAINERS["identity"]
    header = parse_header(data, LAYOUT, KEY)
    payload = data[header.header_len :]
    for codec_id in ("bytesplit", "zstd", "lz4", "fp8", "bytesplit+lz4"):
        forged = encode_header(LAYOUT, KEY, codec_id, list(header.segments)) + payload
        with pytest.raises(ChunkFormatError):
            decode(forged)


@pytest.mark.parametrize("codec_id", ["int8:8", "int4:8", "int8"])
def test_a_codec_error_in_a_run_of_layers_names_its_layer(codec_id):
    """Layers decode a run at a time (one codec call for all of them); an error still names its layer."""
    data = CONTAINERS["identity"]
    header = parse_header(data, LAYOUT, KEY)
    forged = encode_header(LAYOUT, KEY, codec_id, list(header.segments)) + data[header.header_len :]
    with pytest.raises(ChunkFormatError, match=rf"^layer 0: {codec_id.split(':')[0]}"):
        decode(forged)


def test_forge_helper_reproduces_a_real_header():
    """The forging helper writes what the encoder writes, so the forged cases test one change each."""
    data = CONTAINERS["identity"]
    assert forge(*split_header(data)) == data


# ---------------------------------------------------------------------------------------------
# One layer alone, by byte range
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", LOSSLESS + ["fp8+zstd"])
def test_each_layer_decodes_alone_from_its_byte_range(name):
    data = CONTAINERS[name]
    parts = encode_chunk(LAYOUT, KEY, tensor_bytes(CHUNK), make_codec(name))
    header_len = header_length(data[: FIXED.size])  # a first small range read
    header = parse_header(data[:header_len], LAYOUT, KEY)  # then the header
    for layer in reversed(range(LAYOUT.num_layers)):  # any order: each layer stands alone
        segment = header.segments[layer]
        start = header.header_len + segment.offset
        stored = data[start : start + segment.stored_len]
        assert stored == bytes(parts[1 + layer])
        out = torch.empty(LAYOUT.layer_shape, dtype=LAYOUT.dtype)
        decode_layer(header, LAYOUT, layer, stored, tensor_bytes(out))
        assert_bit_exact(out, CLEAN[name][layer])
        if make_codec(name).lossless:
            assert_bit_exact(out, CHUNK[layer])


def test_a_layer_read_from_the_wrong_range_is_an_error():
    data = CONTAINERS["bytesplit"]
    header = parse_header(data, LAYOUT, KEY)
    out = tensor_bytes(torch.empty(LAYOUT.layer_shape, dtype=LAYOUT.dtype))

    def stored(layer: int, shift: int = 0) -> bytes:
        segment = header.segments[layer]
        start = header.header_len + segment.offset + shift
        return data[start : start + segment.stored_len]

    with pytest.raises(ChunkFormatError, match="layer 0"):
        decode_layer(header, LAYOUT, 0, stored(1), out)  # another layer's bytes
    with pytest.raises(ChunkFormatError):
        decode_layer(header, LAYOUT, 1, stored(1, shift=1), out)  # off by one
    with pytest.raises(ChunkFormatError):
        decode_layer(header, LAYOUT, 2, stored(2)[:-1], out)  # short read
    corrupted = bytearray(stored(2))
    corrupted[len(corrupted) // 2] ^= 0x40
    with pytest.raises(ChunkFormatError, match="checksum"):
        decode_layer(header, LAYOUT, 2, corrupted, out)


def test_decode_payload_checks_length_and_every_layer():
    data = CONTAINERS["identity"]
    header = parse_header(data, LAYOUT, KEY)
    payload = bytearray(data[header.header_len :])
    out = torch.empty(LAYOUT.chunk_shape, dtype=LAYOUT.dtype)
    decode_payload(header, LAYOUT, payload, tensor_bytes(out))
    assert_bit_exact(out, CHUNK)
    with pytest.raises(ChunkFormatError, match="header says"):
        decode_payload(header, LAYOUT, payload[:-1], tensor_bytes(out))
    payload[LAYOUT.layer_nbytes + 5] ^= 0x01
    with pytest.raises(ChunkFormatError, match="layer 1"):
        decode_payload(header, LAYOUT, payload, tensor_bytes(out))


# ---------------------------------------------------------------------------------------------
# Property tests: no input is ever anything but a ChunkFormatError or the exact chunk
# ---------------------------------------------------------------------------------------------

FUZZ = settings(max_examples=1000, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])


def decode_or_format_error(data: bytes, name: str) -> None:
    """Either ChunkFormatError, or exactly what the intact container decodes to."""
    try:
        out = decode(data)
    except ChunkFormatError:
        return
    assert_bit_exact(out, CLEAN[name])


@st.composite
def random_objects(draw: st.DrawFn) -> bytes:
    valid = CONTAINERS[draw(st.sampled_from(FUZZ_CODECS))]
    data = draw(
        st.one_of(
            st.binary(max_size=4096),
            st.binary(max_size=512).map(lambda b: MAGIC + b),
            st.binary(min_size=len(valid), max_size=len(valid)),
            # a valid beginning (header, some layers) and then anything
            st.integers(0, len(valid)).flatmap(lambda k: st.binary(max_size=4096).map(lambda b: valid[:k] + b)),
        )
    )
    assume(data != valid)  # the one input that is a chunk
    return data


@FUZZ
@given(data=random_objects())
def test_random_bytes_are_always_a_format_error(data):
    with pytest.raises(ChunkFormatError):
        decode(data)


@FUZZ
@given(name=st.sampled_from(FUZZ_CODECS), fraction=st.floats(0.0, 1.0, exclude_max=True))
def test_any_truncation_is_a_format_error(name, fraction):
    data = CONTAINERS[name]
    length = int(fraction * len(data))
    assert length < len(data)
    with pytest.raises(ChunkFormatError):
        decode(data[:length])


def test_every_truncation_is_a_format_error():
    data = CONTAINERS["bytesplit"]
    for length in range(len(data)):
        with pytest.raises(ChunkFormatError):
            decode(data[:length])


@FUZZ
@given(
    name=st.sampled_from(FUZZ_CODECS),
    position=st.one_of(st.integers(0, 400), st.integers(0, 10**6)),
    bit=st.integers(0, 7),
)
def test_any_bit_flip_is_caught_or_harmless(name, position, bit):
    corrupted = bytearray(CONTAINERS[name])
    corrupted[position % len(corrupted)] ^= 1 << bit
    decode_or_format_error(bytes(corrupted), name)
    with pytest.raises(ChunkFormatError):  # a single flip is always detected (checksums everywhere)
        decode(bytes(corrupted))


@FUZZ
@given(
    name=st.sampled_from(FUZZ_CODECS),
    edits=st.lists(
        st.one_of(
            st.tuples(st.just("set"), st.integers(0, 400), st.integers(0, 255)),
            st.tuples(st.just("set"), st.integers(0, 10**6), st.integers(0, 255)),
            st.tuples(st.just("insert"), st.integers(0, 10**6), st.integers(0, 255)),
            st.tuples(st.just("delete"), st.integers(0, 10**6), st.just(0)),
            st.tuples(st.just("xor-run"), st.integers(0, 10**6), st.integers(1, 255)),
        ),
        min_size=1,
        max_size=8,
    ),
)
def test_small_multi_byte_corruptions_are_caught_or_harmless(name, edits):
    corrupted = bytearray(CONTAINERS[name])
    for kind, position, value in edits:
        position %= len(corrupted) + (kind == "insert")
        if kind == "set":
            corrupted[position] = value
        elif kind == "insert":
            corrupted.insert(position, value)
        elif kind == "delete" and len(corrupted) > 1:
            del corrupted[position]
        elif kind == "xor-run":
            for i in range(position, min(position + 4, len(corrupted))):
                corrupted[i] ^= value
    decode_or_format_error(bytes(corrupted), name)


@FUZZ
@given(
    name=st.sampled_from(FUZZ_CODECS),
    layer=st.integers(0, LAYOUT.num_layers - 1),
    position=st.integers(0, 10**6),
    bit=st.integers(0, 7),
)
def test_a_bit_flip_in_a_layer_read_alone_is_caught(name, layer, position, bit):
    data = CONTAINERS[name]
    header = parse_header(data, LAYOUT, KEY)
    segment = header.segments[layer]
    start = header.header_len + segment.offset
    stored = bytearray(data[start : start + segment.stored_len])
    stored[position % len(stored)] ^= 1 << bit
    out = torch.empty(LAYOUT.layer_shape, dtype=LAYOUT.dtype)
    with pytest.raises(ChunkFormatError):
        decode_layer(header, LAYOUT, layer, bytes(stored), tensor_bytes(out))
