"""A Redis SET whose value goes out in parts, on a raw pooled connection, never joined into one copy.

The Redis tier's data path (:mod:`kvstore.backends.redis`) sends a chunk's container (a header
and one part per layer) this way to a single server. Contract of :func:`set_parts`: the same as
one ``SET name value [PX ttl]`` of the concatenated parts (atomic for readers); the server's error
is raised as redis-py raises it; a stale pooled connection is retried once on a fresh one; a
request cancelled or failed midway is never left half-sent on a pooled connection (the connection
is dropped). Not for a Cluster: the request goes to the client's one connection pool.
"""

from __future__ import annotations

from typing import Any

from redis.asyncio import Redis
from redis.exceptions import ConnectionError as RedisConnectionError

from kvstore.backends.redis_connection import on_raw_connection
from kvstore.util.buffers import Buffer


async def set_parts(client: Redis, name: str, views: list[memoryview], size: int, ttl_ms: int | None) -> None:
    """SET of the concatenation of ``views``, sent without gathering them first.

    redis-py packs a command's arguments into one more copy of the value; writing the RESP
    request by hand lets the socket take the parts as they are (measured: SmolLM2-sized SETs
    went from 0.5-0.65x to 0.9-1.1x of a raw redis-py SET of a ready-made value). A stale pooled
    connection (the server restarted) is retried once on a fresh one. The deadline is the
    caller's (``RedisConnection._call``): a cancelled send disconnects, so no half request stays
    on the socket.
    """
    key = name.encode()
    expiry = [b"PX", str(ttl_ms).encode()] if ttl_ms else []
    head = b"*%d\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n" % (3 + len(expiry), len(key), key, size)
    tail = b"\r\n" + b"".join(b"$%d\r\n%s\r\n" % (len(arg), arg) for arg in expiry)

    async def exchange(connection: Any) -> None:
        await send_parts(connection, [head, *views, tail])
        await connection.read_response()  # raises the server's error, if any

    await on_raw_connection(client, exchange)


async def send_parts(connection: Any, parts: list[Buffer]) -> None:
    """Write ``parts`` to the connection's stream one by one, then wait until the socket took them.

    redis-py's ``send_packed_command`` hands the list to ``writelines``, which on Python 3.11
    joins it into one more copy of the value (a 5.6 MiB join on the event loop per SET), and
    under ``socket_timeout`` runs the send in a task of its own. Written part by part, the
    socket sends what it can take at once straight from the caller's memory and the transport
    buffers only the rest (one copy, as for any write). Measured with 4 SETs in flight: the
    loop's share of a SmolLM2 chunk's put fell by about a quarter (see ``kvstore bench --remote``).
    """
    if not connection.is_connected:
        await connection.connect_check_health(check_health=False)
    writer = connection._writer  # redis-py's asyncio StreamWriter; no public API writes without joining
    try:
        for part in parts:
            # A send that failed (the server died) closes the transport, which then drops each later
            # write with a warning of its own ("socket.send() raised exception.", one per part from
            # the fifth on: dozens per SET of a many-layer chunk). Stop at the first: one error.
            if writer.transport.is_closing():
                raise ConnectionResetError("the connection was lost while sending")
            writer.write(part)
        await writer.drain()
    except OSError as exc:
        await connection.disconnect(nowait=True)
        raise RedisConnectionError(f"redis SET: writing to the socket failed: {exc}") from exc
