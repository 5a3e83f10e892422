"""How one stored chunk is read and checked: from an open file in one blocking call, or by requests.

:class:`ChunkReads` is the reading half of a :class:`kvstore.storage.tier.ChunkTier` (which
counts what these return and raises nothing into the engine): every byte read is verified
against the chunk's header before it is used, and a write into the caller's memory is made
under the caller's guard (a :class:`~kvstore.util.threads.WriteFence`). Every function here
raises on a defect (ChunkFormatError, ForeignChunkError, an I/O error); none counts anything.

- **From a file** (a local backend's thread): the header and the first layers in one read;
  a plain chunk (identity codec, no encryption) is read straight into its destination and
  checksummed while hot, an encoded one decoded layer by layer.
- **By requests** (a network backend): a plain chunk's body is received in place and
  checked; any other is fetched whole and decoded in a thread.
- **Opened for layer reads**: the header checked once (and, remotely, layer 0 in the same
  request), for :class:`kvstore.storage.layer_reader.LayerReader`.
"""

from __future__ import annotations

import contextlib
from concurrent.futures import Executor
from typing import NamedTuple

from kvstore.backends.base import Backend, ObjectFile
from kvstore.codecs import CodecPipeline
from kvstore.errors import ChunkFormatError
from kvstore.keys import ChunkKey
from kvstore.layout import KVLayout
from kvstore.storage.container import (
    CHECK_HOT_BYTES,
    ChunkHeader,
    decode_chunk,
    decode_layer,
    header_length,
    header_size,
    parse_header,
    verify_segments,
)
from kvstore.storage.crypto import ChunkCipher
from kvstore.storage.links import PrefixLinks
from kvstore.util.buffers import Buffer
from kvstore.util.threads import WriteFence, in_thread

INLINE_CHECK_BYTES = 8 << 20  # remote chunks up to this size are checksummed on the event loop
OpenedChunk = tuple[ChunkHeader, ObjectFile | None, memoryview | None]  # header, open file, layer 0's stored bytes
Guard = WriteFence | contextlib.nullcontext[None]  # held around each write into a chunk's destination
NO_FENCE: Guard = contextlib.nullcontext()


class LossyRead(NamedTuple):
    """A read of a chunk stored with a lossy codec (another store's int8, say): its size and that codec.

    What the loaders return instead of the size alone, so the tier counts it (``lossy_reads``) and
    a promotion writes the chunk on in the same codec: the values are the codec's, never exact, and
    a faster tier must not store them under a lossless codec as if they were.
    """

    size: int
    codec: CodecPipeline


ReadOutcome = int | LossyRead | None | BaseException  # what one object's read returns to account()


def _read_size(header: ChunkHeader, size: int) -> int | LossyRead:
    return size if header.codec.lossless else LossyRead(size, header.codec)


class ChunkReads:
    """Reads of one tier's chunks (see the module docstring): the backend, the layout and the key to open them."""

    def __init__(
        self,
        backend: Backend,
        layout: KVLayout,
        codec: CodecPipeline,
        cipher: ChunkCipher | None,
        executor: Executor | None,
    ) -> None:
        self.backend, self.layout, self.cipher, self.executor = backend, layout, cipher, executor
        self._plain = codec.is_identity and cipher is None  # what the tier writes is readable in place
        # exact unless the codec changed
        self._header_guess = header_size(layout.num_layers, codec.id, encrypted=cipher is not None)
        self._batch_layers = min(layout.num_layers, max(1, CHECK_HOT_BYTES // layout.layer_nbytes))
        self.links = PrefixLinks()  # told each chunk's parent as its header records it (ChunkTier.links)

    def _parsed(self, head: Buffer, key: ChunkKey) -> ChunkHeader:
        """``head`` checked as ``key``'s header; the parent it records is noted (a promotion writes it on)."""
        header = parse_header(head, self.layout, key, self.cipher)
        self.links.note(key, header.parent)
        return header

    # -- from a file: read and verify in one thread call, layer batch by layer batch ---------------

    def load_file(self, key: ChunkKey, out: memoryview, guard: Guard, file: ObjectFile) -> int | LossyRead:
        """Read and verify the chunk in ``file`` into ``out`` (blocking); the file's size.

        Every write into ``out`` (at most one layer batch, ~1 MiB, or one decoded layer) is made under ``guard``.
        """
        # One read for the header and, if the file is what we write, the first layer batch.
        first_batch = out[: self._batch_layers * self.layout.layer_nbytes] if self._plain else out[:0]
        header, batch_read = self._read_file_header(file, key, first_batch, guard)
        if header.plain:
            self._read_identity(file, header, out, self._batch_layers if batch_read else 0, guard)
        else:
            self._read_encoded(file, header, out, guard)
        return _read_size(header, file.size)

    def _read_file_header(
        self, file: ObjectFile, key: ChunkKey, first_batch: memoryview, guard: Guard = NO_FENCE
    ) -> tuple[ChunkHeader, bool]:
        """The file's checked header, read together with ``first_batch`` (the bytes right after it).

        The flag says whether ``first_batch`` now holds those bytes: only when the header had the
        expected size (a file written with another codec or key has another header size).
        """
        head = memoryview(bytearray(self._header_guess))
        with guard:
            got = file.readinto([head, first_batch], 0)
        needed = header_length(head[: min(got, len(head))])
        if needed > len(head):
            head = memoryview(bytearray(needed))
            file.readinto([head], 0)
        header = self._parsed(head[:needed], key)
        if file.size != header.total_len:
            raise ChunkFormatError(f"file is {file.size} bytes, header says {header.total_len}")
        return header, needed == len(head) == self._header_guess and len(first_batch) > 0

    def _read_identity(
        self, file: ObjectFile, header: ChunkHeader, out: memoryview, already: int, guard: Guard
    ) -> None:
        """Stored bytes are the chunk's bytes: read them straight into ``out``, then check them hot.

        ``already`` leading layers were read together with the header. Each batch is read and
        checked under ``guard``: once the caller closes it, its buffer may hold the caller's new
        bytes, which must never be checked as the file's (a false corruption would delete a good file).
        """
        step = self._require_layer_sized(header)
        for first in range(0, self.layout.num_layers, self._batch_layers):
            last = min(first + self._batch_layers, self.layout.num_layers)
            with guard:
                if first >= already:
                    file.readinto([out[first * step : last * step]], header.header_len + first * step)
                verify_segments(header.segments, out, range(first, last))

    def _read_encoded(self, file: ObjectFile, header: ChunkHeader, out: memoryview, guard: Guard) -> None:
        step = self.layout.layer_nbytes
        scratch = memoryview(bytearray(max(segment.stored_len for segment in header.segments)))
        for layer, segment in enumerate(header.segments):
            stored = scratch[: segment.stored_len]
            file.readinto([stored], header.header_len + segment.offset)
            with guard:
                decode_layer(header, self.layout, layer, stored, out[layer * step : (layer + 1) * step])

    def _require_layer_sized(self, header: ChunkHeader) -> int:
        """A plain chunk's payload is its layers in order, each one segment: the layer size."""
        step = self.layout.layer_nbytes
        if any(segment.stored_len != step for segment in header.segments):
            raise ChunkFormatError("identity segments must be one layer long")
        return step

    # -- by requests: the body received in place when the chunk is plain, else decoded in a thread --

    async def load_remote(self, key: ChunkKey, out: memoryview) -> int | LossyRead | None:
        if self._plain:
            return await self._load_remote_plain(key, out)
        return await self._load_whole(key, out)

    async def _load_whole(self, key: ChunkKey, out: memoryview) -> int | LossyRead | None:
        data = await self.backend.get(key)
        if data is None:
            return None
        header = await in_thread(self.executor, decode_chunk, data, self.layout, key, out, self.cipher, self.executor)
        self.links.note(key, header.parent)
        return _read_size(header, len(data))

    async def _load_remote_plain(self, key: ChunkKey, out: memoryview) -> int | LossyRead | None:
        """Stored bytes are the chunk's bytes: receive the payload straight into ``out``, then check it.

        Saves a copy of the whole chunk (the backend scatters the body into the header buffer and
        the slot); a header of unexpected size falls back to a plain get.
        """
        head = memoryview(bytearray(self._header_guess))
        size = await self.backend.get_into(key, [head, out])
        if size is None:
            return None
        if size == len(head) + len(out) and header_length(head) == len(head):
            # Checksums only (xxh3 at ~20 GB/s): up to a few MiB, that is cheaper than the thread
            # hop when several reads are in flight (measured: 0.7-0.8x -> 0.9-1.0x of raw Redis GET).
            if len(out) <= INLINE_CHECK_BYTES:
                plain = self._check_plain(key, head, out)
            else:
                plain = await in_thread(self.executor, self._check_plain, key, head, out)
            if plain:
                return size
        return await self._load_whole(key, out)  # another writer's codec, or a damaged object

    def _check_plain(self, key: ChunkKey, head: memoryview, out: memoryview) -> bool:
        """Verify a payload received in place; False when the header says it is not plain after all."""
        header = self._parsed(head, key)
        if not header.plain or header.payload_len != len(out):
            return False
        self._require_layer_sized(header)
        verify_segments(header.segments, out, range(len(header.segments)))
        return True

    def open_file(self, key: ChunkKey, file: ObjectFile) -> OpenedChunk:
        header, _ = self._read_file_header(file, key, memoryview(b""))
        return header, file, None

    async def open_remote(self, key: ChunkKey) -> OpenedChunk | None:
        """The checked header and, read in the same request, layer 0's stored bytes when they fit.

        One round trip instead of two before the first layer (a range past the end is clipped;
        the slack covers a sealed or incompressible segment's few extra bytes).
        """
        sized = await self.backend.get_sized(key, (0, self._header_guess + self.layout.layer_nbytes + 4096))
        if sized is None:
            return None
        head, size = sized
        needed = header_length(head)
        if needed > len(head):
            head = await self.backend.get(key, (0, needed))
            if head is None:
                return None
        header = self._parsed(memoryview(head)[:needed], key)
        if not await self._check_length(key, header, size):
            return None
        first = header.segments[0]
        start = header.header_len + first.offset
        if start + first.stored_len > len(head):
            return header, None, None
        return header, None, memoryview(head)[start : start + first.stored_len]

    async def _check_length(self, key: ChunkKey, header: ChunkHeader, size: int | None) -> bool:
        """True if the object is as long as its header says; False if it vanished meanwhile, else ChunkFormatError.

        A stream reads only the segments the header points at, so bytes appended to an object
        (or a tail cut off) would otherwise go unnoticed until, or past, the last layer. ``size``
        is the object's size where the backend's request told it; else one small range read
        across the header's end must find exactly one byte before it.
        """
        total = header.total_len
        if size is None:
            tail = await self.backend.get(key, (total - 1, total + 1))
            if tail is None:
                return False
            size = total - 1 + len(tail)
        if size != total:
            raise ChunkFormatError(f"object is {size} bytes, header says {total}")
        return True
