"""Redis tier on ``redis.asyncio``: the same code drives one server or a Redis Cluster.

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

Failures: a store must start while Redis is down and resume when it returns, so ``open()`` does
not need the server, and a dropped connection is re-made on the next call (refused or reset
connections are retried RETRIES times, jittered exponential backoff from 50 ms). Timeouts are not
retried: a stalled server rarely recovers within milliseconds, and a miss is cheap. Every call,
waiting for a free connection included, returns or raises within ``operation_timeout`` =
``connect_timeout + socket_timeout + 0.25 s``; that also caps the cluster client's own retries.
The URL's password is never shown: ``url``, ``repr()``, logs and error texts mask it.

(About 550 lines: one backend per module, and this one serves both a single server and a
Cluster, with their retry, timeout and atomic-read rules; the operator-side scan lives in
:mod:`kvstore.backends.maintenance`.)
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import logging
import os
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, TypeVar
from urllib.parse import parse_qsl, quote, unquote, urlsplit, urlunsplit

from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialWithJitterBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisClusterException, RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from kvstore.backends.base import Backend, ByteRange, Scatter
from kvstore.backends.maintenance import LIST_PAGE, RemoveReport, StoredObject, pages
from kvstore.keys import DEFAULT_NAMESPACE, is_namespace_dir
from kvstore.util.buffers import Buffer, as_bytes_view

log = logging.getLogger("kvstore.redis")
T = TypeVar("T")

DEFAULT_URL = "redis://127.0.0.1:6379/0"
RETRIES = 2  # after a server restart the first call meets a dead pooled connection: one retry re-makes it
BACKOFF_BASE, BACKOFF_CAP = 0.05, 0.5
DEADLINE_SLACK = 0.25
READ_PIECE = 2 << 20  # get_into's GETRANGE size
SCRATCH_BUFFERS = 2  # gather buffers kept for multi-part SETs (each about one chunk)
WARN_EVERY = 30.0  # seconds between "unreachable" warnings (a Cluster missing a node fails some calls only)
_ERRORS = (RedisError, RedisClusterException, TimeoutError, OSError)
_GLOB_SPECIALS = str.maketrans({c: "\\" + c for c in "*?[]\\"})


def mask_url(url: str) -> str:
    """``url`` with its password (in the user part or a ``password=`` query) replaced by ``***``."""
    parts = urlsplit(url)
    netloc = parts.netloc
    if parts.password is not None:
        userinfo, _, hostport = netloc.rpartition("@")
        netloc = f"{userinfo.partition(':')[0]}:***@{hostport}"
    pairs = parse_qsl(parts.query, keep_blank_values=True)
    query = "&".join(f"{name}={'***' if name == 'password' else quote(value)}" for name, value in pairs)
    return urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))


def _secrets(url: str) -> list[str]:
    """Every form in which the URL's password could surface in a message (as written, decoded)."""
    parts = urlsplit(url)
    found = [parts.password] + [value for name, value in parse_qsl(parts.query) if name == "password"]
    return sorted({form for secret in found if secret for form in (secret, unquote(secret))}, key=len, reverse=True)


class RedisBackend(Backend):
    """One server or a Cluster (see the module docstring); every call bounded by ``operation_timeout``."""

    name = "redis"
    age_basis = "last access"  # Redis keeps each key's idle time; reads and writes restart it
    reads_refresh_age = True

    def __init__(
        self,
        url: str | None = None,
        *,
        cluster: bool = False,
        prefix: str = "kvstore",
        ttl: float | None = None,
        max_connections: int = 32,
        connect_timeout: float = 2.0,
        socket_timeout: float = 30.0,
        namespace: str = DEFAULT_NAMESPACE,
    ) -> None:
        if not is_namespace_dir(namespace):
            raise ValueError(f"{namespace!r} is not a namespace directory name (see kvstore.keys.namespace_dir)")
        if ttl is not None and ttl <= 0:
            raise ValueError(f"redis ttl must be positive seconds or None, got {ttl!r}")
        self._url = url or os.environ.get("REDIS_URL") or DEFAULT_URL
        self.url, self._secrets = mask_url(self._url), _secrets(self._url)
        self.cluster, self.prefix, self.ttl, self.namespace = cluster, prefix, ttl, namespace
        self._ttl_ms = None if ttl is None else max(1, round(ttl * 1000))
        self.max_connections = max_connections
        self.connect_timeout, self.socket_timeout = connect_timeout, socket_timeout
        self.operation_timeout = connect_timeout + socket_timeout + DEADLINE_SLACK
        self._client: Redis | RedisCluster | None = None
        self._slots = asyncio.Semaphore(max_connections)  # redis-py's async pools raise, not wait, when exhausted
        self._scratch: list[bytearray] = []
        self._closed = self._failing = False
        self._warned_at = -WARN_EVERY
        self.requests = self.errors = self.timeouts = self.connection_errors = self.bytes_in = self.bytes_out = 0

    def __repr__(self) -> str:
        return f"RedisBackend({self.url!r}, cluster={self.cluster}, prefix={self.prefix!r}, ttl={self.ttl})"

    # -- lifecycle ---------------------------------------------------------------------------

    async def open(self) -> None:
        """Create the client and try one PING; a server that is down now only earns a warning."""
        self._closed = False
        try:
            async with asyncio.timeout(self.operation_timeout):
                await self._connect().ping()
        except _ERRORS as exc:
            self._failing, self._warned_at = True, time.monotonic()
            log.warning("redis tier %s is not reachable yet (%s); will keep trying", self.url, self._scrub(exc))
        else:
            kind = "cluster" if self.cluster else "single server"
            log.info("redis tier %s (%s), prefix %r, ttl %s", self.url, kind, self.prefix, self.ttl)

    async def close(self) -> None:
        """Drop the connections; bounded, so shutdown never hangs on a dead or frozen server."""
        client, self._client, self._closed = self._client, None, True
        if client is not None:
            try:
                async with asyncio.timeout(self.connect_timeout):
                    await client.aclose()
            except _ERRORS as exc:
                log.debug("redis tier %s: close: %s", self.url, self._scrub(exc))

    def _connect(self) -> Redis | RedisCluster:
        """The client, made on first use without I/O (connections open lazily, per call)."""
        if self._closed:
            raise RedisConnectionError(f"redis tier {self.url} is closed")
        if self._client is None:
            backoff = ExponentialWithJitterBackoff(cap=BACKOFF_CAP, base=BACKOFF_BASE)
            options: dict[str, Any] = {
                "socket_connect_timeout": self.connect_timeout,
                "socket_timeout": self.socket_timeout,
                "socket_keepalive": True,
                "max_connections": self.max_connections,
                "retry": Retry(backoff, RETRIES, supported_errors=(RedisConnectionError,)),
            }
            try:
                kind = RedisCluster if self.cluster else Redis
                self._client = kind.from_url(self._url, **options)
            except (ValueError, RedisError, RedisClusterException) as exc:
                raise ValueError(f"bad redis URL {self.url}: {self._scrub(exc)}") from None
        return self._client

    # -- calls -------------------------------------------------------------------------------

    def _name(self, key: str, namespace: str | None = None) -> str:
        return f"{self.prefix}:{namespace or self.namespace}:{key}"

    async def _call(self, what: str, fn: Callable[[Any], Awaitable[T]]) -> T:
        """Run one request under the deadline; count it; keep the password out of any error."""
        client = self._connect()
        self.requests += 1
        try:
            async with asyncio.timeout(self.operation_timeout), self._slots:
                result = await fn(client)
        except RedisClusterException as exc:  # not a RedisError: "no node reachable", "slot not covered"
            lost = RedisConnectionError(f"redis {what} at {self.url}: {self._scrub(exc)}")
            self._failed(lost)
            raise lost from (None if self._secrets else exc)
        except RedisError as exc:
            self._failed(exc)
            if any(secret in str(exc) for secret in self._secrets):
                raise RedisError(f"redis {what} at {self.url} failed: {self._scrub(exc)}") from None
            raise
        except TimeoutError:
            error = RedisTimeoutError(f"redis {what} at {self.url} took over {self.operation_timeout:.2f}s")
            self._failed(error)
            raise error from None
        if self._failing:
            self._failing = False
            log.info("redis tier %s answers again", self.url)
        return result

    async def _pipe(self, what: str, fill: Callable[[Any], object], transaction: bool = False) -> list[Any]:
        """One pipeline (one round trip; redis-py sends a Cluster's per node); ``fill`` queues commands."""

        async def run(client: Any) -> list[Any]:
            pipe = client.pipeline(transaction=transaction)
            fill(pipe)
            return list(await pipe.execute())

        return await self._call(what, run)

    def _failed(self, exc: RedisError) -> None:
        """Count the error; warn about unreachability at most every WARN_EVERY seconds."""
        self.errors += 1
        if isinstance(exc, RedisTimeoutError):
            self.timeouts += 1
        elif isinstance(exc, RedisConnectionError):
            self.connection_errors += 1
        else:
            return
        now = time.monotonic()
        if now - self._warned_at >= WARN_EVERY:
            self._failing, self._warned_at = True, now
            log.warning("redis tier %s is unreachable: %s", self.url, self._scrub(exc))
        else:
            log.debug("redis tier %s: %s", self.url, self._scrub(exc))

    def _scrub(self, exc: BaseException) -> str:
        text = f"{type(exc).__name__}: {exc}"
        for secret in self._secrets:
            text = text.replace(secret, "***")
        return text

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

        One MULTI/EXEC (an atomic snapshot, one round trip) of EXISTS, STRLEN and GETRANGEs of READ_PIECE
        bytes over the buffers' capacity (pieces past the end come back empty). Measured here, a
        GET of a 16-40 MiB value runs at ~0.3-0.45 GB/s (both sides allocate and first-touch the
        whole reply) where 2 MiB pieces copied into caller memory ran at 0.75-0.9 GB/s. An empty
        value is present (size 0: the tier counts it corrupt and deletes it), not absent.
        """
        views = [as_bytes_view(buffer) for buffer in buffers]
        capacity, name, ttl = sum(len(view) for view in views), self._name(key), self._ttl_ms

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
        hand-built request (see :func:`_set_parts`). On a Cluster they are gathered into a reused
        scratch buffer: with the tier's fresh header + 30 layer parts, ``b"".join`` ran 2-6 MiB
        SETs at 0.4-0.7 GB/s and the warm buffer at 1.1-2.4 GB/s here (equal from ~24 MiB). A
        buffer is reused only after a SET that succeeded: the reply means every byte was sent.
        """
        views = [as_bytes_view(part) for part in parts]
        name, size, ttl = self._name(key), sum(len(view) for view in views), self._ttl_ms
        if len(views) == 1:
            await self._call("SET", lambda c: c.set(name, views[0], px=ttl))
        elif not self.cluster:
            await self._call("SET", lambda c: _set_parts(c, name, views, size, ttl))
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

    async def exists(self, key: str) -> bool:
        name = self._name(key)
        return bool(await self._call("EXISTS", lambda c: c.exists(name)))

    async def delete(self, key: str) -> None:
        name = self._name(key)
        await self._call("DEL", lambda c: c.delete(name))

    async def _scan_names(self, pattern: str) -> AsyncIterator[str]:
        """Every name matching ``pattern``, by SCAN (never KEYS; on a Cluster redis-py scans every primary).

        Each batch runs under the deadline.
        """
        scan: Any = self._connect().scan_iter(match=pattern, count=LIST_PAGE)  # an async generator
        try:
            while True:
                try:
                    name = await self._call("SCAN", lambda _: anext(scan))
                except StopAsyncIteration:
                    return
                yield name.decode() if isinstance(name, bytes) else name
        finally:
            await scan.aclose()

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

    # -- for the operator's tools: every namespace ----------------------------------------------

    async def scan(self, namespaces: Callable[[str], bool] | None = None) -> AsyncIterator[list[StoredObject]]:
        """SCAN (never KEYS) a thousand names at a time, then one pipeline of OBJECT IDLETIME and
        MEMORY USAGE per page: neither counts as an access, so listing leaves the ages alone.
        """
        names: list[tuple[str, str, str]] = []
        async for name in self._scan_names(f"{self.prefix.translate(_GLOB_SPECIALS)}:*"):
            namespace, _, key = name[len(self.prefix) + 1 :].partition(":")
            if is_namespace_dir(namespace) and _CHUNK_KEY.fullmatch(key):
                if namespaces is None or namespaces(namespace):
                    names.append((name, namespace, key))
            if len(names) == LIST_PAGE:
                yield await self._describe(names)
                names = []
        if names:
            yield await self._describe(names)

    async def _describe(self, names: list[tuple[str, str, str]]) -> list[StoredObject]:
        def fill(pipe: Any) -> None:
            for name, _, _ in names:
                pipe.object("IDLETIME", name)
                pipe.memory_usage(name, samples=0)

        try:
            replies = await self._pipe("OBJECT IDLETIME", fill)
        except RedisError as exc:
            if "LFU" in str(exc):
                raise RuntimeError(
                    f"redis tier {self.url}: an LFU maxmemory-policy keeps no idle times, so chunk ages are "
                    "unknown; use --max-bytes, or let Redis evict (or set redis.ttl)"
                ) from None
            raise
        listed_at, now = time.monotonic(), time.time()
        page = []
        for (_, namespace, key), idle, size in zip(names, replies[::2], replies[1::2], strict=True):
            if idle is None or size is None:
                continue  # expired or deleted since SCAN saw it
            page.append(StoredObject(namespace, key, int(size), now - int(idle), ("idle", int(idle), listed_at)))
        return page

    async def read_object(self, item: StoredObject) -> bytes | None:
        name = self._name(item.key, item.namespace)
        data: bytes | None = await self._call("GET", lambda c: c.get(name))
        self.bytes_in += len(data or b"")
        return data

    async def read_head(self, item: StoredObject, size: int) -> bytes | None:
        """GETRANGE (which restarts the key's idle time, as any read does: see ``reads_refresh_age``)."""
        name = self._name(item.key, item.namespace)
        data: bytes = await self._call("GETRANGE", lambda c: c.getrange(name, 0, size - 1))
        self.bytes_in += len(data)
        return data or None  # Redis answers b"" for an absent key; a chunk is never empty

    def read_version(self, item: StoredObject, data: bytes) -> StoredObject:
        """Reading restarted the key's idle time, so the removal checks the bytes read instead."""
        return dataclasses.replace(item, version=("sha1", hashlib.sha1(data, usedforsecurity=False).hexdigest()))

    async def remove_unchanged_batches(self, items: Sequence[StoredObject]) -> AsyncIterator[RemoveReport]:
        """Per batch, a pipeline of a thousand small scripts, each an atomic check-then-UNLINK of one key.

        The check: the key's idle time shows no access since the listing (or, after ``verify``
        read it, its bytes are the ones read). One key per script: on a Cluster a script may only
        touch keys of one slot.
        """
        for batch in pages(items):
            now = time.monotonic()
            conditions = [_condition(item, now) for item in batch]

            def fill(
                pipe: Any, batch: Sequence[StoredObject] = batch, conditions: list[tuple[str, str]] = conditions
            ) -> None:
                for item, (kind, value) in zip(batch, conditions, strict=True):
                    pipe.eval(_REMOVE_IF_UNCHANGED, 1, self._name(item.key, item.namespace), kind, value)

            report = RemoveReport()
            try:
                outcomes = await self._pipe("EVAL", fill)
            except _ERRORS as exc:
                report.errors.extend(f"{self.prefix}:{item.namespace}:{item.key}: {self._scrub(exc)}" for item in batch)
                outcomes = []
            for item, outcome in zip(batch, outcomes, strict=False):
                if outcome == 1:
                    report.removed += 1
                    report.removed_bytes += item.size
                elif outcome == 0:
                    report.changed += 1
                else:
                    report.gone += 1
            yield report


# KEYS[1]: the chunk. ARGV: "idle" and the least idle seconds it must show, or "sha1" and its bytes' SHA-1.
# Returns -1 (gone), 0 (changed: kept) or 1 (removed). OBJECT IDLETIME does not touch the key.
_REMOVE_IF_UNCHANGED = """
if redis.call('EXISTS', KEYS[1]) == 0 then return -1 end
if ARGV[1] == 'idle' then
  if redis.call('OBJECT', 'IDLETIME', KEYS[1]) < tonumber(ARGV[2]) then return 0 end
elseif redis.sha1hex(redis.call('GET', KEYS[1])) ~= ARGV[2] then return 0 end
redis.call('UNLINK', KEYS[1])
return 1
"""
_CHUNK_KEY = re.compile(r"[0-9a-f]{8,128}")


def _condition(item: StoredObject, now: float) -> tuple[str, str]:
    """The script's check for a listed object: unchanged bytes, or no access since the listing.

    Untouched, a key's idle time grows with the clock; idle times count whole seconds on a
    clock Redis updates every 100 ms, so one second of slack: a key listed idle for over 3 s
    and read or written since is always caught (younger keys are never max-age victims).
    """
    kind, *rest = item.version
    if kind == "sha1":
        return "sha1", str(rest[0])
    idle, listed_at = rest
    return "idle", str(int(idle) + max(0, int(now - float(listed_at)) - 1))


async def _set_parts(client: Redis, name: str, views: list[memoryview], size: int, ttl_ms: int | None) -> None:
    """SET of the concatenation of ``views``, sent without gathering them first.

    redis-py packs a command's arguments into one more copy of the value; writing the RESP
    request by hand lets the socket take the parts as they are (measured: SmolLM2-sized SETs
    went from 0.5-0.65x to 0.9-1.1x of a raw redis-py SET of a ready-made value). A stale pooled
    connection (the server restarted) is retried once on a fresh one. The deadline is the
    caller's (``_call``): a cancelled send disconnects, so no half request stays on the socket.
    """
    key = name.encode()
    expiry = [b"PX", str(ttl_ms).encode()] if ttl_ms else []
    head = b"*%d\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n" % (3 + len(expiry), len(key), key, size)
    tail = b"\r\n" + b"".join(b"$%d\r\n%s\r\n" % (len(arg), arg) for arg in expiry)
    pool = client.connection_pool
    for attempt in range(2):
        connection = await pool.get_connection()
        try:
            await _send_parts(connection, [head, *views, tail])
            await connection.read_response()  # raises the server's error, if any
            return
        except RedisConnectionError:
            await connection.disconnect(nowait=True)
            if attempt:
                raise
        except BaseException:
            # A half-sent request must not stay on the socket. nowait: closing waits for nothing
            # (a frozen server would hold a polite close for connect_timeout, past the call's deadline).
            await connection.disconnect(nowait=True)
            raise
        finally:
            await pool.release(connection)


async def _send_parts(connection: Any, parts: list[Buffer]) -> None:
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
