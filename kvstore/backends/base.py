"""The storage interface every secondary tier implements (modelled on zarr-python v3's ``Store``).

A backend stores opaque objects under chunk keys. It knows nothing of layouts or codecs: the
:class:`kvstore.tier.ChunkTier` above it encodes chunks into containers and checks them on
the way back. Methods are async; blocking work goes to threads via ``in_thread``.
"""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Sequence
from typing import ClassVar, Protocol

from kvstore.buffers import Buffer, as_bytes_view

ByteRange = tuple[int, int]
"""Half-open ``(start, end)`` byte range of an object."""


class Backend(ABC):
    name: ClassVar[str]
    supports_partial_reads: ClassVar[bool] = True
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
