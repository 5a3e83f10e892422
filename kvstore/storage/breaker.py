"""A circuit breaker per tier: a dead or frozen tier is skipped instead of costing every call a timeout.

Without it, a stopped server costs each request that asks it one full timeout (5 s by default),
forever. With it, after ``failures`` consecutive failed operations the tier is *open*: it is not
asked at all (reads and lookups are misses, writes are dropped, each counted) for a back-off
period. When that has passed, exactly one operation is let through as a probe (*half-open*;
every other caller still skips the tier): a success closes the breaker, a failure opens it
again for twice the back-off, up to ``backoff_max``.

Contract:

- A *failure* is a timeout or an error of the tier or its server (connection refused, I/O
  error). A miss is a success, and so is a corrupt or foreign object: that is the object's
  fault, not the tier's; so is a write the server refused while answering (see
  :func:`unreachable`) and a failed removal of a corrupt object. The breaker only keeps the
  state: :class:`kvstore.storage.health.TierHealth` admits each operation (:meth:`admit`) and
  settles its outcome (:meth:`settle`), the one place that does.
- A success resets the count of consecutive failures, and closes a half-open breaker (the
  back-off starts again from ``backoff``).
- The log gets exactly one line when the breaker opens and one when it closes: never one per
  skipped call, nor one per failed probe.
- One breaker belongs to one event loop (not thread-safe); :meth:`stats` may be read from
  another thread (a metrics scrape): it reads plain fields.

The clock is injectable, so tests of the state machine need no sleeping.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Literal

from kvstore.backends.registry import timeout_error_names, unreachable_error_names

log = logging.getLogger("kvstore.breaker")
State = Literal["closed", "open", "half-open"]
STATES: tuple[State, ...] = ("closed", "open", "half-open")


def unreachable(error: BaseException) -> bool:
    """Whether ``error`` says the tier could not be reached (refused, reset, timed out), as opposed to
    a request its server answered with a refusal (out of memory, access denied, file system full).

    Why it matters: a write refused that way says nothing about reads (a Redis at ``maxmemory``
    still serves GETs; read-only S3 credentials still read), so it must not open the breaker
    that reads go through. The error's causes are looked at too (a backend may wrap one). A client
    library's own connection errors are known by class name, as each backend declares them
    (``BackendSpec.unreachable_errors``: redis-py's ``ConnectionError``, botocore's
    ``EndpointConnectionError``, ...), so this module needs none of those libraries.
    """
    names = unreachable_error_names()
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, (ConnectionError, TimeoutError)):
            return True
        if any(cls.__name__ in names for cls in type(current).__mro__):
            return True
        current = current.__cause__ or current.__context__
    return False


def timed_out(error: BaseException) -> bool:
    """Whether ``error`` (or an error it was raised from) is a request that ran out of time: Python's
    TimeoutError or a client's own (redis-py's ``TimeoutError``, botocore's ``ReadTimeoutError``: each
    backend's ``BackendSpec.timeout_errors``)."""
    names = timeout_error_names()
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, TimeoutError) or any(cls.__name__ in names for cls in type(current).__mro__):
            return True
        current = current.__cause__ or current.__context__
    return False


class CircuitBreaker:
    """The state of one tier (see the module docstring for the contract)."""

    def __init__(
        self,
        tier: str,
        failures: int = 3,
        backoff: float = 1.0,
        backoff_max: float = 60.0,
        *,
        enabled: bool = True,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if failures < 1 or backoff <= 0 or backoff_max < backoff:
            raise ValueError(
                f"circuit breaker: need failures >= 1 and 0 < backoff <= backoff_max, "
                f"got {failures}, {backoff}, {backoff_max} (see the [breaker] section of the config)"
            )
        self.tier = tier
        self.enabled = enabled
        self.failures, self.backoff, self.backoff_max = failures, backoff, backoff_max
        self.clock = clock  # injectable: tests drive the back-off without sleeping
        self.state: State = "closed"
        self._consecutive = 0  # failures in a row while closed
        self._wait = backoff  # the back-off of the next (or current) open period
        self._retry_at = 0.0  # when an open breaker lets a probe through
        self.opens = 0
        self.skipped_reads = 0  # reads, lookups and layer reads not attempted while open
        self.skipped_writes = 0  # chunks not written while open

    # -- the state machine ---------------------------------------------------------------------

    def admit(self) -> bool:
        """May an operation go to the tier now? False: skip it (and count it, see :meth:`skip`).

        Closed: yes. Open: no, until the back-off has passed; then this caller is the probe and
        the breaker turns half-open. Half-open: no (the probe is under way).
        """
        if not self.enabled or self.state == "closed":
            return True
        if self.state == "open" and self.clock() >= self._retry_at:
            self.state = "half-open"
            return True
        return False

    def success(self) -> None:
        """The tier answered (a hit or a miss): reset the count; a probe's success closes the breaker."""
        self._consecutive = 0
        if self.state != "closed":
            self.state = "closed"
            self._wait = self.backoff
            log.warning("%s tier: circuit breaker closed: the tier answers again", self.tier)

    def failure(self) -> None:
        """The tier failed (a timeout or an error): the ``failures``-th in a row, or a failed probe, opens it."""
        if not self.enabled:
            return
        if self.state == "half-open":  # the probe failed: back off longer, without a new log line
            self._wait = min(self._wait * 2, self.backoff_max)
            self._open()
            return
        self._consecutive += 1
        if self.state == "closed" and self._consecutive >= self.failures:
            self._open()
            self.opens += 1
            log.warning(
                "%s tier: circuit breaker open after %d consecutive failure(s): the tier is skipped (reads miss, "
                "writes are dropped), probed again after %gs, the back-off doubling up to %gs",
                self.tier,
                self._consecutive,
                self._wait,
                self.backoff_max,
            )

    def abandon(self) -> None:
        """The probe ended without an answer (its caller was cancelled): let the next caller probe at once."""
        if self.state == "half-open":
            self.state = "open"
            self._retry_at = self.clock()

    def _open(self) -> None:
        self.state = "open"
        self._retry_at = self.clock() + self._wait

    def skip(self, writes: int = 0) -> None:
        """Count an operation not attempted: ``writes`` chunks not written, or (0) a read or lookup."""
        if writes:
            self.skipped_writes += writes
        else:
            self.skipped_reads += 1

    def settle(self, probe: bool, failed: bool, cancelled: bool = False) -> None:
        """One admitted operation's outcome (``probe``: it was admitted as the half-open probe).

        A late failure of an operation admitted before the breaker opened changes nothing (the
        tier is already skipped); a cancelled probe is retried by the next caller.
        """
        if failed and (probe or self.state == "closed"):
            self.failure()
        elif failed or cancelled:
            if probe:
                self.abandon()
        else:
            self.success()

    def stats(self) -> dict[str, int | str]:
        """``stats()[tier]["breaker"]``: the state, how often it opened, what it skipped."""
        return {
            "state": self.state,
            "opens": self.opens,
            "skipped_reads": self.skipped_reads,
            "skipped_writes": self.skipped_writes,
        }
