"""Secondary-tier backends: the interface (:mod:`~kvstore.backends.base`, :mod:`~kvstore.backends.maintenance`),
the local disk, Redis and S3, and :func:`make_backend`, which builds one from its config section.

The Redis and S3 modules are imported only when a backend of theirs is made, so a process that
uses neither never loads their client libraries.
"""

from __future__ import annotations

from concurrent.futures import Executor
from typing import Any

from kvstore.backends.base import Backend, ByteRange, ObjectFile, ObjectRead, ObjectWrite
from kvstore.backends.maintenance import LIST_PAGE, Maintenance, Progress, RemoveReport, StoredObject
from kvstore.config import DiskConfig, RedisConfig, S3Config, TimeoutConfig
from kvstore.keys import DEFAULT_NAMESPACE

# Config settings a backend takes under the same names (the rest are derived below).
_S3_SETTINGS = (
    "prefix", "endpoint_url", "region", "addressing_style", "max_concurrency", "multipart_threshold",
    "part_size", "max_attempts", "connect_timeout", "create_bucket",
)  # fmt: skip
_REDIS_SETTINGS = ("url", "cluster", "prefix", "ttl", "max_connections", "connect_timeout")


def make_backend(
    section: DiskConfig | RedisConfig | S3Config,
    timeouts: TimeoutConfig,
    namespace: str = DEFAULT_NAMESPACE,
    *,
    executor: Executor | None = None,
) -> Backend:
    """The backend a config section describes, not opened yet, storing under ``namespace`` (a directory name).

    ``timeouts`` bounds the remote backends' own requests (S3's read timeout, Redis' socket
    timeout); ``executor`` runs the disk backend's blocking calls (default: the loop's). Whether
    the section is enabled is the caller's business.
    """
    if isinstance(section, DiskConfig):
        from kvstore.backends.disk import DiskBackend

        return DiskBackend(
            section.path, int(section.capacity), fsync=section.fsync, executor=executor, namespace=namespace
        )
    if isinstance(section, S3Config):
        from kvstore.backends.s3 import S3Backend

        options = _settings(section, _S3_SETTINGS)
        return S3Backend(section.bucket, read_timeout=max(timeouts.get, timeouts.put), namespace=namespace, **options)
    from kvstore.backends.redis import RedisBackend

    options = _settings(section, _REDIS_SETTINGS)
    return RedisBackend(socket_timeout=timeouts.get, namespace=namespace, **options)


def _settings(section: RedisConfig | S3Config, names: tuple[str, ...]) -> dict[str, Any]:
    """The section's values of ``names``, as keyword arguments."""
    return {name: getattr(section, name) for name in names}


__all__ = [
    "LIST_PAGE",
    "Backend",
    "ByteRange",
    "Maintenance",
    "ObjectFile",
    "ObjectRead",
    "ObjectWrite",
    "Progress",
    "RemoveReport",
    "StoredObject",
    "make_backend",
]
