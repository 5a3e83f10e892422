"""Running blocking work (file I/O, codecs, checksums) off the event loop, safely.

Work handed to a thread often reads or writes a DRAM slot. If the awaiting coroutine is
cancelled (a timeout, a shutdown) the thread keeps running; releasing the slot then would let
another chunk overwrite memory that the thread is still using. So :func:`in_thread` does not
return, even when cancelled, before its thread has finished. What the thread produced for a
caller that is gone (open files, say) is handed to ``discard`` so that nothing leaks.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
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
        while not future.done():
            try:
                await asyncio.shield(future)
            except asyncio.CancelledError:
                continue
            except Exception:
                break
        if discard is not None and not future.cancelled() and future.exception() is None:
            discard(future.result())
        raise
