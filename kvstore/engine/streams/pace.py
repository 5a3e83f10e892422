"""How far a layer stream's producer may run ahead: the consumer's requests, and a ring's releases.

A :class:`~kvstore.engine.streams.stream.LayerStream` fetches at most ``depth`` layers beyond the last one its
consumer asked for; with a ring of output buffers (fewer ``outs`` than layers) also at most ``ring``
layers beyond the last one the consumer released, since layer i lands in the buffer layer ``i - ring``
left. Requests and releases come from the loop (an async consumer) or from engine threads; the
producer parks on the loop until one of them lets it go on. No blocking call; no I/O.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable

from kvstore.engine.transfer import DONE, Completion


class StreamPace:
    """The producer's limit (:meth:`allowed`), moved by requests and releases from the loop or from threads."""

    def __init__(self, depth: int, ring: int, num_layers: int) -> None:
        """``ring``: the number of output buffers used in turn, or 0 (one per layer: releases do nothing)."""
        self.depth, self.ring = depth, ring
        self._requested = 0  # layers the consumer has asked for (on the loop)
        self._released = 0  # layers a ring's consumer is done with (on the loop)
        self._wanted = asyncio.Event()
        # The same from engine threads, without a hop to the loop per layer (see request_from_thread).
        self._thread_requested = 0
        self._thread_released = 0
        self._thread_lock = threading.Lock()  # two engine threads at once never lower a count
        self._parked = False  # the producer waits: only then must a thread wake the loop
        # Per layer, when the consumer's reads of it end: the copies into its buffer's next layer wait for that.
        self.released_after: list[Completion] = [DONE] * num_layers

    def allowed(self) -> int:
        """Layers the producer may have fetched: every request so far, plus ``depth``; with a ring, no more
        than ``ring`` past the layers released."""
        allowed = max(self._requested, self._thread_requested) + self.depth
        if self.ring:
            allowed = min(allowed, max(self._released, self._thread_released) + self.ring)
        return allowed

    async def until_allowed(self, layer: int, closing: Callable[[], bool]) -> None:
        """Park the producer (on the loop) until it may fetch ``layer``; CancelledError once ``closing()``."""
        while layer >= self.allowed():
            if closing():
                raise asyncio.CancelledError
            self._wanted.clear()
            self._parked = True  # before reading the counts again: see request_from_thread
            try:
                if layer < self.allowed():
                    return  # an engine thread moved a count meanwhile (and may not have seen us parked)
                await self._wanted.wait()
            finally:
                self._parked = False

    def request(self, index: int) -> None:
        """Let the producer run up to ``index + depth`` (on the loop thread)."""
        if index + 1 > self._requested:
            self._requested = index + 1
            self._wanted.set()

    def request_from_thread(self, index: int) -> bool:
        """``request`` from another thread, without touching the loop; True if the caller must wake it.

        Waking the loop (``call_soon_threadsafe``) costs the engine thread a GIL hand-over, up to a
        switch interval (5 ms) while the loop thread runs, on every layer: most of what a stream
        failed to hide. So an engine thread only records its request, and wakes the loop (posting
        :meth:`wake`) only when the producer is parked. The two sides write their flag before
        reading the other's (the producer ``_parked``, then the counts; a thread its count, then
        ``_parked``), so one of them always sees the other: a request is never missed, at worst
        the loop is woken once for nothing.
        """
        with self._thread_lock:
            self._thread_requested = max(self._thread_requested, index + 1)
        return self._parked

    def release(self, index: int, after: Completion = DONE) -> None:
        """A ring's consumer is done with layers up to ``index`` once ``after`` is done (on the loop thread)."""
        if self.ring and index + 1 > self._released:
            self._note_released(max(self._released, self._thread_released), index, after)
            self._released = index + 1
            self._wanted.set()

    def release_from_thread(self, index: int, after: Completion = DONE) -> bool:
        """``release`` from another thread; True if the caller must wake the loop, as for
        :meth:`request_from_thread`. The completion is written before the count the producer reads."""
        if not self.ring:
            return False
        with self._thread_lock:
            if index + 1 > self._thread_released:
                self._note_released(max(self._released, self._thread_released), index, after)
                self._thread_released = index + 1
        return self._parked

    def _note_released(self, first: int, last: int, after: Completion) -> None:
        """Layers ``first`` to ``last`` end with ``after`` (a consumer that skipped releases: every one it skipped,
        so no copy into their buffers runs ahead of its work)."""
        for layer in range(first, last + 1):
            self.released_after[layer] = after

    def wake(self, index: int = -1) -> None:
        """Let a parked producer look again (on the loop thread): a thread moved a count (of layer ``index``),
        or the stream is closing."""
        self._wanted.set()

    def before_writing(self, layer: int) -> Completion:
        """What must end before ``layer`` is written into its buffer: its last layer's release (else DONE)."""
        return self.released_after[layer - self.ring] if self.ring and layer >= self.ring else DONE
