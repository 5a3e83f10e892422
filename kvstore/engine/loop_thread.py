"""The store's event loop in a thread of its own, and the calls engine threads make onto it.

- :class:`LoopCall`: a coroutine run on that loop, as a ``concurrent.futures.Future`` whose
  ``cancel()`` returns only once the coroutine has stopped (so memory it was writing is the
  caller's again).
- :class:`LoopWaker`: posts engine threads' small requests to the loop from a thread of its own,
  so the engine thread never pays for waking the loop.
- :func:`on_loop`: a plain callable run on the loop (where the store's state lives).

Used by :class:`~kvstore.engine.sync.SyncKVStore`; nothing here knows what a store is.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")
log = logging.getLogger("kvstore")


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


async def on_loop(fn: Callable[[], T]) -> T:
    """Run a plain callable on the loop thread (where the store's state and running loop live)."""
    return fn()
