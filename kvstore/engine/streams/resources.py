"""What a layer stream draws on from the store that opens it, and what it tells the store back.

The store builds one :class:`StreamResources` and hands it to every stream it opens: its layout, DRAM
pool, tiers, executor, bounds and device copies, the share of the pool streams may hold for staging
(:class:`StagingShare`), and :class:`StreamHooks`, the store's side of a stream (what it counts, promotes
and admits). A stream never reaches into the store otherwise. Nothing here blocks or does I/O.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, field

from kvstore.codecs import CodecPipeline
from kvstore.engine.dram import SlabPool
from kvstore.engine.transfer import DeviceTransfers
from kvstore.keys import ChunkKey
from kvstore.layout import KVLayout
from kvstore.storage.layer_reader import ReaderTier
from kvstore.storage.tier import ChunkTier


@dataclass(frozen=True)
class StreamHooks:
    """The store's side of its layer streams: three calls, each made on the store's loop, never awaited.

    None of them may block; none is given anything to keep but keys, slot numbers and tiers.
    """

    # A stream opened ``keys`` and found their DRAM slots (None: not in DRAM). The store counts them,
    # and a DRAM hit is a chunk's second sighting.
    opened: Callable[[Sequence[ChunkKey], Sequence[int | None]], None]
    # A chunk read whole and verified from ``tier`` into ``slot`` (None: it had no staging slot, see
    # StagingShare), stored in ``codec`` if lossy (written on in it) else None: the store publishes it
    # and queues it for the faster tiers, or counts the drop. The stream keeps its own reference to
    # the slot and releases it.
    promote: Callable[[ChunkKey, ReaderTier, int | None, CodecPipeline | None], None]
    # A chunk read whole and verified from a local ``tier`` straight into the consumer's memory (no
    # staging slot): the store admits it to DRAM in the background.
    admit: Callable[[ChunkKey, ReaderTier], None]


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
class StreamResources:
    """What a layer stream needs from the store that opens it, and nothing more of it."""

    layout: KVLayout
    pool: SlabPool  # chunks in DRAM are copied from their slots (referenced while the stream runs)
    tiers: Sequence[ChunkTier]  # the others are opened from the fastest tier that has them
    executor: Executor  # for blocking file reads
    hooks: StreamHooks  # what the stream tells the store
    read_timeout: float  # seconds a remote tier may take per request (timeouts.get)
    close_timeout: float = 10.0  # seconds close() waits for the producer to stop (timeouts.close)
    staging: StagingShare = field(default_factory=StagingShare)  # shared by every stream of the store
    transfers: DeviceTransfers = field(default_factory=DeviceTransfers)  # copies into device outputs
    read_threads: int = 1  # a layer's file reads are spread over this many of the executor's threads
