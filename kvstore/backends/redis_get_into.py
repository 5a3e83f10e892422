"""A Redis GET whose value the socket receives straight into the caller's memory, on a raw pooled connection.

The Redis tier's data path (:mod:`kvstore.backends.redis`) reads a whole chunk this way from a single
server over plain TCP (or a Unix socket). Contract of :func:`get_into`: the same as one ``GET name`` (or
``GETEX name PX ttl``): atomic, the value's size or None if absent; its leading bytes land in the
caller's buffers, the rest (if any) is read and dropped; the server's error is raised as redis-py
raises it (and the connection dropped); a stale pooled connection (one the server closed, or the
server restarted) is retried once on a fresh one; a request cancelled or failed midway never leaves
a half-read reply on a pooled connection (the connection is dropped).

Why by hand: redis-py hands the socket's bytes to its parser in 64 KiB reads, the parser builds one
``bytes`` of the whole value, and the caller copies that into place: three copies of every byte in
the loop's thread after the kernel's. Here the transport's own ``recv_into`` writes into the caller's
buffers (asyncio's :class:`~asyncio.BufferedProtocol`, swapped in for the reply and back out after).
Measured on 2 cores with 32 MiB values, 4 in flight (``benchmarks/redis_get_parts.py``): the tier's GET
read this way ran at 0.90-1.16 GB/s, 0.87-0.98x of a GET read by hand off a plain socket, where the
MULTI/EXEC of 2 MiB GETRANGEs it replaces, copied into place, ran at 0.45-0.56 and redis-py's GET at
0.21-0.34.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any

from redis.asyncio import Redis
from redis.asyncio.connection import Connection, UnixDomainSocketConnection
from redis.exceptions import ConnectionError as RedisConnectionError

from kvstore.backends.redis_connection import on_raw_connection
from kvstore.util.buffers import as_bytes_view

HEAD_BYTES = 64 << 10  # scratch: the reply's first line and what follows it, a value's bytes past the buffers


def receives_in_place(client: Redis) -> bool:
    """Whether ``client``'s connections are plain TCP or Unix sockets, whose transport can receive into the
    caller's memory (not TLS: an SSL transport decrypts into buffers of its own)."""
    return client.connection_pool.connection_class in (Connection, UnixDomainSocketConnection)


async def get_into(client: Redis, name: str, buffers: Sequence[memoryview], ttl_ms: int | None) -> int | None:
    """``GET name`` (``GETEX name PX ttl_ms`` with a TTL), received straight into ``buffers``; the value's size,
    None if absent. The deadline is the caller's (``RedisConnection._call``)."""
    key = name.encode()
    args = [b"GET", key] if ttl_ms is None else [b"GETEX", key, b"PX", str(ttl_ms).encode()]
    request = b"*%d\r\n" % len(args) + b"".join(b"$%d\r\n%s\r\n" % (len(arg), arg) for arg in args)
    return await on_raw_connection(client, lambda connection: _exchange(connection, request, buffers))


async def _exchange(connection: Any, request: bytes, buffers: Sequence[memoryview]) -> int | None:
    """Send ``request`` and receive its bulk reply into ``buffers`` through the connection's own transport."""
    if not connection.is_connected:
        await connection.connect_check_health(check_health=False)
    writer = connection._writer  # redis-py's asyncio StreamWriter; no public API reads into the caller's memory
    transport = writer.transport
    original = transport.get_protocol()
    if transport.is_closing():
        raise RedisConnectionError("the connection was lost before the request")
    # Unread bytes, or an EOF the server sent while it sat in the pool: not a connection to swap a protocol onto
    # (the transport stopped reading at that EOF, so a reply would never come). The pool skips this check on
    # RESP3 connections with maintenance notifications (redis-py 8's default there), so it is made here.
    if await connection.can_read():
        raise RedisConnectionError("the pooled connection holds unread data or was closed by the server")
    reply = BulkReply(buffers, asyncio.get_running_loop(), connection._parser.parse_error)
    transport.set_protocol(reply)
    try:
        writer.write(request)
        size = await reply.done
    except OSError as exc:
        raise RedisConnectionError(f"redis GET: the socket failed: {exc}") from exc
    finally:
        transport.set_protocol(original)  # (on a failure the connection is dropped as well)
    if reply.extra:  # (unsolicited bytes: never sent to this client) the value is sound, the connection is not
        await connection.disconnect(nowait=True)
    return size


class BulkReply(asyncio.BufferedProtocol):
    """Receives one RESP reply to GET into the caller's buffers: ``$<n>\\r\\n`` + n bytes + ``\\r\\n``, ``$-1\\r\\n``
    or RESP3's ``_\\r\\n`` (absent), or ``-<error>\\r\\n``. ``done`` is the value's size (None: absent), or the error.

    The transport asks :meth:`get_buffer` where its next ``recv_into`` should write: a small buffer of its
    own until the reply's first line is in, then the caller's buffers in order (after them, a buffer of its
    own for what does not fit, and for the closing ``\\r\\n``). Nothing more is read than the reply: the
    request was the only one on the connection.
    """

    def __init__(
        self, buffers: Sequence[memoryview], loop: asyncio.AbstractEventLoop, error_of: Callable[[str], Exception]
    ) -> None:
        """``error_of``: the exception redis-py raises for a server's error line (its parser's ``parse_error``)."""
        self.done: asyncio.Future[int | None] = loop.create_future()
        self._error_of = error_of
        self._targets = [view for view in map(as_bytes_view, buffers) if len(view)]
        self._index = self._offset = 0  # where the value's next byte goes
        self._scratch = bytearray(HEAD_BYTES)
        self._head = bytearray()  # the reply's first bytes, until its first line is complete
        self._size: int | None = None  # the value's length, once known
        self._left = 0  # bytes of the value and its closing "\r\n" still to come
        self._into_scratch = True  # where the last buffer handed out was
        self.extra = False  # bytes came after the reply: the connection's stream is no longer in step

    def get_buffer(self, sizehint: int) -> memoryview:
        """Where the transport's next ``recv_into`` writes (never empty: the transport treats that as fatal)."""
        if self.done.done():  # bytes after the reply (none are expected): received, then judged in buffer_updated
            self._into_scratch = True
            return memoryview(self._scratch)
        if self._size is not None and self._left > 2 and self._index < len(self._targets):
            target = self._targets[self._index]
            self._into_scratch = False
            return target[self._offset : self._offset + min(len(target) - self._offset, self._left - 2)]
        self._into_scratch = True
        limit = len(self._scratch) if self._size is None else min(len(self._scratch), self._left)
        return memoryview(self._scratch)[:limit]

    def buffer_updated(self, nbytes: int) -> None:
        if self.done.done():  # nothing may follow the reply on this connection: it is not reused
            self.extra = True
            return
        if not self._into_scratch:  # straight into the caller's buffer
            self._advance(nbytes)
            return
        received = memoryview(self._scratch)[:nbytes]
        if self._size is None:
            self._head += received
            end = self._head.find(b"\r\n")
            if end < 0:
                if len(self._head) > HEAD_BYTES:
                    self._fail(RedisConnectionError("redis GET: the reply's first line is too long"))
                return
            line, rest = bytes(self._head[:end]), memoryview(bytes(self._head[end + 2 :]))
            if not self._start(line):
                return
            received = rest
        self._place(received)

    def _start(self, line: bytes) -> bool:
        """The reply's first line: False if the reply ends there (absent, or an error)."""
        if line.startswith(b"-"):  # as redis-py raises it: WRONGTYPE a ResponseError, LOADING a BusyLoadingError...
            self.done.set_exception(self._error_of(line[1:].decode(errors="replace")))
            return False
        if line == b"_":  # RESP3's null (a connection that said HELLO 3): absent
            self.done.set_result(None)
            return False
        if not line.startswith(b"$") or not line[1:].lstrip(b"-").isdigit():
            self._fail(RedisConnectionError(f"redis GET: unexpected reply {line[:32]!r}"))
            return False
        size = int(line[1:])
        if size < 0:
            self.done.set_result(None)
            return False
        self._size, self._left = size, size + 2
        return True

    def _place(self, data: memoryview) -> None:
        """Bytes received into scratch: the value's into the caller's buffers (what fits; the rest dropped), then
        the closing CRLF."""
        while len(data) and self._left > 2 and self._index < len(self._targets):
            target = self._targets[self._index]
            take = min(len(data), len(target) - self._offset, self._left - 2)
            target[self._offset : self._offset + take] = data[:take]
            data = data[take:]
            self._advance(take)
        dropped = min(len(data), max(0, self._left - 2))  # the value's bytes past the caller's buffers
        self._left -= dropped
        data = data[dropped:]
        if len(data) > self._left or bytes(data) != b"\r\n"[2 - self._left : 2 - self._left + len(data)]:
            self._fail(RedisConnectionError("redis GET: the reply did not end where its length said"))
            return
        self._left -= len(data)
        if self._left == 0:
            self.done.set_result(self._size)

    def _advance(self, nbytes: int) -> None:
        self._offset += nbytes
        self._left -= nbytes
        if self._offset == len(self._targets[self._index]):
            self._index, self._offset = self._index + 1, 0

    def _fail(self, error: Exception) -> None:
        if not self.done.done():
            self.done.set_exception(error)

    def eof_received(self) -> bool:
        self._fail(RedisConnectionError("redis GET: the server closed the connection"))
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self._fail(RedisConnectionError(f"redis GET: the connection was lost: {exc}"))
