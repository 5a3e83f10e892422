"""The storage interface every secondary tier implements (modelled on zarr-python v3's ``Store``).

A backend stores opaque objects under chunk keys. It knows nothing of layouts or codecs: the
:class:`kvstore.storage.tier.ChunkTier` above it encodes chunks into containers and checks them on
the way back. Methods are async; blocking work goes to threads via ``in_thread``.
"""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import ClassVar, Protocol

from kvstore.util.buffers import Buffer, as_bytes_view

ByteRange = tuple[int, int]
"""Half-open ``(start, end)`` byte range of an object."""


LIST_PAGE = 1000  # objects per listing page and per batch delete (S3 DeleteObjects takes at most 1000)


@dataclass(frozen=True, slots=True)
class StoredObject:
    """A chunk object as a listing saw it: enough to choose it, and to delete it only if unchanged."""

    namespace: str  # its namespace directory (kvstore.keys.namespace_dir)
    key: str
    size: int  # bytes the tier spends on it
    when: float  # Unix time of its last write, or of its last access where the tier records one
    version: tuple[object, ...]  # this exact object: a rewrite (and, where recorded, an access) changes it


@dataclass
class RemoveReport:
    """What a batch delete did; tools add these up for their summary."""

    removed: int = 0
    removed_bytes: int = 0
    changed: int = 0  # rewritten or used since it was listed: kept
    gone: int = 0  # already absent (evicted, expired, another gc): nothing to do
    errors: list[str] = field(default_factory=list)

    def add(self, other: RemoveReport) -> None:
        self.removed += other.removed
        self.removed_bytes += other.removed_bytes
        self.changed += other.changed
        self.gone += other.gone
        self.errors.extend(other.errors)

    @property
    def handled(self) -> int:
        return self.removed + self.changed + self.gone + len(self.errors)


Progress = Callable[[RemoveReport], None]
"""Called after each batch of a removal with that batch's report (for progress bars)."""


class Backend(ABC):
    name: ClassVar[str]
    supports_partial_reads: ClassVar[bool] = True
    # What StoredObject.when means here: "last write" or "last access" (reads refresh it).
    age_basis: ClassVar[str] = "last write"
    # Bytes a range request should carry to amortize its round trip: layer streams coalesce
    # consecutive layers up to this size. 0: one layer per request (round trips are cheap).
    range_request_bytes: ClassVar[int] = 0

    async def open(self) -> None:
        """Connect, create directories, rebuild indexes."""

    async def close(self) -> None:
        """Release connections; must return promptly."""

    @abstractmethod
    async def get(self, key: str, byte_range: ByteRange | None = None) -> bytes | None:
        """The object's bytes (or a range of them), None if absent."""

    async def get_into(self, key: str, buffers: Sequence[memoryview]) -> int | None:
        """Read the object's leading bytes into ``buffers`` in order; returns the object's size.

        Backends that can scatter-read into caller memory override this to skip a copy.
        """
        data = await self.get(key)
        if data is None:
            return None
        view, position = as_bytes_view(data), 0
        for buffer in buffers:
            part = view[position : position + len(buffer)]
            buffer[: len(part)] = part
            position += len(part)
        return len(view)

    @abstractmethod
    async def set(self, key: str, parts: Sequence[Buffer]) -> None:
        """Store the concatenation of ``parts`` atomically: readers see all of it or nothing."""

    @abstractmethod
    async def exists(self, key: str) -> bool: ...

    @abstractmethod
    async def delete(self, key: str) -> None:
        """Remove the object; absent objects are not an error."""

    @abstractmethod
    def list_keys(self, prefix: str = "") -> AsyncIterator[str]:
        """Every stored key starting with ``prefix``, in no particular order."""

    async def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        return list(await asyncio.gather(*(self.get(key) for key in keys)))

    async def prefix_count(self, keys: Sequence[str]) -> int:
        """How many leading ``keys`` exist. Remote backends override this with fewer requests."""
        for count, key in enumerate(keys):
            if not await self.exists(key):
                return count
        return len(keys)

    def stats(self) -> dict[str, int | float | str]:
        """Backend-specific figures (bytes used, objects held) merged into the tier's stats."""
        return {}

    # -- for the operator's tools (kvstore ls / stats / gc / verify): every namespace -----------

    def scan(self, namespaces: Callable[[str], bool] | None = None) -> AsyncIterator[list[StoredObject]]:
        """Every chunk object of every namespace ``namespaces`` accepts (default all), a page at a time."""
        raise NotImplementedError(f"the {self.name} backend cannot be listed by the kvstore tools")

    async def read_object(self, item: StoredObject) -> bytes | None:
        """The listed object's bytes (None if it is gone), for ``kvstore verify``."""
        raise NotImplementedError(f"the {self.name} backend cannot be read by the kvstore tools")

    def read_version(self, item: StoredObject, data: bytes) -> StoredObject:
        """``item`` as :meth:`read_object` found it, for a removal that must spare a rewritten object.

        The listing's version, unless reading changes what it records (Redis: the idle time).
        """
        return item

    async def remove_unchanged(self, items: Sequence[StoredObject], progress: Progress | None = None) -> RemoveReport:
        """Delete each object only if it is still the one listed (same ``version``), in batches.

        Safe beside live engines: a reader of a removed chunk sees a miss, and a chunk rewritten
        or (where recorded) read since it was listed is kept, counted as ``changed``.
        """
        raise NotImplementedError(f"the {self.name} backend cannot be cleaned by the kvstore tools")


class ChunkReader(Protocol):
    """An open object for positioned reads (local files)."""

    size: int

    def readinto(self, buffers: Sequence[memoryview], offset: int) -> int: ...

    def __enter__(self) -> ChunkReader: ...

    def __exit__(self, *exc_info: object) -> None: ...


class LocalBackend(Backend):
    """A backend whose work is plain blocking calls on this machine (files).

    The tier runs a whole chunk's write (encode, checksum, one gather write) or read (read and
    verify, 1 MiB at a time so each batch is checksummed while still in cache) as one call in
    one worker thread: on this machine a thread hop costs ~0.1 ms, as much as the checksums
    of a 5 MB chunk.
    """

    @abstractmethod
    def read(self, key: str, byte_range: ByteRange | None = None) -> bytes | None: ...

    @abstractmethod
    def open_reader(self, key: str) -> ChunkReader | None: ...

    @abstractmethod
    def write(self, key: str, parts: Sequence[Buffer]) -> None:
        """Store the concatenation of ``parts`` atomically (blocking)."""

    @abstractmethod
    def contains(self, key: str) -> bool:
        """Whether the object exists now (blocking; call it from a worker thread)."""

    def holds(self, key: str) -> bool:
        """Whether the object is known to be here without any I/O (a hint: it may be stale)."""
        return False

    def keep(self, key: str) -> bool:
        """Mark the object as just used, if it exists now: True if it does (blocking).

        The tier calls this instead of rewriting a chunk that is already stored, so the put
        still counts as a use for eviction and for ``kvstore gc`` (which spares what changed
        since it listed), atomically: a gc that got there first makes this False, and the
        tier writes the chunk again.
        """
        return self.contains(key)
