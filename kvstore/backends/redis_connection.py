"""The Redis tier's connection: from a URL to a client (one server or a Cluster), and every call bounded.

:class:`RedisConnection` is what the tier's data path (:mod:`kvstore.backends.redis`) and its
operator side (:mod:`kvstore.backends.redis_maintenance`) both send their commands through. Its
contract:

- No I/O before the first call: the client is made on first use, and ``open()`` only tries one
  PING, so a store starts while Redis is down and resumes when it returns.
- Refused or reset connections are retried RETRIES times (jittered exponential backoff from
  50 ms), so a dropped pooled connection is re-made on the next call. Timeouts are not retried:
  a stalled server rarely recovers within milliseconds, and a miss is cheap.
- Every call, waiting for a free connection included, returns or raises within
  ``operation_timeout`` = ``connect_timeout + socket_timeout + 0.25 s``; that also caps the
  cluster client's own retries. A Cluster's "no node reachable" surfaces as a ConnectionError.
- Every call is counted (``requests``, ``errors``, ``timeouts``, ``connection_errors``), and an
  unreachable server is logged at most every WARN_EVERY seconds.
- The URL's password is never shown: ``url``, logs and error texts mask it (:func:`mask_url`).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar
from urllib.parse import parse_qsl, quote, unquote, urlsplit, urlunsplit

from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialWithJitterBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisClusterException, RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from kvstore.keys import DEFAULT_NAMESPACE, is_namespace_dir

log = logging.getLogger("kvstore.redis")
T = TypeVar("T")

DEFAULT_URL = "redis://127.0.0.1:6379/0"
RETRIES = 2  # after a server restart the first call meets a dead pooled connection: one retry re-makes it
BACKOFF_BASE, BACKOFF_CAP = 0.05, 0.5
DEADLINE_SLACK = 0.25
LINK_SUFFIX = "~parent"  # a chunk's parent link beside it: read by kvstore gc without touching the chunk
WARN_EVERY = 30.0  # seconds between "unreachable" warnings (a Cluster missing a node fails some calls only)
CALL_ERRORS = (RedisError, RedisClusterException, TimeoutError, OSError)
"""What a call may raise when the server is unreachable, slow or refusing (callers that report, not raise, catch it)."""


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


def url_secrets(url: str) -> list[str]:
    """Every form in which the URL's password could surface in a message (as written, decoded)."""
    parts = urlsplit(url)
    found = [parts.password] + [value for name, value in parse_qsl(parts.query) if name == "password"]
    return sorted({form for secret in found if secret for form in (secret, unquote(secret))}, key=len, reverse=True)


async def on_raw_connection(client: Redis, exchange: Callable[[Any], Awaitable[T]]) -> T:
    """``exchange(connection)`` on a connection of ``client``'s pool, for a request written or read by hand.

    A stale pooled connection (the server restarted) is retried once on a fresh one. Any other failure,
    a cancellation included, drops the connection, so no half-sent request or half-read reply stays on
    a pooled socket. nowait: closing waits for nothing (a frozen server would hold a polite close for
    connect_timeout, past the call's deadline). The deadline is the caller's (:meth:`RedisConnection._call`).
    """
    pool = client.connection_pool
    for attempt in range(2):
        connection = await pool.get_connection()
        try:
            return await exchange(connection)
        except RedisConnectionError:
            await connection.disconnect(nowait=True)
            if attempt:
                raise
        except BaseException:
            await connection.disconnect(nowait=True)
            raise
        finally:
            await pool.release(connection)
    raise AssertionError("unreachable")  # the second attempt returns or raises


class RedisConnection:
    """One server's or a Cluster's client, made lazily; every call bounded, counted and password-free.

    Keys are named ``{prefix}:{namespace}:{chunk key}`` (:meth:`_name`).
    """

    def __init__(
        self,
        url: str | None = None,
        *,
        cluster: bool = False,
        prefix: str = "kvstore",
        max_connections: int = 32,
        connect_timeout: float = 2.0,
        socket_timeout: float = 30.0,
        namespace: str = DEFAULT_NAMESPACE,
    ) -> None:
        if not is_namespace_dir(namespace):
            raise ValueError(f"{namespace!r} is not a namespace directory name (see kvstore.keys.namespace_dir)")
        self._url = url or os.environ.get("REDIS_URL") or DEFAULT_URL
        self.url, self._secrets = mask_url(self._url), url_secrets(self._url)
        self.cluster, self.prefix, self.namespace = cluster, prefix, namespace
        self.max_connections = max_connections
        self.connect_timeout, self.socket_timeout = connect_timeout, socket_timeout
        self.operation_timeout = connect_timeout + socket_timeout + DEADLINE_SLACK
        self._client: Redis | RedisCluster | None = None
        self._slots = asyncio.Semaphore(max_connections)  # redis-py's async pools raise, not wait, when exhausted
        self._closed = self._failing = False
        self._warned_at = -WARN_EVERY
        self.requests = self.errors = self.timeouts = self.connection_errors = self.bytes_in = self.bytes_out = 0

    # -- lifecycle ---------------------------------------------------------------------------

    async def open(self) -> None:
        """Create the client and try one PING; a server that is down now only earns a warning."""
        self._closed = False
        try:
            async with asyncio.timeout(self.operation_timeout):
                await self._connect().ping()
        except CALL_ERRORS as exc:
            self._failing, self._warned_at = True, time.monotonic()
            log.warning("redis tier %s is not reachable yet (%s); will keep trying", self.url, self._scrub(exc))
        else:
            kind = "cluster" if self.cluster else "single server"
            log.info("redis tier %s (%s), %s", self.url, kind, self._settings_text())

    async def close(self) -> None:
        """Drop the connections; bounded, so shutdown never hangs on a dead or frozen server."""
        client, self._client, self._closed = self._client, None, True
        if client is not None:
            try:
                async with asyncio.timeout(self.connect_timeout):
                    await client.aclose()
            except CALL_ERRORS as exc:
                log.debug("redis tier %s: close: %s", self.url, self._scrub(exc))

    def _settings_text(self) -> str:
        """What the "reachable" log line says of the settings (the data path adds its TTL)."""
        return f"prefix {self.prefix!r}"

    def _connect(self) -> Redis | RedisCluster:
        """The client, made on first use without I/O (connections open lazily, per call)."""
        if self._closed:
            raise RedisConnectionError(f"redis tier {self.url} is closed")
        if self._client is None:
            backoff = ExponentialWithJitterBackoff(cap=BACKOFF_CAP, base=BACKOFF_BASE)
            options: dict[str, Any] = {
                "socket_connect_timeout": self.connect_timeout,
                "socket_timeout": self.socket_timeout,
                "max_connections": self.max_connections,
                "retry": Retry(backoff, RETRIES, supported_errors=(RedisConnectionError,)),
            }
            if urlsplit(self._url).scheme != "unix":  # (redis-py's Unix socket connections take no keepalive)
                options["socket_keepalive"] = True
            try:
                kind = RedisCluster if self.cluster else Redis
                self._client = kind.from_url(self._url, **options)
            except (ValueError, RedisError, RedisClusterException) as exc:
                raise ValueError(f"bad redis URL {self.url}: {self._scrub(exc)}") from None
        return self._client

    # -- calls -------------------------------------------------------------------------------

    def _name(self, key: str, namespace: str | None = None) -> str:
        return f"{self.prefix}:{namespace or self.namespace}:{key}"

    def _link_name(self, key: str, namespace: str | None = None) -> str:
        """Where a chunk's parent key is kept beside it (:meth:`RedisBackend.set_link`); never listed as a chunk."""
        return f"{self._name(key, namespace)}{LINK_SUFFIX}"

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
