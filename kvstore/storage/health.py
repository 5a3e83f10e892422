"""A tier's health: its circuit breaker, its failure counters, its latency and the operations in flight on it.

Every failure of a tier is written here and nowhere else: an error (:meth:`TierHealth.error`),
a timeout, a dropped write, and each breaker transition (through :meth:`TierHealth.run`). The
tier (:class:`kvstore.storage.tier.ChunkTier`) owns one; the store, its loads, layer streams
and layer readers call the tier's guarded operations, never these parts.

One operation, :meth:`TierHealth.run`, admits, bounds, times, counts and trips the breaker:

- **admits**: while the breaker is open the operation is not started at all; the skip is
  counted (a read, or ``writes`` chunks) and :class:`~kvstore.errors.TierSkipped` raised;
- **bounds**: the caller waits at most ``timeout`` seconds, then gets
  :class:`~kvstore.errors.TierTimeout` (counted). A *detached* operation (the default) runs as
  a task tracked here until it really ends, even past its timeout, so the memory it uses is
  released (``on_end``) only then; an *inline* one is cancelled at its timeout and with its caller;
- **times**: the wait goes into the given latency histogram;
- **counts and trips**: an exception out of the operation, a timeout the caller blames on the
  tier, or an error the tier's code reported on the operation's :class:`Attempt` is a failure;
  an answer (a miss included) is a success; a cancellation is neither.

The attempt is passed to the operation explicitly (``run(lambda attempt: ..., ...)``), so
concurrent operations on the same tier never take the blame for each other. All of it runs on
the store's event loop (not thread-safe); the counters may be read from a scrape thread.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from kvstore.errors import TierSkipped, TierTimeout
from kvstore.storage.breaker import CircuitBreaker, unreachable
from kvstore.storage.stats import Histogram, TierLatency, TierStats

log = logging.getLogger("kvstore.tier")
T = TypeVar("T")


class Attempt:
    """One guarded operation on a tier: its code calls :meth:`fail` where the tier (not an object) failed it."""

    __slots__ = ("failed",)

    def __init__(self) -> None:
        self.failed = False

    def fail(self) -> None:
        self.failed = True


class _Unguarded(Attempt):
    """The attempt of a call made outside :meth:`TierHealth.run` (a test, a benchmark, a maintenance tool)."""

    __slots__ = ()

    def fail(self) -> None:
        pass


UNGUARDED = _Unguarded()
"""What tier methods take when no guarded operation is under way: a failure noted on it changes no breaker."""


class TierHealth:
    """One tier's breaker, counters, latency and operations in flight (see the module docstring)."""

    def __init__(self, name: str, breaker: CircuitBreaker | None = None) -> None:
        self.name = name
        self.breaker = breaker if breaker is not None else CircuitBreaker(name)
        self.stats = TierStats()
        self.latency = TierLatency()
        self._running: set[asyncio.Future[Any]] = set()

    # -- the counters of failures -------------------------------------------------------------------

    def error(self, attempt: Attempt, what: str, exc: BaseException, *, tier_fault: bool = True) -> None:
        """Count and log ``what`` failing with ``exc``; ``tier_fault`` (the tier or its server failed it) marks
        ``attempt`` failed.

        Not the tier's fault: a write its server refused while answering (out of memory, access
        denied) and a failed removal of a corrupt object: neither says the tier cannot serve reads.
        A server that cannot be reached is logged at DEBUG, not once per call: the breaker's
        transitions (and the backend's own line) say so once per change of state.
        """
        self.stats.errors += 1
        if tier_fault:
            attempt.fail()
        log.log(logging.DEBUG if unreachable(exc) else logging.WARNING, "%s tier: %s failed: %r", self.name, what, exc)

    def timeout(self, attempt: Attempt, what: str) -> None:
        """Count a request that ran out of time below the caller's bound (a client's own socket timeout)."""
        self.stats.timeouts += 1
        attempt.fail()
        log.debug("%s tier: %s ran out of time", self.name, what)

    def drop(self, chunks: int = 1) -> None:
        """Count writes never made: the tier's queue was full, or the store closed with them queued."""
        self.stats.drops += chunks

    # -- the guarded operation ------------------------------------------------------------------------

    async def run(
        self,
        operation: Callable[[Attempt], Awaitable[T]],
        timeout: float | None,
        *,
        latency: Histogram | None = None,
        on_end: Callable[[], None] | None = None,
        writes: int = 0,
        blame: bool = True,
        detached: bool = True,
        cancel_with_caller: bool = False,
    ) -> T:
        """Run ``operation(attempt)`` on the tier under its breaker and ``timeout`` (see the module docstring).

        ``on_end`` runs once the operation has really ended (at once if it is skipped). ``writes``:
        the chunks a write carries (what a skip counts). ``blame=False``: a timeout was cut short
        by the caller's own deadline, not the tier's fault: counted, never a breaker failure.
        ``detached=False``: awaited in place, cancelled at its timeout and with its caller (an
        operation that cleans up after itself on cancellation; no ``latency`` is observed).
        ``cancel_with_caller``: a detached operation is cancelled too when its caller is (one
        writing into the caller's memory).
        """
        breaker = self.breaker
        if not breaker.admit():
            breaker.skip(writes)
            if on_end is not None:
                on_end()
            raise TierSkipped(self.name)
        probe = breaker.state == "half-open"  # only the probe is admitted while half-open
        attempt = Attempt()
        try:
            if detached:
                result = await self._detached(operation(attempt), timeout, latency, on_end, cancel_with_caller)
            else:
                result = await self._inline(operation(attempt), timeout)
        except asyncio.CancelledError:
            breaker.settle(probe, failed=attempt.failed, cancelled=True)
            raise
        except TierTimeout:
            self.stats.timeouts += 1
            # a probe's timeout is no news: the breaker said the tier is off when it opened
            level = logging.DEBUG if probe else logging.WARNING
            log.log(level, "%s tier: operation exceeded its %.1fs timeout", self.name, timeout)
            breaker.settle(probe, failed=blame, cancelled=not blame)
            raise
        except BaseException:
            breaker.settle(probe, failed=True)
            raise
        breaker.settle(probe, failed=attempt.failed)
        return result

    async def _detached(
        self,
        operation: Awaitable[T],
        timeout: float | None,
        latency: Histogram | None,
        on_end: Callable[[], None] | None,
        cancel_with_caller: bool,
    ) -> T:
        start = time.perf_counter()
        task = asyncio.ensure_future(operation)
        self._running.add(task)
        task.add_done_callback(self._running.discard)
        if on_end is not None:
            task.add_done_callback(lambda _: on_end())
        try:
            done, _ = await asyncio.wait({task}, timeout=timeout)
        except asyncio.CancelledError:
            if cancel_with_caller:
                task.cancel()
            raise
        if latency is not None:
            latency.observe(time.perf_counter() - start)
        if not done:
            task.cancel()
            raise TierTimeout(self.name)
        return task.result()

    async def _inline(self, operation: Awaitable[T], timeout: float | None) -> T:
        try:
            async with asyncio.timeout(timeout):
                return await operation
        except TimeoutError as exc:
            if isinstance(exc, TierTimeout):
                raise
            raise TierTimeout(self.name) from None

    def cancel_all(self) -> None:
        """Ask every detached operation still running to stop (the store is closing); their ``on_end`` still runs."""
        for operation in list(self._running):
            operation.cancel()

    @property
    def running(self) -> frozenset[asyncio.Future[Any]]:
        """The detached operations still running (a read may outlive its caller's wait): for tests and close."""
        return frozenset(self._running)
