"""The backends' sections: the built-in disk, Redis and S3 ones, and :class:`BackendSection`, the base of
every other backend's (a backend from another package declares its own, see :mod:`kvstore.backends.registry`).

A lossy codec is never chosen silently (``allow_lossy`` beside it), and a server's URL is checked
when it is given, with the password never echoed back.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import ClassVar, Literal
from urllib.parse import SplitResult, urlsplit

from pydantic import (
    ByteSize,
    Field,
    field_validator,
    model_validator,
)

from kvstore.codecs import DEFAULT_REMOTE_CODEC, make_codec
from kvstore.config.base import Capacity, Duration, Section, Size, default_cache_dir
from kvstore.eviction import EvictionName
from kvstore.util import units

LOSSY_HELP = (
    "store with a lossy codec (fp8, int8, int4, hadamard): what a get returns is then close to what was put, not equal"
)


def _check_lossy(name: str, codec: str, allow_lossy: bool) -> None:
    """A lossy codec is never chosen silently: without ``allow_lossy`` it is a ValueError naming the fix.

    A typo of ``int4`` for ``int8``, or a config copied from another model, would otherwise change
    every reply the engine gives from reused KV with nothing said anywhere; the opt-in sits next to
    the codec, so whoever reads the config sees both.
    """
    if not allow_lossy and not make_codec(codec).lossless:
        raise ValueError(
            f"{name}.codec {codec!r} is lossy: the KV read back differs from what was stored (measure the "
            f"model's answers with it: kvstore bench --accuracy smollm2). To store with it anyway, set "
            f"{name}.allow_lossy = true ([{name}] allow_lossy = true, or KVSTORE_{name.upper()}__ALLOW_LOSSY=true); "
            f"or pick a lossless codec (identity, byteplanes, zstd, lz4)"
        )


# -- what every backend's section has; the built-in ones below -------------------------------------

BACKEND_ENTRY_POINTS = "kvstore.backends"
BUILTIN_BACKENDS = ("disk", "redis", "s3")  # sections of StoreConfig's own; another backend's comes with it
BACKEND_NAME = re.compile(r"[a-z][a-z0-9]*(?:_[a-z0-9]+)*")  # a TOML table and a KVSTORE_<NAME>__<KEY> prefix


class BackendSection(Section):
    """The settings every backend's section has; a backend's own section subclasses it and adds its own.

    ``section`` is the backend's name: its TOML table (``[name]``) and its environment variables'
    prefix (``KVSTORE_NAME__KEY``).
    """

    section: ClassVar[str] = ""
    enabled: bool = Field(False, description="turn this tier on (its settings below then apply)")
    codec: str = Field(DEFAULT_REMOTE_CODEC, description="codec pipeline at this boundary, e.g. 'identity' or 'zstd'")
    allow_lossy: bool = Field(False, description=LOSSY_HELP)

    @field_validator("codec")
    @classmethod
    def _valid_codec(cls, value: str) -> str:
        make_codec(value)
        return value

    @model_validator(mode="after")
    def _lossy_only_when_allowed(self) -> BackendSection:
        _check_lossy(self.section or "backend", self.codec, self.allow_lossy)
        return self


class DiskConfig(BackendSection):
    section: ClassVar[str] = "disk"
    enabled: bool = Field(True, description="keep chunks in local files (survives restarts); false: no disk tier")
    path: Path = Field(default_factory=default_cache_dir, description="directory of the chunk files")
    capacity: Capacity = Field(
        ByteSize(16 << 30), description="byte budget, e.g. '500GiB'; disk.eviction picks the files that go"
    )
    codec: str = Field("identity", description="codec pipeline for files, e.g. 'identity' or 'byteplanes'")
    fsync: bool = Field(
        False,
        description="fsync each file before it becomes visible: after a power loss a chunk is whole or missing "
        "(its directory is not synced: one written in the last seconds may be gone, a miss)",
    )
    eviction: EvictionName = Field(
        "lru",
        description="which file a full budget drops: 'lru' (least recently used), or the scan-resistant "
        "'s3fifo' or 'arc' (see the eviction page)",
    )

    @field_validator("path", mode="before")
    @classmethod
    def _not_empty(cls, value: object) -> object:
        """An empty path is refused, not read as '.': chunk files would land wherever the engine started."""
        if isinstance(value, str) and not value.strip():
            raise ValueError(
                "disk.path is empty (it would mean the current directory); set it to an absolute directory, "
                "e.g. '/nvme/kvstore', or leave it out for the default ($XDG_CACHE_HOME/kvstore, else ~/.cache/kvstore)"
            )
        return value

    @field_validator("path")
    @classmethod
    def _expand_home(cls, value: Path) -> Path:
        return value.expanduser()


class RemoteSection(BackendSection):
    """A server's section (Redis, S3): off by default, a remote codec, a prefix and a connect timeout."""

    prefix: str = Field("kvstore", description="prepended to every object name, to share a bucket or database")
    codec: str = Field(
        DEFAULT_REMOTE_CODEC, description="codec pipeline at this boundary, e.g. 'byteplanes' or 'fp8+zstd'"
    )
    connect_timeout: Duration = Field(2.0, gt=0, description="seconds to wait for a connection to the server")


MULTIPART_MIN, SINGLE_PUT_MAX = 5 << 20, 5 << 30  # S3's smallest part (all but the last), largest single PUT


class S3Config(RemoteSection):
    """Credentials are not configured here: they come from the standard AWS chain (env, ~/.aws, roles)."""

    section: ClassVar[str] = "s3"
    bucket: str = Field("", description="bucket name (required when s3.enabled)")
    endpoint_url: str | None = Field(
        None, description="S3-compatible endpoint, e.g. 'http://127.0.0.1:9000' (else $AWS_ENDPOINT_URL_S3 or AWS)"
    )
    region: str | None = Field(None, description="region (else $AWS_REGION / $AWS_DEFAULT_REGION, else us-east-1)")
    addressing_style: Literal["auto", "path", "virtual"] = Field(
        "auto", description="'auto' is path style with a custom endpoint (MinIO, SeaweedFS), else virtual"
    )
    max_concurrency: int = Field(16, ge=1, le=1024, description="requests in flight at once")
    multipart_threshold: Size = Field(
        ByteSize(64 << 20),
        description="objects this large upload in parts, smaller ones in one PUT (5MiB to 5GiB; "
        "the default keeps a chunk of even a large model whole: one request is faster than parts)",
    )
    part_size: Size = Field(ByteSize(8 << 20), ge=5 << 20, description="multipart part size (S3 minimum 5MiB)")
    max_attempts: int = Field(4, ge=1, le=20, description="tries per request; throttling and 5xx back off and retry")
    create_bucket: bool = Field(False, description="create the bucket at start if it is missing")

    @field_validator("multipart_threshold")
    @classmethod
    def _threshold_in_s3_limits(cls, value: ByteSize) -> ByteSize:
        """S3 refuses a single PUT over 5 GiB, and multipart parts (but the last) under 5 MiB."""
        if not MULTIPART_MIN <= value <= SINGLE_PUT_MAX:
            raise ValueError(
                "must lie within 5MiB and 5GiB (S3's smallest part and largest single PUT); "
                "set s3.multipart_threshold to e.g. '64MiB', above your model's chunk size"
            )
        return value

    @model_validator(mode="after")
    def _bucket_when_enabled(self) -> S3Config:
        if self.enabled and not self.bucket:
            raise ValueError("s3.bucket is required when s3.enabled is true (set [s3] bucket or KVSTORE_S3__BUCKET)")
        return self

    @model_validator(mode="after")
    def _endpoint_is_a_url(self) -> S3Config:
        """A malformed endpoint is bad configuration (exit 2), not a server that cannot be reached (exit 5)."""
        if self.enabled:
            for source, url in (
                ("s3.endpoint_url (KVSTORE_S3__ENDPOINT_URL)", self.endpoint_url),
                ("$AWS_ENDPOINT_URL_S3", os.environ.get("AWS_ENDPOINT_URL_S3")),
                ("$AWS_ENDPOINT_URL", os.environ.get("AWS_ENDPOINT_URL")),
            ):
                if url:
                    _check_url(url, ("http", "https"), source, "e.g. http://127.0.0.1:8333")
                    break
        return self


class RedisConfig(RemoteSection):
    section: ClassVar[str] = "redis"
    url: str | None = Field(
        None,
        repr=False,
        description="redis://, rediss:// (TLS) or unix:// URL (else $REDIS_URL, else redis://127.0.0.1:6379/0)",
    )
    cluster: bool = Field(False, description="the URL names one node of a Redis Cluster")
    ttl: Duration | None = Field(
        None, gt=0, description="seconds a chunk lives after its last full read, e.g. '7d' (none: forever)"
    )
    max_connections: int = Field(32, ge=1, le=4096, description="connections in the pool (per node on a cluster)")

    @model_validator(mode="after")
    def _url_is_a_url(self) -> RedisConfig:
        """A malformed URL is bad configuration (exit 2), not a server that cannot be reached (exit 5).

        ``redis.url`` is checked whenever it is set (a tier turned on later, or by the tools' ``--tier
        redis``, must not meet it first at connect time); ``$REDIS_URL``, which other programs may
        read, only when the tier is enabled.
        """
        url = self.url or (os.environ.get("REDIS_URL") if self.enabled else None)
        if url:
            source = "redis.url (KVSTORE_REDIS__URL)" if self.url else "$REDIS_URL"
            fix = (
                f"set {'redis.url' if self.url else '$REDIS_URL'} to e.g. redis://127.0.0.1:6379/0 "
                "(rediss:// for TLS, unix:///path/to/redis.sock for a socket)"
            )
            _check_url(url, ("redis", "rediss", "unix"), source, fix)
        return self


def _check_url(url: str, schemes: tuple[str, ...], source: str, example: str) -> SplitResult:
    """``url`` split, if it has one of ``schemes``, a host (but unix://) and a numeric port; else a ValueError
    naming ``source`` and ``example``, and showing the URL without its password."""
    shown = units.clip(_without_password(url))
    try:
        parts = urlsplit(url.strip())
    except ValueError:  # e.g. an unbalanced '[' in the host
        parts = None
    if parts is None or parts.scheme not in schemes:
        raise ValueError(
            f"{source} {shown!r} is not a URL starting {' or '.join(s + '://' for s in schemes)}; {example}"
        )
    try:
        port_ok = parts.port is None or parts.port > 0
    except ValueError:  # not a number, or out of range
        port_ok = False
    if not port_ok or (parts.scheme != "unix" and not parts.hostname):
        raise ValueError(f"{source} {shown!r} needs a host and a numeric port; {example}")
    return parts


def _without_password(url: str) -> str:
    """``url`` with the password in its user part (``user:secret@``) replaced by ``***``."""
    return re.sub(r"(//[^/@:]*:)[^/@]*@", r"\1***@", url)
