"""Copies between host memory (the DRAM pool's pinned slots) and device tensors: where kvstore crosses the bus.

On a GPU the bus is the budget (``../shared/DESIGN.md``: pinned memory moves ~55 GB/s each way on
PCIe Gen5, pageable memory a fraction of that), and a copy the engine's thread waits for costs it
the whole transfer. So every copy to or from a CUDA tensor goes through :class:`DeviceTransfers`:

- **asynchronous, on a stream of its own per direction** (host to device, device to host), never on
  the engine's compute stream and never with a host-side synchronize on the engine's thread;
- **completion is a** :class:`Completion` (a CUDA event recorded after the copies): the consumer
  makes its compute stream wait for it (``wait_on_current_stream``: a device-side wait, the host
  goes on), the store's own threads may block on it;
- **memory under a copy stays alive until the copy has completed**: :meth:`DeviceTransfers.after`
  runs a callback (releasing the DRAM slots a copy read or wrote, publishing a put) on the store's
  loop once the event has completed. A waiter thread of its own blocks on the events, so no slot is
  reused under a copy in flight and no thread of the engine or the loop ever waits for one;
- a device tensor a download reads is recorded on the download stream (``record_stream``), so
  torch's allocator does not hand its memory out again before the copy has read it; the download
  stream first waits for the stream that produced the data (``ready``).

CPU tensors take the same functions: the copies are plain (one thread, :func:`copy_between`) and
the completion is :data:`DONE`. Callers choose their device path with :meth:`DeviceTransfers.crosses_bus`;
``DeviceTransfers(host_as_device=True)`` answers True for CPU tensors too, so the CPU test suite runs
every caller's device path (staging in host memory, deferred releases, completions), only without events.

One path does not come here: ``get_many`` into CUDA tensors copies each chunk synchronously out of its
slot while the call holds it (0.95x of the bus on an H100; the call returns with the data in place).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import Callable, Sequence

import torch

from kvstore.util.buffers import copy_between

log = logging.getLogger("kvstore.transfer")


class Completion:
    """The end of a group of copies: an event on a copy stream, or nothing to wait for (CPU copies).

    ``done()`` never blocks; ``wait_on_current_stream()`` makes the calling thread's current device
    stream wait (the host does not); ``synchronize()`` blocks the calling thread: only the store's
    own threads call it, never an engine thread.
    """

    __slots__ = ("event",)

    def __init__(self, event: torch.cuda.Event | None = None) -> None:
        self.event = event

    def done(self) -> bool:
        return self.event is None or self.event.query()

    def wait_on_current_stream(self) -> None:
        if isinstance(self.event, torch.cuda.Event):  # the current stream of the event's device
            self.event.wait(torch.cuda.current_stream(self.event.device))
        elif self.event is not None:  # an event-like object of a test
            self.event.wait()

    def synchronize(self) -> None:
        if self.event is not None:
            self.event.synchronize()


DONE = Completion()
"""The completion of copies that ended before their function returned (CPU copies)."""


def is_device(tensor: torch.Tensor) -> bool:
    """True for a tensor whose copies go through the copy streams (CUDA); False for CPU memory."""
    return tensor.device.type == "cuda"


def ready_on_current_stream(device: torch.device) -> Completion:
    """An event on the calling thread's current stream of ``device``: what a download must wait for.

    The engine's thread calls it where it produced the data (its compute stream may not be the
    default one) before handing the tensor to the store's loop; :data:`DONE` for a CPU device.
    """
    if device.type != "cuda":
        return DONE
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return Completion(event)


class DeviceTransfers:
    """The copy streams of one store (per CUDA device: host to device, device to host, and the placing of
    uploaded layers on the device), and the thread that watches their events.

    ``upload``/``upload_layers`` copy host to device, ``download`` device to host; each returns at once
    with the copies queued on the direction's stream and a :class:`Completion`. Thread-safe: streams
    are made under a lock, and a copy may be issued from any thread (the stream is set per call).
    """

    def __init__(self, host_as_device: bool = False) -> None:
        """``host_as_device``: treat CPU tensors as device memory (:meth:`crosses_bus`), for tests."""
        self.host_as_device = host_as_device
        self._streams: dict[tuple[torch.device, str], torch.cuda.Stream] = {}
        self._lock = threading.Lock()
        self._pending: queue.SimpleQueue[_Waiting | None] = queue.SimpleQueue()
        self._waiter: threading.Thread | None = None
        self._closed = False

    def crosses_bus(self, tensor: torch.Tensor) -> bool:
        """Whether copies to or from ``tensor`` take the device path: queued, with a completion (CUDA)."""
        return is_device(tensor) or (self.host_as_device and tensor.device.type == "cpu")

    def stream(self, device: torch.device, direction: str) -> torch.cuda.Stream:
        """The stream for ``direction`` ("h2d", "d2h", or "place": uploads put in place) on a CUDA ``device``."""
        device = torch.device("cuda", device.index if device.index is not None else torch.cuda.current_device())
        with self._lock:
            stream = self._streams.get((device, direction))
            if stream is None:
                stream = self._streams[(device, direction)] = torch.cuda.Stream(device)
            return stream

    # -- copies ----------------------------------------------------------------------------------

    def upload(self, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> Completion:
        """Copy each ``(device target, host source)``; the sources must stay untouched until the completion.

        Host sources should be pinned (a DRAM slot): a pageable source makes that copy synchronous.
        """
        if not pairs:
            return DONE
        device = pairs[0][0].device
        if not is_device(pairs[0][0]):
            for target, source in pairs:
                copy_between(target, source)
            return DONE
        stream = self.stream(device, "h2d")
        with torch.cuda.stream(stream):
            for target, source in pairs:
                target.copy_(source, non_blocking=True)
            return _record(stream)

    def upload_layers(
        self,
        outs: Sequence[torch.Tensor],
        sources: Sequence[torch.Tensor],
        scratch: UploadScratch | None,
        before: Sequence[Completion] | None = None,
    ) -> list[Completion]:
        """Consecutive layers of ``len(sources)`` chunks into ``outs``, one completion per layer.

        ``sources[i]`` is chunk i's ``[len(outs), planes, tokens, heads, dim]`` in host memory (a run of its
        DRAM slot); its layer j lands in ``outs[j][:, i * tokens : (i + 1) * tokens]`` (each out is
        ``[planes, n * tokens, heads, dim]``, any strides). On a device, each chunk is one contiguous copy into
        one of ``scratch``'s buffers (a run of layers rather than one: each copy costs the copy engine a setup
        besides its bytes), then one copy per layer on a placing stream puts it in place, while the next
        run's copies go into the other buffer. On the CPU, each piece is copied into place.
        ``before[j]``: what must end before ``outs[j]`` is written (its last reader's stream; a ring's buffer).
        """
        count = len(sources)
        if not is_device(outs[0]):
            tokens = outs[0].shape[1] // max(1, count)
            for layer, out in enumerate(outs):
                for index, source in enumerate(sources):
                    copy_between(out[:, index * tokens : (index + 1) * tokens], source[layer])
            return [DONE] * len(outs)
        assert scratch is not None
        buffer, placed_before = scratch.take(count, len(outs))
        copying, placing = self.stream(outs[0].device, "h2d"), self.stream(outs[0].device, "place")
        if placed_before is not None:  # the buffer's previous run has been put in place: it may be overwritten
            copying.wait_event(placed_before)
        with torch.cuda.stream(copying):
            for index, source in enumerate(sources):
                buffer[index, : len(outs)].copy_(source, non_blocking=True)
            copied = torch.cuda.Event()
            copied.record(copying)
        placing.wait_event(copied)
        completions = []
        with torch.cuda.stream(placing):
            for layer, out in enumerate(outs):
                if before is not None and isinstance(before[layer].event, torch.cuda.Event):
                    placing.wait_event(before[layer].event)
                target = out.unflatten(1, (count, out.shape[1] // count))  # [planes, n, tokens, heads, dim]
                target.copy_(buffer[:count, layer].transpose(0, 1))
                out.record_stream(placing)  # freed early (a request that ended), its memory waits for this copy
                completions.append(_record(placing))
            buffer.record_stream(placing)
        scratch.placed(completions[-1])
        return completions

    def scratch_for(
        self, out: torch.Tensor, chunks: int, layers: int = 1, ready: Completion | None = None
    ) -> UploadScratch | None:
        """Device buffers for :meth:`upload_layers` of up to ``layers`` layers like ``out`` (None on the CPU).

        Two buffers of ``chunks * layers`` chunk-layers each (8 MiB a chunk for Llama-3-8B: 1 GiB for a 32K
        prompt, while it loads). Allocated on the upload stream, so torch's allocator orders their reuse after
        the copies into them. ``ready``: the consumer's stream when it handed over its outputs (memory it may
        still be reading, freed and handed out again): the placing stream waits for it before its first copy.
        """
        if not is_device(out):
            return None
        if ready is not None and isinstance(ready.event, torch.cuda.Event):
            self.stream(out.device, "place").wait_event(ready.event)
        planes, tokens, rest = out.shape[0], out.shape[1] // chunks, tuple(out.shape[2:])
        shape = (chunks, layers, planes, tokens, *rest)
        with torch.cuda.stream(self.stream(out.device, "h2d")):
            return UploadScratch([torch.empty(shape, dtype=out.dtype, device=out.device) for _ in range(2)])

    def download(
        self, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], ready: Completion | None = None
    ) -> Completion:
        """Copy each ``(host target, device source)``, after ``ready`` (the producer's event; default: the
        calling thread's current stream). The targets (pinned DRAM slots) must not be read or reused
        until the completion; the sources are kept from torch's allocator until then (``record_stream``).
        """
        if not pairs:
            return DONE
        source = pairs[0][1]
        if not is_device(source):
            for target, host in pairs:
                copy_between(target, host)
            return DONE
        stream = self.stream(source.device, "d2h")
        wait = ready if ready is not None else ready_on_current_stream(source.device)
        if wait.event is not None:
            stream.wait_event(wait.event)
        with torch.cuda.stream(stream):
            for target, device_source in pairs:
                target.copy_(device_source, non_blocking=True)
                device_source.record_stream(stream)
            return _record(stream)

    # -- completion ------------------------------------------------------------------------------

    def after(
        self,
        completion: Completion,
        callback: Callable[[], None],
        loop: asyncio.AbstractEventLoop,
        on_error: Callable[[BaseException], None] | None = None,
    ) -> None:
        """Run ``callback`` on ``loop`` once ``completion`` is done (at once, inline, if it already is).

        Called on ``loop``'s thread. Never blocks: the waiting happens in this object's waiter thread.
        If the copies fail (a device error), ``on_error`` runs on the loop instead: whoever waits is
        told, and the memory under the copies is never handed back (it may still be in use). A
        callback whose loop has closed meanwhile, or asked for after :meth:`close`, is dropped (the
        store that owned the memory is gone).
        """
        if completion.done():
            callback()
            return
        with self._lock:
            if self._closed:
                log.debug("a copy's callback after the store's transfers closed: dropped")
                return
            if self._waiter is None:
                self._waiter = threading.Thread(target=self._wait, name="kvstore-transfers", daemon=True)
                self._waiter.start()
        self._pending.put((completion, callback, loop, on_error))

    def completed(self, completion: Completion) -> asyncio.Future[None]:
        """A future of the running loop, done once ``completion`` is (its exception: the copies failed).

        Non-blocking, on the loop's thread (see :meth:`after`); already done if ``completion`` is.
        """
        loop = asyncio.get_running_loop()
        finished: asyncio.Future[None] = loop.create_future()

        def failed(error: BaseException) -> None:
            if not finished.done():
                finished.set_exception(error)

        self.after(completion, lambda: finished.done() or finished.set_result(None), loop, failed)
        return finished

    def _wait(self) -> None:
        """The waiter thread: block on each completion in turn, then post its callback to the loop."""
        while True:
            item = self._pending.get()
            if item is None:
                return
            completion, callback, loop, on_error = item
            try:
                completion.synchronize()
            except Exception as exc:  # a device error: the memory may still be in use, so it is never handed back
                log.exception("a device copy failed; its DRAM slots stay held")
                if on_error is not None:
                    self._post(loop, on_error, exc)
                continue
            self._post(loop, callback)

    @staticmethod
    def _post(loop: asyncio.AbstractEventLoop, fn: Callable[..., None], *args: object) -> None:
        try:
            loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the loop closed
            pass

    def close(self) -> None:
        """Stop the waiter thread once the completions queued before are handled (non-blocking)."""
        with self._lock:
            self._closed = True
            if self._waiter is not None:
                self._pending.put(None)


class UploadScratch:
    """Two device buffers that runs of layers land in before a placing copy puts them in place, used in turn:
    the copies into one overlap the placing out of the other (a placing copy costs ~5% of the bus's time)."""

    def __init__(self, buffers: list[torch.Tensor]) -> None:
        self.buffers = buffers
        self._placed: list[torch.cuda.Event | None] = [None] * len(buffers)  # per buffer: its last placing
        self._turn = 0

    def take(self, chunks: int, layers: int) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        """The next buffer, and the event its previous run's placing recorded (the copies into it wait for it)."""
        which = self._turn % len(self.buffers)
        self._turn += 1
        buffer = self.buffers[which]
        if buffer.shape[0] < chunks or buffer.shape[1] < layers:
            raise ValueError(
                f"an upload of {layers} layers of {chunks} chunks into scratch of shape {tuple(buffer.shape)}"
            )
        return buffer, self._placed[which]

    def placed(self, completion: Completion) -> None:
        """The buffer last taken has been put in place once ``completion`` is done."""
        self._placed[(self._turn - 1) % len(self.buffers)] = completion.event


_Waiting = tuple[Completion, Callable[[], None], asyncio.AbstractEventLoop, "Callable[[BaseException], None] | None"]


def _record(stream: torch.cuda.Stream) -> Completion:
    """An event after everything queued on ``stream`` so far (blocking-sync: a waiter sleeps, not spins)."""
    event = torch.cuda.Event(blocking=True)
    event.record(stream)
    return Completion(event)
