"""Redis tier on ``redis.asyncio``: the same code drives one server or a Redis Cluster. This module is its data path.

Layout: one value per chunk, under ``{prefix}:{namespace}:{chunk key}``, holding the whole chunk container.
A layer is one GETRANGE of it (the container's header gives the offsets), so a layer is read and
decoded on its own without per-layer keys. One value rather than a key per layer because:

- one SET is atomic: readers see the whole container or nothing, never layers of two writes, and
  a chunk is present, expired or evicted as a unit (one EXISTS, one DEL, one TTL);
- a full load is one round trip, not one per layer (30-80 of them);
- no command touches two keys, so on a Cluster keys need no ``{hash tags}`` and spread over all
  slots and nodes. Per-layer keys would need a shared tag (``kvstore:{<chunk>}:<layer>``) to be
  written in one MULTI/EXEC, pinning each chunk to one node anyway, and maxmemory eviction could
  still drop some layers of a chunk and keep others.

The tier in modules:

- :mod:`kvstore.backends.redis_connection`: from the URL to a client (one server or a Cluster),
  retries, the per-call deadline (``operation_timeout``), error counts, the password kept out of
  every text. A store starts while Redis is down and resumes when it returns.
- :mod:`kvstore.backends.redis_set_parts`: the multi-part SET written by hand on a raw connection.
- :mod:`kvstore.backends.redis_get_into`: the GET whose reply the socket receives straight into the caller's memory.
- :mod:`kvstore.backends.redis_maintenance`: the operator's side (SCAN of every namespace, removal).
- here, :class:`RedisBackend`: reads, writes and lookups of this store's namespace.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvstore.backends.base import Backend, ByteRange, Scatter
from kvstore.backends.redis_connection import CALL_ERRORS
from kvstore.backends.redis_get_into import get_into as get_received_into
from kvstore.backends.redis_get_into import receives_in_place
from kvstore.backends.redis_maintenance import RedisMaintenance
from kvstore.backends.redis_set_parts import set_parts
from kvstore.util.buffers import Buffer, as_bytes_view

READ_PIECE = 2 << 20  # get_into's GETRANGE size
SCRATCH_BUFFERS = 2  # gather buffers kept for multi-part SETs (each about one chunk)


class RedisBackend(RedisMaintenance, Backend):
    """One server or a Cluster (see the module docstring); every call bounded by ``operation_timeout``."""

    name = "redis"

    def __init__(self, url: str | None = None, *, ttl: float | None = None, **connection: Any) -> None:
        """``ttl``: seconds an object lives (None: until the server evicts it); ``connection``: the settings
        of :class:`~kvstore.backends.redis_connection.RedisConnection` (cluster, prefix, pool, timeouts, namespace)."""
        if ttl is not None and ttl <= 0:
            raise ValueError(f"redis ttl must be positive seconds or None, got {ttl!r}")
        super().__init__(url, **connection)
        self.ttl = ttl
        self._ttl_ms = None if ttl is None else max(1, round(ttl * 1000))
        self._scratch: list[bytearray] = []

    def __repr__(self) -> str:
        return f"RedisBackend({self.url!r}, cluster={self.cluster}, prefix={self.prefix!r}, ttl={self.ttl})"

    def _settings_text(self) -> str:
        return f"prefix {self.prefix!r}, ttl {self.ttl}"

    # -- the Backend interface ---------------------------------------------------------------

    async def fetch(self, key: str, byte_range: ByteRange | None) -> bytes | None:
        """GET, or GETRANGE (whose end is inclusive) for a range.

        With a TTL, a full read (GETEX) and a range read from offset 0 (a layer-streamed load
        starts with the header) refresh it, so hot chunks stay. GETRANGE answers b"" both for a
        missing key and for a range past the end of a value, so an empty answer is settled by the
        key's presence read in the same MULTI/EXEC (the PEXPIRE's reply, or an EXISTS asked again
        with the range: empty answers are rare, hits stay one plain command). Atomic, so a chunk
        written in between can never read as an empty object (which the tier would count corrupt).
        """
        name, ttl = self._name(key), self._ttl_ms
        if byte_range is None:
            data = await self._call("GET", lambda c: c.get(name) if ttl is None else c.getex(name, px=ttl))
        else:
            start, end = byte_range
            present: bool | None = None
            if ttl is not None and start == 0:
                data, present = await self._pipe(
                    "GETRANGE", lambda p: p.getrange(name, 0, end - 1).pexpire(name, ttl), transaction=True
                )
            else:
                data = await self._call("GETRANGE", lambda c: c.getrange(name, start, end - 1))
                if not data:  # absent, or past the end: read again, atomically with the key's presence
                    data, present = await self._pipe(
                        "GETRANGE", lambda p: p.getrange(name, start, end - 1).exists(name), transaction=True
                    )
            if not data:
                data = b"" if present else None
        self.bytes_in += len(data or b"")
        return data

    async def get_into(self, key: str, buffers: Sequence[memoryview]) -> int | None:
        """Read the value's leading bytes straight into ``buffers``; the value's size, None if absent.

        On a single server over plain TCP or a Unix socket: one GET (GETEX with a TTL) whose reply the
        socket receives straight into ``buffers`` (:mod:`~kvstore.backends.redis_get_into`). Otherwise
        (a Cluster, TLS): one MULTI/EXEC (an atomic snapshot, one round trip) of EXISTS, STRLEN and
        GETRANGEs of READ_PIECE bytes over the buffers' capacity (pieces past the end come back empty),
        each copied into place: redis-py's GET of a 16-40 MiB value ran at ~0.3-0.45 GB/s here (both
        sides allocate and first-touch the whole reply), 2 MiB pieces at 0.5-0.9 GB/s. An empty value
        is present (size 0: the tier counts it corrupt and deletes it), not absent.
        """
        views = [as_bytes_view(buffer) for buffer in buffers]
        capacity, name, ttl = sum(len(view) for view in views), self._name(key), self._ttl_ms
        if not self.cluster and receives_in_place(self._connect()):  # type: ignore[arg-type]
            size = await self._call("GET", lambda c: get_received_into(c, name, views, ttl))
            self.bytes_in += 0 if size is None else min(size, capacity)
            return size

        def fill(pipe: Any) -> None:
            pipe.exists(name).strlen(name)
            for start in range(0, capacity, READ_PIECE):
                pipe.getrange(name, start, min(start + READ_PIECE, capacity) - 1)
            if ttl is not None:
                pipe.pexpire(name, ttl)

        present, size, *pieces = await self._pipe("GETRANGE", fill, transaction=True)
        if not present:  # STRLEN is 0 for an absent key and for an empty value: EXISTS tells them apart
            return None
        scatter = Scatter(views)
        for piece in pieces[: len(pieces) - (ttl is not None)]:
            scatter.write(piece)
        self.bytes_in += scatter.copied
        return int(size)

    async def get_sized(self, key: str, byte_range: ByteRange) -> tuple[bytes, int | None] | None:
        """GETRANGE with the value's EXISTS and STRLEN in one MULTI/EXEC: one round trip, one snapshot.

        A range from offset 0 refreshes the TTL, as :meth:`fetch` does.
        """
        name, ttl, (start, end) = self._name(key), self._ttl_ms, byte_range

        def fill(pipe: Any) -> None:
            pipe.exists(name).strlen(name).getrange(name, start, end - 1)
            if ttl is not None and start == 0:
                pipe.pexpire(name, ttl)

        present, size, data, *_ = await self._pipe("GETRANGE", fill, transaction=True)
        if not present:
            return None
        self.bytes_in += len(data)
        return data, int(size)

    async def set(self, key: str, parts: Sequence[Buffer]) -> None:
        """One SET (with PX when a TTL is set): atomic for readers.

        One part is sent as it is. On a single server, several parts go out as they are, in one
        hand-built request (:func:`~kvstore.backends.redis_set_parts.set_parts`). On a Cluster they
        are gathered into a reused scratch buffer: with the tier's fresh header + 30 layer parts,
        ``b"".join`` ran 2-6 MiB SETs at 0.4-0.7 GB/s and the warm buffer at 1.1-2.4 GB/s here
        (equal from ~24 MiB). A buffer is reused only after a SET that succeeded: the reply means
        every byte was sent.
        """
        views = [as_bytes_view(part) for part in parts]
        name, size, ttl = self._name(key), sum(len(view) for view in views), self._ttl_ms
        if len(views) == 1:
            await self._call("SET", lambda c: c.set(name, views[0], px=ttl))
        elif not self.cluster:
            await self._call("SET", lambda c: set_parts(c, name, views, size, ttl))
        else:
            scratch = self._take_scratch(size)
            gather = Scatter([scratch])
            for view in views:
                gather.write(view)
            value = memoryview(scratch)[:size]
            await self._call("SET", lambda c: c.set(name, value, px=ttl))
            if len(self._scratch) < SCRATCH_BUFFERS:
                self._scratch.append(scratch)
        self.bytes_out += size

    def _take_scratch(self, size: int) -> bytearray:
        for index, buffer in enumerate(self._scratch):
            if len(buffer) >= size:
                return self._scratch.pop(index)
        if self._scratch:
            self._scratch.pop(0)  # too small for today's chunks
        return bytearray(size + size // 8)  # headroom: compressed sizes vary from chunk to chunk

    async def set_link(self, key: str, parent: str) -> None:
        """The parent's key in a small value beside the chunk: ``kvstore gc`` reads it there, since reading the
        chunk's header would restart its idle time (the age gc judges it by).

        Without a TTL: a chunk read often outlives its own first TTL, and its link must live as long (gc
        removes the links whose chunk is gone: :meth:`prune_links`). Best effort: a link that cannot be
        written leaves the chunk stored (gc then counts it as the first of its prefix).
        """
        name = self._link_name(key)
        try:
            await self._call("SET", lambda c: c.set(name, parent))
        except CALL_ERRORS:
            pass  # counted and, for an unreachable server, logged by _call

    async def exists(self, key: str) -> bool:
        name = self._name(key)
        return bool(await self._call("EXISTS", lambda c: c.exists(name)))

    async def delete(self, key: str) -> None:
        """The chunk, then its parent link (:meth:`set_link`)."""
        name, link = self._name(key), self._link_name(key)
        await self._call("DEL", lambda c: c.delete(name))
        await self._call("DEL", lambda c: c.delete(link))

    async def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        """Every value in one pipeline of GETs (GETEX, refreshing the TTL, when one is set): one round trip."""
        if not keys:
            return []
        names, ttl = [self._name(key) for key in keys], self._ttl_ms
        values = await self._pipe("GET", lambda p: [p.get(n) if ttl is None else p.getex(n, px=ttl) for n in names])
        self.bytes_in += sum(len(value) for value in values if value is not None)
        return values

    async def prefix_count(self, keys: Sequence[str]) -> int:
        """How many leading keys exist: one pipeline of EXISTS, one round trip (per node)."""
        if not keys:
            return 0
        found = await self._pipe("EXISTS", lambda p: [p.exists(self._name(key)) for key in keys])
        return next((count for count, present in enumerate(found) if not present), len(keys))

    def stats(self) -> dict[str, int | float | str]:
        names = ("requests", "errors", "timeouts", "connection_errors", "bytes_in", "bytes_out")
        return {name: getattr(self, name) for name in names}
