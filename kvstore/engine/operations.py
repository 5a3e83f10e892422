"""Tier operations the store waits for: each bounded by its timeout, each tracked until it really ends.

An engine must never wait on a tier longer than the configured timeout, so the store stops
waiting then and counts a timeout. But the operation itself may still be running (a thread
reading a file into a DRAM slot, a request streaming into one): the memory it uses must not be
handed to another chunk until it has really finished. So every operation is a task kept here
until it ends, and whatever it holds is released by a callback at that moment, not when the
store gave up waiting. ``cancel_all`` (at close) asks the stragglers to stop; their callbacks
still release what they hold when they do.

Each operation may run under its tier's circuit breaker (:mod:`kvstore.storage.breaker`): a
tier that keeps failing or timing out is then skipped at once, instead of costing each call
its timeout, until a probe finds it answering again.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any, Protocol, TypeVar

from kvstore.errors import TierTimeout
from kvstore.storage.breaker import CircuitBreaker
from kvstore.storage.stats import Histogram, TierStats

log = logging.getLogger("kvstore")
T = TypeVar("T")


class GuardedTier(Protocol):
    """What a bounded operation needs of its tier (:class:`kvstore.storage.tier.ChunkTier` is one)."""

    name: str
    stats: TierStats  # counts the timeouts
    breaker: CircuitBreaker


class TierOperations:
    """The tier operations in flight on one store's event loop (not thread-safe: the loop's only)."""

    def __init__(self) -> None:
        self._running: set[asyncio.Future[Any]] = set()

    async def bounded(
        self,
        operation: Awaitable[T],
        timeout: float,
        tier: GuardedTier,
        latency: Histogram,
        on_end: Callable[[], None] | None = None,
        *,
        writes: int = 0,
        blame: bool = True,
    ) -> T:
        """Await ``operation`` on ``tier`` at most ``timeout`` seconds, else count it and raise :class:`TierTimeout`.

        The wait goes into ``latency`` (a timed-out one as about ``timeout``: what the engine waited).
        ``on_end`` runs when the operation has really ended (maybe long after a timeout): that is
        when the memory it used may be released.

        Under the tier's breaker a timeout, or an error the tier noted, is a failure and an answer
        (a miss included) a success. While the breaker is open the operation is not started at all:
        ``on_end`` runs at once and :class:`TierSkipped` (a TierTimeout) is raised, counted as a
        skipped read, or as ``writes`` skipped chunks for a write of that many.
        """
        skipped = partial(_never_started, operation, on_end)
        with tier.breaker.guard(writes, skipped) as attempt:  # raises TierSkipped while the breaker is open
            start = time.perf_counter()
            task = asyncio.ensure_future(operation)  # inside the guard: the tier's failures are noted for it
            self._running.add(task)
            task.add_done_callback(self._running.discard)
            if on_end is not None:
                task.add_done_callback(lambda _: on_end())
            done, _ = await asyncio.wait({task}, timeout=timeout)
            latency.observe(time.perf_counter() - start)
            if not done:
                tier.stats.timeouts += 1
                log.warning("%s tier: operation exceeded its %.1fs timeout", tier.name, timeout)
                task.cancel()
                attempt.excused = not blame
                raise TierTimeout(tier.name)
            return task.result()

    def cancel_all(self) -> None:
        """Ask every operation still running to stop (the store is closing); their ``on_end`` still runs."""
        for operation in list(self._running):
            operation.cancel()


def _never_started(operation: Awaitable[Any], on_end: Callable[[], None] | None) -> None:
    """An operation the breaker skipped: closed unstarted (no 'never awaited' warning), its memory released."""
    if inspect.iscoroutine(operation):
        operation.close()
    if on_end is not None:
        on_end()
