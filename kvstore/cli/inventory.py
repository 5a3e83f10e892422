"""What ``kvstore ls``, ``stats``, ``gc`` and ``verify`` do, apart from printing: list, choose, remove, check.

The tools work on what is stored, in every namespace, without a model layout: each backend
lists its chunk objects (:meth:`Backend.scan`) with their size and the time of their last write
or access, and removes objects only if they are still as listed (:meth:`Backend.remove_unchanged`),
so running them beside live engines is safe. Printing lives in :mod:`kvstore.cli.admin`.
"""

from __future__ import annotations

import asyncio
import fnmatch
import logging
import math
import time
import weakref
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from contextlib import AsyncExitStack, asynccontextmanager, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from kvstore.backends import Backend, RemoveReport, StoredObject, make_backend
from kvstore.backends.disk import DiskBackend
from kvstore.backends.files import unlink_quietly, walk_files
from kvstore.backends.registry import (
    BackendSpec,
    SectionSettings,
    available_backends,
    backend_sections,
    default_endpoint,
)
from kvstore.backends.temporaries import temporary_state
from kvstore.cli.console import TierUnreachable
from kvstore.cli.removal_events import RemovalEvents, chunk_name
from kvstore.cli.removal_events import removal_events as removal_events  # for admin, loaded lazily
from kvstore.config import StoreConfig
from kvstore.errors import BucketMissing, ChunkFormatError, ConfigError
from kvstore.events.wire import BlockHash
from kvstore.keys import namespace_dir
from kvstore.storage.container import HEADER_ALIGN, check_stored_chunk, header_codec, header_length
from kvstore.util.threads import in_thread
from kvstore.util.units import clip

T = TypeVar("T")
NOT_A_CHUNK = "(not a chunk)"  # ls's codec for an object whose header does not check out
AGE_BUCKETS: tuple[tuple[float, str], ...] = (
    (3600, "< 1h"),
    (86400, "1h-1d"),
    (7 * 86400, "1d-7d"),
    (30 * 86400, "7d-30d"),
    (math.inf, ">= 30d"),
)
# What each open tool backend's errors must never show, and how to say where it is (filled by
# tool_backends from the backend's spec, read by reaching and endpoint).
_SECRETS: weakref.WeakKeyDictionary[Backend, list[str]] = weakref.WeakKeyDictionary()
_ENDPOINTS: weakref.WeakKeyDictionary[Backend, Callable[[Backend], str]] = weakref.WeakKeyDictionary()


# -- which tiers and namespaces ----------------------------------------------------------------


def configured_tiers(config: StoreConfig) -> dict[str, tuple[BackendSpec[Any], SectionSettings]]:
    """Every backend ``config`` has a section of (built in, or registered), with its spec, fastest first."""
    return {spec.name: (spec, section) for spec, section in backend_sections(config)}


def enabled_tiers(config: StoreConfig) -> list[str]:
    """The secondary tiers ``config`` enables, fastest first."""
    return [name for name, (_, section) in configured_tiers(config).items() if section.enabled]


@asynccontextmanager
async def tool_backends(config: StoreConfig, tiers: Sequence[str] | None = None) -> AsyncIterator[dict[str, Backend]]:
    """The backends of ``tiers`` (default: every tier the config enables), opened for the tools.

    Each as its spec (:class:`~kvstore.backends.registry.BackendSpec`) says: checked first, its section
    as the tools use it, opened or not (the disk backend is not: opening scans for its eviction index and
    evicts to its budget, which is an engine's business, not a listing's). A bucket is never created here.
    """
    configured = configured_tiers(config)
    names = list(tiers) if tiers else enabled_tiers(config)
    for name in names:
        if name not in configured and name not in available_backends():
            raise ConfigError(f"unknown tier {name!r}; choose from {', '.join(configured)}")
        if name not in configured or not configured[name][1].enabled:
            raise ConfigError(
                f"the {name} tier is not enabled in this configuration; set {name}.enabled = true "
                f"(or KVSTORE_{name.upper()}__ENABLED=true) and its settings"
            )
    for name in names:
        spec, section = configured[name]
        if spec.tools_check is not None:
            spec.tools_check(section)
    backends: dict[str, Backend] = {}
    async with AsyncExitStack() as stack:
        stack.enter_context(_engine_warnings_off(names))
        for name in names:
            spec, section = configured[name]
            if spec.tools_section is not None:
                section = spec.tools_section(section)
            backends[name] = backend = make_backend(section, config.timeouts)
            _SECRETS[backend] = _secrets(spec, section)
            _ENDPOINTS[backend] = spec.endpoint
            if spec.tools_open:
                with reaching(backend):
                    try:
                        await backend.open()
                    except BucketMissing:
                        raise TierUnreachable(
                            name,
                            endpoint(backend),
                            f"the bucket does not exist; kvstore's commands never create one (a store opened "
                            f"with {name}.create_bucket = true does), so create it or check {name}.bucket",
                        ) from None
                stack.push_async_callback(backend.close)
        yield backends


def sources(backends: dict[str, Backend]) -> str:
    """What the command read, one ``tier: where`` per tier: the directory, the (masked) URL, the bucket."""
    return "; ".join(f"{name}: {endpoint(backend)}" for name, backend in backends.items())


@contextmanager
def _engine_warnings_off(tiers: Sequence[str]) -> Iterator[None]:
    """Mute the backends' warnings written for engines ("not reachable yet; will keep trying") unless verbose.

    A tool does not keep trying: it reports a tier it cannot use itself, in one line (:func:`reaching`).
    """
    loggers = [logging.getLogger(f"kvstore.{tier}") for tier in tiers]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        if not logger.isEnabledFor(logging.INFO):  # --verbose keeps everything
            logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.setLevel(level)


@contextmanager
def reaching(backend: Backend) -> Iterator[None]:
    """Whatever goes wrong talking to ``backend`` in the block becomes one :class:`TierUnreachable` line.

    A dead server, a wrong password or key surfaces as whatever its client raises (redis, botocore,
    OSError); the operator gets the tier, its endpoint and the cause, with the tier's secrets
    (as :func:`tool_backends` noted them) blotted out.
    """
    try:
        yield
    except (ConfigError, TierUnreachable):
        raise
    except Exception as exc:
        cause = " ".join(f"{type(exc).__name__}: {exc}".split())  # one line, whatever the client wrote
        for secret in _SECRETS.get(backend, ()):
            cause = cause.replace(secret, "***")
        raise TierUnreachable(backend.name, endpoint(backend), clip(cause, 300)) from exc


def endpoint(backend: Backend) -> str:
    """Where the tools reach ``backend``, without secrets, as its spec says: a directory, a (masked) URL, a bucket."""
    return _ENDPOINTS.get(backend, default_endpoint)(backend)


def _secrets(spec: BackendSpec[Any], section: object) -> list[str]:
    """What must never be printed for this tier, as its spec says (the Redis URL's password, the AWS secret key)."""
    found = list(spec.secrets(section)) if spec.secrets is not None else []
    return [secret for secret in found if len(secret) >= 3]  # a one-letter password would blot out the text


def namespace_filter(patterns: Sequence[str]) -> Callable[[str], bool] | None:
    """Namespace directories matching any pattern: a namespace as engines name it, or a glob on directories."""
    if not patterns:
        return None
    exact = {namespace_dir(pattern) for pattern in patterns}
    return lambda name: name in exact or any(fnmatch.fnmatchcase(name, pattern) for pattern in patterns)


async def list_objects(
    backend: Backend, accept: Callable[[str], bool] | None, on_page: Callable[[int], None] | None = None
) -> list[StoredObject]:
    """Every object the backend holds in the accepted namespaces; ``on_page`` hears each page's size as it comes."""
    objects: list[StoredObject] = []
    with reaching(backend):
        async for page in backend.scan(accept):
            objects.extend(page)
            if on_page is not None:
                on_page(len(page))
    return objects


# -- ls and stats --------------------------------------------------------------------------------


async def read_header_field(backend: Backend, item: StoredObject, field: Callable[[bytes], T], damaged: T) -> T | None:
    """``field`` of ``item``'s chunk header (one small ranged read, two for a header over 4 KiB): ``damaged``
    for a header that does not check out (``field`` raising ChunkFormatError too); None if the object is gone."""
    with reaching(backend):
        head = await backend.read_head(item, HEADER_ALIGN)  # every header of up to ~250 layers fits
        if head is None:
            return None
        try:
            needed = header_length(head)
            if needed > len(head):
                head = await backend.read_head(item, needed)
                if head is None:
                    return None
            return field(head)
        except ChunkFormatError:
            return damaged


async def read_header_fields(
    backend: Backend,
    objects: Sequence[StoredObject],
    field: Callable[[bytes], T],
    damaged: T,
    concurrency: int = 16,
    on_read: Callable[[int], None] | None = None,
) -> list[T | None]:
    """:func:`read_header_field` of each object, ``concurrency`` reads in flight, in the order of ``objects``."""
    slots = asyncio.Semaphore(concurrency)

    async def one(item: StoredObject) -> T | None:
        async with slots:
            value = await read_header_field(backend, item, field, damaged)
        if on_read is not None:
            on_read(1)
        return value

    return list(await asyncio.gather(*(one(item) for item in objects)))


async def read_codecs(
    backend: Backend,
    objects: Sequence[StoredObject],
    concurrency: int = 16,
    on_read: Callable[[int], None] | None = None,
) -> list[str | None]:
    """The codec pipeline each object is stored with, from its header, in the order of ``objects``, ``concurrency``
    reads in flight. None: gone since listed; :data:`NOT_A_CHUNK`: its header does not check out (``verify`` says
    why)."""
    return await read_header_fields(backend, objects, header_codec, NOT_A_CHUNK, concurrency, on_read)


@dataclass
class NamespaceSummary:
    """One namespace in one tier: chunk count, bytes, oldest and newest times, chunks per age bucket,
    and chunks per codec pipeline (empty when the headers were not read)."""

    tier: str
    namespace: str
    chunks: int = 0
    bytes: int = 0
    oldest: float = math.inf  # Unix times
    newest: float = 0.0
    ages: list[int] = field(default_factory=lambda: [0] * len(AGE_BUCKETS))  # chunks per AGE_BUCKETS bucket
    codecs: dict[str, int] = field(default_factory=dict)  # chunks per codec pipeline id, most first


def summarize(
    tier: str, objects: Sequence[StoredObject], now: float, codecs: Sequence[str | None] | None = None
) -> list[NamespaceSummary]:
    """One row per namespace, largest first; ``codecs`` (one per object, None: gone since listed) are counted."""
    rows: dict[str, NamespaceSummary] = {}
    for index, item in enumerate(objects):
        row = rows.setdefault(item.namespace, NamespaceSummary(tier, item.namespace))
        row.chunks += 1
        row.bytes += item.size
        row.oldest = min(row.oldest, item.when)
        row.newest = max(row.newest, item.when)
        age = now - item.when
        row.ages[next(i for i, (limit, _) in enumerate(AGE_BUCKETS) if age < limit)] += 1
        codec = codecs[index] if codecs is not None else None
        if codec is not None:
            row.codecs[codec] = row.codecs.get(codec, 0) + 1
    for row in rows.values():
        row.codecs = dict(sorted(row.codecs.items(), key=lambda entry: (-entry[1], entry[0])))
    return sorted(rows.values(), key=lambda row: (-row.bytes, row.namespace))


# -- temporary files -----------------------------------------------------------------------------


@dataclass
class TemporarySweep:
    """The disk tier's temporary files: stale and orphaned ones (a killed writer's) removed or to remove,
    fresh ones left."""

    stale: int = 0  # older than STALE_TMP_SECONDS
    stale_bytes: int = 0
    orphaned: int = 0  # younger, but the writer named in them no longer runs
    orphaned_bytes: int = 0
    removed: int = 0
    fresh: int = 0  # younger than STALE_TMP_SECONDS, and their writer runs (or cannot be looked up)


async def sweep_temporaries(
    backends: dict[str, Backend], accept: Callable[[str], bool] | None, *, remove: bool
) -> TemporarySweep | None:
    """The disk tier's stale temporary files in the accepted namespaces, removed when ``remove``; None without disk.

    A writer killed mid-write leaves ``<key>.kvc.tmp-...`` (and a killed gc its set-aside file),
    which no listing shows. One older than ``STALE_TMP_SECONDS``, the bound a store's open sweeps
    with, has no live writer: it goes; so does a younger one whose writer (named in it: pid, start
    time, machine) no longer runs. Any other may be a write in progress: it stays, counted.
    """
    backend = backends.get("disk")
    if not isinstance(backend, DiskBackend):
        return None
    return await in_thread(None, _sweep_temporaries, backend.root, accept, remove)


def _sweep_temporaries(root: Path, accept: Callable[[str], bool] | None, remove: bool) -> TemporarySweep:
    sweep = TemporarySweep()
    now = time.time()
    for _, path, stat in walk_files(root, accept):
        temporary = temporary_state(path.name, stat.st_mtime, now)
        if temporary is None:
            continue
        if temporary == "fresh":
            sweep.fresh += 1
            continue
        if temporary == "orphaned":
            sweep.orphaned += 1
            sweep.orphaned_bytes += stat.st_size
        else:
            sweep.stale += 1
            sweep.stale_bytes += stat.st_size
        if remove:
            unlink_quietly(path)
            sweep.removed += 1
    return sweep


# -- verify -------------------------------------------------------------------------------------


@dataclass
class Damaged:
    """An object whose checks failed, and why."""

    item: StoredObject  # as read (its version is what a removal checks)
    reason: str
    name: BlockHash | None = None  # what events call it once removed (removal_events.chunk_name)


@dataclass
class TierCheck:
    """What verify found in one tier: objects checked, gone meanwhile, damaged, unreadable, and removed."""

    tier: str
    checked: int = 0
    checked_bytes: int = 0
    gone: int = 0  # listed, then absent when read (evicted, expired, collected)
    damaged: list[Damaged] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)  # reads that failed (the object may be fine)
    removed: RemoveReport | None = None


async def verify_tier(
    name: str,
    backend: Backend,
    objects: Sequence[StoredObject],
    *,
    concurrency: int = 8,
    on_checked: Callable[[int], None] | None = None,
) -> TierCheck:
    """Read every object and check every checksum; ``concurrency`` reads in flight."""
    result = TierCheck(name)
    slots = asyncio.Semaphore(concurrency)

    async def check(item: StoredObject) -> None:
        async with slots:
            try:
                data = await backend.read_object(item)
            except Exception as exc:
                result.errors.append(f"{item.namespace}/{item.key}: {type(exc).__name__}: {exc}")
                return
            finally:
                if on_checked is not None:
                    on_checked(1)
        if data is None:
            result.gone += 1
            return
        result.checked += 1
        result.checked_bytes += len(data)
        try:
            check_stored_chunk(data, item.key)
        except ChunkFormatError as exc:
            result.damaged.append(Damaged(backend.read_version(item, data), str(exc), chunk_name(data, item.key)))

    await asyncio.gather(*(check(item) for item in objects))
    result.damaged.sort(key=lambda damaged: (damaged.item.namespace, damaged.item.key))
    return result


async def remove_damaged(
    backends: dict[str, Backend], results: Sequence[TierCheck], events: RemovalEvents | None = None
) -> None:
    """Remove what each tier's check found damaged, if still as read (``TierCheck.removed``); ``events``:
    publish what went, each chunk named as its header did, else by its key."""
    for result in results:
        if result.damaged:
            backend = backends[result.tier]
            result.removed = await backend.remove_unchanged([bad.item for bad in result.damaged])
            if events is not None:
                names = {(bad.item.namespace, bad.item.key): bad.name for bad in result.damaged}
                events.report(result.tier, backend, result.removed, names)
