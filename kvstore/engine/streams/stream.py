"""The layer stream itself: its consumer's side, its producer, and how it closes.

The producer fetches runs of layers in order, as far ahead as :class:`~kvstore.engine.streams.pace.StreamPace`
allows. Each run goes one way: the outputs give the run's tensors (:meth:`LayerOutputs.run`), each chunk
adds its reads for the run (:meth:`StreamChunks.schedule`: one class per source kind), the reads run
(:meth:`RunReads.run`), and for device outputs the run's copies are queued (:meth:`LayerOutputs.upload`).
Its layers then arrive, in order; once the last has, the chunks read from tiers are promoted.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
from collections.abc import AsyncIterator, Sequence
from typing import Any

import torch

from kvstore.engine.streams.outputs import LayerOutputs, OutputKind
from kvstore.engine.streams.pace import StreamPace
from kvstore.engine.streams.reads import RunReads
from kvstore.engine.streams.resources import StreamResources
from kvstore.engine.streams.sources import StreamChunks
from kvstore.engine.transfer import DONE, Completion, ready_on_current_stream
from kvstore.errors import PrefetchError
from kvstore.keys import ChunkKey
from kvstore.util.threads import FenceClosed, usable_cores

log = logging.getLogger("kvstore.prefetch")
FETCHES_IN_FLIGHT = 2  # runs of layers being read at once where _fetches_in_flight allows (3 and 4 measured no faster)
UPLOAD_BYTES = 4 << 20  # into device outputs, a chunk's layers cross the bus in copies of about this size
IN_PLACE_BYTES = 8 << 20  # read in place into CPU outputs, a chunk's layers are read in runs of about this size


class RunFailed(Exception):
    """A run of layers failed at ``error``'s layer; ``good`` are the outputs of the layers before it, complete."""

    def __init__(self, error: BaseException, good: list[torch.Tensor]) -> None:
        super().__init__(error)
        self.error, self.good = error, good


class LayerStream:
    """The layers of ``keys``' chunks, each as one tensor ``[planes, len(keys) * chunk_tokens, heads, head_dim]``.

    Iterate it (``async for layer, kv in stream``) or ask for a layer (``await stream.layer(i)``);
    close it (``async with`` does) to release the DRAM slots and files it holds.

    ``outs``: one tensor per layer, or a *ring* of fewer (an engine that copies each layer on, e.g. into
    paged blocks, needs only a few layers' room): layer i lands in ``outs[i % len(outs)]`` once the consumer
    has released layer ``i - len(outs)`` (:meth:`release`; iterating releases each layer when the next is
    asked for). A ring's consumer must release every layer it has taken before waiting for one ``len(outs)``
    later, or that layer never comes (a wait with a timeout ends it).

    For engine threads (:class:`~kvstore.engine.sync.SyncLayerStream`), each layer's outcome is readable
    without a hop to the loop: ``arrived[i]`` (a threading.Event), ``outcomes[i]`` (the tensor or the error),
    ``completions[i]`` (when its copies into device outputs end); requests and releases go through ``pace``.
    """

    def __init__(
        self,
        resources: StreamResources,
        keys: Sequence[ChunkKey],
        depth: int,
        outs: Sequence[torch.Tensor] | None,
        ready: Completion | None = None,
    ) -> None:
        """``ready``: with device ``outs``, the consumer's stream when it handed them over (its work may still
        read that memory): the copies into ``outs`` wait for it. ValueError for ``outs`` of the wrong shape,
        dtype or number, or on more than one device."""
        layout = resources.layout
        if isinstance(depth, bool) or not isinstance(depth, int):
            raise TypeError(f"prefetch: depth must be an int, got {type(depth).__name__}")
        if depth < 1:
            raise ValueError(f"prefetch depth must be at least 1, got {depth}")
        self.shape = (layout.kv_planes, len(keys) * layout.chunk_tokens, layout.num_kv_heads, layout.head_dim)
        self._outputs = LayerOutputs(outs, self.shape, layout, resources.transfers, ready)  # their kind, decided once
        self._resources, self._keys, self._depth = resources, list(keys), depth
        self.ring = self._outputs.ring  # fewer outputs than layers: layer i in outs[i % ring]
        loop = asyncio.get_running_loop()
        self._ready: list[asyncio.Future[torch.Tensor]] = [loop.create_future() for _ in range(layout.num_layers)]
        # The same outcomes for engine threads, readable without a hop to the loop (see SyncLayerStream).
        self.arrived = [threading.Event() for _ in range(layout.num_layers)]
        self.outcomes: list[torch.Tensor | BaseException | None] = [None] * layout.num_layers
        # Per layer, when its copies into device outputs end (DONE on the CPU): what consumers wait on.
        self.completions: list[Completion] = [DONE] * layout.num_layers
        self.pace = StreamPace(depth, self.ring, layout.num_layers)  # how far the producer may run
        self._closing = False
        self._accounted: set[int] = set()  # readers whose failure the tier has counted (once per chunk)
        self._chunks = StreamChunks(resources, self._keys)  # per chunk, its source: DRAM, a file, a remote tier
        self._task = asyncio.create_task(self._produce(), name="kvstore-prefetch")

    @property
    def num_layers(self) -> int:
        return len(self._ready)

    # -- the consumer's side ------------------------------------------------------------------------

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
            await self._resources.transfers.completed(self.completions[index])
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
                done, _ = await asyncio.wait({self._task}, timeout=self._resources.close_timeout)
            except asyncio.CancelledError:
                cancelled = True
            else:
                if not done:  # its outcome is retrieved when it ends (_retrieve)
                    self._task.add_done_callback(_retrieve)
                    log.warning(
                        "a layer stream did not stop within %.1fs; leaving it to end", self._resources.close_timeout
                    )
            if await self._outputs.close():  # no write into outs is in progress, none will start, no copy queued
                cancelled = True
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

    # -- the producer -------------------------------------------------------------------------------

    async def _produce(self) -> None:
        layer = 0
        # fetches started, in layer order: (task, layers); more than one only where _fetches_in_flight allows
        started: collections.deque[tuple[asyncio.Task[list[torch.Tensor]], int]] = collections.deque()
        try:
            await self._chunks.open(ahead=min(self._depth, self.num_layers) - 1)
            self._chunks.reserve_staging(self._outputs.kind)
            in_flight, threads = self._fetches_in_flight()
            step = self._layers_per_fetch()
            while layer < self.num_layers:
                await self.pace.until_allowed(layer, lambda: self._closing)
                following = layer + sum(count for _, count in started)  # the first layer not yet being fetched
                # A ring's layers in flight stay within `ring` of the first one not yet arrived, however far the
                # consumer has released (a restart releases layers it will not take): no two share a buffer.
                limit = min(self.num_layers, self.pace.allowed(), layer + (self.ring or self.num_layers))
                runs: list[tuple[int, int]] = []  # the runs to start now: (first layer, layers)
                while following < limit and len(started) + len(runs) < in_flight:
                    count = min(step, limit - following)
                    runs.append((following, count))
                    following += count
                share = _thread_share(threads, self._resources.read_threads, len(started) + len(runs))
                for first, count in runs:
                    started.append((asyncio.create_task(self._fetch(first, count, step, share)), count))
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
                self._chunks.release(self._outputs.last_copy)

    async def _fetch(self, first: int, count: int, longest: int, threads: int) -> list[torch.Tensor]:
        """Layers ``first`` to ``first + count - 1`` of every chunk, each concatenated along the token axis.

        RunFailed if one of them cannot be fetched. ``longest``: the most layers a fetch has; ``threads``:
        the thread calls its copies and file reads are spread over.
        """
        run = self._outputs.run(first, count, len(self._keys))
        reads = RunReads(self._resources, self._outputs.fence, threads, self._accounted)
        self._chunks.schedule(run, reads)
        try:
            await reads.run()
        except Exception as error:  # (FenceClosed too) the first layer that failed: the layers before it are sound
            bad = error.layer if isinstance(error, PrefetchError) and error.layer is not None else first
            raise RunFailed(error, run.complete_before(bad)) from None
        if run.kind is OutputKind.DEVICE:
            before = [self.pace.before_writing(layer) for layer in range(first, first + count)]  # a ring's readers
            self.completions[first : first + count] = self._outputs.upload(run, longest, before)
        return run.layers

    def _overlaps(self) -> bool:
        """Whether layer i+1's reads may start while layer i's run: every chunk from DRAM or a local tier. The
        thread calls of two layers then keep the I/O threads (and the bus) busy across the wait between layers;
        a remote reader reads its layers in order, so a stream with one does not."""
        return self._chunks.all_local()

    def _fetches_in_flight(self) -> tuple[int, int]:
        """Runs of layers read at once (at most), and the thread calls all of them together may use.

        FETCHES_IN_FLIGHT runs where _overlaps allows, each over ``read_threads`` calls; where that would be
        more threads than cores (2 cores, 2 read threads), the runs in flight share the cores instead
        (:func:`_thread_share`): more threads would only take turns, and a thread switched out between a file
        read and its checksum checks bytes no longer in its cache. (A stream from disk on 2 cores, of
        ``get_many`` from disk: 0.82x with two runs of two threads, about 0.85x with one run of two.)
        """
        threads = self._resources.read_threads
        if not self._overlaps():
            return 1, threads
        return FETCHES_IN_FLIGHT, min(FETCHES_IN_FLIGHT * threads, max(threads, usable_cores()))

    def _layers_per_fetch(self) -> int:
        """Layers fetched together (at most): 1, or from DRAM and local tiers into device outputs, enough that each
        chunk moves about UPLOAD_BYTES at once (one copy across the bus), or into contiguous CPU outputs, about
        IN_PLACE_BYTES (a file's: one vectored read, checksummed while hot). Longer runs switch between files less
        often: a stream from disk on 2 cores made 0.87-0.93x of ``get_many`` from disk in runs of 8 MiB, 0.81-0.86x
        in runs of 4 MiB, 0.64-0.86x in runs doubling from one layer. From DRAM, runs of one layer left the threads
        idle between runs (a stream 4 layers ahead copied 5.5-6 GB/s, in runs of 8 MiB 7-8 GB/s, on 2 cores). A
        remote reader reads its layers one by one."""
        kind = self._outputs.kind
        if kind is OutputKind.HOST or not self._overlaps():
            return 1
        run_bytes = UPLOAD_BYTES if kind is OutputKind.DEVICE else IN_PLACE_BYTES
        return max(1, min(self.num_layers, -(-run_bytes // self._resources.layout.layer_nbytes)))


def _thread_share(threads: int, most: int, in_flight: int) -> int:
    """The thread calls a run of layers started now is spread over: an equal share of ``threads`` among the
    ``in_flight`` runs it will be one of, at most ``most`` (``read_threads``) and at least one.

    Shared by the runs in flight, not fixed per run: a consumer that keeps the stream only a few layers
    ahead (the vLLM connector's depth 4) leaves room for one run at a time, and that run then has every
    thread (one thread there read a stream from disk at 0.50-0.54x of ``get_many`` from disk on 2 cores).
    """
    return max(1, min(most, threads // max(1, in_flight)))


def _retrieve(future: asyncio.Future[Any]) -> None:
    """A finished future's outcome, retrieved: a failure nobody awaits is not an "unhandled" error."""
    if future.done() and not future.cancelled():
        future.exception()
