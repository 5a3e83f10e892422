"""One log line per prefix an engine loads from kvstore, at most one every few seconds.

A user who sends a prompt and wants to know whether kvstore served it reads the engine's log: each
load says its request, its tokens, and the tiers its chunks come from. Under load an engine starts
many loads a second, so the lines are rate-limited the way vLLM's own stats lines are (one every
``interval_s``, 10 s by default): the first load is said at once; loads within the interval are
summed, and said with the next load after it, or by :meth:`LoadLog.tick` (called once a step) once
the interval has passed. Nothing is dropped, and a quiet engine's log says each load as it starts.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable, Sequence

INTERVAL_S = 10.0


def _tiers(chunks: Counter[str]) -> str:
    """'12 chunks from redis, 4 chunks from dram' (most chunks first)."""
    return ", ".join(f"{count} chunk{'s' if count != 1 else ''} from {tier}" for tier, count in chunks.most_common())


class LoadLog:
    """Says the loads of one engine process on ``logger`` at INFO (see the module docstring). Not thread-safe:
    called from the thread that plans loads (vLLM's scheduler thread)."""

    def __init__(
        self, logger: logging.Logger, interval_s: float = INTERVAL_S, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._log, self._interval, self._clock = logger, interval_s, clock
        self._said_at: float | None = None  # when the last line was written
        self._loads = 0  # loads not said yet
        self._tokens = 0
        self._chunks: Counter[str] = Counter()

    def load(self, request: str, tokens: int, tiers: Sequence[str], how: str) -> None:
        """A load was planned: ``tokens`` tokens of ``request``, chunk ``i`` from ``tiers[i]``; ``how`` says where it
        runs (e.g. "in the forward pass"). Said now, or summed into the next line if one was said recently."""
        now = self._clock()
        if self._said_at is not None and now - self._said_at < self._interval:
            self._loads, self._tokens = self._loads + 1, self._tokens + tokens
            self._chunks.update(tiers)
            return
        line = f"kvstore: request {request} loads {tokens:,} tokens ({_tiers(Counter(tiers))}) {how}"
        self._say(line + self._summary(now), now)

    def tick(self) -> None:
        """Once a step: say the loads summed so far, once the interval since the last line has passed."""
        now = self._clock()
        if self._loads and self._said_at is not None and now - self._said_at >= self._interval:
            self._say("kvstore:" + self._summary(now).removeprefix(";"), now)

    def _summary(self, now: float) -> str:
        """The loads not said yet, for the end of a line ('' if none)."""
        if not self._loads:
            return ""
        since = f"in the last {now - self._said_at:.0f} s" if self._said_at is not None else "before"
        plural = "s" if self._loads != 1 else ""
        return f"; {self._loads} load{plural} of {self._tokens:,} tokens ({_tiers(self._chunks)}) {since}"

    def _say(self, line: str, now: float) -> None:
        self._log.info("%s", line)
        self._said_at, self._loads, self._tokens = now, 0, 0
        self._chunks.clear()
