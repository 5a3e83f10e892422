"""KVStore: the DRAM primary tier and the secondary tiers below it, orchestrated on one event loop.

- ``put`` copies the chunk into a DRAM slot and returns; each secondary tier gets the write
  through its own bounded queue (a full queue drops that tier's write and counts it). A chunk on
  a device is copied into its slot asynchronously on the store's download stream
  (:mod:`kvstore.engine.transfer`); it is published and cascaded once that copy has completed.
- ``get`` serves DRAM, else reads the first tier that has the chunk straight into a fresh
  slot (promotion) and queues it for the faster tiers it skipped. Given CPU output tensors,
  the disk tier reads straight into them instead, and the promotion follows the call.
- Every tier operation runs under its configured timeout; ``lookup`` and ``get_many`` wait at
  most one ``timeouts.get`` per call, whatever the number of chunks (engine/loads.py). A slot
  handed to an operation stays referenced until that operation has really finished, even past a
  timeout, so its memory is never reused under a thread that is still reading or writing it.

About 700 lines on purpose: put (from CPU and device memory, through the admission policy),
lookup, get and the streams' promotions share the slot reference rules above and the store's
counters, and read best side by side; what stands alone lives beside this module (the write
cascade: engine/cascade.py; reads from the tiers: engine/loads.py; layer streams:
engine/streams/; which tier a put reaches: kvstore.admission; the tiers themselves, built by
kvstore.storage.build_tiers; each tier's guarded operations: storage/health.py; measured costs,
the DRAM pool, metrics). Engine integrations (connectors) use
:class:`~kvstore.engine.sync.SyncKVStore`, their whole contract, not this class.
"""

from __future__ import annotations

import asyncio
import logging
import time
import weakref
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

from kvstore.admission import HeldBack, make_admission
from kvstore.codecs import CodecPipeline
from kvstore.config import StoreConfig
from kvstore.engine import metrics
from kvstore.engine.arguments import check_keys, check_tensor, check_tensors, refuse_shared_memory
from kvstore.engine.cascade import WriteCascade
from kvstore.engine.costs import bus_bandwidth, copy_bandwidth, measured_costs
from kvstore.engine.dram import SlabPool
from kvstore.engine.loads import Deadline, TierLoader
from kvstore.engine.planner import DRAM, LoadPlan, LoadPlanner
from kvstore.engine.planner_share import SharedEstimates, state_path
from kvstore.engine.stats import StoreLatency
from kvstore.engine.streams import LayerStream, StreamHooks, StreamResources
from kvstore.engine.transfer import Completion, DeviceTransfers, ready_on_current_stream
from kvstore.errors import StoreClosedError
from kvstore.events import DRAM_MEDIUM, NO_EVENTS, ChunkEvents, NoEvents, open_publisher
from kvstore.keys import ChunkKey, chunk_keys, key_to_bytes
from kvstore.layout import KVLayout
from kvstore.sizing.adaptive import AccessTracker, AdaptiveCounters, AutoMode, make_tracker
from kvstore.sizing.advice import Advice, CostModel, Policy, advise
from kvstore.sizing.mrc import ReuseProfile
from kvstore.storage.build import build_tiers
from kvstore.storage.layer_reader import ReaderTier
from kvstore.storage.links import PrefixLinks
from kvstore.storage.tier import ChunkTier
from kvstore.util.buffers import copy_between, tensor_bytes
from kvstore.util.threads import in_thread, usable_cores
from kvstore.util.units import human_bytes

log = logging.getLogger("kvstore")
OFF_LOOP_COPY_BYTES = 1 << 20  # put copies chunks this large in a thread above a remote tier (see _copy_in)


class KVStore:
    """Tiered KV-cache store. Use as ``async with KVStore(config, layout, namespace=...) as store``."""

    def __init__(
        self,
        config: StoreConfig,
        layout: KVLayout,
        namespace: str,
        *,
        salt: bytes | str | None = None,
        tiers: Sequence[ChunkTier] | None = None,
    ) -> None:
        """The store is given its tiers below DRAM, fastest first: ``tiers`` (for tests and custom backends, each
        with its own health: its circuit breaker is the one it was built with, not ``config.breaker``), else
        the ones ``config`` enables (:func:`kvstore.storage.build_tiers`, on the store's I/O threads). Either
        way the store opens and closes them."""
        self.config = config
        self.layout = layout
        self.namespace = namespace
        self._salt = salt
        self._executor = ThreadPoolExecutor(config.io_threads, thread_name_prefix="kvstore-io")
        # put's copies into DRAM above a remote tier (_copy_in): a thread of their own, so a put never
        # waits behind (or, on a frozen disk, forever on) the I/O threads' file reads and writes.
        self._copy_executor = ThreadPoolExecutor(1, thread_name_prefix="kvstore-copy")
        # Helpers for the copies of whole chunks between DRAM and CPU tensors: one thread does not reach
        # the memory's speed (copy_between); idle ones take part of a copy, busy ones are not waited for.
        self._copy_helpers = ThreadPoolExecutor(max(1, usable_cores() - 1), thread_name_prefix="kvstore-copy-helper")
        adaptive = config.adaptive
        most = config.dram_bounds()[1] if adaptive.auto else None  # auto mode resizes the pool in segments
        # KV events for routers (kvstore.events): published from open() to close(), when enabled. The
        # engine's names are remembered for twice the chunks DRAM holds at most, at least.
        remembered = max(
            config.events.remembered_chunks, 2 * (most or int(config.dram.capacity)) // layout.chunk_nbytes
        )
        self.events: ChunkEvents | NoEvents = (
            ChunkEvents(layout.chunk_tokens, remembered) if config.events.enabled else NO_EVENTS
        )
        self.pool = SlabPool(
            layout,
            int(config.dram.capacity),
            config.dram.pin_memory,
            max_bytes=most,
            eviction=config.dram.eviction,
            events=self.events,
        )
        self.adaptive = AdaptiveCounters()
        self._tracker: AccessTracker | None = None
        self._auto: AutoMode | None = None  # made at open(), with the tracker
        # which tiers below DRAM a put is written to, and when (kvstore.admission); auto mode may switch it
        held_back: HeldBack[ChunkTier] = HeldBack(2 * self.pool.max_slots)
        self._admission = make_admission(adaptive.policy, held_back, self._seen_before)
        self.tiers = list(tiers) if tiers is not None else build_tiers(config, layout, namespace, self._executor)
        # each chunk's parent as put or read, written into every tier's copy (kvstore.storage.links)
        self.links = PrefixLinks(max(1 << 16, 2 * self.pool.max_slots))
        for tier in self.tiers:
            tier.report_to(self.events)
            tier.share_links(self.links)
        self._remote_below = any(not tier.is_local for tier in self.tiers)  # puts copy off the loop (_copy_in)
        self._counters = {  # what the engine asked: stats()["store"], the kvstore_* counters
            "puts": 0,
            "put_rejected": 0,
            "put_duplicate": 0,
            "gets": 0,
            "hits": 0,
            "misses": 0,
            "streamed": 0,  # chunks opened by layer streams (prefetch), from any tier
            "streamed_from_dram": 0,
            "stream_promoted": 0,  # chunks streams read from a tier and put in DRAM (and queued for faster tiers)
            "stream_promotions_dropped": 0,  # per chunk with no DRAM slot free, per faster tier whose queue was full
        }
        self.transfers = DeviceTransfers()  # copies to and from device tensors (copy streams, their events)
        self._device_puts: set[asyncio.Future[None]] = set()  # puts whose device-to-slot copy is in flight
        self._stream_resources = StreamResources(  # what the layer streams it opens draw on (kvstore.engine.streams)
            layout,
            self.pool,
            self.tiers,
            self._executor,
            StreamHooks(opened=self._stream_opened, promote=self._stream_promote, admit=self._stream_admit),
            read_timeout=config.timeouts.get,
            close_timeout=config.timeouts.close,
            transfers=self.transfers,
            read_threads=min(config.io_threads, usable_cores()),  # more threads than cores only add hops
        )
        self._streams: weakref.WeakSet[LayerStream] = weakref.WeakSet()  # closed with the store
        # each tier's queue of writes and its workers (kvstore.engine.cascade)
        self._cascade = WriteCascade(
            self.pool, self.tiers, config.queue_depth, config.tier_workers, config.timeouts.put
        )
        self._loader = TierLoader(self.pool, self.tiers, self._cascade.enqueue)
        self.latency = StoreLatency()  # per lookup/get call; each tier keeps its own (tier.latency)
        # DRAM's seed: the bus where the pool is pinned for a GPU, a memcpy elsewhere (measured loads then take over)
        dram_rate = (bus_bandwidth() if self.pool.pinned else None) or copy_bandwidth()
        self.planner = LoadPlanner(config.planner, layout.chunk_nbytes, layout.chunk_tokens, dram_rate)
        # what it measured, shared with the engine's other processes and the next run (engine/planner_share.py)
        state_dir = config.planner.state_dir
        self._estimates = (
            SharedEstimates(self.planner, state_path(state_dir, namespace, layout.fingerprint)) if state_dir else None
        )
        self._sharing: asyncio.Task[None] | None = None
        self.metrics_port: int | None = None  # where the Prometheus exporter listens, when metrics.enabled
        self._state = "new"

    # -- lifecycle ---------------------------------------------------------------------------

    async def open(self) -> KVStore:
        if self._state != "new":
            raise RuntimeError(f"KVStore.open() on a store that is {self._state}")
        if self.config.metrics.enabled:  # first: a port already taken stops the store before any I/O
            self.metrics_port = metrics.start_exporter(self.config.metrics.address, self.config.metrics.port)
        # Before any I/O too: a trace path that fails stops the store here.
        self._tracker = make_tracker(self.config.adaptive, self.layout, self.namespace, self.pool.capacity_bytes)
        if self.config.adaptive.auto:
            assert self._tracker is not None  # auto mode always tracks
            self._auto = AutoMode(self, self._tracker, self.config.adaptive, self.config.dram_bounds(), self.adaptive)
        try:
            if isinstance(self.events, ChunkEvents):  # a socket that cannot be opened stops the store here
                self.events.start(open_publisher(self.config.events, self.namespace))
            for tier in self.tiers:
                await tier.open()
                if not tier.codec.lossless:  # allowed by the config's allow_lossy; said once, where logs are read
                    log.info(
                        "kvstore: the %s tier stores KV with the lossy codec %r (allow_lossy)", tier.name, tier.codec.id
                    )
        except BaseException:
            if isinstance(self.events, ChunkEvents):  # its socket is freed for the next try
                await asyncio.to_thread(self.events.close)
            raise
        self._cascade.start()
        if self._estimates is not None:  # the last run's prefill rate, the other processes' reads, before any plan
            await asyncio.to_thread(self._estimates.exchange)
            self._sharing = asyncio.create_task(self._estimates.keep_sharing(self._sync_planner_if_alive()))
        self._state = "open"
        metrics.register(self)
        return self

    async def __aenter__(self) -> KVStore:
        return await self.open()

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def close(self) -> None:
        """Finish pending writes within ``timeouts.close`` seconds, then abandon the rest.

        Bounded: the layer streams still open are closed first, each within ``timeouts.close`` plus the
        writes into its outputs in progress then (see :meth:`LayerStream.close`: only a stalled disk holds one).
        """
        if self._state in ("closing", "closed"):
            return
        was_open = self._state == "open"
        self._state = "closing"
        await asyncio.gather(*(stream.close() for stream in list(self._streams)))  # each bounded by timeouts.close
        if was_open:
            try:
                async with asyncio.timeout(self.config.timeouts.close):
                    await self.flush()
            except TimeoutError:
                log.warning(
                    "close: pending writes did not finish in %.1fs; abandoning them", self.config.timeouts.close
                )
        if self._auto is not None:
            self._auto.cancel()
        if self._sharing is not None and self._estimates is not None:  # what this run measured, for the next
            self._sharing.cancel()
            self.planner.sync(self.tiers)
            await asyncio.to_thread(self._estimates.exchange)
        await self._cascade.stop()  # what is still queued is dropped, counted
        for tier in self.tiers:  # slots are released by their operations' own callbacks when threads end
            tier.cancel_operations()
        self._loader.cancel_admissions()
        await asyncio.gather(*(self._close_tier(tier) for tier in self.tiers))  # at once: one timeouts.close in all
        if self._tracker is not None:
            try:
                self._tracker.close()
            except OSError as exc:
                log.warning("close: the access trace could not be written: %r", exc)
        self._executor.shutdown(wait=False, cancel_futures=True)
        self._copy_executor.shutdown(wait=False, cancel_futures=True)
        self._copy_helpers.shutdown(wait=False, cancel_futures=True)
        self.transfers.close()
        if isinstance(self.events, ChunkEvents):  # the DRAM tier goes with the store; the others keep theirs
            self.events.removed(DRAM_MEDIUM, self.pool.keys())
            await asyncio.to_thread(self.events.close)  # bounded (EventPublisher.close), off the loop
        self._state = "closed"
        metrics.unregister(self)

    def _sync_planner_if_alive(self) -> Callable[[], bool]:
        """What the planner's sharing calls on the loop: fold in the tiers' counters, False once the store is
        gone (a weak reference: the task never keeps a store nobody closed alive)."""
        store = weakref.ref(self)

        def sync() -> bool:
            alive = store()
            if alive is not None:
                alive.planner.sync(alive.tiers)
            return alive is not None

        return sync

    async def _close_tier(self, tier: ChunkTier) -> None:
        """Close one tier within ``timeouts.close``; a failure is logged, never raised (close never fails)."""
        try:
            async with asyncio.timeout(self.config.timeouts.close):
                await tier.close()
        except Exception as exc:
            log.warning("close: %s tier did not close cleanly: %r", tier.name, exc)

    def _check_open(self) -> None:
        if self._state != "open":
            raise StoreClosedError(f"the store is {self._state}; use it inside 'async with KVStore(...)'")

    # -- keys --------------------------------------------------------------------------------

    def chunk_keys(
        self, token_ids: Sequence[int] | np.ndarray | torch.Tensor, extra: bytes | None = None
    ) -> list[ChunkKey]:
        """Keys for this store's layout, namespace and salt."""
        return chunk_keys(token_ids, self.layout, self.namespace, salt=self._salt, extra=extra)

    # -- put ---------------------------------------------------------------------------------

    async def put(
        self, key: ChunkKey, kv: torch.Tensor, *, parent: ChunkKey | None = None, ready: Completion | None = None
    ) -> bool:
        """Copy ``kv`` into DRAM and queue it for every secondary tier; returns without I/O.

        False when every DRAM slot is held by an in-flight transfer (counted as rejected). A ``kv``
        on a device is copied asynchronously, after ``ready`` (the event its producer recorded;
        default: this thread's current stream), and must not be changed until that copy is done
        (``flush`` waits for it); the chunk is found once the copy has completed.

        ``parent``: the key of the chunk before this one in its prefix (``keys[i - 1]`` of the same
        :func:`~kvstore.keys.chunk_keys` list), if the caller knows it. Each tier's copy records it,
        so that retention removes a prefix tail first (:mod:`kvstore.storage.links`); without it a
        chunk counts as the first of its own prefix there.
        """
        self._check_open()
        self._check_puts([key], [kv], [parent], lambda _: "put: kv")
        return (await self._put_checked([key], [kv], [parent], ready))[0]

    async def put_many(
        self,
        keys: Sequence[ChunkKey],
        kvs: Sequence[torch.Tensor],
        *,
        parents: Sequence[ChunkKey | None] | None = None,
        ready: Completion | None = None,
    ) -> list[bool]:
        """``put`` of several chunks; the ones on a device cross the bus as one batch of asynchronous copies.

        ``parents``: each chunk's ``parent`` (see :meth:`put`); for consecutive chunks of one prefix,
        :func:`~kvstore.keys.chain_parents` makes them. The DRAM pool's eviction policy hears of the
        batch tail first (its last chunk, the first to go, is the least recent of them).
        """
        self._check_open()
        check_keys(keys, "put_many")
        check_tensors(kvs, "put_many: kvs")
        if len(keys) != len(kvs):
            raise ValueError(f"put_many: {len(keys)} keys but {len(kvs)} chunks")
        if parents is not None and len(parents) != len(keys):
            raise ValueError(f"put_many: {len(keys)} keys but {len(parents)} parents")
        self._check_puts(keys, kvs, parents, lambda i: f"put_many: kvs[{i}]")
        return await self._put_checked(keys, kvs, parents, ready)

    def _check_puts(
        self,
        keys: Sequence[ChunkKey],
        kvs: Sequence[torch.Tensor],
        parents: Sequence[ChunkKey | None] | None,
        name: Callable[[int], str],
    ) -> None:
        """Each key, chunk (``name(i)`` in its error) and parent as ``put`` takes it; raises before any copy."""
        for i, (key, kv) in enumerate(zip(keys, kvs, strict=True)):
            key_to_bytes(key)
            self._check_chunk(kv, name(i))
        for parent in parents or ():
            if parent is not None:
                key_to_bytes(parent)

    async def _put_checked(
        self,
        keys: Sequence[ChunkKey],
        kvs: Sequence[torch.Tensor],
        parents: Sequence[ChunkKey | None] | None,
        ready: Completion | None,
    ) -> list[bool]:
        """``put_many`` once its arguments are checked."""
        if parents is not None:
            self.links.note_chain(keys, parents)
        devices = {kv.device for kv in kvs if self.transfers.crosses_bus(kv)}
        if len(devices) > 1:
            raise ValueError(f"put_many: chunks on several devices ({sorted(map(str, devices))}); one call per device")
        accepted: list[bool] = []
        downloads: list[tuple[torch.Tensor, torch.Tensor]] = []  # (slot, device chunk)
        landing: list[tuple[ChunkKey, int, Sequence[ChunkTier]]] = []  # what to publish once they are in
        published: list[ChunkKey] = []  # findable now, told to the eviction policy once the batch is in
        try:
            await self._put_each(keys, kvs, accepted, downloads, landing, published)
        except BaseException:
            for _, slot, _ in landing:  # reserved for copies never issued
                self.pool.release(slot)
            raise
        finally:
            self.pool.rank(published)
        if downloads:
            self._download(downloads, landing, ready)
        await asyncio.sleep(0)  # let the cascade workers start this write while the engine goes on
        return accepted

    async def _put_each(
        self,
        keys: Sequence[ChunkKey],
        kvs: Sequence[torch.Tensor],
        accepted: list[bool],
        downloads: list[tuple[torch.Tensor, torch.Tensor]],
        landing: list[tuple[ChunkKey, int, Sequence[ChunkTier]]],
        published: list[ChunkKey],
    ) -> None:
        """Each chunk into a slot: CPU chunks copied now (and ``published``), device chunks noted for one batch
        of copies."""
        for key, kv in zip(keys, kvs, strict=True):
            self._counters["puts"] += 1
            if self.pool.contains(key):
                self._counters["put_duplicate"] += 1
                accepted.append(True)
                continue
            below = self._admission.admit(key, self.tiers)  # the tiers written now; the rest wait for a DRAM hit
            slot = self.pool.reserve()
            if slot is None:
                self._counters["put_rejected"] += 1
                accepted.append(False)
                continue
            accepted.append(True)
            if self.transfers.crosses_bus(kv):
                downloads.append((self.pool.tensor(slot), kv.detach()))
                landing.append((key, slot, below))
                continue
            try:
                await self._copy_in(self.pool.tensor(slot), kv.detach())  # detach: no autograd history in the slot
                self._check_open()  # closed while the copy ran: the queues are gone (the slot is released below)
                if self._publish(key, slot, below):
                    published.append(key)
            finally:
                self.pool.release(slot)

    def _download(
        self,
        pairs: list[tuple[torch.Tensor, torch.Tensor]],
        landing: list[tuple[ChunkKey, int, Sequence[ChunkTier]]],
        ready: Completion | None,
    ) -> None:
        """Queue the device-to-slot copies; publish and cascade the chunks once they have completed (on the loop)."""
        loop = asyncio.get_running_loop()
        landed: asyncio.Future[None] = loop.create_future()
        self._device_puts.add(landed)

        def publish() -> None:
            published: list[ChunkKey] = []
            try:
                for key, slot, below in landing:
                    try:
                        if self._state == "open" and self._publish(key, slot, below):
                            published.append(key)
                    finally:
                        self.pool.release(slot)
            finally:
                self.pool.rank(published)
                self._device_puts.discard(landed)
                if not landed.done():
                    landed.set_result(None)

        def failed(error: BaseException) -> None:  # a device error: nothing published, the slots stay held
            self._counters["put_rejected"] += len(landing)
            self._device_puts.discard(landed)
            if not landed.done():
                landed.set_result(None)

        try:
            copies = self.transfers.download(pairs, ready)
        except BaseException:  # nothing was queued (a device error at launch): the slots are free again
            for _, slot, _ in landing:
                self.pool.release(slot)
            failed(RuntimeError("the copies could not be queued"))
            raise
        self.transfers.after(copies, publish, loop, failed)

    def _publish(self, key: ChunkKey, slot: int, below: Sequence[ChunkTier]) -> bool:
        """A filled slot (referenced by the caller): findable under ``key``, and queued for the tiers ``below``.

        Not yet told to the eviction policy: the caller ranks its batch (``pool.rank``) once it is in. False
        if another put of the same key won the race.
        """
        if not self.pool.publish(slot, key, ranked=False):
            self._counters["put_duplicate"] += 1
            return False
        self._cascade.enqueue(below, key, slot)
        if len(below) < len(self.tiers):  # the admission policy held tiers back: the next DRAM hit writes them
            self._admission.hold(key, [tier for tier in self.tiers if tier not in below])
        return True

    async def _copy_in(self, target: torch.Tensor, kv: torch.Tensor) -> None:
        """Copy a chunk into its slot: in the copy thread when a remote tier is below, else on the loop.

        By :func:`copy_between` (numpy, with the store's copy helpers): torch's copy_ of a 5.6 MiB
        chunk ran an OpenMP team that contended with the tiers' sends (17 ms a put on 2 cores, 2.6 ms
        in one thread). Off the loop with a remote tier: the loop drives its sockets, and a copy there
        stalls every request in flight (Redis put+flush of SmolLM2 chunks: 0.55x of raw SETs with the
        copy on the loop, 0.9x with no copy at all). Local tiers write in threads, so there (and for small chunks) the
        copy stays inline: a thread hop would cost more than it frees. Returns only once the copy
        is done, even if cancelled (:func:`in_thread`).
        """
        if self._remote_below and kv.device.type == "cpu" and self.layout.chunk_nbytes >= OFF_LOOP_COPY_BYTES:
            await in_thread(self._copy_executor, copy_between, target, kv, self._copy_helpers)
        else:
            copy_between(target, kv, self._copy_helpers)

    # -- lookup and get ------------------------------------------------------------------------

    async def lookup(self, keys: Sequence[ChunkKey]) -> int:
        """How many leading ``keys`` some tier holds: the prefix that can be loaded, not recomputed.

        Each secondary tier is asked at most once (one query for every key DRAM lacks), and the
        call waits at most ``timeouts.get`` in all: a tier that has not answered by then holds nothing.
        """
        return len(await self._held(keys, "lookup"))

    async def plan(self, keys: Sequence[ChunkKey]) -> LoadPlan:
        """``lookup``, with which tier holds each chunk and how many are worth loading (engine/planner.py).

        ``plan.held`` is ``lookup``'s answer; load ``plan.load`` leading chunks and recompute the
        rest: their expected load time is no more than their expected recompute time.
        """
        holders = await self._held(keys, "plan")
        self.planner.sync(self.tiers)
        names = [DRAM if tier is None else tier.name for tier in holders]
        return self.planner.plan(names, [tier is None or tier.is_local for tier in holders])

    async def _held(self, keys: Sequence[ChunkKey], call: str) -> list[ChunkTier | None]:
        """Per leading key some tier holds, the fastest that holds it (None: DRAM); ``call`` names the caller."""
        self._check_open()
        check_keys(keys, call)
        start = time.perf_counter()
        keys = list(keys)
        for key in keys:
            key_to_bytes(key)
        if self._tracker is not None:
            self._tracker.note(keys)
            if self._auto is not None:
                self._auto.maybe_decide()
        in_dram = [self.pool.contains(key) for key in keys]
        holders = await self._loader.held_tiers(keys, in_dram, Deadline(self.config.timeouts.get))
        self.latency.lookup.observe(time.perf_counter() - start)
        return holders

    async def get(self, key: ChunkKey, out: torch.Tensor | None = None) -> torch.Tensor | None:
        """The chunk (into ``out`` if given, else a new tensor), or None on a miss of any kind.

        Pass ``out`` (pre-allocated, chunk-shaped) on hot paths: a fresh tensor pays page faults.
        """
        self._check_open()
        if out is not None:
            self._check_chunk(out, "get: out")
        return (await self.get_many([key], None if out is None else [out]))[0]

    async def get_many(
        self, keys: Sequence[ChunkKey], outs: Sequence[torch.Tensor] | None = None
    ) -> list[torch.Tensor | None]:
        """Several chunks (typically the prefix ``lookup`` found) in one call.

        DRAM hits are copied at once; the misses are read from each lower tier as one batch and
        promoted into DRAM. Each result is ``outs[i]`` (or a new tensor), or None on a miss (whose
        ``outs[i]`` may then hold anything). With ``outs`` in CPU memory the disk tier reads straight
        into them, and the chunks are admitted to DRAM after the call, in the background (engine/loads.py).
        The reads wait at most ``timeouts.get`` in all (one deadline for the call, whatever the
        number of chunks or tiers) and stage through the DRAM slots free, in rounds: a pool with
        fewer free slots than ``keys`` still loads every chunk the tiers hold, with or without ``outs``.
        ``outs`` must not share memory (the same tensor twice, or overlapping views): a ValueError names the two.
        """
        self._check_open()
        start = time.perf_counter()
        check_keys(keys, "get_many")
        for key in keys:
            key_to_bytes(key)
        if outs is not None:
            check_tensors(outs, "get_many: outs")
            if len(outs) != len(keys):
                raise ValueError(f"get_many: {len(keys)} keys but {len(outs)} output tensors")
            for i, out in enumerate(outs):
                self._check_chunk(out, f"get_many: outs[{i}]")
            refuse_shared_memory(outs, "get_many", "outs", "each chunk needs a buffer of its own")
        self._counters["gets"] += len(keys)
        results: list[torch.Tensor | None] = [None] * len(keys)

        def deliver(i: int, slot: int | None) -> None:  # the slot is referenced during the call
            if slot is None:  # read straight into outs[i]
                assert outs is not None
                results[i] = outs[i]
                return
            source = self.pool.tensor(slot)
            if outs is None:
                results[i] = source.clone()
            else:  # as in put (copy_between): torch's OpenMP team slowed gets of 5.6 MiB chunks
                copy_between(outs[i].detach(), source, self._copy_helpers)
                results[i] = outs[i]

        slots = self.pool.acquire_many(keys)
        try:
            self._release_held_back(keys, slots)
            for i, slot in enumerate(slots):
                if slot is not None:
                    deliver(i, slot)
        finally:
            for slot in slots:
                if slot is not None:
                    self.pool.release(slot)
        missing = [i for i, slot in enumerate(slots) if slot is None]
        if missing and self.tiers:
            deadline = Deadline(self.config.timeouts.get)  # one for the whole call, every tier and round
            direct = None  # the caller's buffers, for tiers that can read into them
            if outs is not None and all(out.device.type == "cpu" and out.is_contiguous() for out in outs):
                direct = [tensor_bytes(outs[i]) for i in missing]
            await self._loader.load(
                [keys[i] for i in missing], lambda j, slot: deliver(missing[j], slot), deadline, direct
            )
        hits = sum(result is not None for result in results)
        self._counters["hits"] += hits
        self._counters["misses"] += len(keys) - hits
        self.latency.get.observe(time.perf_counter() - start)
        return results

    def _release_held_back(self, keys: Sequence[ChunkKey], slots: Sequence[int | None]) -> None:
        """DRAM hits on chunks the admission policy held back from lower tiers: a second sighting, so write them."""
        if not self._admission.holding:
            return
        for key, slot in zip(keys, slots, strict=True):
            if slot is not None and (tiers := self._admission.sighted(key)):
                self._cascade.enqueue(tiers, key, slot)

    def _stream_opened(self, keys: Sequence[ChunkKey], slots: Sequence[int | None]) -> None:
        """A layer stream found ``slots`` (None: not in DRAM) for ``keys``: count; a DRAM hit is a second sighting."""
        self._release_held_back(keys, slots)
        self._counters["streamed"] += len(keys)
        self._counters["streamed_from_dram"] += sum(slot is not None for slot in slots)

    def _stream_promote(
        self, key: ChunkKey, tier: ReaderTier, slot: int | None, lossy: CodecPipeline | None = None
    ) -> None:
        """A layer stream read ``key`` whole and verified from ``tier`` into ``slot``: into DRAM and the faster tiers.

        As ``get_many`` promotes (under either write policy: a chunk read from a tier was written
        there, so this is at least its second sighting). ``slot`` None: no DRAM slot was free, the
        promotion is dropped and counted; so is each faster tier's write whose queue is full.
        Never blocks; the stream keeps (and later releases) its reference to the slot.
        """
        if slot is None or self._state != "open":
            self._counters["stream_promotions_dropped"] += 1
            return
        position = next(i for i, held in enumerate(self.tiers) if held is tier)
        drops = sum(held.stats.drops for held in self.tiers[:position])
        if not self._loader.promote(position, key, slot, lossy):
            return  # a put (or another stream) of the same key landed meanwhile: DRAM has it
        self._counters["stream_promoted"] += 1
        self._counters["stream_promotions_dropped"] += sum(held.stats.drops for held in self.tiers[:position]) - drops

    def _stream_admit(self, key: ChunkKey, tier: ReaderTier) -> None:
        """A layer stream read ``key`` from local ``tier`` straight into its consumer's memory: admit it to DRAM
        in the background (a re-read of the file, as after ``get_many``; engine/loads.py). Never blocks."""
        if self._state != "open":
            return
        position = next(i for i, held in enumerate(self.tiers) if held is tier)
        self._loader.admit(position, key, self.config.timeouts.get)

    # -- adaptive sizing (what auto mode may read and change: kvstore.sizing.adaptive.SizingTarget) ----

    @property
    def policy(self) -> Policy:
        """The admission (write) policy in force, by name (``adaptive.policy``; see :mod:`kvstore.admission`)."""
        return self._admission.name  # type: ignore[return-value]  # a registry name, as make_admission checked

    @policy.setter
    def policy(self, name: Policy) -> None:
        """Switch to policy ``name`` (auto mode does): it takes over the chunks held back so far."""
        self._admission = make_admission(name, self._admission.held_back, self._seen_before)

    def _seen_before(self, key: ChunkKey) -> bool:
        """Whether lookups saw ``key`` before (the admission policy's sightings); True where none are tracked."""
        return self._tracker is None or self._tracker.seen_before(key)

    @property
    def dram_bytes(self) -> int:
        """The DRAM tier's capacity now (auto mode may resize it)."""
        return self.pool.capacity_bytes

    async def resize_dram(self, capacity_bytes: int) -> int:
        """Resize the DRAM pool in a worker thread (a grow allocates); the capacity it has afterwards.

        Chunks beyond a smaller size are evicted; slots held by transfers are kept until released.
        """
        self._check_open()
        await asyncio.get_running_loop().run_in_executor(self._executor, self.pool.resize, capacity_bytes)
        return self.pool.capacity_bytes

    def sizing_advice(self, bounds: tuple[int, int] | None) -> tuple[Advice, ReuseProfile, CostModel]:
        """:meth:`advise`, with the reuse profile and the cost model it came from (auto mode weighs them again)."""
        if self._tracker is None:
            raise RuntimeError("advise() needs the access tracker: set adaptive.track = true")
        settings = self.config.adaptive
        profile = self._tracker.profile()
        cost = measured_costs(self.layout, self.tiers, settings.prefill_tokens_per_s)
        advice = advise(profile, cost, self.pool.capacity_bytes, self.policy, bounds=bounds, knee=settings.knee)
        return advice, profile, cost

    def advise(self, bounds: tuple[int, int] | None = None) -> Advice:
        """Hit rate against DRAM size for the traffic seen so far, the size and write policy to use, and why.

        ``bounds`` (bytes) limits the recommended size; by default sizes from 1/8x to 8x are considered.
        """
        self._check_open()
        return self.sizing_advice(bounds)[0]

    def prefetch(
        self,
        keys: Sequence[ChunkKey],
        *,
        depth: int = 2,
        outs: Sequence[torch.Tensor] | None = None,
        ready: Completion | None = None,
    ) -> LayerStream:
        """Stream ``keys``' chunks layer by layer, ``depth`` layers ahead of the consumer.

        ``async for layer, kv in store.prefetch(keys[:n])``: ``kv`` is layer ``layer`` of all
        chunks, ``[planes, n * chunk_tokens, heads, head_dim]`` (into ``outs[layer]`` if given).
        A layer that cannot be loaded raises :class:`kvstore.errors.PrefetchError`. ``outs`` (one per
        layer, or a ring of fewer) must not share memory: a ValueError names the two.
        CUDA ``outs`` are written only after the work queued so far on this thread's current stream
        (``ready``, recorded by :class:`SyncKVStore` on the engine's thread), which may still read them.
        """
        self._check_open()
        check_keys(keys, "prefetch")
        for key in keys:
            key_to_bytes(key)
        if outs is not None:  # their shapes are LayerStream's to check
            check_tensors(outs, "prefetch: outs")
            refuse_shared_memory(outs, "prefetch", "outs", "each layer (or slot of a ring) needs a buffer of its own")
        if ready is None and outs:
            ready = ready_on_current_stream(outs[0].device)
        stream = LayerStream(self._stream_resources, keys, depth, outs, ready)
        self._streams.add(stream)  # store.close() closes the streams still open
        return stream

    async def flush(self) -> None:
        """Wait until every queued write has reached its tier (or failed, or timed out).

        Chunks ``get_many`` read into the caller's buffers are admitted to DRAM first (they may queue writes),
        and puts of device tensors wait for their copies into DRAM. An auto-mode decision in progress
        (a DRAM resize) finishes first, so what the store holds afterwards does not depend on timing.
        """
        if self._auto is not None:
            await self._auto.settle()
        await asyncio.gather(*(asyncio.shield(landed) for landed in list(self._device_puts)))
        await self._loader.settle()
        await self._cascade.join()

    # -- introspection ---------------------------------------------------------------------------

    def describe(self) -> str:
        """The store in one line, for a log (no secrets): namespace, layout, DRAM and each tier below, fastest first."""
        dram = f"dram {human_bytes(self.pool.capacity_bytes)} ({self.config.dram.eviction})"
        tiers = ", ".join([dram, *(tier.describe() for tier in self.tiers)])
        return f"namespace {self.namespace!r}; {self.layout.describe()}; tiers: {tiers}"

    def stats(self) -> dict[str, dict[str, Any]]:
        queued = {tier: self._cascade.queued(tier) for tier in self.tiers}
        tiers = {tier.name: {**tier.stats_dict(), "queued": n} for tier, n in queued.items() if n is not None}
        loader = self._loader
        store = {**self._counters, "admitted": loader.admitted, "admissions_dropped": loader.admissions_dropped}
        adaptive: dict[str, Any] = {"policy": self.policy, **self.adaptive.as_dict(), **self._admission.counters()}
        if self._tracker is not None:  # counts only: stats() may run on a scrape thread, the tracker is the loop's
            adaptive |= {"lookups_tracked": self._tracker.references, "sample_rate": self._tracker.sampler.rate}
        return {"store": store, "dram": self.pool.stats(), "adaptive": adaptive, **tiers}

    def _check_chunk(self, tensor: torch.Tensor, what: str) -> None:
        """A TypeError or ValueError naming ``what`` unless ``tensor`` is a chunk: this layout's shape and dtype."""
        check_tensor(tensor, what)
        if tensor.device.type == "meta":  # shapes only, no memory: nothing could be copied in or out
            raise ValueError(f"{what} is on the 'meta' device (no storage); pass a CPU or GPU tensor")
        if tuple(tensor.shape) != self.layout.chunk_shape or tensor.dtype != self.layout.dtype:
            raise ValueError(
                f"{what} must be a {self.layout.dtype} tensor of shape {self.layout.chunk_shape} "
                f"([layers, planes, tokens, heads, head_dim]), got {tensor.dtype} {tuple(tensor.shape)}"
            )
