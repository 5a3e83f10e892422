"""An in-memory Backend for unit tests of the layers above storage (never proof that a real store works)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence

from kvstore.backends.base import Backend, ByteRange
from kvstore.util.buffers import Buffer, as_bytes_view


class MemoryBackend(Backend):
    """The smallest backend: only the abstract methods, so the base class's defaults are used."""

    name = "memory"

    def __init__(self) -> None:
        self.objects: dict[str, bytes] = {}
        self.gets = 0

    async def get(self, key: str, byte_range: ByteRange | None = None) -> bytes | None:
        self.gets += 1
        data = self.objects.get(key)
        if data is None or byte_range is None:
            return data
        return data[byte_range[0] : byte_range[1]]

    async def set(self, key: str, parts: Sequence[Buffer]) -> None:
        self.objects[key] = b"".join(bytes(as_bytes_view(p)) for p in parts)

    async def exists(self, key: str) -> bool:
        return key in self.objects

    async def delete(self, key: str) -> None:
        self.objects.pop(key, None)

    async def list_keys(self, prefix: str = "") -> AsyncIterator[str]:
        for key in list(self.objects):
            if key.startswith(prefix):
                yield key
