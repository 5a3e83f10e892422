"""The chunk container: one object or file per chunk, every byte checked before use.

Layout (little-endian)::

    fixed part   magic "KVSTCHNK", version u16, flags u16, header_len u32,
                 layout fingerprint 16s, key 32s, token_count u32, num_layers u32,
                 codec name length u16, codec name (ASCII),
                 key id 8s (only when flags has ENCRYPTED: which key sealed the segments)
    segment table  num_layers x (offset u64, stored_len u64, raw_len u64, xxh3-64 u64)
    zero padding   up to a multiple of 4096 bytes, less the checksum; it may start with the
                 engine's name for the chunk (below)
    header checksum  xxh3-64 of everything above, u64
    segments     one per layer, in layer order, each encoded on its own

Segment offsets count from the end of the header, so layer ``i`` is one byte-range read
(``header_len + offset``) and decodes alone: remote tiers can stream layer by layer. The
checksum covers the stored bytes, so corruption is caught before a decoder sees it. With
encryption (:mod:`kvstore.storage.crypto`) each stored segment is an AES-GCM box of the encoded layer.
Stored objects are data, never code: nothing here unpickles.

**Records in the padding.** The padding may start with up to two records, in this order, each
written only where the padding has room for it (it lacks 38 bytes for a few layer counts, e.g. 125
layers under the identity codec), so the header's length is what every kvstore version expects:
readers that do not know a record skip it, as they skip the padding.

- *The engine's name.* Where KV events are on and the engine named the chunk (its block hash,
  :mod:`kvstore.events`): ``"KVNM"``, a kind u8 (1: bytes, 2: an unsigned 64-bit int), a length u8
  and 32 bytes, so ``kvstore gc`` and ``verify`` can name in their events the chunks they remove as
  the engine did (else they name them by their keys).
- *The chunk's parent.* Where the writer knew it (``put(..., parent=)``): ``"KVPA"`` and the 32
  bytes of the key of the chunk before this one in its prefix. ``kvstore gc`` reads it to remove a
  prefix tail first (:mod:`kvstore.storage.links`): a chunk whose parent is gone is never reached.

About 575 lines on purpose: this is the one place the stored format is written and read, and the
writer (``encode_*``) and the reader that checks every field of it (``parse_header``,
``verify_*``, ``decode_*``) are kept side by side, so that a change to one is made against the
other; the encryption and the per-layer reads that use them live beside it (crypto.py,
chunk_reads.py, layer_reader.py).
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass
from functools import lru_cache
from typing import NamedTuple, TypeVar

import xxhash

from kvstore.backends.base import StreamedObject
from kvstore.codecs import MAX_CODEC_NAME, CodecPipeline, SegmentSpec, make_codec
from kvstore.errors import ChunkFormatError, CodecError, DecryptionError, ForeignChunkError
from kvstore.keys import ChunkKey, key_to_bytes
from kvstore.layout import KVLayout
from kvstore.storage.crypto import KEY_ID_BYTES, ChunkCipher, associated_data
from kvstore.util.buffers import Buffer, as_bytes_view
from kvstore.util.threads import map_with_helpers, usable_cores

T = TypeVar("T")
MAGIC = b"KVSTCHNK"
VERSION = 1
_FIXED = struct.Struct("<8sHHI16s32sIIH")
_SEGMENT = struct.Struct("<QQQQ")
_CHECKSUM = struct.Struct("<Q")
_NAME = struct.Struct("<4sBB32s")  # in the padding: "KVNM", kind, length, value
_PARENT = struct.Struct("<4s32s")  # in the padding, after the name if there is one: "KVPA", the parent's key
NAME_MAGIC = b"KVNM"
PARENT_MAGIC = b"KVPA"
NAME_BYTES, NAME_INT = 1, 2
MAX_LAYERS = 4096
HEADER_ALIGN = 4096
FLAG_ENCRYPTED = 1
PARALLEL_MIN_BYTES = 1 << 20  # a smaller chunk's layers are encoded and decoded in one thread
CHECK_HOT_BYTES = 1 << 20  # a file reader reads (a file writer writes) this much at once, checksummed while in L2 cache
IDENTITY_ID = "identity"  # the codec id of bytes stored as they are


def checksum(data: Buffer) -> int:
    return xxhash.xxh3_64_intdigest(data)


def header_size(num_layers: int, codec_id: str, encrypted: bool = False) -> int:
    """Header bytes, padded so the payload starts on a page boundary (unaligned copies are slower)."""
    unpadded = _FIXED.size + len(codec_id.encode("ascii")) + num_layers * _SEGMENT.size + _CHECKSUM.size
    unpadded += KEY_ID_BYTES if encrypted else 0
    return -(-unpadded // HEADER_ALIGN) * HEADER_ALIGN


class Segment(NamedTuple):  # a tuple: one is built per layer on every read
    offset: int  # from the end of the header
    stored_len: int
    raw_len: int
    checksum: int


@dataclass(frozen=True)
class ChunkHeader:
    header_len: int
    codec: CodecPipeline
    token_count: int
    segments: tuple[Segment, ...]
    payload_len: int  # the segments' stored bytes, summed once at parse time
    cipher: ChunkCipher | None = None  # set when the segments are sealed
    key_bytes: bytes = b""  # the chunk's key, part of each sealed segment's associated data
    parent: ChunkKey | None = None  # the key of the chunk before it in its prefix, where the writer knew it

    @property
    def plain(self) -> bool:
        """Stored bytes are the layer's bytes (identity codec, no encryption): readable in place."""
        return self.codec.is_identity and self.cipher is None

    @property
    def total_len(self) -> int:
        return self.header_len + self.payload_len


def encode_header(
    layout: KVLayout,
    key: ChunkKey,
    codec_id: str,
    segments: list[Segment],
    key_id: bytes | None = None,
    name: bytes | int | None = None,
    parent: ChunkKey | None = None,
) -> bytes:
    """The header; ``name`` (the engine's name for the chunk) and ``parent`` (the previous chunk's key) are
    kept in the padding where they fit (see above)."""
    codec_bytes = codec_id.encode("ascii")
    size = header_size(len(segments), codec_id, key_id is not None)
    parts = [
        _FIXED.pack(
            MAGIC,
            VERSION,
            0 if key_id is None else FLAG_ENCRYPTED,
            size,
            layout.fingerprint,
            key_to_bytes(key),
            layout.chunk_tokens,
            len(segments),
            len(codec_bytes),
        ),
        codec_bytes,
        key_id or b"",
    ]
    parts.extend(_SEGMENT.pack(s.offset, s.stored_len, s.raw_len, s.checksum) for s in segments)
    body = b"".join(parts)
    for record in (_name_record(name), _parent_record(parent)):
        if record and len(body) + len(record) <= size - _CHECKSUM.size:
            body += record
    body += bytes(size - len(body) - _CHECKSUM.size)  # zero padding
    return body + _CHECKSUM.pack(checksum(body))


def _name_record(name: bytes | int | None) -> bytes:
    if isinstance(name, bytes) and 0 < len(name) <= 32:
        return _NAME.pack(NAME_MAGIC, NAME_BYTES, len(name), name)
    if isinstance(name, int) and not isinstance(name, bool) and 0 <= name < 1 << 64:
        return _NAME.pack(NAME_MAGIC, NAME_INT, 8, name.to_bytes(8, "big"))
    return b""  # no name, or one no engine gives (then events name the chunk by its key)


def _parent_record(parent: ChunkKey | None) -> bytes:
    return b"" if parent is None else _PARENT.pack(PARENT_MAGIC, key_to_bytes(parent))


class PaddingRecords(NamedTuple):
    """What a header's padding keeps (see the module docstring): the engine's name and the parent's key."""

    name: bytes | int | None
    parent: ChunkKey | None


def header_records(head: Buffer) -> PaddingRecords:
    """The records a chunk's header keeps, from the object's first bytes (at least the whole header:
    :func:`header_length` says how many), the header's checksum checked.

    For ``kvstore gc`` and ``verify`` (removals named as the engine named them; prefixes removed tail
    first). Raises ChunkFormatError.
    """
    view = as_bytes_view(head)
    return _padding_records(view, _checked_fields(view))


def header_name(head: Buffer) -> bytes | int | None:
    """The engine's name a chunk's header keeps (None if none): :func:`header_records`' ``name``."""
    return header_records(head).name


def _padding_records(view: memoryview, fields: _Fields) -> PaddingRecords:
    start = (
        _FIXED.size + fields.codec_len + (KEY_ID_BYTES if fields.encrypted else 0) + _SEGMENT.size * fields.num_layers
    )
    end = fields.header_len - _CHECKSUM.size
    name: bytes | int | None = None
    if start + _NAME.size <= end:
        magic, kind, length, value = _NAME.unpack_from(view, start)
        if magic == NAME_MAGIC:
            start += _NAME.size
            if 0 < length <= 32 and kind == NAME_BYTES:
                name = value[:length]
            elif 0 < length <= 32 and kind == NAME_INT:
                name = int.from_bytes(value[:8], "big")
    parent: ChunkKey | None = None
    if start + _PARENT.size <= end:
        magic, parent_key = _PARENT.unpack_from(view, start)
        if magic == PARENT_MAGIC:
            parent = parent_key.hex()
    return PaddingRecords(name, parent)


def name_in_head(head: Buffer | None) -> bytes | int | None:
    """The engine's name ``head`` (an object's first bytes) keeps, or None: none read, no name, or no
    sound header (then a chunk is named by its key)."""
    if head is None:
        return None
    try:
        return header_name(head)
    except ChunkFormatError:
        return None


def encode_layers(
    layout: KVLayout,
    chunk: Buffer,
    codec: CodecPipeline,
    cipher: ChunkCipher | None = None,
    key: ChunkKey = "",
    executor: Executor | None = None,
) -> list[tuple[memoryview, Segment]]:
    """Each layer's stored bytes and table entry, in order; each checksummed while still in cache (blocking).

    With the identity codec and no cipher the stored bytes are views of ``chunk`` itself: zero
    copies, in one piece. Otherwise runs of layers are encoded in parallel over idle workers of
    ``executor`` (see :func:`layer_runs`); the result is the same bytes either way.
    """
    raw = as_bytes_view(chunk)
    if len(raw) != layout.chunk_nbytes:
        raise ValueError(f"chunk is {len(raw)} bytes, layout needs {layout.chunk_nbytes}")
    spec = SegmentSpec(layout.dtype, layout.layer_shape)
    step = layout.layer_nbytes
    key_bytes = key_to_bytes(key) if cipher is not None else b""

    def encode_run(layers: range) -> list[tuple[memoryview, int]]:
        stored = [raw[layer * step : (layer + 1) * step] for layer in layers]
        if not codec.is_identity:  # one codec call for the run: per-call costs are paid once, not per layer
            stored = [as_bytes_view(out) for out in codec.encode_batch(stored, spec)]
        if cipher is not None:
            stored = [
                memoryview(cipher.seal(view, associated_data(key_bytes, layer, layout.fingerprint)))
                for view, layer in zip(stored, layers, strict=True)
            ]
        return [(view, checksum(view)) for view in stored]

    plain = codec.is_identity and cipher is None
    encoded = layer_runs(encode_run, layout, None if plain else executor)
    segments: list[tuple[memoryview, Segment]] = []
    offset = 0
    for stored, digest in encoded:
        segments.append((stored, Segment(offset, len(stored), step, digest)))
        offset += len(stored)
    return segments


def encode_chunk(
    layout: KVLayout,
    key: ChunkKey,
    chunk: Buffer,
    codec: CodecPipeline,
    cipher: ChunkCipher | None = None,
    executor: Executor | None = None,
    name: bytes | int | None = None,
    parent: ChunkKey | None = None,
) -> list[Buffer]:
    """The whole container as a list of buffers (header first), for a gather write or upload (blocking).

    ``executor``: the pool this runs in, whose idle workers may encode some of the layers.
    ``name``: the engine's name for the chunk, ``parent``: the previous chunk's key (see the module
    docstring), or None.
    """
    encoded = encode_layers(layout, chunk, codec, cipher, key, executor)
    key_id = None if cipher is None else cipher.key_id
    header = encode_header(layout, key, codec.id, [segment for _, segment in encoded], key_id, name, parent)
    return [header, *(stored for stored, _ in encoded)]


def stream_plain_chunk(
    layout: KVLayout,
    key: ChunkKey,
    chunk: Buffer,
    name: bytes | int | None = None,
    parent: ChunkKey | None = None,
) -> StreamedObject:
    """:func:`encode_chunk`'s bytes for the identity codec without a cipher, made a run of layers at a time.

    Each run (about :data:`CHECK_HOT_BYTES`) is checksummed right before it is handed to the
    writer, so the write reads it from the CPU's cache: the checksums cost no pass over memory of
    their own. The header, which holds them, comes last (blocking).
    """
    raw = as_bytes_view(chunk)
    if len(raw) != layout.chunk_nbytes:
        raise ValueError(f"chunk is {len(raw)} bytes, layout needs {layout.chunk_nbytes}")
    step, layers = layout.layer_nbytes, layout.num_layers
    per_run = max(1, CHECK_HOT_BYTES // step)
    segments: list[Segment] = []

    def body() -> Iterator[list[memoryview]]:
        for first in range(0, layers, per_run):
            run = [raw[layer * step : (layer + 1) * step] for layer in range(first, min(first + per_run, layers))]
            segments.extend(Segment((first + i) * step, step, step, checksum(view)) for i, view in enumerate(run))
            yield run

    def head() -> bytes:
        if len(segments) != layers:
            raise RuntimeError("a streamed chunk's header was asked for before all its layers were made")
        return encode_header(layout, key, IDENTITY_ID, segments, None, name, parent)

    head_length = header_size(layers, IDENTITY_ID)
    return StreamedObject(head_length + len(raw), head_length, body(), head)


def layer_runs(fn: Callable[[range], list[T]], layout: KVLayout, executor: Executor | None) -> list[T]:
    """``fn`` over consecutive runs of layers, its results joined in layer order (blocking);
    spread over idle workers of ``executor`` when it pays.

    A chunk's codec work is one thread call per chunk, so without this one chunk used one core
    however many were idle. It is cut into one run per usable core; the calling thread works
    through the runs itself and helper tasks of ``executor`` (the tier's own I/O pool, which the
    caller usually runs in) take runs from the same queue when a worker is free; it never waits
    for a helper that has not started, so a busy or small pool cannot deadlock it
    (:func:`~kvstore.util.threads.map_with_helpers`). One run of every layer without ``executor``
    or for a chunk under ``PARALLEL_MIN_BYTES``, where a helper's start costs more than it saves.
    A codec's batch hooks take a run in one call: the quantizers' per-call costs are then paid
    once per run, and runs on different threads overlap instead of handing the GIL back and
    forth on every small call (int8 encode, 2 threads: 313 MB/s layer by layer, 687 by runs).
    """
    layers = layout.num_layers
    runs = 1 if executor is None or layout.chunk_nbytes < PARALLEL_MIN_BYTES else min(layers, usable_cores())
    if runs == 1:
        return fn(range(layers))
    bounds = [layers * index // runs for index in range(runs + 1)]
    results = map_with_helpers(lambda index: fn(range(bounds[index], bounds[index + 1])), runs, executor, runs - 1)
    return [item for run in results for item in run]


def header_length(prefix: Buffer) -> int:
    """The full header's length, from its first bytes (at least the fixed part)."""
    view = as_bytes_view(prefix)
    if len(view) < _FIXED.size:
        raise ChunkFormatError(f"object is {len(view)} bytes, shorter than a chunk header")
    magic, _, _, header_len = struct.unpack_from("<8sHHI", view)
    if magic != MAGIC:
        raise ChunkFormatError("not a kvstore chunk (bad magic)")
    if not _FIXED.size < header_len <= header_size(MAX_LAYERS, "x" * MAX_CODEC_NAME, encrypted=True):
        raise ChunkFormatError(f"header length {header_len} out of range")
    return header_len


class _Fields(NamedTuple):
    """A header's fixed part, checked on its own terms (no layout needed)."""

    header_len: int
    fingerprint: bytes
    key: bytes
    token_count: int
    num_layers: int
    codec_len: int
    encrypted: bool


def _checked_fields(view: memoryview) -> _Fields:
    """The fixed part of the header at the start of ``view``, once the header proves whole and intact.

    Checks what a header says about itself: magic, version and flags, counts, its length, and
    its checksum. Raises ChunkFormatError.
    """
    if len(view) < _FIXED.size:
        raise ChunkFormatError(f"object is {len(view)} bytes, shorter than a chunk header")
    magic, version, flags, header_len, fingerprint, stored_key, tokens, n_layers, codec_len = _FIXED.unpack_from(view)
    if magic != MAGIC:
        raise ChunkFormatError("not a kvstore chunk (bad magic)")
    encrypted = bool(flags & FLAG_ENCRYPTED)
    if version != VERSION or flags & ~FLAG_ENCRYPTED:
        raise ChunkFormatError(f"unsupported chunk format version {version} (flags {flags})")
    if not 0 < n_layers <= MAX_LAYERS or not 0 < codec_len <= MAX_CODEC_NAME:
        raise ChunkFormatError("header counts out of range")
    expected_len = header_size(n_layers, "x" * codec_len, encrypted)
    if header_len != expected_len or len(view) < header_len:
        raise ChunkFormatError(f"header length {header_len} is inconsistent (object has {len(view)} bytes)")
    body_end = header_len - _CHECKSUM.size
    if _CHECKSUM.unpack_from(view, body_end)[0] != checksum(view[:body_end]):
        raise ChunkFormatError("header checksum mismatch")
    return _Fields(header_len, fingerprint, stored_key, tokens, n_layers, codec_len, encrypted)


def _codec_name(view: memoryview, fields: _Fields) -> str:
    """The codec pipeline the header names (ASCII, as every codec name is; else the header is damaged)."""
    start = _FIXED.size
    try:
        return bytes(view[start : start + fields.codec_len]).decode("ascii")
    except UnicodeDecodeError as exc:
        raise ChunkFormatError(f"unknown codec in header: {exc}") from None


def _codec_for(name: str) -> CodecPipeline:
    """The pipeline a header names; one this process cannot build makes the chunk foreign, not damaged.

    Codecs can come from plugins (the ``kvstore.codecs`` entry points): an engine that lacks one
    must leave the chunks of engines that have it in place, not delete them as corrupt.
    """
    try:
        return _codec_named(name)
    except Exception as exc:  # unknown, or a plugin that fails to load or build: whatever it raises
        raise ForeignChunkError(f"unknown codec in header ({exc}); this process cannot decode it") from None


def _segment_table(view: memoryview, fields: _Fields, raw_len: int | None) -> tuple[Segment, ...]:
    """The segment table: consecutive segments, each of ``raw_len`` bytes decoded (None: as the first one's)."""
    table_start = _FIXED.size + fields.codec_len + (KEY_ID_BYTES if fields.encrypted else 0)
    table = struct.unpack_from(f"<{4 * fields.num_layers}Q", view, table_start)
    segments = tuple(Segment._make(table[i : i + 4]) for i in range(0, len(table), 4))
    expected_raw, offset = segments[0].raw_len if raw_len is None else raw_len, 0
    for i, segment in enumerate(segments):
        if segment.offset != offset or segment.raw_len != expected_raw:
            raise ChunkFormatError(f"segment table entry {i} is inconsistent")
        offset += segment.stored_len
    return segments


def parse_header(data: Buffer, layout: KVLayout, key: ChunkKey, cipher: ChunkCipher | None = None) -> ChunkHeader:
    """Check the header against ``layout``, ``key`` and ``cipher``; ``data`` may hold more than the header.

    A store with a cipher accepts only chunks sealed under its key; a store without one only
    plain chunks (else anyone who can write to the bucket could plant KV past the encryption).
    A sound header written for another layout, codec or key is foreign (ForeignChunkError: left
    for its owner); any other defect raises ChunkFormatError (corrupt).
    """
    view = as_bytes_view(data)
    fields = _checked_fields(view)
    if fields.fingerprint != layout.fingerprint:  # a sound chunk of another model sharing the store: its owner's
        raise ForeignChunkError("chunk was written for another model layout")
    if fields.key != key_to_bytes(key):
        raise ChunkFormatError("chunk holds another key")
    if fields.num_layers != layout.num_layers or fields.token_count != layout.chunk_tokens:
        raise ChunkFormatError("chunk shape does not match the layout")
    codec = _codec_for(_codec_name(view, fields))
    if fields.encrypted and cipher is None:
        raise ForeignChunkError("chunk is encrypted and this store has no encryption key")
    if cipher is not None and not fields.encrypted:
        raise ForeignChunkError("chunk is not encrypted and this store requires encryption")
    key_id_start = _FIXED.size + fields.codec_len
    if cipher is not None and bytes(view[key_id_start : key_id_start + KEY_ID_BYTES]) != cipher.key_id:
        raise ForeignChunkError("chunk was encrypted under another key")
    segments = _segment_table(view, fields, layout.layer_nbytes)
    payload_len = segments[-1].offset + segments[-1].stored_len
    parent = _padding_records(view, fields).parent
    return ChunkHeader(fields.header_len, codec, fields.token_count, segments, payload_len, cipher, fields.key, parent)


def verify_segments(segments: Sequence[Segment], payload: Buffer, layers: Iterable[int]) -> None:
    """Check the stored bytes of ``layers`` in ``payload`` (laid out as the table says, offsets from its start).

    The one checksum loop: of a whole object (``kvstore verify``), of a payload received in place,
    of a batch of layers read from a file. Raises ChunkFormatError naming the first bad layer.
    """
    view = as_bytes_view(payload)
    for layer in layers:
        segment = segments[layer]
        _check_segment(segment, layer, view[segment.offset : segment.offset + segment.stored_len])


def verify_segment(header: ChunkHeader, layer: int, stored: Buffer | list[memoryview]) -> None:
    """Check one layer's stored bytes, read on their own (in one buffer, or in parts, in order), against the table."""
    if not isinstance(stored, list):
        _check_segment(header.segments[layer], layer, stored)
        return
    hasher, length = xxhash.xxh3_64(), 0
    for part in stored:
        hasher.update(part)
        length += len(part)
    segment = header.segments[layer]
    if length != segment.stored_len or hasher.intdigest() != segment.checksum:
        raise ChunkFormatError(f"layer {layer} failed its checksum")


def _check_segment(segment: Segment, layer: int, stored: Buffer) -> None:
    if len(stored) != segment.stored_len or checksum(stored) != segment.checksum:
        raise ChunkFormatError(f"layer {layer} failed its checksum")


def _opened(header: ChunkHeader, layout: KVLayout, layer: int, stored: Buffer) -> Buffer:
    """One layer's stored bytes, verified and, if sealed, opened; ChunkFormatError naming the layer if not."""
    verify_segment(header, layer, stored)
    if header.cipher is None:
        return stored
    try:
        return header.cipher.open(stored, associated_data(header.key_bytes, layer, layout.fingerprint))
    except DecryptionError as exc:
        raise ChunkFormatError(f"layer {layer}: {exc}") from None


def _stored_bytes(header: ChunkHeader, layer: int, payload: memoryview) -> memoryview:
    """The layer's stored bytes within ``payload`` (the bytes after the header)."""
    segment = header.segments[layer]
    return payload[segment.offset : segment.offset + segment.stored_len]


def _decode_opened(header: ChunkHeader, layer: int, opened: Buffer, spec: SegmentSpec, out: memoryview) -> None:
    try:
        header.codec.decode_into(opened, spec, out)
    except CodecError as exc:
        raise ChunkFormatError(f"layer {layer}: {exc}") from None


def decode_layer(header: ChunkHeader, layout: KVLayout, layer: int, stored: Buffer, out: memoryview) -> None:
    """Verify and decode one layer's stored bytes into ``out`` (``layout.layer_nbytes`` long)."""
    opened = _opened(header, layout, layer, stored)
    _decode_opened(header, layer, opened, SegmentSpec(layout.dtype, layout.layer_shape), out)


def decode_payload(
    header: ChunkHeader, layout: KVLayout, payload: Buffer, out: Buffer, executor: Executor | None = None
) -> None:
    """Verify and decode every layer of ``payload`` (the bytes after the header) into ``out`` (blocking).

    ``executor``: the pool this runs in, whose idle workers may decode some runs of layers
    (:func:`layer_runs`; not for plain chunks, whose layers are only checksummed). When this
    returns, or raises, no thread is writing into ``out``.
    """
    payload_view, out_view = as_bytes_view(payload), as_bytes_view(out)
    if len(payload_view) != header.payload_len:
        raise ChunkFormatError(f"payload is {len(payload_view)} bytes, header says {header.payload_len}")
    if len(out_view) != layout.chunk_nbytes:
        raise ValueError(f"output is {len(out_view)} bytes, layout needs {layout.chunk_nbytes}")
    step = layout.layer_nbytes
    spec = SegmentSpec(layout.dtype, layout.layer_shape)

    def decode_run(layers: range) -> list[None]:
        opened = [_opened(header, layout, layer, _stored_bytes(header, layer, payload_view)) for layer in layers]
        outs = [out_view[layer * step : (layer + 1) * step] for layer in layers]
        try:
            header.codec.decode_batch_into(opened, spec, outs)  # one codec call for the run, as encode_layers
        except CodecError:  # which layer: decode them one by one, the first bad one raises with its number
            for layer, view, out in zip(layers, opened, outs, strict=True):
                _decode_opened(header, layer, view, spec, out)
            raise ChunkFormatError(f"layers {layers.start}-{layers.stop - 1}: decoding them together failed") from None
        return [None] * len(layers)

    layer_runs(decode_run, layout, None if header.plain else executor)


def decode_chunk(
    data: Buffer,
    layout: KVLayout,
    key: ChunkKey,
    out: Buffer,
    cipher: ChunkCipher | None = None,
    executor: Executor | None = None,
) -> ChunkHeader:
    """Check and decode a whole container into ``out`` (blocking); any defect raises ChunkFormatError.

    ``executor``: as for :func:`decode_payload`.
    """
    view = as_bytes_view(data)
    header = parse_header(view, layout, key, cipher)
    if len(view) != header.total_len:
        raise ChunkFormatError(f"object is {len(view)} bytes, header says {header.total_len}")
    decode_payload(header, layout, view[header.header_len :], out, executor)
    return header


@lru_cache(maxsize=64)
def _codec_named(name: str) -> CodecPipeline:
    """Codec objects are stateless across chunks (per-thread state lives inside them): share them."""
    return make_codec(name)


@dataclass(frozen=True)
class StoredChunk:
    """What ``kvstore verify`` learns from a chunk object without knowing the model's layout."""

    fingerprint: str  # the layout's, hex: which model wrote it
    codec: str
    num_layers: int
    token_count: int
    encrypted: bool


def header_codec(head: Buffer) -> str:
    """The codec pipeline id a chunk's header names, from the object's first bytes (at least the
    whole header: :func:`header_length` says how many), the header's checksum checked.

    For ``kvstore ls``: no layout, key or codec of this process is needed. Raises ChunkFormatError.
    """
    view = as_bytes_view(head)
    return _codec_name(view, _checked_fields(view))


def check_stored_chunk(data: Buffer, key: ChunkKey) -> StoredChunk:
    """Check every byte of a stored object that should be chunk ``key``, with no layout at hand.

    The header checksum, the key it names, the segment table, the object's length and each
    segment's checksum: everything the reading tier checks, short of decoding (an encrypted
    chunk's checksums cover its sealed bytes, so no key is needed; a codec this process does not
    have, a plugin's, is not damage either). Raises ChunkFormatError.
    """
    view = as_bytes_view(data)
    fields = _checked_fields(view)
    if fields.key != key_to_bytes(key):
        raise ChunkFormatError("chunk holds another key")
    codec = _codec_name(view, fields)
    segments = _segment_table(view, fields, raw_len=None)
    total = fields.header_len + segments[-1].offset + segments[-1].stored_len
    if len(view) != total:
        raise ChunkFormatError(f"object is {len(view)} bytes, header says {total}")
    verify_segments(segments, view[fields.header_len :], range(len(segments)))
    return StoredChunk(fields.fingerprint.hex(), codec, fields.num_layers, fields.token_count, fields.encrypted)
