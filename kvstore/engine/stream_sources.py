"""Where each chunk of a layer stream comes from, and the DRAM slots the stream holds while it runs.

:class:`StreamSources` is what a store hands every :class:`~kvstore.engine.prefetch.LayerStream` it
opens (its pool, its tiers, its executor, the promotion and admission hooks), and nothing more of
the store. :class:`StreamChunks` is one stream's per-chunk state, from open to release:

- **open**: each chunk is a DRAM slot (referenced: copied from while the stream runs), else a
  reader from the fastest tier that has it (each tier opens its batch at once; an open circuit
  breaker skips the tier). A chunk in no tier fails the stream with :class:`PrefetchError`.
- **staging**: a chunk read from a tier gets a DRAM slot where its layers are assembled, the
  contiguous staging every read needs anyway, which the store publishes once the chunk has arrived
  whole (a promotion). Across all streams of a store these slots are at most half the pool
  (:class:`StagingShare`: the engine's puts keep the rest); a chunk with none is read as without
  promotion, and its promotion is dropped and counted. A chunk read from a local tier straight
  into the caller's contiguous CPU outputs (``direct``) takes no slot: it is admitted to DRAM after
  the stream instead.
- **promote**: once every layer has arrived verified, each chunk read from a tier is handed to the
  store (``StreamSources.promote`` or ``admit``); nothing of a stream that failed or closed early is.
- **release**: readers are closed at once; the slots (DRAM and staging) are released once the last
  copy out of them (to a device) has completed, not only when the stream ends.

Everything here runs on the store's loop (no lock); nothing blocks but the batched tier opens, which
are awaited.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, field

from kvstore.codecs import CodecPipeline
from kvstore.engine.dram import SlabPool
from kvstore.engine.transfer import Completion, DeviceTransfers
from kvstore.errors import PrefetchError, TierTimeout
from kvstore.keys import ChunkKey
from kvstore.layout import KVLayout
from kvstore.storage.layer_reader import LayerReader, ReaderTier
from kvstore.storage.tier import ChunkTier


class StagingShare:
    """The DRAM slots a store's layer streams hold for promotion: at most half the pool.

    Uncapped, a forward pass streaming as many chunks from a tier as the pool has slots would
    hold them all until its streams end, and every put meanwhile would be rejected. A slot is
    taken as ``get_many`` takes one: a free slot first, else the least recently used chunk is
    evicted (a warm pool is always full; staging only in free slots would never promote there).
    A stream closed early has evicted those chunks for nothing: the price of promoting at all.
    Touched only by stream producers, on the store's loop: no lock. Never blocks.
    """

    def __init__(self) -> None:
        self.held = 0  # staging slots the store's streams hold now

    def take(self, pool: SlabPool) -> int | None:
        """A slot for staging (referenced), or None: the share is used up or every slot is referenced."""
        if self.held >= pool.num_slots // 2:
            return None
        slot = pool.reserve()
        if slot is not None:
            self.held += 1
        return slot

    def give_back(self, pool: SlabPool, slot: int) -> None:
        """Release a slot ``take`` gave (published meanwhile or not)."""
        pool.release(slot)
        self.held -= 1


@dataclass(frozen=True)
class StreamSources:
    """What a layer stream needs from the store that opens it, and nothing more of it.

    The store builds one and hands it to every stream it opens; a stream never reaches into the
    store itself. ``opened`` is told, per stream, which chunks DRAM held (their slots, else None):
    the store counts them and treats a DRAM hit as a chunk's second sighting.
    """

    layout: KVLayout
    pool: SlabPool  # chunks in DRAM are copied from their slots (referenced while the stream runs)
    tiers: Sequence[ChunkTier]  # the others are opened from the fastest tier that has them
    executor: Executor  # for blocking file reads
    read_timeout: float  # seconds a remote tier may take per request (timeouts.get)
    opened: Callable[[Sequence[ChunkKey], Sequence[int | None]], None]
    close_timeout: float = 10.0  # seconds close() waits for the producer to stop (timeouts.close)
    # A chunk read whole and verified from ``tier`` into ``slot`` (None: it had no staging slot,
    # see StagingShare): the store publishes it and queues it for the faster tiers, or counts the
    # drop. Called on the loop, never awaited; the stream keeps its own reference to the slot and
    # releases it.
    promote: Callable[[ChunkKey, ReaderTier, int | None, CodecPipeline | None], None] | None = None
    # A chunk read whole and verified from a local ``tier`` straight into the consumer's memory (no
    # staging slot): the store admits it to DRAM in the background. Called on the loop, never awaited.
    admit: Callable[[ChunkKey, ReaderTier], None] | None = None
    staging: StagingShare = field(default_factory=StagingShare)  # shared by every stream of the store
    transfers: DeviceTransfers = field(default_factory=DeviceTransfers)  # copies into device outputs
    read_threads: int = 1  # a layer's file reads are spread over this many of the executor's threads


class StreamChunks:
    """One stream's chunks: per chunk its DRAM slot or tier reader, its staging slot, and whether it is read direct.

    The lists are indexed by chunk (the order of ``keys``) and filled by :meth:`open` and
    :meth:`reserve_staging`; :meth:`release` empties them. A chunk has a slot or a reader, never both.
    """

    def __init__(self, sources: StreamSources, keys: Sequence[ChunkKey]) -> None:
        self.sources, self.keys = sources, list(keys)
        self.slots: list[int | None] = []  # per chunk: its DRAM slot (referenced), or None
        self.readers: list[LayerReader | None] = []  # per chunk not in DRAM: the reader of the tier that has it
        self.staging: list[int | None] = []  # per chunk read from a tier: its DRAM slot for promotion
        self.direct: list[bool] = []  # per chunk: read from a local tier straight into CPU outputs (then admitted)

    def all_local(self) -> bool:
        """Every chunk from DRAM or a local tier (no remote reader)."""
        return all(reader is None or reader.is_local for reader in self.readers)

    def index_of(self, reader: LayerReader) -> int:
        """The chunk ``reader`` reads."""
        return next(index for index, held in enumerate(self.readers) if held is reader)

    async def open(self) -> None:
        """Per chunk: a DRAM slot (referenced), else the fastest tier's reader (each tier opens its batch at once)."""
        sources = self.sources
        self.slots = sources.pool.acquire_many(self.keys)  # hits told to the eviction policy tail first
        sources.opened(self.keys, self.slots)
        self.readers = [None] * len(self.keys)
        missing = [index for index, slot in enumerate(self.slots) if slot is None]
        for tier in sources.tiers:
            if not missing:
                return
            # Files are opened in one thread call that is not cancelled midway (that would leak their
            # descriptors); a remote tier's header reads are bounded by its timeout.
            timeout = None if tier.is_local else sources.read_timeout
            try:  # an open breaker skips the tier at once (TierSkipped, a TierTimeout)
                opened = await tier.open_layers([self.keys[i] for i in missing], timeout)
            except TierTimeout:
                continue
            for index, reader in zip(missing, opened, strict=True):
                self.readers[index] = reader
            missing = [index for index in missing if self.readers[index] is None]
        if missing:
            raise PrefetchError(f"chunk {missing[0]} ({self.keys[missing[0]][:16]}...) is in no tier", chunk=missing[0])

    def reserve_staging(self, direct: bool) -> None:
        """A DRAM slot per chunk read from a tier, where its layers are assembled for promotion.

        None past the store's staging share or with every slot referenced (see StagingShare): that chunk
        is read through a temporary (into device outputs: pageable, so its copy to the device is
        synchronous) and its promotion dropped (counted when promoted). None too for chunks read in
        place into CPU outputs (``direct``: the stream's outputs are contiguous CPU tensors, and the chunk
        is on a local tier): those are admitted to DRAM after the stream instead.
        """
        sources = self.sources
        self.staging = [None] * len(self.keys)
        self.direct = [direct and reader is not None and reader.is_local for reader in self.readers]
        if sources.promote is None:
            return
        for index, reader in enumerate(self.readers):
            if reader is not None and not self.direct[index]:
                self.staging[index] = slot = sources.staging.take(sources.pool)
                if slot is None:
                    return  # the share is used up or no slot is free: the rest is dropped too

    def promote(self) -> None:
        """Every layer arrived: hand each chunk read from a tier to the store (its slot, or None: dropped)."""
        promote, admit = self.sources.promote, self.sources.admit
        if promote is None:
            return
        for key, reader, slot, direct in zip(self.keys, self.readers, self.staging, self.direct, strict=True):
            if reader is None:
                continue
            if direct and admit is not None:
                admit(key, reader.tier)
            else:  # a chunk stored lossy is written on in its codec (kvstore.storage.chunk_reads.LossyRead)
                promote(key, reader.tier, slot, None if reader.header.codec.lossless else reader.header.codec)

    def release(self, last_copy: Completion) -> None:
        """Close the readers now; release the slots once ``last_copy`` (the last copy out of them) has completed."""
        for reader in self.readers:
            if reader is not None:
                reader.close()
        slots, staging = self.slots, self.staging
        self.slots, self.readers, self.staging = [], [], []
        sources = self.sources

        def release() -> None:
            for slot in slots:
                if slot is not None:
                    sources.pool.release(slot)
            for slot in staging:
                if slot is not None:
                    sources.staging.give_back(sources.pool, slot)

        sources.transfers.after(last_copy, release, asyncio.get_running_loop())
