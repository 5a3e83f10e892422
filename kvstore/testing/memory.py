"""An in-memory Backend for unit tests of the layers above storage (never proof that a real store works)."""

from __future__ import annotations

from collections.abc import Sequence

from kvstore.backends.base import Backend, ByteRange
from kvstore.util.buffers import Buffer, as_bytes_view


class MemoryBackend(Backend):
    """The smallest backend: only the abstract methods, so every default of :class:`Backend` is in use.

    ``objects`` may be shared between instances, like a server shared by two engines. The
    operator's tools cannot list it (:class:`~kvstore.backends.maintenance.Maintenance`'s defaults).
    """

    name = "memory"

    def __init__(self, objects: dict[str, bytes] | None = None) -> None:
        self.objects: dict[str, bytes] = {} if objects is None else objects
        self.gets = 0  # fetches: whole objects and ranges

    async def fetch(self, key: str, byte_range: ByteRange | None) -> bytes | None:
        self.gets += 1
        data = self.objects.get(key)
        if data is None or byte_range is None:
            return data
        return data[byte_range[0] : byte_range[1]]

    async def set(self, key: str, parts: Sequence[Buffer]) -> None:
        self.objects[key] = b"".join(bytes(as_bytes_view(part)) for part in parts)

    async def exists(self, key: str) -> bool:
        return key in self.objects

    async def delete(self, key: str) -> None:
        self.objects.pop(key, None)
