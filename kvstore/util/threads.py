"""Running blocking work (file I/O, codecs, checksums) off the event loop, safely.

Work handed to a thread often reads or writes a DRAM slot. If the awaiting coroutine is
cancelled (a timeout, a shutdown) the thread keeps running; releasing the slot then would let
another chunk overwrite memory that the thread is still using. So :func:`in_thread` does not
return, even when cancelled, before its thread has finished.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import Executor
from typing import ParamSpec, TypeVar

P = ParamSpec("P")
T = TypeVar("T")


async def in_thread(executor: Executor | None, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
    """Run ``fn`` in ``executor``; on cancellation, wait for the thread, then re-raise."""
    loop = asyncio.get_running_loop()
    future = loop.run_in_executor(executor, lambda: fn(*args, **kwargs))
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
        raise
