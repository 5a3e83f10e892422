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
How one object is read and checked is :mod:`kvstore.storage.chunk_reads`; the tier counts the
outcome. Its health (breaker, failure counters, latency, operations in flight) is
:mod:`kvstore.storage.health`: the store, loads and streams call the tier's guarded operations
(:meth:`ChunkTier.lookup`, ``read``, ``write``, ``open_layers``, ``guarded``), never its parts.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import Executor
from functools import partial
from typing import Any, TypeVar

from kvstore.backends.base import Backend, ObjectRead, ObjectWrite, StreamedObject
from kvstore.backends.registry import default_endpoint, lookup_backend
from kvstore.codecs import CodecPipeline
from kvstore.codecs.base import SegmentSpec
from kvstore.config import BreakerConfig
from kvstore.errors import ChunkFormatError, CodecError, ConfigError, ForeignChunkError
from kvstore.events import NO_EVENTS, Medium, NoEvents, TierEvents
from kvstore.keys import ChunkKey
from kvstore.layout import KVLayout
from kvstore.storage.breaker import CircuitBreaker, timed_out, unreachable
from kvstore.storage.chunk_reads import NO_FENCE, ChunkReads, Guard, LossyRead, ReadOutcome
from kvstore.storage.container import encode_chunk, name_in_head, stream_plain_chunk
from kvstore.storage.crypto import ChunkCipher
from kvstore.storage.health import UNGUARDED, Attempt, TierHealth
from kvstore.storage.layer_reader import LayerReader
from kvstore.storage.links import PrefixLinks
from kvstore.storage.stats import TierLatency, TierStats
from kvstore.util.threads import FenceClosed, WriteFence
from kvstore.util.units import human_bytes

log = logging.getLogger("kvstore.tier")
T = TypeVar("T")


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
        breaker: BreakerConfig | None = None,
    ):
        """``breaker``: the circuit breaker's settings (the ``[breaker]`` section; default: its defaults)."""
        self.backend = backend
        self.parallel_reads = parallel_reads
        self.parallel_writes = parallel_writes
        self.codec = codec
        self.cipher = cipher
        self.layout = layout
        self.name = backend.name
        settings = (breaker or BreakerConfig()).model_dump()
        # its breaker, failure counters, latency and operations in flight: see kvstore.storage.health
        self.health = TierHealth(self.name, CircuitBreaker(self.name, **settings))
        # where encoding, decoding and checksums run (and a local backend's batches); a whole chunk's
        # encode or decode also spreads its layers over this pool's idle workers (container.layer_runs)
        self.executor = executor
        self._refuse_a_codec_for_other_values()
        self._reads = ChunkReads(backend, layout, codec, cipher, executor)  # each object's bytes read and checked
        self.medium = Medium.of_tier(self.name, backend.is_local)  # what KV events call this tier
        self.events: TierEvents = NO_EVENTS
        self._writes = 0  # write batches in flight
        self._evicted_while_writing: set[ChunkKey] = set()  # their chunks are not told stored after the fact
        backend.on_evicted = self._evicted

    def report_to(self, events: TierEvents) -> None:
        """Tell ``events`` of every chunk written here (stored) and evicted or removed as corrupt (removed)."""
        self.events = events
        self.backend.evicted_heads = not isinstance(events, NoEvents)  # the evicted chunks' names

    @property
    def links(self) -> PrefixLinks:
        """Each chunk's parent: noted from the headers read here, written into the headers written here."""
        return self._reads.links

    def share_links(self, links: PrefixLinks) -> None:
        """Write each chunk's parent as ``links`` knows it, and note there the parents of the chunks read here
        (the store's map, shared by its tiers: a chunk read from one is written to another with its parent)."""
        self._reads.links = links

    def _evicted(self, keys: Sequence[ChunkKey], heads: Sequence[bytes | None]) -> None:
        """The backend evicted ``keys`` (from any thread): removed, named by their headers where read."""
        if self._writes:
            self._evicted_while_writing.update(keys)
        self.events.removed(self.medium, keys, [name_in_head(head) for head in heads])

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
        capacity, chunk = self.capacity_bytes, self.layout.chunk_nbytes
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
    def capacity_bytes(self) -> int | None:
        """The backend's byte budget; None where it has none (Redis, S3: their servers evict)."""
        return self.backend.capacity_bytes

    @property
    def is_local(self) -> bool:
        """Blocking file I/O on this machine (batched into thread calls), rather than network requests."""
        return self.backend.is_local

    def describe(self) -> str:
        """This tier for a log line: its name, where it keeps chunks (no secrets), its budget and codec."""
        spec = lookup_backend(self.name)
        where = spec.endpoint(self.backend) if spec is not None else default_endpoint(self.backend)
        budget = f", {human_bytes(self.capacity_bytes)}" if self.capacity_bytes is not None else ""
        return f"{self.name} {where}{budget} ({self.codec.id}{', encrypted' if self.cipher else ''})"

    @property
    def stats(self) -> TierStats:
        """What the tier did (read-only for callers: the tier and its health write it)."""
        return self.health.stats

    @property
    def latency(self) -> TierLatency:
        """Seconds per guarded operation as its caller waited, and the throughput they delivered (the planner's)."""
        return self.health.latency

    @property
    def breaker(self) -> CircuitBreaker:
        return self.health.breaker

    # -- guarded: what the store, its loads and layer streams call (each admitted, bounded, timed, counted) ----

    async def lookup(self, keys: list[ChunkKey], timeout: float, *, blame: bool = True) -> int:
        """How many leading ``keys`` the tier holds, within ``timeout`` (else :class:`TierTimeout`, or
        :class:`TierSkipped` while the breaker is open). ``blame`` as in :meth:`TierHealth.run`."""
        return await self.health.run(
            lambda attempt: self.prefix_count(keys, attempt), timeout, latency=self.latency.lookup, blame=blame
        )

    async def read(
        self,
        keys: Sequence[ChunkKey],
        outs: Sequence[memoryview],
        timeout: float,
        *,
        fences: Sequence[WriteFence] | None = None,
        counted: bool = True,
        on_end: Callable[[], None] | None = None,
        blame: bool = True,
        cancel_with_caller: bool = False,
        lossy: list[CodecPipeline | None] | None = None,
    ) -> list[bool]:
        """:meth:`read_many_into` within ``timeout`` (else :class:`TierTimeout`); ``on_end`` once it has really ended.

        The read may outlive a timeout (a thread reading a file): whatever memory it writes
        must stay reserved until ``on_end``, or be fenced (``fences``, ``cancel_with_caller``).
        A counted read feeds the tier's read latency and throughput (the load planner's).
        """
        transfer = self.latency.transfer
        if counted:
            transfer.begin()
        found: list[bool] = []
        try:
            found = await self.health.run(
                lambda attempt: self.read_many_into(keys, outs, fences, counted, attempt, lossy),
                timeout,
                latency=self.latency.read if counted else None,
                on_end=on_end,
                blame=blame,
                cancel_with_caller=cancel_with_caller,
            )
        finally:
            if counted:
                transfer.end(sum(found) * self.layout.chunk_nbytes)
        return found

    async def write(
        self,
        items: Sequence[tuple[ChunkKey, memoryview]],
        timeout: float,
        on_end: Callable[[], None] | None = None,
        codecs: Sequence[CodecPipeline | None] | None = None,
    ) -> list[BaseException | None]:
        """:meth:`write_many` within ``timeout`` (else :class:`TierTimeout`); ``on_end`` once it has really ended."""
        return await self.health.run(
            lambda attempt: self.write_many(items, attempt, codecs),
            timeout,
            latency=self.latency.write,
            on_end=on_end,
            writes=len(items),
        )

    async def open_layers(self, keys: Sequence[ChunkKey], timeout: float | None) -> list[LayerReader | None]:
        """:meth:`open_layers_many` within ``timeout`` (None: unbounded, for files opened in one thread call
        that must not be cancelled midway); cancelled with its caller, which then owns no reader."""
        return await self.health.run(lambda attempt: self.open_layers_many(keys, attempt), timeout, detached=False)

    async def guarded(self, operation: Callable[[Attempt], Awaitable[T]], timeout: float | None) -> T:
        """Any other operation on the tier, awaited in place under its breaker and ``timeout`` (a layer's read)."""
        return await self.health.run(operation, timeout, detached=False)

    # -- what layer readers use (kvstore.storage.layer_reader.ReaderTier) ------------------------------

    @property
    def range_request_bytes(self) -> int:
        return self.backend.range_request_bytes

    async def read_range(self, key: ChunkKey, start: int, stop: int) -> bytes | None:
        """Bytes ``[start, stop)`` of ``key``'s object (None if absent), timed: the load planner's throughput of
        the tier as layer streams read it (``latency.transfer``)."""
        data: bytes | None = None
        self.latency.transfer.begin()
        try:
            data = await self.backend.get(key, (start, stop))
        finally:
            self.latency.transfer.end(len(data) if data is not None else 0)
        return data

    def count_read(self, nbytes: int) -> None:
        self.stats.bytes_read += nbytes

    def drop(self, chunks: int = 1) -> None:
        """Count writes to this tier that were never made (its queue was full, or the store closed)."""
        self.health.drop(chunks)

    def cancel_operations(self) -> None:
        """Ask every operation still running on the tier to stop (the store is closing)."""
        self.health.cancel_all()

    # -- whole chunks ------------------------------------------------------------------------------

    def _stream(
        self, key: ChunkKey, chunk: memoryview, codec: CodecPipeline, parent: ChunkKey | None
    ) -> Callable[[], StreamedObject] | None:
        """The chunk made a run of layers at a time, where its bytes are stored as they are (see ObjectWrite.stream)."""
        if not self.is_local or not codec.is_identity or self.cipher is not None:
            return None
        return partial(stream_plain_chunk, self.layout, key, chunk, self.events.name_of(key), parent)

    async def write_many(
        self,
        items: Sequence[tuple[ChunkKey, memoryview]],
        attempt: Attempt = UNGUARDED,
        codecs: Sequence[CodecPipeline | None] | None = None,
    ) -> list[BaseException | None]:
        """Store several chunks; per chunk, the exception that stopped it or None (counted either way).

        ``codecs[i]`` (where not None) encodes chunk ``i`` instead of the tier's codec: a promoted
        chunk that was read lossy (:class:`LossyRead`) is written on in the codec it came in.

        A chunk the backend already holds is not written again (counted as skipped): its bytes
        never change under its key. A local backend writes the batch in ``parallel_writes``
        slices at once, each in one thread call (the cascade drains its queue in batches under
        load; one thread per batch left the second core idle: ~0.35-0.65x of two raw writers).
        Each file reserves its bytes in the backend's budget before it is written, so writers
        in parallel never take the tier past its capacity.
        """
        chosen = codecs if codecs is not None else [None] * len(items)
        parents = [self.links.parent_of(key) for key, _ in items]
        writes = [
            ObjectWrite(
                key,
                partial(
                    encode_chunk,
                    self.layout,
                    key,
                    chunk,
                    codec or self.codec,
                    self.cipher,
                    self.executor,
                    self.events.name_of(key),
                    parent,
                ),
                parent,
                self._stream(key, chunk, codec or self.codec, parent),
            )
            for (key, chunk), codec, parent in zip(items, chosen, parents, strict=True)
        ]
        self._writes += 1
        try:
            if self.is_local and len(writes) > 1:
                slices = await asyncio.gather(
                    *(self.backend.write_many(part, self.executor) for part in _split(writes, self.parallel_writes))
                )
                outcomes = [outcome for part in slices for outcome in part]
            else:
                outcomes = await self.backend.write_many(writes, self.executor)
        finally:
            self._writes -= 1
            evicted = self._evicted_while_writing
            if not self._writes:
                self._evicted_while_writing = set()
        results: list[BaseException | None] = []
        durable: list[ChunkKey] = []  # written, or held already
        for (key, _), outcome in zip(items, outcomes, strict=True):
            if isinstance(outcome, asyncio.CancelledError):
                raise outcome
            if isinstance(outcome, BaseException):
                what = f"write of {key[:16]}"
                if timed_out(outcome):  # the client's own timeout (a socket's), under the batch's
                    self.health.timeout(attempt, what)
                else:  # a refused write (out of memory, denied, full) leaves reads alone
                    self.health.error(attempt, what, outcome, tier_fault=unreachable(outcome))
                results.append(outcome)
                continue
            if outcome is None:
                self.stats.skipped += 1
            else:
                self.stats.writes += 1
                self.stats.bytes_written += outcome
            if key not in evicted:  # evicted by a parallel write meanwhile: its removal is told already
                durable.append(key)
            results.append(None)
        self.events.stored(self.medium, durable)
        return results

    async def read_many_into(
        self,
        keys: Sequence[ChunkKey],
        outs: Sequence[memoryview],
        fences: Sequence[WriteFence] | None = None,
        counted: bool = True,
        attempt: Attempt = UNGUARDED,
        lossy: list[CodecPipeline | None] | None = None,
    ) -> list[bool]:
        """Fill each ``outs[i]`` with ``keys[i]``; per key, False on a miss of any kind (absent, corrupt, error).

        ``lossy`` (a list as long as ``keys``): set to the codec of each chunk read that was stored
        lossy, for its promotion (see :class:`LossyRead`).

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
        guards: Sequence[Guard] = fences if fences is not None else [NO_FENCE] * len(keys)
        reads = [
            ObjectRead(key, partial(self._reads.load_file, key, out, guard), partial(self._reads.load_remote, key, out))
            for key, out, guard in zip(keys, outs, guards, strict=True)
        ]
        slices = await asyncio.gather(
            *(self.backend.read_many(part, self.executor) for part in _split(reads, self.parallel_reads))
        )
        outcomes = [outcome for part in slices for outcome in part]
        self.backend.used_in_order([key for key, outcome in zip(keys, outcomes, strict=True) if _found(outcome)])
        if lossy is not None:
            for i, outcome in enumerate(outcomes):
                if isinstance(outcome, LossyRead):
                    lossy[i] = outcome.codec
        return [await self.account(key, outcome, counted, attempt) for key, outcome in zip(keys, outcomes, strict=True)]

    async def account(
        self, key: ChunkKey, outcome: ReadOutcome, counted: bool = True, attempt: Attempt = UNGUARDED
    ) -> bool:
        """Count one read's outcome (bytes read, None for absent, or what it raised); True for a hit.

        A hit on a chunk stored lossy (:class:`LossyRead`) is counted in ``lossy_reads`` too.

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
            return isinstance(outcome, (int, LossyRead))
        if isinstance(outcome, BaseException):  # I/O errors, a server gone: a miss, counted
            self.health.error(attempt, f"read of {key[:16]}", outcome)  # the tier's fault, not the object's
            return False
        if outcome is None:
            self.stats.misses += 1
            return False
        self.stats.hits += 1
        if isinstance(outcome, LossyRead):
            self.stats.lossy_reads += 1
            outcome = outcome.size
        self.stats.bytes_read += outcome
        return True

    # -- layer by layer ------------------------------------------------------------------------------

    async def open_layers_many(
        self, keys: Sequence[ChunkKey], attempt: Attempt = UNGUARDED
    ) -> list[LayerReader | None]:
        """The chunks opened for reads layer by layer (each header read and checked once); None where missed.

        None on a miss of any kind (absent, corrupt, foreign, an I/O error), counted as usual.
        Files are opened in one thread call and stay open in their readers; remote headers
        are read concurrently.
        """
        opens = self._reads
        reads = [ObjectRead(key, partial(opens.open_file, key), partial(opens.open_remote, key)) for key in keys]
        outcomes = await self.backend.open_many(reads, self.executor)
        self.backend.used_in_order([key for key, outcome in zip(keys, outcomes, strict=True) if _found(outcome)])
        readers: list[LayerReader | None] = [
            None if isinstance(outcome, BaseException) or outcome is None else LayerReader(self, key, *outcome)
            for key, outcome in zip(keys, outcomes, strict=True)
        ]
        try:  # the misses are counted (a corrupt one removed: an await) with every file already owned
            for key, outcome, reader in zip(keys, outcomes, readers, strict=True):
                if reader is None:
                    await self.account(key, outcome if isinstance(outcome, BaseException) else None, True, attempt)
                else:
                    self.stats.hits += 1  # one per chunk opened; its layers add to bytes_read
                    self.stats.lossy_reads += not reader.header.codec.lossless
        except BaseException:  # cancelled meanwhile: nobody will close these readers but us
            for opened in readers:
                if opened is not None:
                    opened.close()
            raise
        return readers

    # -- the rest ------------------------------------------------------------------------------------

    async def _discard_corrupt(self, key: ChunkKey, exc: ChunkFormatError) -> None:
        self.stats.corrupt += 1
        log.warning("%s tier: chunk %s is unusable (%s); removing it", self.name, key[:16], exc)
        self.events.removed(self.medium, [key])
        try:
            await self.backend.delete(key)
        except Exception as delete_error:  # not a breaker failure: read-only credentials may refuse it forever
            self.health.error(UNGUARDED, f"removal of corrupt {key[:16]}", delete_error, tier_fault=False)

    async def prefix_count(self, keys: list[ChunkKey], attempt: Attempt = UNGUARDED) -> int:
        """How many leading ``keys`` the backend holds (a failure counts as an error and answers 0)."""
        try:
            return await self.backend.prefix_count(keys)
        except Exception as exc:
            self.health.error(attempt, "lookup", exc)  # the tier's fault, not the object's: its breaker counts it
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


def _found(outcome: object) -> bool:
    """Whether a batch read's outcome is an object that was there (read, or opened), however it checks out."""
    return outcome is not None and not isinstance(outcome, BaseException)


def _split(items: list[T], groups: int) -> list[list[T]]:
    """At most ``groups`` contiguous, near-equal, non-empty slices of ``items``."""
    groups = max(1, min(groups, len(items)))
    size, extra = divmod(len(items), groups)
    bounds = [i * size + min(i, extra) for i in range(groups + 1)]
    return [items[bounds[i] : bounds[i + 1]] for i in range(groups)]


__all__ = ["ChunkTier", "LayerReader"]
