"""The storage interface every secondary tier implements: the data path (modelled on zarr-python v3's ``Store``).

A backend stores opaque objects under chunk keys. It knows nothing of layouts or codecs: the
chunk tier above it (:class:`kvstore.storage.tier.ChunkTier`) encodes chunks into containers
and checks them on the way back. Methods are async; blocking work goes to threads via
:func:`kvstore.util.threads.in_thread`.

A backend implements :meth:`Backend.fetch`, :meth:`~Backend.set`, :meth:`~Backend.exists` and
:meth:`~Backend.delete`; every other method has a default built on those, which it overrides
where it can do better. The batch hooks (:meth:`~Backend.write_many`, :meth:`~Backend.read_many`,
:meth:`~Backend.open_many`) take the caller's per-object work as callables, so that a backend
whose I/O is blocking calls (files) runs a whole batch, work included, in one thread call (a
thread hop costs ~0.1 ms here, a 5 MB file write ~1 ms), while a network backend sends the
batch's requests at once. What the operator's tools need (listing every namespace, removal)
lives apart, in :mod:`kvstore.backends.maintenance`.
"""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Iterable, Iterator, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import ClassVar, Generic, NamedTuple, Protocol, TypeVar

from kvstore.backends.maintenance import Maintenance
from kvstore.util.buffers import Buffer, as_bytes_view
from kvstore.util.threads import in_thread

T = TypeVar("T")
I = TypeVar("I")  # noqa: E741 (an item)

ByteRange = tuple[int, int]
"""Half-open ``(start, end)`` byte range of an object."""

Outcomes = list[T | None | BaseException]
"""Per object of a batch: the work's result, None (absent; for a write: skipped), or the exception it raised."""


class ObjectFile(Protocol):
    """A stored object opened for positioned reads (a local file)."""

    size: int

    def readinto(self, buffers: Sequence[memoryview], offset: int) -> int:
        """Fill ``buffers`` in order from ``offset``, stopping at the object's end; the bytes read."""
        ...

    def close(self) -> None: ...


@dataclass(frozen=True, slots=True)
class ObjectWrite:
    """One object of a batch write: its key, and the blocking work that makes its bytes."""

    key: str
    encode: Callable[[], Sequence[Buffer]]  # the object's parts, in order (a gather list)
    parent: str | None = None  # the key of the chunk before it in its prefix, where known (see set_link)
    # The same bytes made a run at a time, where the object allows it (None: use encode). A backend
    # writing files writes each run while it is still in the CPU's cache, and the head last.
    stream: Callable[[], StreamedObject] | None = None


class StreamedObject(NamedTuple):
    """An object's bytes made as they are written: ``head_length`` bytes of head, then ``body``'s runs in order.

    Each run of ``body`` is made (checksummed) right before it is handed over, so a writer that
    writes it at once reads it from the CPU's cache, not from memory. ``head()`` gives the head,
    only once ``body`` is exhausted; ``length`` is the whole object's.
    """

    length: int
    head_length: int
    body: Iterator[Sequence[Buffer]]
    head: Callable[[], Buffer]


@dataclass(frozen=True, slots=True)
class ObjectRead(Generic[T]):
    """One object of a batch read: its key, and the caller's work in the two forms a backend may run it."""

    key: str
    # Blocking: the work on the object opened as a file, for backends whose objects are files.
    from_file: Callable[[ObjectFile], T]
    # Async: the work done with requests through the backend's get/get_into (None: the object is absent).
    from_requests: Callable[[], Awaitable[T | None]]


CHUNK_HEAD_BYTES = 4096  # an object's first page: a chunk header of up to ~125 layers, with the engine's name


class Backend(Maintenance, ABC):
    """A store of opaque objects under keys; see the module docstring for what a backend must provide.

    Capabilities, read by the chunk tier and the layer streams:

    - ``is_local``: operations are blocking calls on this machine (files): the tier's layer reads
      of such objects are batched into one thread call each, and never cancelled midway (so not
      bounded by a timeout). A backend that sets it overrides the batch hooks to run each batch
      in one thread call, as :class:`~kvstore.backends.disk.DiskBackend` does.
    - ``capacity_bytes``: the byte budget the backend keeps itself within, or None when its size is
      set elsewhere (retention, TTL); the cost model sizes the tier by it.
    - ``range_request_bytes``: bytes a range request should carry to amortize its round trip; layer
      streams coalesce consecutive layers up to this size (0: one layer per request).

    A backend that evicts objects itself (the disk tier's byte budget) calls ``on_evicted`` with
    their keys and, where ``evicted_heads`` is set, each object's first ``CHUNK_HEAD_BYTES``
    read just before its removal (else None), from whatever thread evicts. The chunk tier sets
    both (KV events, :mod:`kvstore.events`: the head names the chunk as its engine did).
    """

    name: ClassVar[str]
    on_evicted: Callable[[Sequence[str], Sequence[bytes | None]], None] = staticmethod(lambda keys, heads: None)
    evicted_heads: bool = False
    is_local: ClassVar[bool] = False
    range_request_bytes: ClassVar[int] = 0
    capacity_bytes: int | None = None

    async def open(self) -> None:
        """Connect, create directories, rebuild indexes."""

    async def close(self) -> None:
        """Release connections; must return promptly."""

    # -- single objects ------------------------------------------------------------------------

    async def get(self, key: str, byte_range: ByteRange | None = None) -> bytes | None:
        """The object's bytes, or those of the half-open ``byte_range``; None if the object is absent.

        Byte ranges mean the same on every backend (decided here, once; backends implement :meth:`fetch`):

        - a range is clipped at the object's end, like a file read;
        - an empty range, or one that starts at or past the end, is ``b""`` for a present object;
        - any range of an absent object is None;
        - a negative start, or an end before the start, is a ValueError (the caller's bug).
        """
        if byte_range is not None:
            start, end = byte_range
            if start < 0 or end < start:
                raise ValueError(f"bad byte range {byte_range!r}")
            if start == end:  # nothing to request (S3 and Redis cannot express it): presence decides
                return b"" if await self.exists(key) else None
        return await self.fetch(key, byte_range)

    @abstractmethod
    async def fetch(self, key: str, byte_range: ByteRange | None) -> bytes | None:
        """What :meth:`get` asks of a backend: ``byte_range`` is None (the whole object) or non-empty and valid.

        Clip the range at the object's end; a range that starts at or past the end is ``b""``.
        None only when the object is absent.
        """

    async def get_sized(self, key: str, byte_range: ByteRange) -> tuple[bytes, int | None] | None:
        """:meth:`get` of a non-empty ``byte_range``, with the object's whole size when this request tells it.

        The size lets a reader check an object's length against its header from the request that
        brings the header (a layer stream opens chunks this way). None as the size means this
        request cannot tell: the caller checks the end itself. Default: the size only when the
        range was clipped at the object's end; Redis and S3 answer it from the same round trip.
        """
        data = await self.get(key, byte_range)
        if data is None:
            return None
        start, end = byte_range
        return data, start + len(data) if 0 < len(data) < end - start else None

    async def get_into(self, key: str, buffers: Sequence[memoryview]) -> int | None:
        """Read the object's leading bytes into ``buffers``, in order; the object's size, None if absent.

        Bytes beyond the buffers' capacity are not read; buffer bytes beyond the object's end are
        left as they were. Backends that can receive straight into caller memory override this
        to save a copy.
        """
        data = await self.get(key)
        if data is None:
            return None
        Scatter(buffers).write(data)
        return len(data)

    @abstractmethod
    async def set(self, key: str, parts: Sequence[Buffer]) -> None:
        """Store the concatenation of ``parts`` atomically: readers see all of it or nothing."""

    @abstractmethod
    async def exists(self, key: str) -> bool:
        """Whether the object is stored now."""

    @abstractmethod
    async def delete(self, key: str) -> None:
        """Remove the object; absent objects are not an error."""

    async def prefix_count(self, keys: Sequence[str]) -> int:
        """How many leading ``keys`` exist. Backends override this with fewer requests."""
        for count, key in enumerate(keys):
            if not await self.exists(key):
                return count
        return len(keys)

    def stats(self) -> dict[str, int | float | str]:
        """Backend-specific figures (bytes used, objects held) merged into the tier's stats."""
        return {}

    # -- batch hooks: the caller's per-object work, run the backend's way ------------------------

    async def write_many(self, writes: Sequence[ObjectWrite], executor: Executor | None) -> Outcomes[int]:
        """Store every object of ``writes``; per write, the bytes stored, None if skipped, or the exception.

        None means the backend already held the object and marked it used rather than writing
        it again (an object's bytes never change under its key). Default: all writes at once,
        each encoded in a thread of ``executor``, then sent with :meth:`set`.
        """

        async def write(item: ObjectWrite) -> int:
            parts = await in_thread(executor, item.encode)
            await self.set(item.key, parts)
            if item.parent is not None:
                await self.set_link(item.key, item.parent)
            return byte_length(parts)

        return await gather_outcomes(write(item) for item in writes)

    async def set_link(self, key: str, parent: str) -> None:
        """Record ``key``'s parent apart from the object, for a backend whose reads change what the tools
        judge age by (:attr:`reads_refresh_age`: ``kvstore gc`` then reads links with :meth:`read_parents`,
        never the chunks' headers). Default: nothing (the chunk's header holds its parent)."""

    def used_in_order(self, keys: Sequence[str]) -> None:
        """The hits of a batch read through :meth:`read_many` or :meth:`open_many` (its slices done), a prefix's
        chunks in order: a backend that evicts by a policy (the disk budget) tells it of them tail first, so a
        prefix's tail leaves before its head. Called on the event loop: never blocks, no I/O. Default: nothing."""

    async def read_many(self, reads: Sequence[ObjectRead[T]], executor: Executor | None) -> Outcomes[T]:
        """Do each read's work on its object; per read, the work's result, None if absent, or the exception.

        Default: every read's ``from_requests`` at once. A backend whose objects are files runs
        ``from_file`` on each instead, a whole batch in one thread call of ``executor``, and
        closes each file afterwards.
        """
        return await gather_outcomes(read.from_requests() for read in reads)

    async def open_many(self, reads: Sequence[ObjectRead[T]], executor: Executor | None) -> Outcomes[T]:
        """:meth:`read_many`, except that a file given to ``from_file`` stays open: its result owns it.

        (If ``from_file`` raises, the backend closes the file.)
        """
        return await gather_outcomes(read.from_requests() for read in reads)


class Scatter:
    """Copies a stream of byte pieces into consecutive caller buffers, in order; what does not fit is dropped."""

    def __init__(self, buffers: Sequence[Buffer]) -> None:
        self._targets = [view for view in map(as_bytes_view, buffers) if len(view)]
        self._index = self._offset = 0
        self.copied = 0  # bytes placed so far

    def write(self, piece: Buffer) -> None:
        """Place ``piece`` after what came before it."""
        source = as_bytes_view(piece)
        while len(source) and self._index < len(self._targets):
            target = self._targets[self._index]
            take = min(len(source), len(target) - self._offset)
            target[self._offset : self._offset + take] = source[:take]
            source, self._offset, self.copied = source[take:], self._offset + take, self.copied + take
            if self._offset == len(target):
                self._index, self._offset = self._index + 1, 0


def byte_length(parts: Sequence[Buffer]) -> int:
    """Bytes in a gather list."""
    return sum(memoryview(part).nbytes for part in parts)


async def gather_outcomes(calls: Iterable[Awaitable[T]]) -> list[T | BaseException]:
    """Await every call at once; per call, its result or what it raised (a CancelledError too: callers re-raise it)."""
    return list(await asyncio.gather(*calls, return_exceptions=True))


def each_caught(operation: Callable[[I], T], items: Iterable[I]) -> list[T | Exception]:
    """``operation`` on every item in turn, each failure returned in its place: one bad object never sinks a batch."""
    outcomes: list[T | Exception] = []
    for item in items:
        try:
            outcomes.append(operation(item))
        except Exception as exc:  # the caller accounts for it, per object
            outcomes.append(exc)
    return outcomes
