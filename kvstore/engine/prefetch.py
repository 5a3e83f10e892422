"""Layerwise prefetch: a prefix's KV arrives layer by layer, in the order the engine consumes it.

A cache hit should shorten time-to-first-token, so the engine must not wait for the whole prefix:
``store.prefetch(keys)`` starts fetching layer 0 of every chunk, then layer 1, ..., running at
most ``depth`` layers ahead of the consumer. Each chunk comes from the fastest place that has
it: a DRAM slot (a copy), or a secondary tier opened once and read one segment per layer (a
positioned file read, or one byte-range request). Every segment is verified before it is used.

If a layer cannot be loaded (a chunk vanished, a segment is corrupt, a tier timed out) the
stream raises :class:`PrefetchError` for that layer and every later one: the engine keeps the
layers it already has or, simpler, recomputes the prefix. Nothing unverified reaches it.

A chunk the stream reads from a secondary tier is promoted: its layers are read into a DRAM
slot reserved for it when the stream opens (the contiguous staging every read needs anyway,
since a chunk's share of a layer is a strided slice of the engine's tensor), and once every
layer of it has arrived verified, the store publishes the slot and queues it for the faster
tiers it skipped (``StreamSources.promote``). Nothing of a chunk whose stream failed or closed
early is promoted. The exception: a chunk read from a local tier (disk) into the caller's CPU
outputs (``outs``) whose planes are contiguous is read straight into them (one vectored read per
run of its layers, then a checksum per layer: no staging copy), and once the stream has it whole the store admits it
to DRAM in the background, re-reading the file from the page cache, as ``get_many`` does
(``StreamSources.admit``). A stream holds its staging slots for its whole life, so across all
streams of a store they are at most half the pool (:class:`~kvstore.engine.stream_sources.StagingShare`:
the engine's puts keep the rest). A chunk with no staging slot is read as without promotion, and its
promotion is dropped and counted.

Outputs may live on a device (``outs`` CUDA tensors): each layer is then assembled in host memory
(a chunk's DRAM slot as it is, a chunk read from a tier in its promotion slot) and crosses the bus
as asynchronous copies on the store's upload stream (:mod:`kvstore.engine.transfer`), while the
reads of the next layer go on. A layer has *arrived* when its copies are queued; its
:class:`~kvstore.engine.transfer.Completion` is what the consumer's compute stream waits on
(``await stream.layer(i)`` and ``SyncLayerStream.wait_layer`` make the caller's current stream wait,
without blocking the host). The slots a stream copies from stay referenced until its last copy has
completed, not only until it closes.

Where each chunk comes from and the slots a stream holds (opening, staging, promotion, release) live in
:mod:`kvstore.engine.stream_sources`, the reads of local sources themselves in
:mod:`kvstore.engine.stream_reads`, how far the producer may run (requests, a ring's releases) in
:mod:`kvstore.engine.stream_pace`; this module keeps the stream itself: its consumer's side, the
producer (which runs of layers are fetched, how many at once) and the device path.

Closing a stream is bounded (``timeouts.close``) and a cancellation is never lost: every wait
on a tier is under ``asyncio.timeout`` (``asyncio.wait_for`` can swallow a cancel on 3.11,
which left a producer waiting forever for a consumer that was gone).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
from collections.abc import AsyncIterator, Sequence

import torch

from kvstore.engine.stream_pace import StreamPace
from kvstore.engine.stream_reads import (
    LocalRead,
    RunFailed,
    chunk_parts,
    failed_where,
    read_files,
)
from kvstore.engine.stream_sources import StreamChunks, StreamSources
from kvstore.engine.transfer import DONE, Completion, UploadScratch, ready_on_current_stream
from kvstore.errors import PrefetchError, TierSkipped, TierTimeout
from kvstore.keys import ChunkKey
from kvstore.storage.layer_reader import LayerReader
from kvstore.util.buffers import copy_between, tensor_bytes
from kvstore.util.threads import FenceClosed, WriteFence, in_thread, usable_cores, wait_through_cancel

log = logging.getLogger("kvstore.prefetch")
FETCHES_IN_FLIGHT = 2  # runs of layers being read at once where _fetches_in_flight allows (3 and 4 measured no faster)
UPLOAD_BYTES = 4 << 20  # into device outputs, a chunk's layers cross the bus in copies of about this size
IN_PLACE_BYTES = 8 << 20  # read in place into CPU outputs, a chunk's layers are read in runs of about this size


class LayerStream:
    """The layers of ``keys``' chunks, each as one tensor ``[planes, len(keys) * chunk_tokens, heads, head_dim]``.

    Iterate it (``async for layer, kv in stream``) or ask for a layer (``await stream.layer(i)``);
    close it (``async with`` does) to release the DRAM slots and files it holds.

    ``outs``: one tensor per layer, or a *ring* of fewer (an engine that copies each layer on, e.g. into
    paged blocks, needs only a few layers' room): layer i lands in ``outs[i % len(outs)]`` once the consumer
    has released layer ``i - len(outs)`` (:meth:`release`; iterating releases each layer when the next is
    asked for). A ring's consumer must release every layer it has taken before waiting for one ``len(outs)``
    later, or that layer never comes (a wait with a timeout ends it).
    """

    def __init__(
        self,
        sources: StreamSources,
        keys: Sequence[ChunkKey],
        depth: int,
        outs: Sequence[torch.Tensor] | None,
        ready: Completion | None = None,
    ) -> None:
        """``ready``: with device ``outs``, the consumer's stream when it handed them over (its work may still
        read that memory): the copies into ``outs`` wait for it."""
        layout = sources.layout
        if isinstance(depth, bool) or not isinstance(depth, int):
            raise TypeError(f"prefetch: depth must be an int, got {type(depth).__name__}")
        if depth < 1:
            raise ValueError(f"prefetch depth must be at least 1, got {depth}")
        self.shape = (layout.kv_planes, len(keys) * layout.chunk_tokens, layout.num_kv_heads, layout.head_dim)
        if outs is not None:
            if not 1 <= len(outs) <= layout.num_layers:
                raise ValueError(
                    f"prefetch: {layout.num_layers} layers but {len(outs)} output tensors "
                    f"(one per layer, or from 1 to {layout.num_layers - 1} used in turn: see LayerStream)"
                )
            for out in outs:
                if tuple(out.shape) != self.shape or out.dtype != layout.dtype:
                    raise ValueError(f"prefetch outputs must be {layout.dtype} tensors of shape {self.shape}")
                if out.device != outs[0].device or out.device.type not in ("cpu", "cuda"):
                    raise ValueError(
                        f"prefetch outputs must all be on one CPU or CUDA device, got {out.device} and {outs[0].device}"
                    )
        self._on_device = outs is not None and len(outs) > 0 and sources.transfers.crosses_bus(outs[0])
        self._sources, self._keys, self._depth, self._outs = sources, list(keys), depth, outs
        # Fewer outputs than layers: a ring, layer i lands in outs[i % ring] once layer i - ring is released.
        self.ring = len(outs) if outs is not None and len(outs) < layout.num_layers else 0
        loop = asyncio.get_running_loop()
        self._ready: list[asyncio.Future[torch.Tensor]] = [loop.create_future() for _ in range(layout.num_layers)]
        # The same outcomes for engine threads, readable without a hop to the loop (see SyncLayerStream).
        self.arrived = [threading.Event() for _ in range(layout.num_layers)]
        self.outcomes: list[torch.Tensor | BaseException | None] = [None] * layout.num_layers
        # Per layer, when its copies into device outputs end (DONE on the CPU): what consumers wait on.
        self.completions: list[Completion] = [DONE] * layout.num_layers
        self._last_upload = DONE  # the latest layer's: the slots copied from are held until it is done
        self._scratch: UploadScratch | None = None  # device staging of runs of layers (DeviceTransfers.upload_layers)
        self._consumer_ready = ready
        self._accounted: set[int] = set()  # readers whose failure the tier has counted (once per chunk)
        self.pace = StreamPace(depth, self.ring, layout.num_layers)  # how far the producer may run
        self._closing = False
        self._fence = WriteFence()  # over the caller's outs: every write into them is made under it (see close)
        self._threads_per_fetch = sources.read_threads  # thread calls a run of layers is read in (see _fetch)
        self._chunks = StreamChunks(sources, keys)  # per chunk: its DRAM slot or tier reader, its staging slot
        self._task = asyncio.create_task(self._produce(), name="kvstore-prefetch")

    @property
    def num_layers(self) -> int:
        return len(self._ready)

    async def layer(self, index: int) -> torch.Tensor:
        """Layer ``index`` once it has arrived (raises PrefetchError if it cannot).

        With device outputs, the calling thread's current stream is made to wait for the layer's
        copies (the host does not wait): work queued there afterwards sees the layer.
        """
        kv = await self._arrived_layer(index)
        self.completions[index].wait_on_current_stream()
        return kv

    async def _arrived_layer(self, index: int) -> torch.Tensor:
        if not 0 <= index < self.num_layers:
            raise IndexError(f"layer {index} out of range for {self.num_layers} layers")
        self.request(index)
        return await asyncio.shield(self._ready[index])

    async def landed(self, index: int) -> None:
        """Wait until layer ``index`` has arrived and its copies have completed (raises PrefetchError if it cannot).

        For the store's own timing (a load planner measures a whole load this way); no stream waits.
        """
        await self._arrived_layer(index)
        try:
            await self._sources.transfers.completed(self.completions[index])
        except Exception as error:  # a device error
            raise PrefetchError(f"the copies of layer {index} failed: {error!r}") from None

    def request(self, index: int) -> None:
        """Let the producer run up to ``index + depth`` (on the loop thread)."""
        self.pace.request(index)

    def release(self, index: int, after: Completion = DONE) -> None:
        """A ring's consumer is done with layer ``index`` once ``after`` is done (on the loop thread).

        Its output buffer may then take layer ``index + ring``: the copies into it wait for ``after`` (the
        consumer's stream, whose work may still read the layer). Every layer must be released, in order,
        before the consumer waits for the layer ``ring`` places after it; without a ring, a no-op.
        """
        self.pace.release(index, after)

    async def __aiter__(self) -> AsyncIterator[tuple[int, torch.Tensor]]:
        """Every layer in order; leaving the loop early closes the stream."""
        try:
            for index in range(self.num_layers):
                kv = await self.layer(index)
                yield index, kv
                if self.ring:  # the loop's body is done with it (its device work queued on this thread's stream)
                    self.release(index, ready_on_current_stream(kv.device))
        finally:
            await self.close()

    async def close(self) -> None:
        """Stop fetching and release what the stream holds (idempotent).

        Waits at most ``timeouts.close`` for the producer to stop, then for the writes into ``outs`` still
        in progress: pieces of bounded size (a copy, one run of layers read from a file, about 8 MiB), so
        only a stalled disk makes it wait longer.

        Once it returns or raises, cancelled or not, nothing of the stream writes into the caller's
        ``outs`` again: the writes in progress then (a copy, a file read of a run of layers, the copies
        to a device already queued) are waited for, through a cancellation too, which is raised after
        them. Every layer not yet arrived fails with PrefetchError (an engine thread waiting on one
        wakes). A producer that does not stop in time (a tier call that ignores cancellation) is left to
        finish on its own and logged: it writes nothing into ``outs`` any more, and still releases its
        slots and files when it ends.
        """
        self._closing = True
        self.pace.wake()  # a producer waiting for the consumer wakes and sees the stream closing
        self._task.cancel()
        cancelled = False
        try:
            try:
                done, _ = await asyncio.wait({self._task}, timeout=self._sources.close_timeout)
            except asyncio.CancelledError:
                cancelled = True
            else:
                if not done:  # its outcome is retrieved when it ends (_retrieve)
                    self._task.add_done_callback(_retrieve)
                    log.warning(
                        "a layer stream did not stop within %.1fs; leaving it to end", self._sources.close_timeout
                    )
            try:
                await self._fence.close()  # no write into outs is in progress, and none will start
            except asyncio.CancelledError:  # (raised once the writes in progress have ended)
                cancelled = True
            copies = self._sources.transfers.completed(self._last_upload)  # the copies to a device already queued
            if await wait_through_cancel(copies):
                cancelled = True
            _retrieve(copies)  # a device error was logged where it happened
        finally:
            self._fail_pending()
        if cancelled:
            raise asyncio.CancelledError

    def _fail_pending(self) -> None:
        """Every layer not yet arrived fails (closed), and every failure is marked as retrieved."""
        closed = PrefetchError("the layer stream was closed")
        for index, future in enumerate(self._ready):
            self._arrive(index, closed)  # wakes any engine thread still waiting on this layer
            if not future.cancelled():
                future.exception()  # retrieved: an unconsumed failure is not an "unhandled" error

    async def __aenter__(self) -> LayerStream:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    # -- the producer ---------------------------------------------------------------------------

    async def _produce(self) -> None:
        layer = 0
        # fetches started, in layer order: (task, layers); more than one only where _fetches_in_flight allows
        started: collections.deque[tuple[asyncio.Task[list[torch.Tensor]], int]] = collections.deque()
        try:
            await self._chunks.open()
            # CPU outputs whose planes are contiguous: a chunk on a local tier is read straight into them
            self._chunks.reserve_staging(
                not self._on_device and self._outs is not None and self._outs[0].is_contiguous()
            )
            (in_flight, self._threads_per_fetch), step = self._fetches_in_flight(), self._layers_per_fetch()
            while layer < self.num_layers:
                await self.pace.until_allowed(layer, lambda: self._closing)
                following = layer + sum(count for _, count in started)  # the first layer not yet being fetched
                # A ring's layers in flight stay within `ring` of the first one not yet arrived, however far the
                # consumer has released (a restart releases layers it will not take): no two share a buffer.
                limit = min(self.num_layers, self.pace.allowed(), layer + (self.ring or self.num_layers))
                while following < limit and len(started) < in_flight:
                    count = min(step, limit - following)
                    started.append((asyncio.create_task(self._fetch(following, count)), count))
                    following += count
                fetch, count = started.popleft()
                following = layer + count
                try:
                    fetched = await fetch
                except RunFailed as failed:  # the layers before the one that failed are sound: delivered
                    for index, out in enumerate(failed.good, start=layer):
                        self._arrive(index, out)
                    layer += len(failed.good)
                    raise failed.error from None
                for index, out in enumerate(fetched, start=layer):
                    self._arrive(index, out)
                layer = following
                if layer == self.num_layers:
                    self._chunks.promote()  # no await before it: a consumer closing the stream now cannot stop it
                await asyncio.sleep(0)  # let waiters in between layers
        except (asyncio.CancelledError, FenceClosed):  # closed: close() fails the layers not arrived
            raise
        except Exception as exc:
            error = exc if isinstance(exc, PrefetchError) else PrefetchError(f"layer {layer}: {exc!r}")
            log.warning("prefetch of %d chunks stopped at layer %d: %s", len(self._keys), layer, error)
            for index in range(layer, self.num_layers):
                self._arrive(index, error)
        finally:
            try:
                for task, _ in started:  # their threads must end before the slots and files are let go
                    task.cancel()
                await asyncio.gather(*(task for task, _ in started), return_exceptions=True)
            finally:
                self._chunks.release(self._last_upload)

    def _overlaps(self) -> bool:
        """Whether layer i+1's reads may start while layer i's run: every chunk from DRAM or a local tier. The
        thread calls of two layers then keep the I/O threads (and the bus) busy across the wait between layers;
        a remote reader reads its layers in order, so a stream with one does not."""
        return self._chunks.all_local()

    def _fetches_in_flight(self) -> tuple[int, int]:
        """Runs of layers read at once, and the thread calls each run's reads are spread over.

        FETCHES_IN_FLIGHT runs where _overlaps allows, each over ``read_threads`` calls; where files are read
        and that would be more threads than cores (2 cores, 2 read threads), the runs share the cores instead
        (one thread each there): more threads would only take turns, and a thread switched out between a read
        and its checksum checks bytes no longer in its cache. (A stream from disk on 2 cores, of ``get_many``
        from disk: 0.82x with two runs of two threads, about 0.85x with one run of two, which leaves the cores
        idle between runs.)
        """
        threads = self._sources.read_threads
        if not self._overlaps():
            return 1, threads
        cores = usable_cores()
        if any(reader is not None for reader in self._chunks.readers) and FETCHES_IN_FLIGHT * threads > cores:
            return FETCHES_IN_FLIGHT, max(1, cores // FETCHES_IN_FLIGHT)
        return FETCHES_IN_FLIGHT, threads

    def _layers_per_fetch(self) -> int:
        """Layers fetched together (at most): 1, or from DRAM and local tiers into device outputs, enough that each
        chunk moves about UPLOAD_BYTES at once (one copy across the bus), or read in place into CPU outputs, about
        IN_PLACE_BYTES (one vectored read, checksummed while hot). Longer runs switch between files less often: a
        stream from disk on 2 cores made 0.87-0.93x of ``get_many`` from disk in runs of 8 MiB, 0.81-0.86x in runs
        of 4 MiB, 0.64-0.86x in runs doubling from one layer. A remote reader reads its layers one by one."""
        if not (self._on_device or any(self._chunks.direct)) or not self._overlaps():
            return 1
        run_bytes = UPLOAD_BYTES if self._on_device else IN_PLACE_BYTES
        return max(1, min(self.num_layers, -(-run_bytes // self._sources.layout.layer_nbytes)))

    def _arrive(self, layer: int, outcome: torch.Tensor | BaseException) -> None:
        future = self._ready[layer]
        if future.done():
            return
        if isinstance(outcome, BaseException):
            future.set_exception(outcome)
        else:
            future.set_result(outcome)
        self.outcomes[layer] = outcome
        self.arrived[layer].set()

    async def _fetch(self, first: int, count: int) -> list[torch.Tensor]:
        """Layers ``first`` to ``first + count - 1`` of every chunk, each concatenated along the token axis.

        CPU outputs (one layer at a time): each chunk is copied or read into its place. Device outputs:
        each chunk's layers are first in host memory (a run of its DRAM slot; of its promotion slot, or a
        temporary, for a chunk read from a tier), then cross the bus, one copy per chunk.
        """
        layout, pool = self._sources.layout, self._sources.pool
        layers = range(first, first + count)
        outs = [  # a ring's layer i in outs[i % ring]; without a ring that is outs[i]
            self._outs[i % len(self._outs)] if self._outs is not None else torch.empty(self.shape, dtype=layout.dtype)
            for i in layers
        ]
        tokens = layout.chunk_tokens
        hosts: list[torch.Tensor] = []  # device outputs: each chunk's layers in host memory, in order
        reads = []
        local: dict[int, list[LocalRead]] = {}  # per chunk read from a local tier: its layers' reads, in order
        copies: list[tuple[torch.Tensor, torch.Tensor]] = []
        for j, (layer, out) in enumerate(zip(layers, outs, strict=True)):
            parts = chunk_parts(out, len(self._keys)) if any(self._chunks.direct) else None
            chunks = zip(self._chunks.slots, self._chunks.readers, self._chunks.staging, strict=True)
            for index, (slot, reader, staging) in enumerate(chunks):
                target = out[:, index * tokens : (index + 1) * tokens]
                if slot is not None:
                    if not self._on_device:
                        copies.append((target, pool.tensor(slot)[layer]))
                    elif j == 0:
                        hosts.append(pool.tensor(slot)[first : first + count])
                    continue
                assert reader is not None
                stage = pool.tensor(staging)[layer] if staging is not None else None
                if self._on_device:  # read into host memory (a temporary, pageable, if no slot: a synchronous upload)
                    if j == 0:
                        run = (count, *layout.layer_shape)
                        hosts.append(
                            pool.tensor(staging)[first : first + count]
                            if staging is not None
                            else torch.empty(run, dtype=layout.dtype)
                        )
                    target = hosts[index][j]
                if reader.is_local:
                    direct = parts[index] if parts is not None and self._chunks.direct[index] else None
                    local.setdefault(index, []).append((reader, layer, target, stage, direct))
                else:
                    reads.append(self._read(reader, layer, target, stage, index))
        # DRAM copies and file reads in as many thread calls as _fetches_in_flight allows; a chunk's layers in one
        files = list(local.values())
        groups = max(1, min(self._threads_per_fetch, len(files)))
        if files or copies:
            for g in range(groups):
                items = [item for chunk in files[g::groups] for item in chunk]
                reads.append(self._read_local(items, copies[g::groups] if files else copies))
                if not files:
                    break
        errors = [error for error in await asyncio.gather(*reads, return_exceptions=True) if error is not None]
        if errors:  # the first layer that failed, and of it the first chunk: the layers before it are sound
            error = min(errors, key=failed_where)
            bad = error.layer if isinstance(error, PrefetchError) and error.layer is not None else first
            good = [] if self._on_device else outs[: bad - first]  # device outputs: not uploaded
            raise RunFailed(error, good)
        if self._on_device:
            self.completions[first : first + count] = self._upload(outs, hosts, first)
        return outs

    def _upload(self, outs: list[torch.Tensor], hosts: list[torch.Tensor], first: int) -> list[Completion]:
        """Queue the copies of a run of layers to the device, on the loop: a copy's launch costs microseconds (a
        thread hop per layer left the bus idle between layers: 0.47x of raw H2D on an H100). The slots copied
        from are held until the latest copy issued has completed (one stream: it completes after every earlier one)."""
        transfers = self._sources.transfers
        if self._scratch is None:  # once per stream, reused by every run of layers (one stream, in order)
            self._scratch = transfers.scratch_for(outs[0], len(hosts), self._layers_per_fetch(), self._consumer_ready)
        # a ring buffer takes its next layer once the consumer's reads of its last one have ended
        before = [self.pace.before_writing(layer) for layer in range(first, first + len(outs))]
        with self._fence:  # closed: no copy into outs is queued any more
            completions = transfers.upload_layers(outs, hosts, self._scratch, before)
        self._last_upload = completions[-1]
        return completions

    async def _read_local(self, items: list[LocalRead], copies: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """DRAM copies (``(target, source)``) and file reads, in one worker-thread call.

        A chunk's consecutive layers read straight into the caller's memory are one vectored read.

        In a worker, not on the loop: the loop thread then sits in ``select`` while the bytes move,
        and an engine thread woken by the previous layer gets the GIL at once instead of waiting
        up to a switch interval (5 ms) for a loop thread that copies layer after layer.
        """
        executor, layout = self._sources.executor, self._sources.layout
        outcomes = await in_thread(executor, read_files, items, copies, layout, self._fence)
        failed: tuple[int, int, LayerReader] | None = None  # (layer, chunk) first, and its reader
        for (reader, layer, _, _, _), outcome in zip(items, outcomes, strict=True):
            if outcome is None:
                reader.count(layer)
                continue
            if id(reader) not in self._accounted:  # a chunk's failure counts once (runs in flight may both see it)
                self._accounted.add(id(reader))
                await reader.tier.account(reader.key, outcome)  # counted; a corrupt file is removed
            chunk = self._chunks.index_of(reader)
            failed = min(failed, (layer, chunk, reader), key=lambda f: f[:2]) if failed else (layer, chunk, reader)
        if failed is not None:
            layer, chunk, reader = failed
            message = f"layer {layer} of chunk {reader.key[:16]}... could not be read from disk"
            raise PrefetchError(message, chunk=chunk, layer=layer)

    async def _read(
        self, reader: LayerReader, layer: int, target: torch.Tensor, stage: torch.Tensor | None, chunk: int
    ) -> None:
        """One layer of a remote chunk, verified, into ``stage`` (its promotion slot) if given, and ``target``.

        Decoded into memory of the stream's own (the promotion slot, else a temporary), then copied into
        ``target`` on the loop under the fence: a read a closing stream leaves running writes nothing there.
        """
        contiguous = stage if stage is not None else torch.empty(self._sources.layout.layer_shape, dtype=target.dtype)
        where = f"chunk {reader.key[:16]}... on the {reader.tier.name} tier"
        try:
            # Later layers ride along in the same request, and the next request starts early,
            # as far as the stream may run ahead.
            ahead = min(self._depth, self.num_layers) - 1
            ok = await reader.tier.guarded(  # open breaker: this layer fails at once, without a wait
                lambda attempt: reader.read_counted(layer, tensor_bytes(contiguous), ahead, attempt),
                self._sources.read_timeout,
            )
        except TierSkipped:
            raise PrefetchError(
                f"layer {layer} of {where} skipped: the tier's circuit breaker is open", chunk=chunk, layer=layer
            ) from None
        except TierTimeout:
            raise PrefetchError(f"layer {layer} of {where} timed out", chunk=chunk, layer=layer) from None
        if not ok:
            raise PrefetchError(
                f"layer {layer} of {where} could not be read (counted in the tier's stats)", chunk=chunk, layer=layer
            )
        with self._fence:
            copy_between(target, contiguous)


def _retrieve(future: asyncio.Future[object]) -> None:
    """A finished future's outcome, retrieved: a failure nobody awaits is not an "unhandled" error."""
    if future.done() and not future.cancelled():
        future.exception()
