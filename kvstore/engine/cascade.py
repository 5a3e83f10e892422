"""The write cascade: each secondary tier's bounded queue of chunks to write, and the workers that drain it.

A put (or a promotion) hands a DRAM slot to the queue of every tier it goes to and returns: the
engine never waits for a tier's write. Each queue holds one reference to the slot per queued
write, released when that write has really ended (:func:`kvstore.engine.loads.releaser`), so the
slot's bytes stay valid under a write that outlives its timeout.

Contract:

- :meth:`WriteCascade.enqueue` never blocks: a full queue drops that tier's write, counted in the
  tier's ``drops`` (so does every write still queued when the store closes);
- a worker writes what its queue holds in batches of up to :data:`WRITE_BATCH` when writes pile
  up, each batch bounded by ``timeouts.put`` per chunk, through the tier's guarded
  :meth:`~kvstore.storage.tier.ChunkTier.write` (which counts failures and timeouts);
- a chunk read lossy is written in the codec it came in (``lossy``, see
  :class:`kvstore.storage.chunk_reads.LossyRead`);
- all of it runs on the store's event loop (not thread-safe).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from kvstore.codecs import CodecPipeline
from kvstore.engine.dram import SlabPool
from kvstore.engine.loads import releaser
from kvstore.errors import TierTimeout
from kvstore.keys import ChunkKey
from kvstore.storage.tier import ChunkTier

WRITE_BATCH = 8  # chunks a worker writes in one go when its queue has backed up
QueuedWrite = tuple[ChunkKey, int, CodecPipeline | None]  # a chunk, its DRAM slot, the lossy codec it came in


class WriteCascade:
    """The queues and workers writing DRAM slots to the secondary tiers (see the module docstring)."""

    def __init__(
        self, pool: SlabPool, tiers: Sequence[ChunkTier], queue_depth: int, workers: int, put_timeout: float
    ) -> None:
        self.pool, self.tiers = pool, tiers
        self.queue_depth, self.workers, self.put_timeout = queue_depth, workers, put_timeout
        self._queues: dict[ChunkTier, asyncio.Queue[QueuedWrite]] = {}
        self._tasks: list[asyncio.Task[None]] = []

    def start(self) -> None:
        """Make each tier's queue and start its workers (the store's ``open``)."""
        for tier in self.tiers:
            queue: asyncio.Queue[QueuedWrite] = asyncio.Queue(self.queue_depth)
            self._queues[tier] = queue
            for n in range(self.workers):
                self._tasks.append(asyncio.create_task(self._work(tier, queue), name=f"kvstore-{tier.name}-{n}"))

    def enqueue(self, tiers: Sequence[ChunkTier], key: ChunkKey, slot: int, lossy: CodecPipeline | None = None) -> None:
        """Queue ``slot`` (holding ``key``) for each of ``tiers``, one slot reference per queued write. Never blocks."""
        for tier in tiers:
            queue = self._queues[tier]
            if queue.full():
                tier.drop()
                continue
            self.pool.retain(slot)
            queue.put_nowait((key, slot, lossy))

    def queued(self, tier: ChunkTier) -> int | None:
        """Writes waiting in ``tier``'s queue; None before the cascade started (no queue yet)."""
        queue = self._queues.get(tier)
        return None if queue is None else queue.qsize()

    async def join(self) -> None:
        """Wait until every queued write has ended (written, failed or timed out)."""
        await asyncio.gather(*(queue.join() for queue in self._queues.values()))

    async def stop(self) -> None:
        """Stop the workers; every write still queued is dropped (counted) and its slot reference released."""
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for tier, queue in self._queues.items():
            while not queue.empty():
                _, slot, _ = queue.get_nowait()
                tier.drop()
                self.pool.release(slot)

    async def _work(self, tier: ChunkTier, queue: asyncio.Queue[QueuedWrite]) -> None:
        """Write what the queue holds, in batches of up to WRITE_BATCH when writes pile up."""
        while True:
            batch = [await queue.get()]
            while len(batch) < WRITE_BATCH and not queue.empty():
                batch.append(queue.get_nowait())
            try:
                await tier.write(  # each failure counted and logged by the tier
                    [(key, self.pool.buffer(slot)) for key, slot, _ in batch],
                    self.put_timeout * len(batch),
                    releaser(self.pool, [slot for _, slot, _ in batch]),
                    [lossy for _, _, lossy in batch],
                )
            except TierTimeout:
                pass  # counted; the slots are released when the write really ends
            finally:
                for _ in batch:
                    queue.task_done()
