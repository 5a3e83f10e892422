"""Reads from the secondary tiers for ``lookup`` and ``get_many``: one deadline per call, bounded DRAM use.

An engine asks for a prefix of chunks and must get an answer within ``timeouts.get``, however
many chunks the prefix has and however many tiers the call visits: a frozen archive under a
32-chunk prefix must cost one timeout, not 32. So each call gets one :class:`Deadline`, and
every tier operation it starts waits only for what is left of it. A tier with others below it
may take at most half of the call's time: a frozen Redis above S3 then leaves S3 the other half
to serve the chunk, instead of spending the whole call on the frozen tier.

Loading needs DRAM slots to read into (the read's memory must stay valid until the read really
ends, even past a timeout, see :mod:`kvstore.storage.health`). A call does not need a slot
per chunk: it stages through the slots it can reserve, hands each chunk found to its caller
(who copies it out), and goes again with the rest, while its deadline lasts. A pool of 4 slots
loads a 6-chunk prefix in two rounds.

A caller that brings its own buffers (``get_many(keys, outs)``) has a local tier (disk) read
straight into them: no slot, no second copy, and no limit from the slots free. Each write into
a caller's buffer is fenced (:class:`~kvstore.util.threads.WriteFence`): at the deadline the
buffers are closed to the reading threads, so no write lands in them after the call returns.
Closing waits for a write already in progress (one ~1 MiB read or one decoded layer): a disk
frozen inside that very read system call holds the call past its deadline until the system call
returns, the price of never letting a late write into memory the caller has taken back.
The chunks found are then admitted to DRAM (and queued for the faster tiers) off the caller's
path: a background read of the same file, now in the page cache, into a fresh slot. Copying
from the caller's buffers instead would trust memory the caller may already be changing.
Admissions are extras: a few at a time (each holds a slot while it reads), only while the pool
keeps a quarter of its slots free or evictable for the engine's own puts and loads, not counted
again in the tier's hits, bytes or latency, and never blamed on its breaker.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence

from kvstore.codecs import CodecPipeline
from kvstore.engine.dram import SlabPool
from kvstore.errors import TierTimeout
from kvstore.keys import ChunkKey
from kvstore.storage.tier import ChunkTier
from kvstore.util.threads import WriteFence, close_fences

log = logging.getLogger("kvstore")
# (index of the key in the call, its slot: valid during the call only; None: read into the caller's buffer)
Deliver = Callable[[int, int | None], None]
Enqueue = Callable[[Sequence[ChunkTier], ChunkKey, int, CodecPipeline | None], None]


class Deadline:
    """The moment a call must have its answer by (on the running loop's clock)."""

    def __init__(self, seconds: float) -> None:
        self._loop = asyncio.get_running_loop()
        self.seconds = seconds
        self._end = self._loop.time() + seconds

    def allowance(self, last: bool) -> float:
        """Seconds one tier may take now: all that is left for the ``last`` tier, at most half the call's
        time for a tier above others, so a frozen tier leaves the tiers below it the other half."""
        remaining = self.remaining()
        return remaining if last else min(remaining, self.seconds / 2)

    def fair(self, allowance: float) -> bool:
        """Whether a tier given ``allowance`` had its fair share of the call's time (about half or more).

        A tier that times out with less was cut short by the tiers before it: its circuit breaker
        must not count that as the tier's failure.
        """
        return allowance >= 0.45 * self.seconds

    def remaining(self) -> float:
        """Seconds left (0 once passed)."""
        return max(0.0, self._end - self._loop.time())


def releaser(pool: SlabPool, slots: list[int]) -> Callable[[], None]:
    """A callback that drops one reference to each of ``slots`` (when an operation ends)."""

    def release() -> None:
        for slot in slots:
            pool.release(slot)

    return release


class TierLoader:
    """The store's reads from its secondary tiers (the loop's only, like the store).

    ``enqueue`` hands a promoted chunk's slot to the faster tiers that lacked it (the store's
    write queues).
    """

    def __init__(self, pool: SlabPool, tiers: Sequence[ChunkTier], enqueue: Enqueue) -> None:
        self.pool, self.tiers, self._enqueue = pool, tiers, enqueue
        self._loading: dict[ChunkKey, asyncio.Future[None]] = {}
        self._admissions: set[asyncio.Task[None]] = set()  # background reads into DRAM after direct loads
        # at most this many admissions hold a slot (reading) at once; the others wait without one
        self._admitting = asyncio.Semaphore(max((t.parallel_reads for t in tiers if t.is_local), default=2))
        self._closing = False  # set by cancel_admissions: no admission starts after it
        self.admitted = 0  # chunks read into callers' buffers, then admitted to DRAM
        self.admissions_dropped = 0  # ... not admitted: no slot free, or the admission read failed

    async def held_prefix(self, keys: Sequence[ChunkKey], in_dram: Sequence[bool], deadline: Deadline) -> int:
        """How many leading ``keys`` are in DRAM or in some tier (see :meth:`held_tiers`)."""
        return len(await self.held_tiers(keys, in_dram, deadline))

    async def held_tiers(
        self, keys: Sequence[ChunkKey], in_dram: Sequence[bool], deadline: Deadline
    ) -> list[ChunkTier | None]:
        """Per leading key in DRAM or in some tier: the fastest tier found to hold it (None: DRAM).

        Each tier is asked once, in one query covering every key not in DRAM (all the gaps at
        once), about the keys no faster tier was found to hold; all within ``deadline``. A tier
        that fails or times out holds nothing for this call.
        """
        gaps = [i for i, here in enumerate(in_dram) if not here]
        holders: dict[int, ChunkTier] = {}  # gap index -> the tier that holds it
        found = 0  # leading gaps some tier holds
        for position, tier in enumerate(self.tiers):
            allowance = deadline.allowance(last=position + 1 == len(self.tiers))
            if found == len(gaps) or allowance <= 0:
                break
            asked = [keys[i] for i in gaps[found:]]
            try:
                count = await tier.lookup(asked, allowance, blame=deadline.fair(allowance))
            except TierTimeout:
                continue
            holders.update(dict.fromkeys(gaps[found : found + count], tier))
            found += count
        held = gaps[found] if found < len(gaps) else len(keys)
        return [holders.get(i) for i in range(held)]

    async def load(
        self, keys: Sequence[ChunkKey], deliver: Deliver, deadline: Deadline, outs: Sequence[memoryview] | None = None
    ) -> None:
        """``deliver(i, slot)`` for each of ``keys`` some tier has, read within ``deadline``; the rest are misses.

        A key another call is already loading is waited for (within the deadline), not read twice.
        ``deliver`` runs while the slot is referenced; the slot is released after it returns.
        With ``outs`` (the caller's buffers, one per key), local tiers read straight into
        ``outs[i]`` and ``deliver(i, None)`` says so; the chunk is admitted to DRAM afterwards, off
        this call (see the module docstring). Such a call reads for itself, never waiting for
        another call's load of the same key (that one fills its own buffers). A miss may leave
        ``outs[i]`` partly written; nothing writes into ``outs`` once this returns.
        """
        if outs is not None and any(tier.is_local for tier in self.tiers):
            # Not deduplicated against other calls: each has its own buffers to fill.
            await self._load_own(list(keys), deliver, deadline, outs)
            return
        waiting: dict[int, asyncio.Future[None]] = {}
        own: list[int] = []
        for i, key in enumerate(keys):
            if key in self._loading:
                waiting[i] = self._loading[key]
            else:
                self._loading[key] = asyncio.get_running_loop().create_future()
                own.append(i)
        try:
            await self._load_own([keys[i] for i in own], lambda j, slot: deliver(own[j], slot), deadline)
        finally:
            for i in own:
                self._loading.pop(keys[i]).set_result(None)
        for i, loading in waiting.items():
            if not loading.done():
                await asyncio.wait({loading}, timeout=deadline.remaining())  # never cancels the other call's
            if loading.done():
                self._deliver_cached(i, keys[i], deliver)

    async def _load_own(
        self, keys: list[ChunkKey], deliver: Deliver, deadline: Deadline, outs: Sequence[memoryview] | None = None
    ) -> None:
        """Rounds of the cascade (each tier reads, as one batch, what no faster tier had) over the free slots.

        With ``outs``, a local tier reads its whole group straight into them (no slot needed).
        """
        next_tier = dict.fromkeys(range(len(keys)), 0)  # per key still sought: the tier to ask next
        while next_tier:
            progressed = False
            for position, tier in enumerate(self.tiers):
                group = [i for i, at in next_tier.items() if at == position]
                allowance = deadline.allowance(last=position + 1 == len(self.tiers))
                if allowance <= 0:
                    return  # what is left is a miss: the call's time is up
                if outs is not None and tier.is_local and group:
                    progressed = True
                    found = await self._read_direct(tier, keys, group, outs, allowance, deadline.fair(allowance))
                    for i, ok in zip(group, found, strict=True):
                        if ok:
                            del next_tier[i]
                            deliver(i, None)
                            self.admit(position, keys[i], deadline.seconds)
                        elif position + 1 < len(self.tiers):
                            next_tier[i] = position + 1
                        else:
                            del next_tier[i]  # in no tier
                    continue
                reserved = self._reserve(group)
                if not reserved:
                    continue  # no slot now; a later round may find one freed
                progressed = True
                outcomes = await self._read(tier, keys, reserved, allowance, deadline.fair(allowance))
                for n, (i, ok, lossy) in enumerate(outcomes):
                    try:
                        taken = ok and self._take(position, keys[i], reserved[i], deliver, i, lossy)
                    except BaseException:  # a delivery that raised (a copy to the caller's buffer): free the rest
                        for later, _, _ in outcomes[n + 1 :]:
                            self.pool.release(reserved[later])
                        raise
                    if taken:
                        del next_tier[i]
                        continue
                    if not ok:
                        self.pool.release(reserved[i])  # (the read's own reference goes when it ends)
                    if position + 1 < len(self.tiers):
                        next_tier[i] = position + 1
                    else:
                        del next_tier[i]  # in no tier
            if not progressed:
                log.debug("%d chunks not loaded: every DRAM slot is in use", len(next_tier))
                return

    async def _read_direct(
        self,
        tier: ChunkTier,
        keys: list[ChunkKey],
        group: list[int],
        outs: Sequence[memoryview],
        timeout: float,
        blame: bool,
    ) -> list[bool]:
        """One batch read of local ``tier`` straight into the caller's ``outs``; per key of ``group``, whether read.

        Whatever happens (a timeout, a cancellation), the buffers are closed to the reading
        threads before this returns: a thread still reading after the deadline writes no more.
        A cancelled caller cancels the read too (``cancel_with_caller``), so nothing it read is
        checked or counted after the caller has its buffers back.
        """
        fences = [WriteFence() for _ in group]
        try:
            return await tier.read(
                [keys[i] for i in group],
                [outs[i] for i in group],
                timeout,
                fences=fences,
                blame=blame,
                cancel_with_caller=True,
            )
        except TierTimeout:
            return [False] * len(group)
        finally:
            await close_fences(fences)  # uncontended once the read has ended: no wait

    def admit(self, position: int, key: ChunkKey, timeout: float) -> None:
        """Admit a chunk just read into a caller's buffer to DRAM, in the background (see the module docstring).

        At most as many admissions wait as the pool has slots; beyond that one is dropped
        (counted). Each takes its slot when it starts reading, a few at a time (``_admitting``),
        none while that would leave the pool under its reserve: none is held when the caller
        resumes. None starts once the store is closing. Non-blocking.
        """
        if self._closing:
            return
        if len(self._admissions) >= self.pool.max_slots:
            self.admissions_dropped += 1
            return
        task = asyncio.create_task(self._admission(position, key, timeout))
        self._admissions.add(task)
        task.add_done_callback(self._admissions.discard)

    async def _admission(self, position: int, key: ChunkKey, timeout: float) -> None:
        """Read ``key`` from tier ``position`` into a fresh slot, then publish it and queue it for the faster tiers.

        Dropped (counted) when fewer than a quarter of the pool's slots would stay free or
        evictable: the engine's next put or load must find a slot, not a pool held by admissions.
        """
        async with self._admitting:
            if self.pool.contains(key):
                return  # a put, or another call, brought it meanwhile
            if not self.pool.has_spare(self.pool.num_slots // 4):
                self.admissions_dropped += 1
                return
            slot = self.pool.reserve()
            if slot is None:
                self.admissions_dropped += 1
                return
            self.pool.retain(slot)  # the read's own reference: released only when the read ends
            try:
                outcomes = await self._read(self.tiers[position], [key], {0: slot}, timeout, blame=False, counted=False)
            except BaseException:  # (_read released the slot)
                self.admissions_dropped += 1
                raise
        _, read, lossy = outcomes[0]
        if not read:
            self.admissions_dropped += 1
            self.pool.release(slot)
            return
        try:
            if self.promote(position, key, slot, lossy):
                self.admitted += 1
        finally:
            self.pool.release(slot)

    async def settle(self) -> None:
        """Wait for the DRAM admissions under way (each bounded by its read's timeout)."""
        while self._admissions:
            await asyncio.gather(*list(self._admissions), return_exceptions=True)

    def cancel_admissions(self) -> None:
        """Stop the admissions under way (the store is closing); their slots are released as they end.

        One not started yet never takes a slot, and none is started from now on.
        """
        self._closing = True
        for task in list(self._admissions):
            task.cancel()

    def _reserve(self, group: list[int]) -> dict[int, int]:
        """A slot for as many of ``group`` as can have one, each with a second reference for the read itself."""
        reserved: dict[int, int] = {}
        for i in group:
            slot = self.pool.reserve()
            if slot is None:
                break
            self.pool.retain(slot)  # the read's own reference: released only when the read ends
            reserved[i] = slot
        return reserved

    async def _read(
        self,
        tier: ChunkTier,
        keys: list[ChunkKey],
        reserved: dict[int, int],
        timeout: float,
        blame: bool,
        counted: bool = True,
    ) -> list[tuple[int, bool, CodecPipeline | None]]:
        """One batch read of ``tier`` into the reserved slots; per key, whether it was read (a timeout: none)
        and the codec it was stored in if that is lossy (its promotion writes it on in that codec).

        ``blame``: a timeout counts against the tier's circuit breaker (it had a fair share of the call's time).
        ``counted=False``: a re-read of chunks already counted (an admission): not in the tier's
        hits, bytes or read latency (see :meth:`ChunkTier.account`).
        """
        order = list(reserved)
        lossy: list[CodecPipeline | None] = [None] * len(order)
        try:
            found = await tier.read(
                [keys[i] for i in order],
                [self.pool.buffer(reserved[i]) for i in order],
                timeout,
                counted=counted,
                on_end=releaser(self.pool, [reserved[i] for i in order]),
                blame=blame,
                lossy=lossy,
            )
        except TierTimeout:
            found = [False] * len(order)
        except BaseException:
            for slot in reserved.values():
                self.pool.release(slot)
            raise
        return list(zip(order, found, lossy, strict=True))

    def promote(self, position: int, key: ChunkKey, slot: int, lossy: CodecPipeline | None = None) -> bool:
        """Publish a chunk read whole and verified from tier ``position`` into ``slot``, and queue it
        for the faster tiers; False if DRAM already held the key (nothing queued). Non-blocking; the
        caller keeps (and later releases) its reference to the slot. ``lossy``: the lossy codec the
        chunk was stored in, which the faster tiers write it in too (its values are that codec's)."""
        if not self.pool.publish(slot, key):
            return False
        self._enqueue(self.tiers[:position], key, slot, lossy)
        return True

    def _take(
        self, position: int, key: ChunkKey, slot: int, deliver: Deliver, i: int, lossy: CodecPipeline | None
    ) -> bool:
        """A chunk read into ``slot``: published (and queued for the faster tiers), delivered; the slot released.

        False only if the read's slot was not published and no copy of the key is in DRAM either.
        """
        if self.promote(position, key, slot, lossy):
            try:
                deliver(i, slot)
            finally:
                self.pool.release(slot)
            return True
        self.pool.release(slot)  # a put of the same key landed meanwhile: serve that one
        return self._deliver_cached(i, key, deliver)

    def _deliver_cached(self, i: int, key: ChunkKey, deliver: Deliver) -> bool:
        """Deliver the key's DRAM copy if there is one."""
        slot = self.pool.acquire(key)
        if slot is None:
            return False
        try:
            deliver(i, slot)
        finally:
            self.pool.release(slot)
        return True
