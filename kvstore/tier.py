"""A secondary tier: a storage backend plus a codec, moving whole chunks to and from DRAM slots.

The tier owns the chunk container: it encodes on the way down and checks every byte on the
way up. Whatever goes wrong below it (a missing object, a corrupt or foreign one, an I/O
error) comes out as a counted miss, never as an exception into the engine and never as
wrong KV. A corrupt object is deleted so it is not read again.
"""

from __future__ import annotations

import logging
from concurrent.futures import Executor

from kvstore.backends.base import Backend
from kvstore.codecs import CodecPipeline
from kvstore.format import ChunkFormatError, decode_chunk, decode_payload, encode_chunk, header_size, parse_header
from kvstore.keys import ChunkKey
from kvstore.layout import KVLayout
from kvstore.stats import TierStats
from kvstore.threads import in_thread

log = logging.getLogger("kvstore.tier")


class ChunkTier:
    def __init__(self, backend: Backend, codec: CodecPipeline, layout: KVLayout, executor: Executor | None):
        self.backend = backend
        self.codec = codec
        self.layout = layout
        self.name = backend.name
        self.stats = TierStats()
        self._executor = executor
        # With the identity codec a stored chunk is header + the slot's exact bytes, so a
        # scatter read can land the payload directly in the slot: no second copy.
        self._direct_header_len = header_size(layout.num_layers, codec.id) if codec.is_identity else None

    async def open(self) -> None:
        await self.backend.open()

    async def close(self) -> None:
        await self.backend.close()

    async def write(self, key: ChunkKey, chunk: memoryview) -> None:
        """Encode (in a thread) and store one chunk; raises on failure so the caller can count it."""
        try:
            parts = await in_thread(self._executor, encode_chunk, self.layout, key, chunk, self.codec)
            await self.backend.set(key, parts)
        except Exception:
            self.stats.errors += 1
            raise
        self.stats.writes += 1
        self.stats.bytes_written += sum(len(memoryview(p)) for p in parts)

    def holds(self, key: ChunkKey) -> bool:
        """True only when the tier knows, without I/O, that it has the chunk."""
        holds = getattr(self.backend, "holds", None)
        return bool(holds(key)) if holds is not None else False

    async def read_into(self, key: ChunkKey, out: memoryview) -> bool:
        """Fill ``out`` with the chunk; False on a miss of any kind (absent, corrupt, error)."""
        try:
            found = await self._read_direct(key, out) if self._direct_header_len else None
            if found is None:
                found = await self._read_whole(key, out)
        except ChunkFormatError as exc:
            await self._discard_corrupt(key, exc)
            return False
        except Exception as exc:  # I/O errors, a server gone: a miss, counted
            self.stats.errors += 1
            log.warning("%s tier: read of %s failed: %r", self.name, key[:16], exc)
            return False
        if found:
            self.stats.hits += 1
        else:
            self.stats.misses += 1
        return found

    async def _read_direct(self, key: ChunkKey, out: memoryview) -> bool | None:
        """Header into a small buffer, payload straight into ``out``; None if the object needs the general path."""
        assert self._direct_header_len is not None
        header_buffer = memoryview(bytearray(self._direct_header_len))
        size = await self.backend.get_into(key, [header_buffer, out])
        if size is None:
            return False
        if size != self._direct_header_len + len(out):
            return None  # written with another codec, or not ours: decode it the general way
        await in_thread(self._executor, self._check_in_place, key, header_buffer, out)
        self.stats.bytes_read += size
        return True

    def _check_in_place(self, key: ChunkKey, header_buffer: memoryview, out: memoryview) -> None:
        header = parse_header(header_buffer, self.layout, key)
        decode_payload(header, self.layout, out, out)

    async def _read_whole(self, key: ChunkKey, out: memoryview) -> bool:
        data = await self.backend.get(key)
        if data is None:
            return False
        await in_thread(self._executor, decode_chunk, data, self.layout, key, out)
        self.stats.bytes_read += len(data)
        return True

    async def _discard_corrupt(self, key: ChunkKey, exc: ChunkFormatError) -> None:
        self.stats.corrupt += 1
        log.warning("%s tier: chunk %s is unusable (%s); removing it", self.name, key[:16], exc)
        try:
            await self.backend.delete(key)
        except Exception as delete_error:
            self.stats.errors += 1
            log.warning("%s tier: could not remove %s: %r", self.name, key[:16], delete_error)

    async def prefix_count(self, keys: list[ChunkKey]) -> int:
        try:
            return await self.backend.prefix_count(keys)
        except Exception as exc:
            self.stats.errors += 1
            log.warning("%s tier: lookup failed: %r", self.name, exc)
            return 0

    def stats_dict(self) -> dict[str, int | float | str]:
        return {**self.stats.as_dict(), "codec": self.codec.id, **self.backend.stats()}
