"""A secondary tier: a storage backend plus a codec, moving whole chunks to and from DRAM slots.

The tier owns the chunk container: it encodes on the way down and checks every byte on the
way up. Whatever goes wrong below it (a missing object, a corrupt or foreign one, an I/O
error) comes out as a counted miss, never as an exception into the engine and never as
wrong KV. A corrupt object is deleted so it is not read again.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from typing import TypeVar

from kvstore.backends.base import Backend, ChunkReader, LocalBackend
from kvstore.codecs import CodecPipeline
from kvstore.errors import ChunkFormatError, ForeignChunkError
from kvstore.keys import ChunkKey
from kvstore.layout import KVLayout
from kvstore.storage.container import (
    ChunkHeader,
    checksum,
    decode_chunk,
    decode_layer,
    encode_chunk,
    header_length,
    header_size,
    parse_header,
    verify_segment,
)
from kvstore.storage.crypto import ChunkCipher
from kvstore.storage.stats import TierLatency, TierStats
from kvstore.util.buffers import Buffer
from kvstore.util.threads import in_thread

log = logging.getLogger("kvstore.tier")
T = TypeVar("T")
BATCH_BYTES = 1 << 20  # read this much of a file, then checksum it while it is still in L2 cache
INLINE_CHECK_BYTES = 8 << 20  # remote chunks up to this size are checksummed on the event loop


class ChunkTier:
    def __init__(
        self,
        backend: Backend,
        codec: CodecPipeline,
        layout: KVLayout,
        executor: Executor | None,
        parallel_reads: int = 2,
        cipher: ChunkCipher | None = None,
    ):
        self.backend = backend
        self.parallel_reads = parallel_reads
        self.codec = codec
        self.cipher = cipher
        self._plain = codec.is_identity and cipher is None  # what we write is readable in place
        self.layout = layout
        self.name = backend.name
        self.stats = TierStats()
        self.latency = TierLatency()  # fed by KVStore, which times each operation it waits for
        self._executor = executor
        # exact unless the codec changed
        self._header_guess = header_size(layout.num_layers, codec.id, encrypted=cipher is not None)
        self._batch_layers = min(layout.num_layers, max(1, BATCH_BYTES // layout.layer_nbytes))

    async def open(self) -> None:
        await self.backend.open()

    async def close(self) -> None:
        await self.backend.close()

    async def write(self, key: ChunkKey, chunk: memoryview) -> None:
        """Encode (in a thread) and store one chunk; raises on failure so the caller can count it."""
        (outcome,) = await self.write_many([(key, chunk)])
        if isinstance(outcome, BaseException):
            raise outcome

    async def write_many(self, items: Sequence[tuple[ChunkKey, memoryview]]) -> list[BaseException | None]:
        """Store several chunks; per chunk, the exception that stopped it or None (counted either way).

        A local tier writes the whole batch in one thread call: the cascade drains its queue in
        batches under load, and a thread hop costs ~0.1 ms, a 5 MB file write ~1 ms.
        """
        outcomes: Sequence[int | None | BaseException]
        if isinstance(self.backend, LocalBackend):
            outcomes = await in_thread(self._executor, _each, self._write_local, list(items))
        else:
            outcomes = await asyncio.gather(*(self._write_remote(k, c) for k, c in items), return_exceptions=True)
        results: list[BaseException | None] = []
        for outcome in outcomes:
            if isinstance(outcome, asyncio.CancelledError):
                raise outcome
            if isinstance(outcome, BaseException):
                self.stats.errors += 1
                results.append(outcome)
                continue
            if outcome is None:
                self.stats.skipped += 1
            else:
                self.stats.writes += 1
                self.stats.bytes_written += outcome
            results.append(None)
        return results

    async def _write_remote(self, key: ChunkKey, chunk: memoryview) -> int:
        parts = await in_thread(self._executor, encode_chunk, self.layout, key, chunk, self.codec, self.cipher)
        await self.backend.set(key, parts)
        return _total_len(parts)

    def _write_local(self, key: ChunkKey, chunk: memoryview) -> int | None:
        """Encode (checksumming each layer) and write the file in one gather write; one thread call.

        None when the file is already there (it is marked used instead): a chunk's bytes never change
        under its key.
        (Measured: one write of header + payload beats layer batches by ~10% on ext4, since
        every write call updates the inode's times.)
        """
        assert isinstance(self.backend, LocalBackend)
        if self.backend.holds(key) and self.backend.keep(key):
            return None
        parts = encode_chunk(self.layout, key, chunk, self.codec, self.cipher)
        self.backend.write(key, parts)
        return _total_len(parts)

    @property
    def is_local(self) -> bool:
        """Blocking file I/O on this machine (batched into thread calls), rather than network requests."""
        return isinstance(self.backend, LocalBackend)

    def holds(self, key: ChunkKey) -> bool:
        """True only when the tier knows, without I/O, that it has the chunk."""
        return isinstance(self.backend, LocalBackend) and self.backend.holds(key)

    async def read_into(self, key: ChunkKey, out: memoryview) -> bool:
        """Fill ``out`` with the chunk; False on a miss of any kind (absent, corrupt, error)."""
        return (await self.read_many_into([key], [out]))[0]

    async def read_many_into(self, keys: Sequence[ChunkKey], outs: Sequence[memoryview]) -> list[bool]:
        """Fill each ``outs[i]`` with ``keys[i]``; per key, False on a miss of any kind.

        A local tier reads the batch in ``parallel_reads`` thread calls rather than one per
        chunk: a thread hop costs ~0.1 ms here, a warm 5 MB chunk read ~0.4 ms.
        """
        outcomes: Sequence[int | None | BaseException]
        if isinstance(self.backend, LocalBackend):
            groups = _split(list(zip(keys, outs, strict=True)), self.parallel_reads)
            results = await asyncio.gather(
                *(in_thread(self._executor, _each, self._read_local, group) for group in groups)
            )
            outcomes = [outcome for group in results for outcome in group]
        else:
            outcomes = await asyncio.gather(
                *(self._read_remote(k, o) for k, o in zip(keys, outs, strict=True)), return_exceptions=True
            )
        return [await self._account(key, outcome) for key, outcome in zip(keys, outcomes, strict=True)]

    async def _account(self, key: ChunkKey, outcome: int | None | BaseException) -> bool:
        """Count one read's outcome; a corrupt object is removed, a foreign one left alone."""
        if isinstance(outcome, ForeignChunkError):
            self.stats.foreign += 1
            log.warning("%s tier: chunk %s cannot be opened here (%s)", self.name, key[:16], outcome)
            return False
        if isinstance(outcome, ChunkFormatError):
            await self._discard_corrupt(key, outcome)
            return False
        if isinstance(outcome, asyncio.CancelledError):
            raise outcome
        if isinstance(outcome, BaseException):  # I/O errors, a server gone: a miss, counted
            self.stats.errors += 1
            log.warning("%s tier: read of %s failed: %r", self.name, key[:16], outcome)
            return False
        if outcome is None:
            self.stats.misses += 1
            return False
        self.stats.hits += 1
        self.stats.bytes_read += outcome
        return True

    def _read_local(self, key: ChunkKey, out: memoryview) -> int | None:
        """Read and verify in one thread call, layer batch by layer batch; the file's size or None."""
        assert isinstance(self.backend, LocalBackend)
        reader = self.backend.open_reader(key)
        if reader is None:
            return None
        with reader:
            # One read for the header and, if the file is what we write, the first layer batch.
            first_batch = out[: self._batch_layers * self.layout.layer_nbytes] if self._plain else out[:0]
            header, batch_read = self._read_file_header(reader, key, first_batch)
            if header.plain:
                self._read_identity(reader, header, out, self._batch_layers if batch_read else 0)
            else:
                self._read_encoded(reader, header, out)
        return reader.size

    def _read_file_header(
        self, reader: ChunkReader, key: ChunkKey, first_batch: memoryview
    ) -> tuple[ChunkHeader, bool]:
        """The file's checked header, read together with ``first_batch`` (the bytes right after it).

        The flag says whether ``first_batch`` now holds those bytes: only when the header had the
        expected size (a file written with another codec or key has another header size).
        """
        head = memoryview(bytearray(self._header_guess))
        got = reader.readinto([head, first_batch], 0)
        needed = header_length(head[: min(got, len(head))])
        if needed > len(head):
            head = memoryview(bytearray(needed))
            reader.readinto([head], 0)
        header = parse_header(head[:needed], self.layout, key, self.cipher)
        if reader.size != header.total_len:
            raise ChunkFormatError(f"file is {reader.size} bytes, header says {header.total_len}")
        return header, needed == len(head) == self._header_guess and len(first_batch) > 0

    def _read_identity(self, reader: ChunkReader, header: ChunkHeader, out: memoryview, already: int) -> None:
        """Stored bytes are the chunk's bytes: read them straight into ``out``, then check them hot.

        ``already`` leading layers were read together with the header.
        """
        step = self.layout.layer_nbytes
        if any(segment.stored_len != step for segment in header.segments):
            raise ChunkFormatError("identity segments must be one layer long")
        segments = header.segments
        for first in range(0, self.layout.num_layers, self._batch_layers):
            last = min(first + self._batch_layers, self.layout.num_layers)
            if first >= already:
                reader.readinto([out[first * step : last * step]], header.header_len + first * step)
            for layer in range(first, last):  # inline verify_segment: this loop runs per layer per read
                if checksum(out[layer * step : (layer + 1) * step]) != segments[layer].checksum:
                    raise ChunkFormatError(f"layer {layer} failed its checksum")

    def _read_encoded(self, reader: ChunkReader, header: ChunkHeader, out: memoryview) -> None:
        step = self.layout.layer_nbytes
        scratch = memoryview(bytearray(max(segment.stored_len for segment in header.segments)))
        for layer, segment in enumerate(header.segments):
            stored = scratch[: segment.stored_len]
            reader.readinto([stored], header.header_len + segment.offset)
            decode_layer(header, self.layout, layer, stored, out[layer * step : (layer + 1) * step])

    async def _read_remote(self, key: ChunkKey, out: memoryview) -> int | None:
        if self._plain:
            return await self._read_remote_plain(key, out)
        data = await self.backend.get(key)
        if data is None:
            return None
        await in_thread(self._executor, decode_chunk, data, self.layout, key, out, self.cipher)
        return len(data)

    async def _read_remote_plain(self, key: ChunkKey, out: memoryview) -> int | None:
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
                plain = await in_thread(self._executor, self._check_plain, key, head, out)
            if plain:
                return size
        data = await self.backend.get(key)  # another writer's codec, or a damaged object: the general path
        if data is None:
            return None
        await in_thread(self._executor, decode_chunk, data, self.layout, key, out, self.cipher)
        return len(data)

    def _check_plain(self, key: ChunkKey, head: memoryview, out: memoryview) -> bool:
        """Verify a payload received in place; False when the header says it is not plain after all."""
        header = parse_header(head, self.layout, key, self.cipher)
        if not header.plain or header.payload_len != len(out):
            return False
        step = self.layout.layer_nbytes
        for layer, segment in enumerate(header.segments):
            if checksum(out[layer * step : (layer + 1) * step]) != segment.checksum:
                raise ChunkFormatError(f"layer {layer} failed its checksum")
        return True

    async def read_layer(self, key: ChunkKey, layer: int, out: memoryview) -> bool:
        """Fill ``out`` with one layer of the chunk (a header read, then one segment read).

        False on a miss of any kind. Streams that read many layers use :meth:`open_layers`.
        """
        reader = await self.open_layers(key)
        if reader is None:
            return False
        try:
            return await reader.read_counted(layer, out)
        finally:
            reader.close()

    async def open_layers(self, key: ChunkKey) -> LayerReader | None:
        """The chunk opened for reads layer by layer (its header read and checked once), or None.

        None on a miss of any kind (absent, corrupt, foreign, an I/O error), counted as usual.
        """
        return (await self.open_layers_many([key]))[0]

    async def open_layers_many(self, keys: Sequence[ChunkKey]) -> list[LayerReader | None]:
        """:meth:`open_layers` for several chunks: files in one thread call, remote headers concurrently."""
        outcomes: Sequence[tuple[ChunkHeader, ChunkReader | None, memoryview | None] | None | BaseException]
        if isinstance(self.backend, LocalBackend):
            outcomes = await in_thread(self._executor, _each, self._open_local, [(key, None) for key in keys])
        else:
            outcomes = await asyncio.gather(*(self._open_remote(key) for key in keys), return_exceptions=True)
        readers: list[LayerReader | None] = []
        for key, outcome in zip(keys, outcomes, strict=True):
            if isinstance(outcome, BaseException) or outcome is None:
                await self._account(key, outcome)
                readers.append(None)
                continue
            header, file, first_layer = outcome
            self.stats.hits += 1  # one per chunk opened; its layers add to bytes_read
            readers.append(LayerReader(self, key, header, file, first_layer))
        return readers

    def _open_local(self, key: ChunkKey, _: object = None) -> tuple[ChunkHeader, ChunkReader, None] | None:
        assert isinstance(self.backend, LocalBackend)
        file = self.backend.open_reader(key)
        if file is None:
            return None
        try:
            header, _ = self._read_file_header(file, key, memoryview(b""))
        except BaseException:
            file.__exit__(None, None, None)
            raise
        return header, file, None

    async def _open_remote(self, key: ChunkKey) -> tuple[ChunkHeader, None, memoryview | None] | None:
        """The checked header and, read in the same request, layer 0's stored bytes when they fit.

        One round trip instead of two before the first layer (a range past the end is clamped;
        the slack covers a sealed or incompressible segment's few extra bytes).
        """
        head = await self.backend.get(key, (0, self._header_guess + self.layout.layer_nbytes + 4096))
        if head is None:
            return None
        needed = header_length(head)
        if needed > len(head):
            head = await self.backend.get(key, (0, needed))
            if head is None:
                return None
        header = parse_header(memoryview(head)[:needed], self.layout, key, self.cipher)
        first = header.segments[0]
        start = header.header_len + first.offset
        if start + first.stored_len > len(head):
            return header, None, None
        return header, None, memoryview(head)[start : start + first.stored_len]

    async def _discard_corrupt(self, key: ChunkKey, exc: ChunkFormatError) -> None:
        self.stats.corrupt += 1
        log.warning("%s tier: chunk %s is unusable (%s); removing it", self.name, key[:16], exc)
        try:
            await self.backend.delete(key)
        except Exception as delete_error:
            self.stats.errors += 1
            log.warning("%s tier: could not remove %s: %r", self.name, key[:16], delete_error)

    async def prefix_count(self, keys: list[ChunkKey]) -> int:
        try:
            return await self.backend.prefix_count(keys)
        except Exception as exc:
            self.stats.errors += 1
            log.warning("%s tier: lookup failed: %r", self.name, exc)
            return 0

    def stats_dict(self) -> dict[str, int | float | str]:
        """The tier's counters, then the backend's own figures (the tier's win a name clash)."""
        return {**self.backend.stats(), **self.stats.as_dict(), "codec": self.codec.id}


def _total_len(parts: list[Buffer]) -> int:
    return sum(memoryview(part).nbytes for part in parts)


def _split(items: list[T], groups: int) -> list[list[T]]:
    """At most ``groups`` contiguous, near-equal, non-empty slices of ``items``."""
    groups = max(1, min(groups, len(items)))
    size, extra = divmod(len(items), groups)
    bounds = [i * size + min(i, extra) for i in range(groups + 1)]
    return [items[bounds[i] : bounds[i + 1]] for i in range(groups)]


def _each(
    operation: Callable[[ChunkKey, memoryview], T], items: list[tuple[ChunkKey, memoryview]]
) -> list[T | Exception]:
    """``operation`` on every item, each failure caught, so one bad chunk does not sink its batch."""
    outcomes: list[T | Exception] = []
    for key, buffer in items:
        try:
            outcomes.append(operation(key, buffer))
        except Exception as exc:  # accounted for on the event loop, per chunk
            outcomes.append(exc)
    return outcomes


class LayerReader:
    """One chunk of a tier opened for layer-by-layer reads; ``close()`` it when done.

    Disk keeps the file open and reads each segment with one positioned read. Remote tiers
    issue byte-range requests that may cover the next few layers too (``ahead``): each request
    costs a round trip (~4 ms on moto), so layer 0 comes with the header, and later requests
    span as many layers as were fetched before (1, 2, 4, ...), keeping the first layer fast and
    the request count near ``log2(layers)``. Every segment is verified when it is used.
    """

    def __init__(
        self,
        tier: ChunkTier,
        key: ChunkKey,
        header: ChunkHeader,
        file: ChunkReader | None,
        first_layer: memoryview | None = None,
    ) -> None:
        self.tier, self.key, self.header, self._file = tier, key, header, file
        # Remote segments received ahead of their layer (layer 0 may come with the header).
        self._fetched: dict[int, memoryview] = {} if first_layer is None else {0: first_layer}
        self._layers_fetched = len(self._fetched)

    @property
    def is_local(self) -> bool:
        """Reads are blocking file reads (batch them into one thread call with :meth:`read_local`)."""
        return self._file is not None

    async def read(self, layer: int, out: memoryview, ahead: int = 0) -> None:
        """Verify and decode layer ``layer`` into ``out``; raises on any problem (not counted).

        A remote read that must make a request fetches up to ``ahead`` further layers with it.
        """
        tier = self.tier
        if self._file is not None:
            await in_thread(tier._executor, self.read_local, layer, out)
            return
        stored = self._fetched.pop(layer, None)
        if stored is None:
            stored = await self._fetch_span(layer, min(layer + 1 + ahead, len(self.header.segments)))
        await in_thread(tier._executor, decode_layer, self.header, tier.layout, layer, stored, out)

    async def _fetch_span(self, first: int, end: int) -> memoryview:
        """Layers ``first`` to ``end - 1`` in one range request; returns the first, keeps the rest."""
        segments, base = self.header.segments, self.header.header_len
        start = base + segments[first].offset
        stop = base + segments[end - 1].offset + segments[end - 1].stored_len
        self._layers_fetched += end - first
        data = await self.tier.backend.get(self.key, (start, stop))
        if data is None:
            raise ChunkFormatError(f"layer {first} vanished while the chunk was being read")
        if len(data) != stop - start:
            raise ChunkFormatError(f"layers {first}-{end - 1}: {len(data)} bytes, expected {stop - start}")
        view = memoryview(data)
        for layer in range(first + 1, end):
            offset = base + segments[layer].offset - start
            self._fetched[layer] = view[offset : offset + segments[layer].stored_len]
        return view[: segments[first].stored_len]

    def next_span(self, layer: int, limit: int) -> int:
        """Layers to fetch ahead with ``layer``'s request: as many as fetched so far (spans double), at most ``limit``.

        The span also stops at the backend's ``range_request_bytes``: a bigger request would
        only make the consumer wait longer for its first layer, on a server where a round
        trip is cheap (Redis here: one layer a request measured best; S3 gains ~3x from spans).
        """
        if layer in self._fetched:
            return 0
        per_request = self.tier.backend.range_request_bytes
        cap = max(1, per_request // max(1, self.header.segments[layer].stored_len)) - 1
        return min(self._layers_fetched, limit, cap)

    async def read_counted(self, layer: int, out: memoryview, ahead: int = 0) -> bool:
        """``read``, with a failure counted in the tier's stats (a corrupt chunk is removed)."""
        try:
            await self.read(layer, out, ahead)
        except Exception as exc:
            return await self.tier._account(self.key, exc)
        self.count(layer)
        return True

    def count(self, layer: int) -> None:
        """Add a layer read that succeeded to the tier's stats."""
        self.tier.stats.bytes_read += self.header.segments[layer].stored_len

    def read_local(self, layer: int, out: memoryview) -> None:
        """The blocking file read of :meth:`read` (call it from a worker thread)."""
        assert self._file is not None
        segment = self.header.segments[layer]
        start, stored_len = self.header.header_len + segment.offset, segment.stored_len
        plain = self.header.plain and stored_len == len(out)
        target = out if plain else memoryview(bytearray(stored_len))
        if self._file.readinto([target], start) != stored_len:
            raise ChunkFormatError(f"layer {layer} is truncated")
        if plain:
            verify_segment(self.header, layer, out)  # read in place: only the checksum is left
        else:
            decode_layer(self.header, self.tier.layout, layer, target, out)

    def close(self) -> None:
        self._fetched.clear()
        if self._file is not None:
            self._file.__exit__(None, None, None)
            self._file = None
