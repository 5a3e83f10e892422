"""One chunk of a tier opened for reads layer by layer: what layer streams (``store.prefetch``) read from.

:meth:`kvstore.storage.tier.ChunkTier.open_layers_many` opens chunks (their headers read and
checked once); each :class:`LayerReader` then reads one verified layer at a time, a positioned
read of an open file or a byte-range request, in whatever order the stream asks.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from concurrent.futures import Executor
from typing import Protocol, TypeVar

from kvstore.backends.base import ObjectFile
from kvstore.errors import ChunkFormatError
from kvstore.keys import ChunkKey
from kvstore.layout import KVLayout
from kvstore.storage.container import CHECK_HOT_BYTES, ChunkHeader, decode_layer, verify_segment
from kvstore.storage.health import UNGUARDED, Attempt
from kvstore.util.threads import in_thread

T = TypeVar("T")


class ReaderTier(Protocol):
    """What a LayerReader uses of the tier it came from (:class:`kvstore.storage.tier.ChunkTier` is one)."""

    name: str
    layout: KVLayout
    executor: Executor | None

    @property
    def range_request_bytes(self) -> int:
        """The most bytes one range request should ask for (the backend's)."""
        ...

    async def read_range(self, key: ChunkKey, start: int, stop: int) -> bytes | None:
        """Bytes ``[start, stop)`` of ``key``'s object (None if it is gone), timed for the load planner."""
        ...

    def count_read(self, nbytes: int) -> None:
        """Add ``nbytes`` of stored bytes read (a layer that was read and verified) to the tier's stats."""
        ...

    async def account(
        self, key: ChunkKey, outcome: int | None | BaseException, counted: bool = True, attempt: Attempt = ...
    ) -> bool:
        """Count a read's outcome in the tier's stats; True for a hit (a corrupt object is removed)."""
        ...

    async def guarded(self, operation: Callable[[Attempt], Awaitable[T]], timeout: float | None) -> T:
        """Run ``operation`` on the tier under its circuit breaker and ``timeout`` (see ChunkTier.guarded)."""
        ...


class LayerReader:
    """One chunk of a tier opened for layer-by-layer reads; ``close()`` it when done.

    Disk keeps the file open and reads each segment with one positioned read. Remote tiers
    issue byte-range requests that may cover the next few layers too (``ahead``): each request
    costs a round trip (~4 ms on moto), so layer 0 comes with the header, and later requests
    span as many layers as were fetched before (1, 2, 4, ...), keeping the first layer fast and
    the request count near ``log2(layers)``. Every segment is verified when it is used.

    The next request starts in the background as soon as its first layer is within ``ahead`` of
    the layer being read, so one span arrives while the one before it is consumed: issued only
    when its first layer was wanted, a span of ``ahead`` layers came just in time at best (a
    consumer as fast as the fetch stalled on every jitter; S3 streams hid 77% of their fetch).
    What a reader holds is still bounded: at most the span in hand and the one in flight.
    A failed read-ahead fails the read of its first layer (and is counted there); ``close``
    cancels one still in flight.
    """

    def __init__(
        self,
        tier: ReaderTier,
        key: ChunkKey,
        header: ChunkHeader,
        file: ObjectFile | None,
        first_layer: memoryview | None = None,
    ) -> None:
        self.tier, self.key, self.header, self._file = tier, key, header, file
        # Remote segments received ahead of their layer (layer 0 may come with the header).
        self._fetched: dict[int, memoryview] = {} if first_layer is None else {0: first_layer}
        self._layers_fetched = len(self._fetched)
        self._requested_end = len(self._fetched)  # layers [0, this) were requested, in order
        self._ahead: asyncio.Task[None] | None = None  # the read-ahead in flight, for _ahead_layers
        self._ahead_layers = range(0)

    @property
    def is_local(self) -> bool:
        """Reads are blocking file reads (batch them into one thread call with :meth:`read_local`)."""
        return self._file is not None

    async def read(self, layer: int, out: memoryview, ahead: int = 0) -> None:
        """Verify and decode layer ``layer`` into ``out``; raises on any problem (not counted).

        A remote read that must make a request fetches up to ``ahead`` further layers with it.
        """
        tier = self.tier
        if self._file is not None:
            await in_thread(tier.executor, self.read_local, layer, [out])
            return
        stored = self._fetched.pop(layer, None)
        if stored is None and layer in self._ahead_layers:
            task, self._ahead, self._ahead_layers = self._ahead, None, range(0)
            assert task is not None
            await task  # raises what the read-ahead raised; a cancelled read cancels it
            stored = self._fetched.pop(layer, None)
        if stored is None:  # nothing in flight for it (the first read, or out of order)
            await self._fetch_span(layer, layer + 1 + self.next_span(layer, ahead))
            stored = self._fetched.pop(layer)
        self._read_ahead(layer, ahead)
        await in_thread(tier.executor, decode_layer, self.header, tier.layout, layer, stored, out)

    def _read_ahead(self, layer: int, ahead: int) -> None:
        """Start the next span's request in the background if its first layer is within ``ahead`` of ``layer``."""
        first = self._requested_end
        if self._ahead is not None or first >= len(self.header.segments) or first > layer + ahead:
            return
        end = first + 1 + self.next_span(first, ahead)
        self._ahead_layers = range(first, min(end, len(self.header.segments)))
        self._ahead = asyncio.create_task(self._fetch_span(first, end), name="kvstore-read-ahead")
        self._ahead.add_done_callback(_retrieved)

    async def _fetch_span(self, first: int, end: int) -> None:
        """Layers ``first`` to ``end - 1`` (cut at the last layer) in one range request, kept until read."""
        segments, base = self.header.segments, self.header.header_len
        end = min(end, len(segments))
        start = base + segments[first].offset
        stop = base + segments[end - 1].offset + segments[end - 1].stored_len
        self._layers_fetched += end - first
        self._requested_end = max(self._requested_end, end)
        data = await self.tier.read_range(self.key, start, stop)
        if data is None:
            raise ChunkFormatError(f"layer {first} vanished while the chunk was being read")
        if len(data) != stop - start:
            raise ChunkFormatError(f"layers {first}-{end - 1}: {len(data)} bytes, expected {stop - start}")
        view = memoryview(data)
        for layer in range(first, end):
            offset = base + segments[layer].offset - start
            self._fetched[layer] = view[offset : offset + segments[layer].stored_len]

    def next_span(self, layer: int, limit: int) -> int:
        """Layers to fetch ahead with ``layer``'s request: as many as fetched so far (spans double), at most ``limit``.

        The span also stops at the backend's ``range_request_bytes``: a bigger request would
        only make the consumer wait longer for its first layer, on a server where a round
        trip is cheap (Redis here: one layer a request measured best; S3 gains ~3x from spans).
        """
        if layer in self._fetched:
            return 0
        per_request = self.tier.range_request_bytes
        cap = max(1, per_request // max(1, self.header.segments[layer].stored_len)) - 1
        return min(self._layers_fetched, limit, cap)

    async def read_counted(self, layer: int, out: memoryview, ahead: int = 0, attempt: Attempt = UNGUARDED) -> bool:
        """``read``, with a failure counted in the tier's stats (a corrupt chunk is removed) and, when the tier
        failed it, on ``attempt`` (the guarded operation it runs in: :meth:`ChunkTier.guarded`)."""
        try:
            await self.read(layer, out, ahead)
        except Exception as exc:
            return await self.tier.account(self.key, exc, True, attempt)
        self.count(layer)
        return True

    def count(self, layer: int) -> None:
        """Add a layer read that succeeded to the tier's stats."""
        self.tier.count_read(self.header.segments[layer].stored_len)

    def read_local(self, layer: int, parts: list[memoryview]) -> None:
        """The blocking file read of :meth:`read` (call it from a worker thread) into ``parts``, filled in order.

        One buffer, or the pieces of one (a layer's planes where they sit in the caller's tensor): a
        plain chunk is read straight into them (one vectored read) and only checksummed.
        """
        assert self._file is not None
        segment = self.header.segments[layer]
        start, stored_len = self.header.header_len + segment.offset, segment.stored_len
        size = sum(len(part) for part in parts)
        if self.header.plain and stored_len == size:
            if self._file.readinto(parts, start) != stored_len:
                raise ChunkFormatError(f"layer {layer} is truncated")
            verify_segment(self.header, layer, parts)  # read in place: only the checksum is left
            return
        stored = memoryview(bytearray(stored_len))
        if self._file.readinto([stored], start) != stored_len:
            raise ChunkFormatError(f"layer {layer} is truncated")
        whole = parts[0] if len(parts) == 1 else memoryview(bytearray(size))
        decode_layer(self.header, self.tier.layout, layer, stored, whole)
        if whole is not parts[0]:
            offset = 0
            for part in parts:
                part[:] = whole[offset : offset + len(part)]
                offset += len(part)

    def read_local_run(self, first: int, parts: list[list[memoryview]]) -> list[Exception | None]:
        """Layers ``first``, ``first + 1``, ... into ``parts[0]``, ``parts[1]``, ... (blocking; a worker thread's).

        A plain chunk's consecutive segments are read in vectored reads of about ``CHECK_HOT_BYTES``, each
        checksummed layer by layer right after it, while its bytes are still in the core's cache (a run read
        whole, then checked, read it twice from memory: 0.76x of ``get_many``'s reads on a 2-core Xeon). Per
        layer, None or the error (a layer after a failed one may still be sound: each is judged on its own bytes).
        """
        assert self._file is not None
        segments = self.header.segments[first : first + len(parts)]
        sizes = [sum(len(part) for part in layer_parts) for layer_parts in parts]
        contiguous = all(a.offset + a.stored_len == b.offset for a, b in zip(segments, segments[1:], strict=False))
        if (
            not self.header.plain
            or not contiguous
            or any(s.stored_len != n for s, n in zip(segments, sizes, strict=True))
        ):
            return [self._read_one(first + k, layer_parts) for k, layer_parts in enumerate(parts)]
        batch = max(1, CHECK_HOT_BYTES // max(1, max(sizes)))
        outcomes: list[Exception | None] = []
        for start in range(0, len(parts), batch):
            batch_parts = parts[start : start + batch]
            offset = self.header.header_len + segments[start].offset
            got = self._file.readinto([part for layer_parts in batch_parts for part in layer_parts], offset)
            end = 0
            for k, layer_parts in enumerate(batch_parts, start=start):
                end += segments[k].stored_len
                if got < end:
                    outcomes.append(ChunkFormatError(f"layer {first + k} is truncated"))
                    continue
                try:
                    verify_segment(self.header, first + k, layer_parts)
                except ChunkFormatError as exc:
                    outcomes.append(exc)
                    continue
                outcomes.append(None)
        return outcomes

    def _read_one(self, layer: int, parts: list[memoryview]) -> Exception | None:
        try:
            self.read_local(layer, parts)
        except Exception as exc:
            return exc
        return None

    def close(self) -> None:
        """Release the file (or the segments fetched ahead, cancelling a read-ahead in flight); idempotent."""
        if self._ahead is not None:
            self._ahead.cancel()
            self._ahead, self._ahead_layers = None, range(0)
        self._fetched.clear()
        if self._file is not None:
            self._file.close()
            self._file = None


def _retrieved(task: asyncio.Task[None]) -> None:
    """A read-ahead's outcome, retrieved: one nobody read (its stream closed) is not an "unhandled" error."""
    if not task.cancelled():
        task.exception()
