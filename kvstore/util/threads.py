"""Running blocking work (file I/O, codecs, checksums) off the event loop, safely.

Work handed to a thread often reads or writes a DRAM slot. If the awaiting coroutine is
cancelled (a timeout, a shutdown) the thread keeps running; releasing the slot then would let
another chunk overwrite memory that the thread is still using. So :func:`in_thread` does not
return, even when cancelled, before its thread has finished. What the thread produced for a
caller that is gone (open files, say) is handed to ``discard`` so that nothing leaks.

A thread that writes into memory the caller owns (a read straight into the caller's buffer)
cannot hold on to that memory past the caller's deadline: :class:`WriteFence` lets the loop
close the buffer to the thread at the deadline, waiting only for the writes in progress.

One piece of blocking work can be spread over idle workers of the executor it already runs in
(:func:`map_with_helpers`: a chunk's layers, encoded or decoded on every core).
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from typing import ParamSpec, TypeVar

P = ParamSpec("P")
T = TypeVar("T")


async def in_thread(
    executor: Executor | None,
    fn: Callable[P, T],
    *args: P.args,
    **kwargs: P.kwargs,
) -> T:
    """Run ``fn`` in ``executor``; on cancellation, wait for the thread, then re-raise."""
    return await in_thread_or_discard(executor, None, lambda: fn(*args, **kwargs))


async def in_thread_or_discard(
    executor: Executor | None, discard: Callable[[T], None] | None, fn: Callable[[], T]
) -> T:
    """:func:`in_thread` for work whose result holds resources: a result nobody awaits any more goes to ``discard``.

    If the awaiting task is cancelled, the thread is still waited for (its memory may be in use)
    and, once it has finished, its result is given to ``discard`` (e.g. to close the files it
    opened) before the cancellation is re-raised. The cancellation is never lost.
    """
    loop = asyncio.get_running_loop()
    future = loop.run_in_executor(executor, fn)
    try:
        return await asyncio.shield(future)
    except asyncio.CancelledError:
        await wait_through_cancel(future)
        if discard is not None and not future.cancelled() and future.exception() is None:
            discard(future.result())
        raise


class FenceClosed(Exception):
    """A write into a fenced buffer after its owner closed the fence (the thread stops there)."""


class WriteFence:
    """Guards caller-owned buffers against worker threads' late writes.

    A thread wraps each write into the buffers in ``with fence:`` (raises :class:`FenceClosed`
    once the fence is closed, so nothing starts after); several threads may write at once. The
    loop calls :meth:`close` when it stops waiting (a deadline, a closed stream): from its return
    on, no write into the buffers is in progress and none will start, so the caller may reuse
    them at once. Loop code may write under the fence too: it then never waits (the fence's lock
    is held only to count writers, never across a write).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()  # held only to count writers and to read the flag
        self._idle = threading.Condition(self._lock)  # notified when the last writer leaves
        self._writers = 0
        self._closed = False

    def __enter__(self) -> None:
        with self._lock:
            if self._closed:
                raise FenceClosed("the buffer's owner stopped waiting")
            self._writers += 1

    def __exit__(self, *exc_info: object) -> None:
        with self._lock:
            self._writers -= 1
            if not self._writers:
                self._idle.notify_all()

    @property
    def closed(self) -> bool:
        """Whether no write may start any more (:meth:`shut` or :meth:`close` was called)."""
        return self._closed

    def shut(self) -> None:
        """Let no write start from now on (non-blocking); :meth:`close` then waits for those in progress."""
        with self._lock:
            self._closed = True

    async def close(self) -> None:
        """Close the fence; returns once no write into the buffers is in progress (non-blocking for the loop).

        Waits for at most the writes threads are in the middle of (bounded pieces, e.g. 1 MiB of a
        file each), never for the rest of their work. Cancelled meanwhile, it still waits for them,
        then raises the cancellation.
        """
        with self._lock:
            self._closed = True  # a thread entering from now on sees it
            if not self._writers:
                return
        waiting = asyncio.get_running_loop().run_in_executor(None, self._wait_for_writers)
        if await wait_through_cancel(waiting):
            raise asyncio.CancelledError

    def _wait_for_writers(self) -> None:
        with self._lock:
            while self._writers:
                self._idle.wait()


async def wait_through_cancel(future: asyncio.Future[object]) -> bool:
    """Wait until ``future`` is done, even if the caller is cancelled meanwhile; True if it was.

    For waits that must not be cut short (memory still being written): the caller finishes its
    clean-up, then raises ``asyncio.CancelledError`` itself when this returns True. The
    future's own outcome is left to whoever reads it.
    """
    cancelled = False
    while not future.done():
        try:
            await asyncio.shield(future)
        except asyncio.CancelledError:
            cancelled = cancelled or not future.cancelled()  # the caller's, not the future's own
        except Exception:
            break
    return cancelled


async def close_fences(fences: Sequence[WriteFence]) -> None:
    """Close every fence; returns once no write into any of their buffers is in progress.

    All are shut first, so no write starts anywhere while this waits for those in progress; a
    cancellation meanwhile is raised once every fence is closed (never with a buffer still written).
    """
    for fence in fences:
        fence.shut()
    cancelled = False
    for fence in fences:
        try:
            await fence.close()
        except asyncio.CancelledError:  # raised only once that fence's write has ended
            cancelled = True
    if cancelled:
        raise asyncio.CancelledError


def usable_cores() -> int:
    """CPU cores this process may run on (its affinity mask where the OS has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


class _SharedItems:
    """Items ``0..count-1`` claimed one at a time by whichever thread asks next (see :func:`map_with_helpers`)."""

    def __init__(self, fn: Callable[[int], T], count: int) -> None:
        self._fn = fn
        self._count = count
        self._next = 0
        self._running = 0  # items claimed and not finished
        self._lock = threading.Lock()
        self._finished = threading.Condition(self._lock)
        self.results: list[T | None] = [None] * count
        self.error: BaseException | None = None

    def _claim(self) -> int | None:
        with self._lock:
            if self._next >= self._count or self.error is not None:
                return None
            self._next += 1
            self._running += 1
            return self._next - 1

    def work(self) -> None:
        """Run items until none is left to claim (blocking); never raises (the first error is kept)."""
        while (item := self._claim()) is not None:
            try:
                self.results[item] = self._fn(item)
            except BaseException as exc:  # handed to the caller, who raises it
                with self._lock:
                    self.error = self.error or exc
            finally:
                with self._lock:
                    self._running -= 1
                    if not self._running:
                        self._finished.notify_all()

    def wait(self) -> None:
        """Block until every claimed item has finished (call once nothing is left to claim)."""
        with self._lock:
            while self._running:
                self._finished.wait()


def map_with_helpers(fn: Callable[[int], T], count: int, executor: Executor | None, helpers: int) -> list[T]:
    """``[fn(0), ..., fn(count - 1)]``, run by the calling thread with up to ``helpers`` tasks of ``executor``.

    Blocking. The calling thread works through the items itself; each helper task, whenever a
    worker of ``executor`` gets to it, takes items from the same queue. So the caller may well be
    running in ``executor`` already (a tier's codec work does, in its I/O threads): it never
    waits for a helper that has not started (if every worker is busy, the caller does all the
    items alone, as it would without helpers), only for items that a running helper has claimed
    and is working on. No deadlock however small the executor, and no second pool to size. A
    helper that starts after the items are gone returns at once, touching nothing: when this
    returns, no thread is still running ``fn``, so the caller's buffers are its own again.

    ``fn`` runs concurrently with itself: it must be thread-safe, and worth it only where it
    releases the GIL (zstd, numpy's whole-array operations and xxh3 do: a thread running each for
    100 ms stalled another thread's wake-ups by at most 4 ms).
    The first exception ``fn`` raises is re-raised here, once every claimed item has finished;
    items not yet claimed by then are skipped.
    """
    shared = _SharedItems(fn, count)
    if executor is not None:
        for _ in range(min(helpers, count - 1)):
            try:
                executor.submit(shared.work)
            except RuntimeError:  # the executor is shutting down: the caller does the rest alone
                break
    shared.work()
    shared.wait()
    if shared.error is not None:
        raise shared.error
    return shared.results  # type: ignore[return-value]  # every item ran, or the error was raised
