"""The Redis tier's operator side: listing every namespace's chunks, and removing only what is unchanged.

What ``kvstore ls``, ``stats``, ``gc`` and ``verify`` ask of a Redis tier (the interface is
:class:`~kvstore.backends.maintenance.Maintenance`), over the tier's connection
(:class:`~kvstore.backends.redis_connection.RedisConnection`); the data path is
:mod:`kvstore.backends.redis`. Contract:

- Listing uses SCAN (never KEYS, which blocks the server), and per page one pipeline of OBJECT
  IDLETIME and MEMORY USAGE: neither counts as an access, so listing leaves the ages alone. A
  chunk's age is its idle time (reads and writes restart it: ``reads_refresh_age``).
- A removal deletes a key only if it shows no access since it was listed (or, once ``verify``
  read it, still holds the bytes read): one atomic script per key, since on a Cluster a script
  may only touch keys of one slot. A batch that fails is reported as errors, never raised.
"""

from __future__ import annotations

import dataclasses
import hashlib
import re
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from redis.exceptions import RedisError

from kvstore.backends.maintenance import LIST_PAGE, Maintenance, RemoveReport, StoredObject, pages
from kvstore.backends.redis_connection import CALL_ERRORS, LINK_SUFFIX, RedisConnection
from kvstore.keys import is_namespace_dir

_GLOB_SPECIALS = str.maketrans({c: "\\" + c for c in "*?[]\\"})


class RedisMaintenance(RedisConnection, Maintenance):
    """Listing and removal over every namespace under the prefix (see the module docstring)."""

    age_basis = "last access"  # Redis keeps each key's idle time; reads and writes restart it
    reads_refresh_age = True

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

    async def read_parents(self, items: Sequence[StoredObject]) -> list[str | None] | None:
        """The links beside the chunks (:meth:`RedisBackend.set_link`), a pipeline of GETs per page: the
        chunks themselves are not touched, so their idle times (their ages) stay as listed."""
        parents: list[str | None] = []
        for page in pages(items):
            names = [self._link_name(item.key, item.namespace) for item in page]
            values = await self._pipe("GET", lambda pipe, names=names: [pipe.get(name) for name in names])
            for value in values:
                text = value.decode("ascii", "replace") if isinstance(value, bytes) else None
                parents.append(text if text is not None and _CHUNK_KEY.fullmatch(text) else None)
        return parents

    async def prune_links(self, namespaces: Callable[[str], bool] | None = None) -> int:
        """Remove the parent links whose chunk is gone (expired, evicted, deleted elsewhere); how many went.

        One SCAN of the links (never KEYS), then per page one pipeline of EXISTS of their chunks and one of
        UNLINK of the links whose chunk is absent. A link is written after its chunk, so one whose chunk is
        absent at the check is stale (a chunk written again later writes its link again).
        """
        removed = 0
        page: list[str] = []
        async for name in self._scan_names(f"{self.prefix.translate(_GLOB_SPECIALS)}:*{LINK_SUFFIX}"):
            namespace = name[len(self.prefix) + 1 :].partition(":")[0]
            if namespaces is None or namespaces(namespace):
                page.append(name)
            if len(page) == LIST_PAGE:
                removed += await self._unlink_stale(page)
                page = []
        return removed + (await self._unlink_stale(page) if page else 0)

    async def _unlink_stale(self, links: list[str]) -> int:
        chunks = [link.removesuffix(LINK_SUFFIX) for link in links]
        present = await self._pipe("EXISTS", lambda pipe: [pipe.exists(chunk) for chunk in chunks])
        stale = [link for link, there in zip(links, present, strict=True) if not there]
        if stale:
            await self._pipe("UNLINK", lambda pipe: [pipe.unlink(link) for link in stale])
        return len(stale)

    def read_version(self, item: StoredObject, data: bytes) -> StoredObject:
        """Reading restarted the key's idle time, so the removal checks the bytes read instead."""
        return dataclasses.replace(item, version=("sha1", hashlib.sha1(data, usedforsecurity=False).hexdigest()))

    async def remove_unchanged_batches(
        self, items: Sequence[StoredObject], head_bytes: int = 0
    ) -> AsyncIterator[RemoveReport]:
        """Per batch, a pipeline of a thousand small scripts, each an atomic check-then-UNLINK of one key.

        The check: the key's idle time shows no access since the listing (or, after ``verify``
        read it, its bytes are the ones read). One key per script: on a Cluster a script may only
        touch keys of one slot. The head (``head_bytes``) is read by the script itself, after the
        check and just before the UNLINK: a read beforehand would restart the idle time checked.
        """
        for batch in pages(items):
            now = time.monotonic()
            conditions = [_condition(item, now) for item in batch]

            def fill(
                pipe: Any, batch: Sequence[StoredObject] = batch, conditions: list[tuple[str, str]] = conditions
            ) -> None:
                for item, (kind, value) in zip(batch, conditions, strict=True):
                    name = self._name(item.key, item.namespace)
                    pipe.eval(_REMOVE_IF_UNCHANGED, 1, name, kind, value, head_bytes)

            report = RemoveReport()
            try:
                outcomes = await self._pipe("EVAL", fill)
            except CALL_ERRORS as exc:
                report.errors.extend(f"{self.prefix}:{item.namespace}:{item.key}: {self._scrub(exc)}" for item in batch)
                outcomes = []
            for item, outcome in zip(batch, outcomes, strict=False):
                if isinstance(outcome, bytes):  # removed, and this is its head
                    report.count_removed(item, item.size, outcome)
                elif outcome == 1:
                    report.count_removed(item, item.size)
                elif outcome == 0:
                    report.changed += 1
                else:
                    report.gone += 1
            yield report


# KEYS[1]: the chunk. ARGV: "idle" and the least idle seconds it must show, or "sha1" and its bytes' SHA-1;
# then how many of its first bytes to return (0: none). Returns -1 (gone), 0 (changed: kept), or, removed,
# 1 or its first bytes. OBJECT IDLETIME does not touch the key.
_REMOVE_IF_UNCHANGED = """
if redis.call('EXISTS', KEYS[1]) == 0 then return -1 end
if ARGV[1] == 'idle' then
  if redis.call('OBJECT', 'IDLETIME', KEYS[1]) < tonumber(ARGV[2]) then return 0 end
elseif redis.sha1hex(redis.call('GET', KEYS[1])) ~= ARGV[2] then return 0 end
local head = 1
if tonumber(ARGV[3]) > 0 then head = redis.call('GETRANGE', KEYS[1], 0, tonumber(ARGV[3]) - 1) end
redis.call('UNLINK', KEYS[1])
return head
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
