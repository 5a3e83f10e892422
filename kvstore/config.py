"""Store configuration: keyword arguments > ``KVSTORE_*`` environment > TOML file > defaults.

Nested keys use ``__`` in the environment (``KVSTORE_DRAM__CAPACITY=8GiB``) and tables in
TOML (``[dram] capacity = "8GiB"``). ``KVSTORE_CONFIG`` names a TOML file to read. A wrong or
unknown key fails at start with a :class:`ConfigError` naming the key and what is valid.
"""

from __future__ import annotations

import base64
import binascii
import difflib
import os
import re
import tomllib
from contextvars import ContextVar
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal
from urllib.parse import SplitResult, urlsplit

from pydantic import (
    BaseModel,
    BeforeValidator,
    ByteSize,
    ConfigDict,
    Field,
    SecretStr,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic.fields import FieldInfo
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    SettingsError,
    TomlConfigSettingsSource,
)

from kvstore.codecs import DEFAULT_REMOTE_CODEC, make_codec
from kvstore.errors import ConfigError
from kvstore.util import units

ENV_PREFIX = "KVSTORE_"
CONFIG_FILE_ENV = "KVSTORE_CONFIG"
# Read by scripts/bootstrap.sh and scripts/vllm_env.sh, not by the store: never "unknown" to it.
SCRIPT_VARIABLES = frozenset({"KVSTORE_TORCH_VERSION", "KVSTORE_VLLM_VERSION", "KVSTORE_EXTRAS"})
_toml_file: ContextVar[Path | None] = ContextVar("kvstore_toml_file", default=None)
_environment_off: ContextVar[bool] = ContextVar("kvstore_environment_off", default=False)  # isolated()


def _size(value: Any) -> Any:
    """Sizes through the one strict parser (kvstore.util.units): pydantic's ByteSize read '12,5GB' as 12 bytes."""
    return value if isinstance(value, ByteSize) else units.parse_size(value)


def _capacity(value: Any) -> Any:
    """A tier's byte budget: positive (0 or less would evict every chunk; the store checks one chunk at open)."""
    if isinstance(value, ByteSize) and value > 0:
        return value
    return units.parse_size(value, minimum=1, why="a capacity must hold at least one chunk of the model's KV")


def _duration(value: Any) -> Any:
    """Durations (seconds) through the one strict parser: 5, 2.5, '500ms', '30s', '10m', '1h30m'."""
    return units.parse_duration(value)


Size = Annotated[ByteSize, BeforeValidator(_size)]
Capacity = Annotated[ByteSize, BeforeValidator(_capacity)]
Duration = Annotated[float, BeforeValidator(_duration)]


def default_cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kvstore"


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    def __setattr__(self, name: str, value: Any) -> None:
        """Assign with validation; a value refused (by a field or a whole-section check) changes nothing."""
        missing = object()
        old = self.__dict__.get(name, missing)
        try:
            super().__setattr__(name, value)
        except ValidationError as exc:
            if old is not missing:  # pydantic has already stored it when a whole-section check refuses it
                self.__dict__[name] = old
            raise ConfigError(_explain(exc, type(self))) from None


class DramConfig(_Section):
    capacity: Capacity = Field(ByteSize(1 << 30), description="bytes of the DRAM slab pool, e.g. '4GiB'")
    pin_memory: Literal["auto", "always", "never"] = Field(
        "auto", description="pin the pool (page-locked) when CUDA is present ('auto'), always, or never"
    )


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


class DiskConfig(_Section):
    section: ClassVar[str] = "disk"
    enabled: bool = Field(True, description="keep chunks in local files (survives restarts); false: no disk tier")
    path: Path = Field(default_factory=default_cache_dir, description="directory of the chunk files")
    capacity: Capacity = Field(
        ByteSize(16 << 30), description="byte budget, e.g. '500GiB'; least recently used files go first"
    )
    codec: str = Field("identity", description="codec pipeline for files, e.g. 'identity' or 'byteplanes'")
    allow_lossy: bool = Field(False, description=LOSSY_HELP)
    fsync: bool = Field(False, description="fsync each file before it becomes visible (survives power loss)")

    @field_validator("codec")
    @classmethod
    def _valid_codec(cls, value: str) -> str:
        make_codec(value)  # raises ValueError listing the valid stages
        return value

    @field_validator("path")
    @classmethod
    def _expand_home(cls, value: Path) -> Path:
        return value.expanduser()

    @model_validator(mode="after")
    def _lossy_only_when_allowed(self) -> DiskConfig:
        _check_lossy(self.section, self.codec, self.allow_lossy)
        return self


class _RemoteSection(_Section):
    section: ClassVar[str]  # the TOML table, for error messages
    enabled: bool = Field(False, description="turn this tier on (its settings below then apply)")
    prefix: str = Field("kvstore", description="prepended to every object name, to share a bucket or database")
    codec: str = Field(
        DEFAULT_REMOTE_CODEC, description="codec pipeline at this boundary, e.g. 'byteplanes' or 'fp8+zstd'"
    )
    allow_lossy: bool = Field(False, description=LOSSY_HELP)
    connect_timeout: Duration = Field(2.0, gt=0, description="seconds to wait for a connection to the server")

    @field_validator("codec")
    @classmethod
    def _valid_codec(cls, value: str) -> str:
        make_codec(value)
        return value

    @model_validator(mode="after")
    def _lossy_only_when_allowed(self) -> _RemoteSection:
        _check_lossy(self.section, self.codec, self.allow_lossy)
        return self


MULTIPART_MIN, SINGLE_PUT_MAX = 5 << 20, 5 << 30  # S3's smallest part (all but the last), largest single PUT


class S3Config(_RemoteSection):
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


class RedisConfig(_RemoteSection):
    section: ClassVar[str] = "redis"
    url: str | None = Field(
        None, repr=False, description="redis:// or rediss:// URL (else $REDIS_URL, else redis://127.0.0.1:6379/0)"
    )
    cluster: bool = Field(False, description="the URL names one node of a Redis Cluster")
    ttl: Duration | None = Field(
        None, gt=0, description="seconds a chunk lives after its last full read, e.g. '7d' (none: forever)"
    )
    max_connections: int = Field(32, ge=1, le=4096, description="connections in the pool (per node on a cluster)")

    @model_validator(mode="after")
    def _url_is_a_url(self) -> RedisConfig:
        """A malformed URL is bad configuration (exit 2), not a server that cannot be reached (exit 5)."""
        if self.enabled:
            source = "redis.url (KVSTORE_REDIS__URL)" if self.url else "$REDIS_URL"
            url = self.url or os.environ.get("REDIS_URL")
            if url:
                _check_url(url, ("redis", "rediss", "unix"), source, "e.g. redis://127.0.0.1:6379/0")
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


def parse_key(text: str) -> bytes:
    """A 128/192/256-bit AES key (encryption at rest) from hex or base64 text; the error never echoes the text."""
    text = text.strip()
    key: bytes | None = None
    if len(text) in (32, 48, 64):
        try:
            key = bytes.fromhex(text)
        except ValueError:
            key = None
    if key is None:
        try:
            key = base64.b64decode(text, validate=True)
        except (binascii.Error, ValueError):
            key = None
    if key is None or len(key) not in (16, 24, 32):
        raise ValueError(
            "the encryption key must be 16, 24 or 32 bytes written as hex or base64 "
            '(make one with: python -c "import os; print(os.urandom(32).hex())")'
        )
    return key


class EncryptionConfig(_Section):
    """AES-GCM per layer segment on every secondary tier, when a key is given."""

    key: SecretStr | None = Field(
        None, description="32-byte key as 64 hex characters or base64 (e.g. from $KVSTORE_ENCRYPTION__KEY)"
    )
    key_file: Path | None = Field(None, description="file holding the key (hex or base64), instead of 'key'")

    @field_validator("key")
    @classmethod
    def _valid_key(cls, value: SecretStr | None) -> SecretStr | None:
        if value is not None:
            parse_key(value.get_secret_value())  # raises ValueError without echoing the key
        return value

    def resolve_key(self) -> bytes | None:
        """The raw key bytes, or None when encryption is off."""
        if self.key is not None and self.key_file is not None:
            raise ConfigError("encryption.key and encryption.key_file are both set; keep one of them")
        if self.key is not None:
            return parse_key(self.key.get_secret_value())
        if self.key_file is not None:
            try:
                text = self.key_file.expanduser().read_text().strip()
            except OSError as exc:
                raise ConfigError(f"encryption.key_file {self.key_file} cannot be read: {exc.strerror}") from None
            try:
                return parse_key(text)
            except ValueError as exc:
                raise ConfigError(f"encryption.key_file {self.key_file}: {exc}") from None
        return None


class TimeoutConfig(_Section):
    get: Duration = Field(
        5.0,
        gt=0,
        description="seconds a get, get_many or lookup call waits on the tiers in all (one deadline per call)",
    )
    put: Duration = Field(
        30.0, gt=0, description="seconds a tier may take to write one chunk before it counts as an error"
    )
    close: Duration = Field(10.0, gt=0, description="seconds close() waits for pending writes before abandoning them")


class BreakerConfig(_Section):
    """A circuit breaker per secondary tier: a dead or frozen tier is skipped, not waited for.

    See :mod:`kvstore.storage.breaker`; the defaults cost a dead tier three timeouts, then one
    probe per back-off period (1 s, doubling to one a minute).
    """

    enabled: bool = Field(True, description="skip a tier after repeated failures instead of waiting for each timeout")
    failures: int = Field(
        3, ge=1, le=1000, description="consecutive timeouts or errors of a tier that open its breaker"
    )
    backoff: Duration = Field(1.0, gt=0, le=3600, description="seconds an open breaker skips the tier before one probe")
    backoff_max: Duration = Field(
        60.0,
        gt=0,
        le=3600,  # a tier back for an hour but never probed would be lost capacity nobody sees
        description="seconds the back-off grows to at most (it doubles after each failed probe)",
    )

    @model_validator(mode="after")
    def _backoff_order(self) -> BreakerConfig:
        if self.backoff_max < self.backoff:
            raise ValueError(
                f"breaker.backoff_max ({self.backoff_max}s) must be at least breaker.backoff ({self.backoff}s); "
                "raise breaker.backoff_max or lower breaker.backoff"
            )
        return self


class MetricsConfig(_Section):
    """A Prometheus exporter for every store in the process (see kvstore.engine.metrics)."""

    enabled: bool = Field(False, description="serve the Prometheus metrics of every store in this process over HTTP")
    address: str = Field("127.0.0.1", description="interface to listen on; '0.0.0.0' or '::' for every one")
    port: int = Field(9464, ge=0, le=65535, description="TCP port of /metrics; 0 picks a free one")


class AdaptiveConfig(_Section):
    """Online hit-rate tracking (``store.advise()``), the write policy, and auto mode (see kvstore.sizing.adaptive)."""

    track: bool = Field(
        True, description="measure the hit rate against tier size online (~0.25 us a key, after lookup returns)"
    )
    sample_rate: float = Field(1 / 64, gt=0, le=1, description="fraction of chunk lookups whose reuse is timed")
    max_watches: int = Field(1 << 16, ge=16, le=1 << 24, description="sampled lookups waiting for their reuse, at most")
    half_life: int = Field(
        1_000_000, ge=1000, description="chunk lookups after which old traffic counts half (adapts to phase changes)"
    )
    prefill_tokens_per_s: float = Field(
        10_000.0, gt=0, description="your engine's prefill rate: what a hit saves (tokens per chunk / this)"
    )
    policy: Literal["write-through", "second-sighting"] = Field(
        "write-through", description="write every chunk below DRAM, or only prefixes seen before"
    )
    auto: bool = Field(False, description="resize DRAM within [dram_min, dram_max], switch policy as traffic changes")
    dram_min: Size | None = Field(None, description="smallest DRAM size auto mode may pick (default dram.capacity/8)")
    dram_max: Size | None = Field(None, description="largest DRAM size auto mode may pick (default dram.capacity)")
    interval: Duration = Field(30.0, ge=0, description="seconds between auto mode's decisions, at least")
    min_references: int = Field(20_000, ge=1, description="chunk lookups between auto mode's decisions, at least")
    knee: float = Field(0.95, gt=0, le=1, description="smallest DRAM size with this share of the largest one's gain")
    trace: Path | None = Field(None, description="append every chunk lookup to this trace file (for kvstore advise)")


class PlannerConfig(_Section):
    """Load or recompute (see kvstore.engine.planner): a hit is loaded only if that beats computing it."""

    enabled: bool = Field(True, description="recompute a held chunk whose expected load is slower than its prefill")
    prefill_tokens_per_s: float | None = Field(
        None, gt=0, description="pin the engine's prefill rate (tokens/s); by default the connectors measure it"
    )


class StoreConfig(BaseSettings):
    """Everything a :class:`kvstore.KVStore` needs besides the model layout."""

    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX, env_nested_delimiter="__", extra="forbid", validate_assignment=True
    )

    dram: DramConfig = Field(default_factory=DramConfig)
    disk: DiskConfig = Field(default_factory=DiskConfig)
    s3: S3Config = Field(default_factory=S3Config)
    redis: RedisConfig = Field(default_factory=RedisConfig)
    encryption: EncryptionConfig = Field(default_factory=EncryptionConfig)
    timeouts: TimeoutConfig = Field(default_factory=TimeoutConfig)
    breaker: BreakerConfig = Field(default_factory=BreakerConfig)
    metrics: MetricsConfig = Field(default_factory=MetricsConfig)
    adaptive: AdaptiveConfig = Field(default_factory=AdaptiveConfig)
    planner: PlannerConfig = Field(default_factory=PlannerConfig)
    queue_depth: int = Field(64, ge=1, description="pending writes per secondary tier; a full queue drops the write")
    tier_workers: int = Field(2, ge=1, le=64, description="concurrent writes per secondary tier")
    io_threads: int = Field(4, ge=1, le=256, description="threads for file I/O and codecs")

    @model_validator(mode="after")
    def _auto_bounds(self) -> StoreConfig:
        low, high = self.dram_bounds()
        if not low <= int(self.dram.capacity) <= high:
            raise ValueError(
                f"dram.capacity ({int(self.dram.capacity)} bytes) must lie within adaptive.dram_min ({low}) and "
                f"adaptive.dram_max ({high}); widen the bounds or change dram.capacity"
            )
        return self

    def dram_bounds(self) -> tuple[int, int]:
        """The DRAM sizes auto mode may choose between (bytes)."""
        capacity, adaptive = int(self.dram.capacity), self.adaptive
        low = int(adaptive.dram_min) if adaptive.dram_min is not None else capacity // 8
        high = int(adaptive.dram_max) if adaptive.dram_max is not None else capacity
        return low, high

    def __init__(self, **values: Any) -> None:
        environment = not _environment_off.get()
        if environment and _toml_file.get() is None and os.environ.get(CONFIG_FILE_ENV):
            token = _toml_file.set(_toml_path(None))  # StoreConfig() honours $KVSTORE_CONFIG too
            try:
                self.__init__(**values)  # type: ignore[misc]
            finally:
                _toml_file.reset(token)
            return
        if environment:
            _reject_unknown_env()
        try:
            super().__init__(**values)
        except ValidationError as exc:
            raise ConfigError(_explain(exc, type(self))) from None
        except SettingsError as exc:  # e.g. KVSTORE_DRAM='not json'
            field = re.search(r'field "([^"]+)"', str(exc))
            name = f"{ENV_PREFIX}{field[1].upper()}" if field else f"a {ENV_PREFIX}* variable"
            raise ConfigError(
                f"invalid kvstore configuration: {exc}; {name} must be a JSON object "
                f'(e.g. \'{{"capacity": "4GiB"}}\'), or set one key with {ENV_PREFIX}SECTION__KEY'
            ) from None
        except (tomllib.TOMLDecodeError, UnicodeDecodeError, OSError) as exc:
            raise ConfigError(f"config file {_toml_file.get()} cannot be read as TOML: {exc}; fix the file") from None

    def __setattr__(self, name: str, value: Any) -> None:
        try:
            super().__setattr__(name, value)
        except ValidationError as exc:
            raise ConfigError(_explain(exc, type(self))) from None

    @classmethod
    def load(cls, path: str | os.PathLike[str] | None = None, **overrides: Any) -> StoreConfig:
        """Read a TOML file (``path`` or ``$KVSTORE_CONFIG``), then the environment, then ``overrides``."""
        token = _toml_file.set(_toml_path(path))
        try:
            return cls(**overrides)
        finally:
            _toml_file.reset(token)

    @classmethod
    def isolated(cls, **values: Any) -> StoreConfig:
        """A configuration of ``values`` and the defaults alone: no ``KVSTORE_*`` variable, no ``$KVSTORE_CONFIG``.

        For a store that must not touch what the shell points at (``kvstore demo``): with the
        defaults, that is DRAM and the local disk, never Redis or S3.
        """
        token = _environment_off.set(True)
        try:
            return cls(**values)
        finally:
            _environment_off.reset(token)

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        if _environment_off.get():
            return (init_settings,)
        toml_path = _toml_file.get()
        sources: list[PydanticBaseSettingsSource] = [init_settings, env_settings]
        if toml_path is not None:
            sources.append(TomlConfigSettingsSource(settings_cls, toml_file=toml_path))
        return tuple(sources)


def _toml_path(path: str | os.PathLike[str] | None) -> Path | None:
    """The TOML file to read: ``path``, else ``$KVSTORE_CONFIG``, else none; it must exist."""
    file = path if path is not None else os.environ.get(CONFIG_FILE_ENV)
    toml_path = Path(file).expanduser() if file else None
    if toml_path is None:
        return None
    source, fix = (
        ("the path given", "pass the path of an existing TOML file")
        if path is not None
        else (CONFIG_FILE_ENV, f"set {CONFIG_FILE_ENV} to an existing TOML file, or unset it")
    )
    denied = f"config file {toml_path} (from {source}) cannot be read (permission denied); run as a user who can"
    try:
        is_file = toml_path.is_file()
    except PermissionError:  # a directory on its way that this user may not enter
        raise ConfigError(denied) from None
    if not is_file:
        raise ConfigError(f"config file {toml_path} (from {source}) does not exist or is not a file; {fix}")
    if not os.access(toml_path, os.R_OK):
        raise ConfigError(denied)
    return toml_path


def _known_paths(model: type[BaseModel], prefix: str = "") -> dict[str, type[BaseModel] | None]:
    """Dotted key -> sub-model (for sections) or None (for leaves)."""
    paths: dict[str, type[BaseModel] | None] = {}
    for name, field in model.model_fields.items():
        annotation = field.annotation
        is_section = isinstance(annotation, type) and issubclass(annotation, BaseModel)
        paths[prefix + name] = annotation if is_section else None
        if is_section:
            paths.update(_known_paths(annotation, f"{prefix}{name}."))
    return paths


def _reject_unknown_env() -> None:
    """pydantic-settings ignores unknown ``KVSTORE_*`` variables; a typo there should not pass silently."""
    known = {path.replace(".", "__").upper() for path in _known_paths(StoreConfig)}
    for name in os.environ:
        # pydantic-settings matches names case-insensitively (kvstore_io_threads is read), so check them
        # all; KVSTORE_CONFIG is only read spelled exactly so.
        if name != CONFIG_FILE_ENV and name not in SCRIPT_VARIABLES and name.upper().startswith(ENV_PREFIX):
            rest = name[len(ENV_PREFIX) :].upper()
            if rest not in known:
                choices = sorted(known | {CONFIG_FILE_ENV.removeprefix(ENV_PREFIX)})
                hint = difflib.get_close_matches(rest, choices, n=1)
                fix = f"did you mean {ENV_PREFIX}{hint[0]}?" if hint else f"valid: {sorted(known)}"
                raise ConfigError(f"unknown environment variable {units.clip(name)}: {fix}")


def _explain(exc: ValidationError, model: type[BaseModel]) -> str:
    """One line per problem: the dotted key, what was wrong, and what would be valid."""
    paths = _known_paths(model)
    lines = ["invalid kvstore configuration:"]
    for error in exc.errors():
        key = units.clip(".".join(str(part) for part in error["loc"]))  # a typo'd key may be huge too
        if error["type"] == "extra_forbidden":
            parent = key.rpartition(".")[0]
            siblings = sorted(p for p in paths if p.rpartition(".")[0] == parent)
            # Compare leaf names only: the shared "section." prefix would make any name look close.
            leaves = {p.rpartition(".")[2]: p for p in siblings}
            hint = difflib.get_close_matches(key.rpartition(".")[2], list(leaves), n=1)
            fix = f"did you mean '{leaves[hint[0]]}'?" if hint else f"valid keys here: {', '.join(siblings)}"
            lines.append(f"  {key}: unknown key; {fix}")
            continue
        message = error["msg"].removeprefix("Value error, ")
        if isinstance(error.get("input"), dict | BaseModel):  # a whole section's check: its message names the keys
            lines.append(f"  {key}: {message}" if key else f"  {message}")
            continue
        field = _field(model, error["loc"])
        description = field.description if field else None
        shown = "'**********'" if field is not None and _is_secret(field) else units.shown(error.get("input"))
        lines.append(f"  {key} = {shown}: {message}" + (f" ({description})" if description else ""))
    return "\n".join(lines)


def _field(model: type[BaseModel], loc: tuple[int | str, ...]) -> FieldInfo | None:
    current: Any = model
    field = None
    for part in loc:
        fields = getattr(current, "model_fields", None)
        if not fields or part not in fields:
            return None
        field = fields[part]
        current = field.annotation
    return field


def _is_secret(field: FieldInfo) -> bool:
    """Keys and URLs with passwords are never echoed back in an error."""
    return not field.repr or "SecretStr" in str(field.annotation)
