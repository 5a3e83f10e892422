"""The specs of the built-in backends: the local disk, Redis and S3 (see :mod:`kvstore.backends.registry`).

Each ``make`` imports its backend's module when it runs, so a process that uses neither Redis nor
S3 never loads their client libraries (redis, aiobotocore): the configuration imports these specs.
Their sections are :class:`~kvstore.config.DiskConfig`, :class:`~kvstore.config.RedisConfig` and
:class:`~kvstore.config.S3Config`, fields of :class:`~kvstore.config.StoreConfig`.
"""

from __future__ import annotations

import os
import re
from concurrent.futures import Executor
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

from kvstore.backends.base import Backend
from kvstore.backends.registry import BackendSpec
from kvstore.config import DiskConfig, RedisConfig, S3Config, TimeoutConfig
from kvstore.errors import ConfigError

# Config settings a backend takes under the same names (the rest are derived in make).
_S3_SETTINGS = (
    "prefix", "endpoint_url", "region", "addressing_style", "max_concurrency", "multipart_threshold",
    "part_size", "max_attempts", "connect_timeout", "create_bucket",
)  # fmt: skip
_REDIS_SETTINGS = ("url", "cluster", "prefix", "ttl", "max_connections", "connect_timeout")
_HEX_PAIR = re.compile(r"[0-9a-f]{2}")


def _settings(section: RedisConfig | S3Config, names: tuple[str, ...]) -> dict[str, Any]:
    """The section's values of ``names``, as keyword arguments."""
    return {name: getattr(section, name) for name in names}


# -- disk ------------------------------------------------------------------------------------------


def make_disk(section: DiskConfig, timeouts: TimeoutConfig, namespace: str, executor: Executor | None) -> Backend:
    """A :class:`~kvstore.backends.disk.DiskBackend` under ``section.path`` (``timeouts`` do not apply to files)."""
    from kvstore.backends.disk import DiskBackend

    return DiskBackend(
        section.path,
        int(section.capacity),
        fsync=section.fsync,
        executor=executor,
        namespace=namespace,
        eviction=section.eviction,
    )


def check_disk_root(section: DiskConfig) -> None:
    """Refuse a disk path the tools would read as an empty cache: missing, a file, unreadable, or a namespace.

    Each is a :class:`ConfigError` (exit 2) naming the path and the fix; an empty directory is a real
    empty cache and passes.
    """
    root: Path = section.path
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


DISK = BackendSpec(
    name="disk",
    rank=100,
    section=DiskConfig,
    make=make_disk,
    tools_open=False,  # opening scans for the eviction index and evicts to the budget: an engine's business
    tools_check=check_disk_root,
)


# -- redis -----------------------------------------------------------------------------------------


def make_redis(section: RedisConfig, timeouts: TimeoutConfig, namespace: str, executor: Executor | None) -> Backend:
    """A :class:`~kvstore.backends.redis.RedisBackend`; its socket timeout is the get timeout."""
    from kvstore.backends.redis import RedisBackend

    return RedisBackend(socket_timeout=timeouts.get, namespace=namespace, **_settings(section, _REDIS_SETTINGS))


def redis_secrets(section: RedisConfig) -> list[str]:
    """The password of the URL the backend uses (``redis.url``, else ``$REDIS_URL``), as written and decoded."""
    url = section.url or os.environ.get("REDIS_URL")
    password = urlsplit(url).password if url else None
    return [password, unquote(password)] if password else []


REDIS = BackendSpec(
    name="redis",
    rank=200,
    section=RedisConfig,
    make=make_redis,
    unreachable_errors=frozenset({"ConnectionError", "TimeoutError"}),  # redis.exceptions'
    timeout_errors=frozenset({"TimeoutError"}),
    endpoint=lambda backend: str(backend.url),  # the URL with its password masked
    secrets=redis_secrets,
    dev_server="kvstore.testing.servers:RedisServer",
)


# -- s3 --------------------------------------------------------------------------------------------


def make_s3(section: S3Config, timeouts: TimeoutConfig, namespace: str, executor: Executor | None) -> Backend:
    """An :class:`~kvstore.backends.s3.S3Backend`; its read timeout is the longer of the get and put timeouts."""
    from kvstore.backends.s3 import S3Backend

    read_timeout = max(timeouts.get, timeouts.put)
    return S3Backend(section.bucket, read_timeout=read_timeout, namespace=namespace, **_settings(section, _S3_SETTINGS))


def s3_endpoint(backend: Any) -> str:
    """``bucket 'name' at <endpoint>``: the configured endpoint, else the AWS_ENDPOINT_URL variables, else AWS."""
    where = backend.endpoint_url or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    return f"bucket {backend.bucket!r} at {where or 'AWS'}"


def s3_secrets(section: S3Config) -> list[str]:
    """The AWS secret key and session token (credentials come from the environment, not the section)."""
    return [os.environ.get(name, "") for name in ("AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN")]


S3 = BackendSpec(
    name="s3",
    rank=300,
    section=S3Config,
    make=make_s3,
    # botocore.exceptions': connection refused or dropped, and the two timeouts
    unreachable_errors=frozenset({"EndpointConnectionError", "ConnectionClosedError"}),
    timeout_errors=frozenset({"ConnectTimeoutError", "ReadTimeoutError"}),
    endpoint=s3_endpoint,
    secrets=s3_secrets,
    tools_section=lambda section: section.model_copy(update={"create_bucket": False}),  # the tools never create one
    dev_server="kvstore.testing.servers:MotoServer",
)

BUILTIN_SPECS: tuple[BackendSpec[Any], ...] = (DISK, REDIS, S3)
