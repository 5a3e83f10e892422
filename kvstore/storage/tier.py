"""A secondary tier: a storage backend plus a codec, moving whole chunks to and from DRAM slots.

The tier owns the chunk container: it encodes on the way down and checks every byte on the
way up. Whatever goes wrong below it (a missing object, a corrupt or foreign one, an I/O
error) comes out as a counted miss, never as an exception into the engine and never as
wrong KV. A corrupt object is deleted so it is not read again; a foreign one (another layout,
encryption key or codec: sound, but not this store's to read) is left for its owner.

Batches go through the backend's hooks (:meth:`~kvstore.backends.base.Backend.write_many`,
``read_many``, ``open_many``) with the tier's per-chunk work as callables, in both the forms a
backend may run it: blocking work on an open file (a backend of files runs a whole batch in one
thread call), and async work through the backend's requests (a network backend, all at once).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Sequence
from concurrent.futures import Executor
from functools import partial
from typing import Any, TypeVar

from kvstore.backends.base import Backend, ObjectFile, ObjectRead, ObjectWrite
from kvstore.codecs import CodecPipeline
from kvstore.codecs.base import SegmentSpec
from kvstore.errors import ChunkFormatError, CodecError, ConfigError, ForeignChunkError
from kvstore.keys import ChunkKey
from kvstore.layout import KVLayout
from kvstore.storage.breaker import CircuitBreaker, note_failure, timed_out, unreachable
from kvstore.storage.container import (
    CHECK_HOT_BYTES,
    ChunkHeader,
    decode_chunk,
    decode_layer,
    encode_chunk,
    header_length,
    header_size,
    parse_header,
    verify_segments,
)
from kvstore.storage.crypto import ChunkCipher
from kvstore.storage.layer_reader import LayerReader
from kvstore.storage.stats import TierLatency, TierStats
from kvstore.util.threads import FenceClosed, WriteFence, in_thread
from kvstore.util.units import human_bytes

log = logging.getLogger("kvstore.tier")
T = TypeVar("T")
INLINE_CHECK_BYTES = 8 << 20  # remote chunks up to this size are checksummed on the event loop
OpenedChunk = tuple[ChunkHeader, ObjectFile | None, memoryview | None]  # header, open file, layer 0's stored bytes
Guard = WriteFence | contextlib.nullcontext[None]  # held around each write into a chunk's destination
UNGUARDED: Guard = contextlib.nullcontext()


class ChunkTier:
    """One backend below the DRAM pool, in whole chunks: encoded, checked, counted (see the module docstring)."""

    def __init__(
        self,
        backend: Backend,
        codec: CodecPipeline,
        layout: KVLayout,
        executor: Executor | None,
        parallel_reads: int = 2,
        cipher: ChunkCipher | None = None,
        parallel_writes: int = 2,
    ):
        self.backend = backend
        self.parallel_reads = parallel_reads
        self.parallel_writes = parallel_writes
        self.codec = codec
        self.cipher = cipher
        self._plain = codec.is_identity and cipher is None  # what we write is readable in place
        self.layout = layout
        self.name = backend.name
        self.stats = TierStats()
        self.latency = TierLatency()  # fed by KVStore, which times each operation it waits for
        self.breaker = CircuitBreaker(self.name)  # the store replaces it with one configured from [breaker]
        # where encoding, decoding and checksums run (and a local backend's batches); a whole chunk's
        # encode or decode also spreads its layers over this pool's idle workers (container.layer_runs)
        self.executor = executor
        self._refuse_a_codec_for_other_values()
        # exact unless the codec changed
        self._header_guess = header_size(layout.num_layers, codec.id, encrypted=cipher is not None)
        self._batch_layers = min(layout.num_layers, max(1, CHECK_HOT_BYTES // layout.layer_nbytes))

    def _refuse_a_codec_for_other_values(self) -> None:
        """ConfigError, at start, for a codec that cannot encode this layout's values (e.g. fp8 on fp8 KV).

        One layer of zeros is encoded (lossy codecs quantize 16- and 32-bit floats only): else
        every put to this tier would fail, one counted error at a time, and the tier keep nothing.
        """
        if self.codec.is_identity:
            return
        spec = SegmentSpec(self.layout.dtype, self.layout.layer_shape)
        try:
            self.codec.encode(memoryview(bytes(spec.nbytes)), spec)
        except CodecError as exc:
            raise ConfigError(
                f"{self.name}.codec {self.codec.id!r} cannot store this model's KV ({self.layout.describe()}): "
                f"{exc}; use a lossless codec for it (identity, zstd, byteplanes)"
            ) from None

    async def open(self) -> None:
        """Open the backend, after refusing a byte budget below one chunk (it would evict everything it holds)."""
        capacity, chunk = self.backend.capacity_bytes, self.layout.chunk_nbytes
        if capacity is not None and capacity < chunk:
            raise ConfigError(
                f"{self.name}.capacity = {capacity:,} bytes is below one chunk of {self.layout.describe()} "
                f"({chunk:,} bytes): the tier could keep nothing (and would evict every file it finds); "
                f"set {self.name}.capacity to at least {human_bytes(chunk)}, in practice many chunks (e.g. '500GiB')"
            )
        await self.backend.open()

    async def close(self) -> None:
        await self.backend.close()

    @property
    def is_local(self) -> bool:
        """Blocking file I/O on this machine (batched into thread calls), rather than network requests."""
        return self.backend.is_local

    # -- whole chunks ------------------------------------------------------------------------------

    async def write_many(self, items: Sequence[tuple[ChunkKey, memoryview]]) -> list[BaseException | None]:
        """Store several chunks; per chunk, the exception that stopped it or None (counted either way).

        A chunk the backend already holds is not written again (counted as skipped): its bytes
        never change under its key. A local backend writes the batch in ``parallel_writes``
        slices at once, each in one thread call (the cascade drains its queue in batches under
        load; one thread per batch left the second core idle: ~0.35-0.65x of two raw writers).
        Each file reserves its bytes in the backend's budget before it is written, so writers
        in parallel never take the tier past its capacity.
        """
        writes = [
            ObjectWrite(key, partial(encode_chunk, self.layout, key, chunk, self.codec, self.cipher, self.executor))
            for key, chunk in items
        ]
        if self.is_local and len(writes) > 1:
            slices = await asyncio.gather(
                *(self.backend.write_many(part, self.executor) for part in _split(writes, self.parallel_writes))
            )
            outcomes = [outcome for part in slices for outcome in part]
        else:
            outcomes = await self.backend.write_many(writes, self.executor)
        results: list[BaseException | None] = []
        for outcome in outcomes:
            if isinstance(outcome, asyncio.CancelledError):
                raise outcome
            if isinstance(outcome, BaseException):
                if timed_out(outcome):  # the client's own timeout (a socket's), under the batch's
                    self.stats.timeouts += 1
                else:
                    self.stats.errors += 1
                if unreachable(outcome):  # a refused write (out of memory, denied, full) leaves reads alone
                    note_failure()
                results.append(outcome)
                continue
            if outcome is None:
                self.stats.skipped += 1
            else:
                self.stats.writes += 1
                self.stats.bytes_written += outcome
            results.append(None)
        return results

    async def read_many_into(
        self,
        keys: Sequence[ChunkKey],
        outs: Sequence[memoryview],
        fences: Sequence[WriteFence] | None = None,
        counted: bool = True,
    ) -> list[bool]:
        """Fill each ``outs[i]`` with ``keys[i]``; per key, False on a miss of any kind (absent, corrupt, error).

        The batch goes to the backend in ``parallel_reads`` slices at once: a local backend reads
        each slice in one thread call (a thread hop costs ~0.1 ms here, a warm 5 MB chunk read ~0.4 ms).
        ``fences`` (local tiers only): each write into ``outs[i]`` is made under ``fences[i]``, so
        a caller whose buffers these are can close them to the thread at its deadline.
        ``counted=False``: a second read of chunks already counted (a DRAM admission after a read
        into a caller's buffers), see :meth:`account`. A miss may leave ``outs[i]`` partly written.
        """
        if not keys:
            return []
        if fences is not None and not self.is_local:
            raise ValueError(f"{self.name} tier: fenced reads are for local tiers (file reads in threads)")
        guards: Sequence[Guard] = fences if fences is not None else [UNGUARDED] * len(keys)
        reads = [
            ObjectRead(key, partial(self._load_file, key, out, guard), partial(self._load_remote, key, out))
            for key, out, guard in zip(keys, outs, guards, strict=True)
        ]
        slices = await asyncio.gather(
            *(self.backend.read_many(part, self.executor) for part in _split(reads, self.parallel_reads))
        )
        outcomes = [outcome for part in slices for outcome in part]
        return [await self.account(key, outcome, counted) for key, outcome in zip(keys, outcomes, strict=True)]

    async def account(self, key: ChunkKey, outcome: int | None | BaseException, counted: bool = True) -> bool:
        """Count one read's outcome (bytes read, None for absent, or what it raised); True for a hit.

        A corrupt object is removed so it is not read again; a foreign one (written for another
        model layout, sealed under another encryption key, plain where this store encrypts, or
        in a codec this process lacks) is left alone for its owner. A cancellation is
        re-raised, never counted. :class:`FenceClosed` (the caller stopped waiting, so the
        thread stopped writing into its buffer) says nothing of the object or the tier: a
        miss for that call, counted nowhere, never a corruption or a breaker failure.

        ``counted=False`` (a re-read of a chunk already counted once): hits, bytes, misses and
        errors are not counted again and never blamed on the tier's breaker; a corrupt object is
        still counted and removed (the bytes checked were the file's, read into our own memory).
        """
        if isinstance(outcome, FenceClosed):
            return False
        if isinstance(outcome, ForeignChunkError):
            if not counted:
                return False
            self.stats.foreign += 1
            log.warning("%s tier: chunk %s cannot be opened here (%s)", self.name, key[:16], outcome)
            return False
        if isinstance(outcome, ChunkFormatError):
            await self._discard_corrupt(key, outcome)
            return False
        if isinstance(outcome, asyncio.CancelledError):
            raise outcome
        if not counted:
            return isinstance(outcome, int)
        if isinstance(outcome, BaseException):  # I/O errors, a server gone: a miss, counted
            self.stats.errors += 1
            note_failure()  # the tier's fault, not the object's: its breaker counts it
            log.warning("%s tier: read of %s failed: %r", self.name, key[:16], outcome)
            return False
        if outcome is None:
            self.stats.misses += 1
            return False
        self.stats.hits += 1
        self.stats.bytes_read += outcome
        return True

    # -- from a file: read and verify in one thread call, layer batch by layer batch ---------------

    def _load_file(self, key: ChunkKey, out: memoryview, guard: Guard, file: ObjectFile) -> int:
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
        return file.size

    def _read_file_header(
        self, file: ObjectFile, key: ChunkKey, first_batch: memoryview, guard: Guard = UNGUARDED
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
        header = parse_header(head[:needed], self.layout, key, self.cipher)
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

    async def _load_remote(self, key: ChunkKey, out: memoryview) -> int | None:
        if self._plain:
            return await self._load_remote_plain(key, out)
        return await self._load_whole(key, out)

    async def _load_whole(self, key: ChunkKey, out: memoryview) -> int | None:
        data = await self.backend.get(key)
        if data is None:
            return None
        await in_thread(self.executor, decode_chunk, data, self.layout, key, out, self.cipher, self.executor)
        return len(data)

    async def _load_remote_plain(self, key: ChunkKey, out: memoryview) -> int | None:
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
        header = parse_header(head, self.layout, key, self.cipher)
        if not header.plain or header.payload_len != len(out):
            return False
        self._require_layer_sized(header)
        verify_segments(header.segments, out, range(len(header.segments)))
        return True

    # -- layer by layer ------------------------------------------------------------------------------

    async def open_layers_many(self, keys: Sequence[ChunkKey]) -> list[LayerReader | None]:
        """The chunks opened for reads layer by layer (each header read and checked once); None where missed.

        None on a miss of any kind (absent, corrupt, foreign, an I/O error), counted as usual.
        Files are opened in one thread call and stay open in their readers; remote headers
        are read concurrently.
        """
        reads = [ObjectRead(key, partial(self._open_file, key), partial(self._open_remote, key)) for key in keys]
        outcomes = await self.backend.open_many(reads, self.executor)
        readers: list[LayerReader | None] = [
            None if isinstance(outcome, BaseException) or outcome is None else LayerReader(self, key, *outcome)
            for key, outcome in zip(keys, outcomes, strict=True)
        ]
        try:  # the misses are counted (a corrupt one removed: an await) with every file already owned
            for key, outcome, reader in zip(keys, outcomes, readers, strict=True):
                if reader is None:
                    await self.account(key, outcome if isinstance(outcome, BaseException) else None)
                else:
                    self.stats.hits += 1  # one per chunk opened; its layers add to bytes_read
        except BaseException:  # cancelled meanwhile: nobody will close these readers but us
            for opened in readers:
                if opened is not None:
                    opened.close()
            raise
        return readers

    def _open_file(self, key: ChunkKey, file: ObjectFile) -> OpenedChunk:
        header, _ = self._read_file_header(file, key, memoryview(b""))
        return header, file, None

    async def _open_remote(self, key: ChunkKey) -> OpenedChunk | None:
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
        header = parse_header(memoryview(head)[:needed], self.layout, key, self.cipher)
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

    # -- the rest ------------------------------------------------------------------------------------

    async def _discard_corrupt(self, key: ChunkKey, exc: ChunkFormatError) -> None:
        self.stats.corrupt += 1
        log.warning("%s tier: chunk %s is unusable (%s); removing it", self.name, key[:16], exc)
        try:
            await self.backend.delete(key)
        except Exception as delete_error:
            self.stats.errors += 1  # not a breaker failure: read-only credentials may refuse it forever
            log.warning("%s tier: could not remove %s: %r", self.name, key[:16], delete_error)

    async def prefix_count(self, keys: list[ChunkKey]) -> int:
        """How many leading ``keys`` the backend holds (a failure counts as an error and answers 0)."""
        try:
            return await self.backend.prefix_count(keys)
        except Exception as exc:
            self.stats.errors += 1
            note_failure()  # the tier's fault, not the object's: its breaker counts it
            log.warning("%s tier: lookup failed: %r", self.name, exc)
            return 0

    def stats_dict(self) -> dict[str, Any]:
        """The tier's counters, then the backend's own figures (the tier's win a name clash), and its breaker's."""
        return {
            **self.backend.stats(),
            **self.stats.as_dict(),
            "codec": self.codec.id,
            "lossless": self.codec.lossless,
            "breaker": self.breaker.stats(),
        }


def _split(items: list[T], groups: int) -> list[list[T]]:
    """At most ``groups`` contiguous, near-equal, non-empty slices of ``items``."""
    groups = max(1, min(groups, len(items)))
    size, extra = divmod(len(items), groups)
    bounds = [i * size + min(i, extra) for i in range(groups + 1)]
    return [items[bounds[i] : bounds[i + 1]] for i in range(groups)]


__all__ = ["ChunkTier", "LayerReader"]
