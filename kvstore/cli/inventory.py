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
import os
import re
import time
import weakref
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from contextlib import AsyncExitStack, asynccontextmanager, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

from kvstore.backends import Backend, Progress, RemoveReport, StoredObject, make_backend
from kvstore.backends.disk import DiskBackend, temporary_state
from kvstore.backends.files import unlink_quietly, walk_files
from kvstore.cli.console import TierUnreachable
from kvstore.config import RedisConfig, S3Config, StoreConfig
from kvstore.errors import BucketMissing, ChunkFormatError, ConfigError
from kvstore.keys import namespace_dir
from kvstore.storage.container import HEADER_ALIGN, check_stored_chunk, header_codec, header_length
from kvstore.util.threads import in_thread
from kvstore.util.units import clip

TIERS = ("disk", "redis", "s3")
NOT_A_CHUNK = "(not a chunk)"  # ls's codec for an object whose header does not check out
AGE_BUCKETS: tuple[tuple[float, str], ...] = (
    (3600, "< 1h"),
    (86400, "1h-1d"),
    (7 * 86400, "1d-7d"),
    (30 * 86400, "7d-30d"),
    (math.inf, ">= 30d"),
)
# What each open tool backend's errors must never show (filled by tool_backends, read by reaching).
_SECRETS: weakref.WeakKeyDictionary[Backend, list[str]] = weakref.WeakKeyDictionary()


# -- which tiers and namespaces ----------------------------------------------------------------


def enabled_tiers(config: StoreConfig) -> list[str]:
    """The secondary tiers ``config`` enables, in :data:`TIERS` order."""
    return [name for name in TIERS if getattr(config, name).enabled]


@asynccontextmanager
async def tool_backends(config: StoreConfig, tiers: Sequence[str] | None = None) -> AsyncIterator[dict[str, Backend]]:
    """The backends of ``tiers`` (default: every tier the config enables), opened for the tools.

    The disk backend is not opened: opening scans for its LRU index and evicts to its budget,
    which is an engine's business, not a listing's. A bucket is never created here.
    """
    names = list(tiers) if tiers else enabled_tiers(config)
    for name in names:
        if name not in TIERS:
            raise ConfigError(f"unknown tier {name!r}; choose from {', '.join(TIERS)}")
        if not getattr(config, name).enabled:
            raise ConfigError(
                f"the {name} tier is not enabled in this configuration; set {name}.enabled = true "
                f"(or KVSTORE_{name.upper()}__ENABLED=true) and its settings"
            )
    if "disk" in names:
        check_disk_root(config.disk.path)
    backends: dict[str, Backend] = {}
    async with AsyncExitStack() as stack:
        stack.enter_context(_engine_warnings_off(names))
        for name in names:
            section = getattr(config, name)
            if name == "s3":
                section = section.model_copy(update={"create_bucket": False})
            backends[name] = backend = make_backend(section, config.timeouts)
            _SECRETS[backend] = _secrets(section)
            if name != "disk":
                with reaching(backend):
                    try:
                        await backend.open()
                    except BucketMissing:
                        raise TierUnreachable(
                            name,
                            endpoint(backend),
                            "the bucket does not exist; kvstore's commands never create one (a store opened "
                            "with s3.create_bucket = true does), so create it or check s3.bucket",
                        ) from None
                stack.push_async_callback(backend.close)
        yield backends


def check_disk_root(root: Path) -> None:
    """Refuse a disk path the tools would read as an empty cache: missing, a file, unreadable, or a namespace.

    Each is a :class:`ConfigError` (exit 2) naming the path and the fix; an empty directory is a real
    empty cache and passes.
    """
    fix = "set disk.path (or KVSTORE_DISK__PATH) to the directory engines write their chunks to"
    if not root.exists():
        raise ConfigError(f"disk tier directory {root} does not exist; {fix}")
    if not root.is_dir():
        raise ConfigError(f"disk tier path {root} is not a directory; {fix}")
    denied = f"disk tier directory {root} cannot be read (permission denied); run as its owner"
    if not os.access(root, os.R_OK | os.X_OK):
        raise ConfigError(denied)
    try:
        inside = [entry.name for entry in os.scandir(root) if entry.is_dir(follow_symlinks=False)]
    except PermissionError:
        raise ConfigError(denied) from None
    if inside and all(_HEX_PAIR.fullmatch(name) for name in inside):
        raise ConfigError(
            f"{root} is one namespace of a disk tier (its subdirectories are 2-letter hash prefixes), "
            f"not the tier's directory; give its parent {root.parent}, and --namespace to select it"
        )


_HEX_PAIR = re.compile(r"[0-9a-f]{2}")


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
    """Where the tools reach ``backend``, without secrets: a directory, a (masked) Redis URL, bucket and endpoint."""
    url, bucket, root = (getattr(backend, name, None) for name in ("url", "bucket", "root"))
    if bucket is not None:
        where = getattr(backend, "endpoint_url", None)
        where = where or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or "AWS"
        return f"bucket {bucket!r} at {where}"
    return str(url if url is not None else root if root is not None else backend.name)


def _secrets(section: object) -> list[str]:
    """What must never be printed for this tier: the Redis URL's password, the AWS secret key and session token."""
    url = getattr(section, "url", None) or (os.environ.get("REDIS_URL") if isinstance(section, RedisConfig) else None)
    found = [urlsplit(url).password or ""] if url else []
    if isinstance(section, S3Config):
        found += [os.environ.get(name, "") for name in ("AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN")]
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


async def read_codec(backend: Backend, item: StoredObject) -> str | None:
    """The codec pipeline ``item`` is stored with, from its header (one small ranged read); None if it is gone.

    An object whose header does not check out reads as :data:`NOT_A_CHUNK` (``verify`` says why).
    """
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
            return header_codec(head)
        except ChunkFormatError:
            return NOT_A_CHUNK


async def read_codecs(
    backend: Backend,
    objects: Sequence[StoredObject],
    concurrency: int = 16,
    on_read: Callable[[int], None] | None = None,
) -> list[str | None]:
    """:func:`read_codec` of each object, ``concurrency`` reads in flight, in the order of ``objects``."""
    slots = asyncio.Semaphore(concurrency)

    async def one(item: StoredObject) -> str | None:
        async with slots:
            codec = await read_codec(backend, item)
        if on_read is not None:
            on_read(1)
        return codec

    return list(await asyncio.gather(*(one(item) for item in objects)))


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


# -- gc -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Retention:
    """What gc keeps: chunks younger than ``max_age``, then the newest that fit in ``max_bytes`` per tier."""

    max_age: float | None = None  # seconds since the last write (or access, where the tier records it)
    max_bytes: int | None = None  # per tier, over the namespaces selected

    def __post_init__(self) -> None:
        if self.max_age is None and self.max_bytes is None:
            raise ValueError("give a maximum age, a byte budget, or both")
        if (self.max_age is not None and self.max_age < 0) or (self.max_bytes is not None and self.max_bytes < 0):
            raise ValueError("the maximum age and the byte budget cannot be negative")


def choose_victims(objects: Sequence[StoredObject], retention: Retention, now: float) -> list[StoredObject]:
    """Everything older than the maximum age, then the oldest of the rest until the budget holds.

    Ties in time are broken by key, so the same listing always gives the same choice.
    """
    ordered = sorted(objects, key=lambda item: (item.when, item.key))  # oldest first
    victims: list[StoredObject] = []
    kept: list[StoredObject] = []
    for item in ordered:
        too_old = retention.max_age is not None and now - item.when > retention.max_age
        (victims if too_old else kept).append(item)
    if retention.max_bytes is not None:
        remaining = sum(item.size for item in kept)
        for item in kept:
            if remaining <= retention.max_bytes:
                break
            victims.append(item)
            remaining -= item.size
    return victims


@dataclass
class TierPlan:
    """One tier's gc plan: everything listed, and the victims chosen from it (deleted only if still as listed)."""

    tier: str
    age_basis: str
    listed: list[StoredObject]
    victims: list[StoredObject]

    @property
    def listed_bytes(self) -> int:
        """Bytes of everything listed."""
        return sum(item.size for item in self.listed)

    @property
    def victim_bytes(self) -> int:
        """Bytes of the chosen victims."""
        return sum(item.size for item in self.victims)


async def plan_gc(
    backends: dict[str, Backend],
    accept: Callable[[str], bool] | None,
    retention: Retention,
    *,
    now: float | None = None,
    on_page: Callable[[str, int], None] | None = None,
) -> list[TierPlan]:
    """List every tier, then choose what goes. Nothing is deleted: a dry run is exactly this."""
    plans = []
    for name, backend in backends.items():
        objects = await list_objects(backend, accept, None if on_page is None else lambda n, t=name: on_page(t, n))
        moment = time.time() if now is None else now
        plans.append(TierPlan(name, backend.age_basis, objects, choose_victims(objects, retention, moment)))
    return plans


async def run_gc(
    backends: dict[str, Backend], plans: Sequence[TierPlan], progress: Callable[[str, RemoveReport], None] | None = None
) -> dict[str, RemoveReport]:
    """Remove each plan's victims that are still as listed; per tier, what happened."""
    reports = {}
    for plan in plans:
        step: Progress | None = None if progress is None else (lambda report, t=plan.tier: progress(t, report))
        reports[plan.tier] = await backends[plan.tier].remove_unchanged(plan.victims, step)
    return reports


# -- temporary files -----------------------------------------------------------------------------


@dataclass
class TemporarySweep:
    """The disk tier's temporary files: stale ones (a killed writer's) removed or to remove, fresh ones left."""

    stale: int = 0
    stale_bytes: int = 0
    removed: int = 0
    fresh: int = 0  # younger than STALE_TMP_SECONDS: a live writer may own them


async def sweep_temporaries(
    backends: dict[str, Backend], accept: Callable[[str], bool] | None, *, remove: bool
) -> TemporarySweep | None:
    """The disk tier's stale temporary files in the accepted namespaces, removed when ``remove``; None without disk.

    A writer killed mid-write leaves ``<key>.kvc.tmp-...`` (and a killed gc its set-aside file),
    which no listing shows. One older than ``STALE_TMP_SECONDS``, the bound a store's open sweeps
    with, has no live writer: it goes. A younger one may be a write in progress: it stays, counted.
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
            result.damaged.append(Damaged(backend.read_version(item, data), str(exc)))

    await asyncio.gather(*(check(item) for item in objects))
    result.damaged.sort(key=lambda damaged: (damaged.item.namespace, damaged.item.key))
    return result
