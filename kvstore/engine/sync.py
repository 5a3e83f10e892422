"""SyncKVStore: the store for engine threads, with its event loop in one background thread.

Each method submits the async method to that loop and waits for its result: a thin wrapper,
so behaviour and errors are the async core's. ``put`` waits only for the DRAM copy; the writes
to slower tiers continue on the loop thread while the engine goes on.

A call that ends early never leaves work behind in the caller's memory. ``submit`` returns a
:class:`LoopCall`, whose ``cancel()`` returns only once its coroutine has stopped (a read that
fills the caller's ``outs`` writes nothing into them after that; see ``KVStore.get_many``), and a
blocking call interrupted in the engine thread (a ``flush(timeout)`` that times out, a
KeyboardInterrupt) cancels its coroutine the same way before the exception reaches the caller.
The wait is bounded by ``timeouts.close``: the store's own operations stop within it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from collections.abc import Callable, Coroutine, Iterator, Sequence
from typing import Any, TypeVar

import torch

from kvstore.config import StoreConfig
from kvstore.engine.arguments import check_tensor, check_tensors
from kvstore.engine.planner import LoadPlan
from kvstore.engine.prefetch import LayerStream
from kvstore.engine.store import KVStore
from kvstore.engine.transfer import DONE, ready_on_current_stream
from kvstore.errors import LayerTimeout, StoreClosedError
from kvstore.keys import ChunkKey
from kvstore.layout import KVLayout
from kvstore.sizing.advice import Advice

T = TypeVar("T")
log = logging.getLogger("kvstore")


class SyncKVStore:
    """:class:`~kvstore.KVStore`'s methods for engine threads, blocking (see the module's doc)."""

    def __init__(self, config: StoreConfig, layout: KVLayout, namespace: str, **kwargs: Any) -> None:
        self._settle_s = config.timeouts.close  # how long a cancelled call may take to stop
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="kvstore-loop", daemon=True)
        self._thread.start()
        self._waker = LoopWaker(self._loop)
        try:
            self.store = self._call(self._create(config, layout, namespace, kwargs))
        except BaseException:
            self._stop_loop()
            raise

    @staticmethod
    async def _create(config: StoreConfig, layout: KVLayout, namespace: str, kwargs: dict[str, Any]) -> KVStore:
        return await KVStore(config, layout, namespace, **kwargs).open()

    def _call(self, coroutine: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run ``coroutine`` on the loop and wait for it; if the wait ends early (a timeout, an interrupt),
        the coroutine is cancelled, and has stopped, before the exception is raised."""
        if threading.current_thread() is self._thread:
            coroutine.close()
            raise RuntimeError("SyncKVStore methods cannot be called from its own event-loop thread")
        call = self.submit(coroutine)
        try:
            return call.result(timeout)
        except BaseException:
            call.cancel()  # False if it had ended: then nothing is left running
            raise

    def chunk_keys(self, token_ids: Sequence[int], extra: bytes | None = None) -> list[ChunkKey]:
        return self.store.chunk_keys(token_ids, extra)

    def put(self, key: ChunkKey, kv: torch.Tensor, *, parent: ChunkKey | None = None) -> bool:
        """``KVStore.put``; a device ``kv`` is copied once the work queued on this thread's current stream is done."""
        check_tensor(kv, "put: kv")  # before its device is read here
        return self._call(self.store.put(key, kv, parent=parent, ready=ready_on_current_stream(kv.device)))

    def put_many(
        self,
        keys: Sequence[ChunkKey],
        kvs: Sequence[torch.Tensor],
        *,
        parents: Sequence[ChunkKey | None] | None = None,
    ) -> list[bool]:
        """``KVStore.put_many`` (one hop to the loop for all of them); device tensors as in :meth:`put`."""
        check_tensors(kvs, "put_many: kvs")  # before their devices are read here
        device = next((kv.device for kv in kvs if kv.device.type == "cuda"), None)
        ready = ready_on_current_stream(device) if device is not None else None
        return self._call(self.store.put_many(keys, kvs, parents=parents, ready=ready))

    def lookup(self, keys: Sequence[ChunkKey]) -> int:
        return self._call(self.store.lookup(keys))

    def lookup_future(self, keys: Sequence[ChunkKey]) -> concurrent.futures.Future[int]:
        """``lookup`` without waiting: for callers that must not block (an engine's scheduler)."""
        return self.submit(self.store.lookup(keys))

    def plan(self, keys: Sequence[ChunkKey]) -> LoadPlan:
        """``KVStore.plan``: how many leading ``keys`` to load, and from which tier (blocking)."""
        return self._call(self.store.plan(keys))

    def plan_future(self, keys: Sequence[ChunkKey]) -> concurrent.futures.Future[LoadPlan]:
        """``plan`` without waiting: for callers that must not block (an engine's scheduler)."""
        return self.submit(self.store.plan(keys))

    def submit(self, coroutine: Coroutine[Any, Any, T]) -> LoopCall[T]:
        """Run a coroutine (using ``self.store``) on the store's loop without waiting for it.

        The future's ``cancel()`` returns once the coroutine has stopped (see :class:`LoopCall`).
        """
        if self._loop.is_closed() or not self._thread.is_alive():
            coroutine.close()
            raise StoreClosedError("the SyncKVStore is closed")
        call: LoopCall[T] = LoopCall(self._loop, self._thread, self._settle_s)
        try:
            self._loop.call_soon_threadsafe(call.start, coroutine)
        except RuntimeError:  # the loop closed meanwhile
            coroutine.close()
            raise StoreClosedError("the SyncKVStore is closed") from None
        return call

    def get(self, key: ChunkKey, out: torch.Tensor | None = None) -> torch.Tensor | None:
        return self._call(self.store.get(key, out))

    def get_many(
        self, keys: Sequence[ChunkKey], outs: Sequence[torch.Tensor] | None = None
    ) -> list[torch.Tensor | None]:
        """``KVStore.get_many``: each chunk as ``outs[i]`` (or a new tensor), or None on a miss.

        Once this returns, or raises, nothing writes into ``outs`` any more; so too once a
        ``submit(store.get_many(keys, outs))`` future's ``cancel()`` has returned.
        """
        return self._call(self.store.get_many(keys, outs))

    def prefetch(
        self, keys: Sequence[ChunkKey], *, depth: int = 2, outs: Sequence[torch.Tensor] | None = None
    ) -> SyncLayerStream:
        """The layer stream for engine threads: ``stream.wait_layer(i)`` blocks until layer i is in."""
        if outs is not None:  # before their device is read here
            check_tensors(outs, "prefetch: outs")
        ready = ready_on_current_stream(outs[0].device) if outs else None  # this thread's stream, not the loop's
        stream = self._call(_on_loop(lambda: self.store.prefetch(keys, depth=depth, outs=outs, ready=ready)))
        return SyncLayerStream(self, stream)

    def flush(self, timeout: float | None = None) -> None:
        self._call(self.store.flush(), timeout)

    def stats(self) -> dict[str, dict[str, Any]]:
        return self._call(_on_loop(self.store.stats))

    def advise(self, bounds: tuple[int, int] | None = None) -> Advice:
        """:meth:`KVStore.advise`, run on the store's loop (the tracker is the loop's)."""
        return self._call(_on_loop(lambda: self.store.advise(bounds)))

    def close(self) -> None:
        if not self._thread.is_alive():
            return
        try:
            # close() bounds each of its steps (streams, pending writes, tiers) by timeouts.close.
            self._call(self.store.close(), timeout=3 * self.store.config.timeouts.close + 5)
        finally:
            self._stop_loop()

    def _stop_loop(self) -> None:
        self._waker.stop()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)
        if not self._thread.is_alive():
            self._loop.close()

    def __enter__(self) -> SyncKVStore:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class LoopCall(concurrent.futures.Future[T]):
    """A coroutine run on the store's loop (what :meth:`SyncKVStore.submit` returns).

    A ``concurrent.futures.Future`` whose :meth:`cancel` stops the coroutine, not only the wait
    for it: one not started yet never starts (no wait); a running one is cancelled on the loop,
    and ``cancel()`` returns once it has ended, at most ``settle_s`` seconds later (the store's
    ``timeouts.close``, within which its operations stop). So when ``cancel()`` returns True,
    memory the coroutine was writing (a ``get_many``'s ``outs``) is the caller's again, and
    whoever waits on ``result()`` in another thread is woken only then too.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, loop_thread: threading.Thread, settle_s: float) -> None:
        super().__init__()
        self._loop, self._loop_thread, self._settle_s = loop, loop_thread, settle_s
        self._task: asyncio.Task[T] | None = None
        self._started = False  # under _start_lock: the coroutine runs (or ran) on the loop
        self._start_lock = threading.Lock()
        self._ended = threading.Event()  # the coroutine has ended: nothing of it runs any more
        self._notified = False  # under _start_lock: waiters (concurrent.futures.wait) were told of the cancel

    def start(self, coroutine: Coroutine[Any, Any, T]) -> None:
        """Start the coroutine (on the loop), unless the call was cancelled first: then it never runs."""
        with self._start_lock:
            if self.cancelled():
                coroutine.close()
                self._ended.set()
                return
            self._started = True
        self._task = self._loop.create_task(coroutine)
        self._task.add_done_callback(self._finish)

    def _finish(self, task: asyncio.Task[T]) -> None:
        """The coroutine ended (on the loop): its outcome becomes this future's."""
        try:
            if task.cancelled():
                self._cancel_and_notify()
            elif self.set_running_or_notify_cancel():
                exception = task.exception()
                if exception is None:
                    self.set_result(task.result())
                else:
                    self.set_exception(exception)
        finally:
            self._ended.set()

    def cancel(self) -> bool:
        """Cancel the coroutine; True once it has stopped cancelled, False if it had ended (or would not stop).

        On the loop's own thread it cannot be waited for: it is cancelled and True returned at once.
        """
        with self._start_lock:
            if self.done():
                return False
            if not self._started:  # start() will see it and close the coroutine unrun
                return self._cancel_and_notify(locked=True)
        if threading.current_thread() is self._loop_thread:
            assert self._task is not None  # started, and start() runs on this thread
            self._task.cancel()
            return True
        try:
            self._loop.call_soon_threadsafe(self._cancel_task)
        except RuntimeError:  # the loop is closed: nothing of the coroutine runs any more
            return self._cancel_and_notify()
        if not self._ended.wait(self._settle_s):
            log.warning("a cancelled kvstore call did not stop within %.1fs (timeouts.close)", self._settle_s)
            return False
        return self.cancelled()

    def _cancel_and_notify(self, locked: bool = False) -> bool:
        """Mark the future cancelled and tell every waiter (``concurrent.futures.wait``, ``as_completed``), once.

        A plain ``Future.cancel()`` leaves waiters asleep until ``set_running_or_notify_cancel()``,
        which an executor calls; here nobody else would.
        """
        if not locked:
            with self._start_lock:
                return self._cancel_and_notify(locked=True)
        if not super().cancel():
            return False
        if not self._notified:
            self._notified = True
            self.set_running_or_notify_cancel()  # CANCELLED -> CANCELLED_AND_NOTIFIED, waiters woken
        return True

    def _cancel_task(self) -> None:
        if self._task is not None:
            self._task.cancel()


class LoopWaker:
    """Posts engine threads' calls to the store's loop from a thread of its own.

    ``call_soon_threadsafe`` wakes the loop with a write to its self-pipe: a system call that
    releases the GIL, which the calling thread then waits to get back while the woken loop
    thread runs (measured 1.1-1.4 ms per call on this 2-core VM, up to the 5 ms switch interval).
    A layer stream that runs ``depth`` layers ahead waits for the engine's next request on every
    layer, so the engine thread paid that once per layer: most of the fetch time a stream left
    visible. Here the engine thread only appends to a list and notifies a condition (no system
    call that drops the GIL); this thread pays for the wake-up while the engine computes.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._ready = threading.Condition(threading.Lock())
        self._calls: list[tuple[Callable[[int], None], int]] = []
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="kvstore-waker", daemon=True)
        self._thread.start()

    def post(self, fn: Callable[[int], None], arg: int) -> None:
        """Have ``fn(arg)`` called on the loop soon (non-blocking; dropped once the loop is closed)."""
        with self._ready:
            self._calls.append((fn, arg))
            self._ready.notify()

    def stop(self) -> None:
        """End the thread (blocking, briefly); calls not yet posted are dropped."""
        with self._ready:
            self._stopped = True
            self._ready.notify()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        while True:
            with self._ready:
                while not self._calls and not self._stopped:
                    self._ready.wait()
                if self._stopped:
                    return
                calls, self._calls = self._calls, []
            for fn, arg in calls:
                try:
                    self._loop.call_soon_threadsafe(fn, arg)
                except RuntimeError:  # the loop closed: its streams were closed first, every layer arrived
                    return


class SyncLayerStream:
    """A :class:`~kvstore.engine.prefetch.LayerStream` driven from an engine thread; close it when done."""

    def __init__(self, owner: SyncKVStore, stream: LayerStream) -> None:
        self._owner, self._stream = owner, stream

    def wait_layer(self, index: int, timeout: float | None = None) -> torch.Tensor:
        """Layer ``index`` (blocking until it has arrived, at most ``timeout`` seconds if given).

        Raises :class:`PrefetchError` if it cannot be loaded, :class:`LayerTimeout` (a PrefetchError
        and a TimeoutError) if it is late, :class:`StoreClosedError` if the store closed first.
        No round trip through the loop: the request is recorded (the loop is woken only if the
        stream waits for it, see ``StreamPace.request_from_thread``), the arrival is a
        threading.Event (a layer that is already in costs microseconds, not a thread hop).
        With device outputs, the calling thread's current stream waits for the layer's copies
        (a device-side wait: this returns once the copies are queued, not once they are done).
        """
        stream = self._stream
        if not 0 <= index < stream.num_layers:
            raise IndexError(f"layer {index} out of range for {stream.num_layers} layers")
        loop = self._owner._loop
        if loop.is_closed():  # the store's loop is closed: what has arrived is all there will be
            if not stream.arrived[index].is_set():
                raise StoreClosedError(f"the store closed before layer {index} of its stream arrived")
        elif stream.pace.request_from_thread(index):
            self._owner._waker.post(stream.pace.request, index)
        if not stream.arrived[index].wait(timeout):
            raise LayerTimeout(f"layer {index} did not arrive within {timeout}s")
        outcome = stream.outcomes[index]
        if isinstance(outcome, BaseException):
            raise outcome
        assert outcome is not None
        stream.completions[index].wait_on_current_stream()
        return outcome

    def release(self, index: int) -> None:
        """With a ring of outputs, this thread is done with layer ``index`` (see ``LayerStream``): its buffer
        takes a later layer once the work queued so far on this thread's current stream has ended. Non-blocking;
        no round trip through the loop unless the stream waits for it."""
        stream = self._stream
        if not stream.ring:
            return
        outcome = stream.outcomes[index]
        after = ready_on_current_stream(outcome.device) if isinstance(outcome, torch.Tensor) else DONE
        if stream.pace.release_from_thread(index, after) and not self._owner._loop.is_closed():
            self._owner._waker.post(stream.pace.wake, index)

    def on_arrival(self, index: int, callback: Callable[[BaseException | None], None]) -> None:
        """Call ``callback(None)`` on the store's loop when layer ``index`` has arrived and its copies into
        device outputs have completed (its error if it cannot); non-blocking. A load planner times a
        whole load this way (layer -1: the last)."""
        stream = self._stream

        async def notify() -> None:
            try:
                await stream.landed(index % stream.num_layers)
            except Exception as exc:
                callback(exc)
            else:
                callback(None)

        self._owner.submit(notify())

    def __iter__(self) -> Iterator[tuple[int, torch.Tensor]]:
        """Every layer in order; with a ring of outputs, each is released when the next is asked for."""
        for index in range(self._stream.num_layers):
            yield index, self.wait_layer(index)
            self.release(index)

    def close(self) -> None:
        """Stop the stream and release what it holds; bounded by ``timeouts.close`` (plus a margin).

        Once it returns, nothing of the stream writes into its ``outs`` again (see ``LayerStream.close``),
        unless it logged that the stream did not close in time: a read into them stalled (a hung disk), and
        they may still be written. A no-op once the store is closed (closing the store closed its streams).
        """
        try:
            limit = self._owner.store.config.timeouts.close + 5  # the stream bounds itself; the margin is the hop's
            self._owner._call(self._stream.close(), timeout=limit)
        except StoreClosedError:
            return
        except TimeoutError:
            log.warning(
                "a layer stream did not close within %.1fs (a stalled read?); its buffers may still be written", limit
            )

    def __enter__(self) -> SyncLayerStream:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


async def _on_loop(fn: Callable[[], T]) -> T:
    """Run a plain callable on the loop thread (where the store's state and running loop live)."""
    return fn()
