"""The store's own sections: DRAM, encryption, timeouts, the circuit breaker, metrics, adaptive sizing
and the load planner (the backends' sections are in :mod:`kvstore.config.backend_sections`).
"""

from __future__ import annotations

import base64
import binascii
import re
from pathlib import Path
from typing import Literal

from pydantic import (
    ByteSize,
    Field,
    SecretStr,
    field_validator,
    model_validator,
)

from kvstore.admission import DEFAULT_ADMISSION, AdmissionName
from kvstore.config.base import Capacity, Duration, Section, Size, default_planner_dir
from kvstore.errors import ConfigError
from kvstore.eviction import EvictionName


class DramConfig(Section):
    capacity: Capacity = Field(ByteSize(1 << 30), description="bytes of the DRAM slab pool, e.g. '4GiB'")
    pin_memory: Literal["auto", "always", "never"] = Field(
        "auto", description="pin the pool (page-locked) when CUDA is present ('auto'), always, or never"
    )
    eviction: EvictionName = Field(
        "lru",
        description="which chunk a full pool drops: 'lru' (least recently used), or the scan-resistant "
        "'s3fifo' or 'arc' (see the eviction page)",
    )


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


class EncryptionConfig(Section):
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


class TimeoutConfig(Section):
    get: Duration = Field(
        5.0,
        gt=0,
        description="seconds a get, get_many or lookup call waits on the tiers in all (one deadline per call)",
    )
    put: Duration = Field(
        30.0, gt=0, description="seconds a tier may take to write one chunk before it counts as an error"
    )
    close: Duration = Field(10.0, gt=0, description="seconds close() waits for pending writes before abandoning them")


class BreakerConfig(Section):
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


class MetricsConfig(Section):
    """A Prometheus exporter for every store in the process (see kvstore.engine.metrics)."""

    enabled: bool = Field(False, description="serve the Prometheus metrics of every store in this process over HTTP")
    address: str = Field("127.0.0.1", description="interface to listen on; '0.0.0.0' or '::' for every one")
    port: int = Field(9464, ge=0, le=65535, description="TCP port of /metrics; 0 picks a free one")


MAX_PORT = 65535
_TCP_PORT = re.compile(r"[-+]?\d+")


def tcp_port(endpoint: str) -> int | None:
    """The port number an endpoint ends with (``tcp://*:5567``: 5567), whatever its range; None where it has none
    (``ipc://``, ``inproc://``, a ``*`` port, no port): the ones data-parallel ranks offset (vLLM's rule)."""
    if endpoint.startswith(("ipc://", "inproc://")):
        return None
    port = endpoint.rpartition(":")[2]
    return int(port) if _TCP_PORT.fullmatch(port) else None


class EventsConfig(Section):
    """KV events for cache-aware routers, in vLLM's wire format (see the events page and kvstore.events)."""

    enabled: bool = Field(False, description="publish a KV event when a chunk is stored on a tier or leaves one")
    endpoint: str = Field(
        "tcp://*:5567",
        description="ZeroMQ PUB address: bound when it has '*' (e.g. 'tcp://*:5567', 'tcp://*:0' for a free port), "
        "else connected to (a router's SUB socket, 'tcp://router:5567')",
    )
    replay_endpoint: str = Field(
        "", description="ZeroMQ ROUTER address serving missed batches by sequence number ('' for none)"
    )
    admin_endpoint: str = Field(
        "",
        description="where kvstore gc and verify publish their removals ('' for endpoint): beside a live engine, "
        "another port or the router's address",
    )
    topic: str = Field(
        "kv@{engine}@{model}", description="each message's topic; {engine} and {model} are replaced (llm-d's form)"
    )
    engine_id: str = Field("", description="the engine's identity in the topic ('' for this host's name)")
    model: str = Field("", description="the model's name in the topic ('' for the store's namespace)")
    data_parallel_rank: int = Field(
        0, ge=0, description="set in every batch; added to the endpoints' TCP ports (vLLM's rule for DP ranks)"
    )
    flush_interval: Duration = Field(0.01, gt=0, le=10, description="events are sent in batches at most this late")
    buffer_batches: int = Field(10_000, ge=1, description="sent batches kept for replay")
    remembered_chunks: int = Field(
        16_384, ge=1, description="chunks whose engine identity (hashes, ~1 KB of tokens) is kept for later events"
    )

    @model_validator(mode="after")
    def _ports_in_range(self) -> EventsConfig:
        """Each endpoint's TCP port, and that port plus ``data_parallel_rank``, is a port (ZeroMQ wraps past 65535)."""
        rank = self.data_parallel_rank
        for option in ("endpoint", "replay_endpoint", "admin_endpoint"):
            endpoint = getattr(self, option)
            port = tcp_port(endpoint)
            if port is None:
                continue
            if not 0 <= port <= MAX_PORT:
                raise ValueError(
                    f"events.{option} = {endpoint!r}: port {port} is not a TCP port (0 to {MAX_PORT}); "
                    "use e.g. 'tcp://*:5567', or 'tcp://*:0' for a free one"
                )
            if port and port + rank > MAX_PORT:
                raise ValueError(
                    f"events.{option} = {endpoint!r} with events.data_parallel_rank = {rank}: the rank's port "
                    f"{port} + {rank} = {port + rank} is past {MAX_PORT} (each rank adds itself to the port); "
                    f"use a port at most {MAX_PORT - rank}, or 'tcp://*:0' for a free one"
                )
        return self

    def resolved_topic(self, model: str) -> str:
        """The topic, with ``{engine}`` (this host's name if unset) and ``{model}`` (``model`` if unset) filled in."""
        import socket

        return self.topic.replace("{engine}", self.engine_id or socket.gethostname()).replace(
            "{model}", self.model or model
        )


class AdaptiveConfig(Section):
    """Online hit-rate tracking (``store.advise()``), the write (admission) policy, and auto mode (kvstore.sizing)."""

    track: bool = Field(
        True, description="measure the hit rate against tier size online (~0.25 us a key, after lookup returns)"
    )
    sample_rate: float = Field(1 / 64, gt=0, le=1, description="fraction of chunk lookups whose reuse is timed")
    max_watches: int = Field(1 << 16, ge=16, le=1 << 24, description="sampled lookups waiting for their reuse, at most")
    half_life: int = Field(
        1_000_000, ge=1000, description="chunk lookups after which old traffic counts half (adapts to phase changes)"
    )
    prefill_tokens_per_s: float = Field(
        10_000.0,
        gt=0,
        allow_inf_nan=False,
        description="your engine's prefill rate: what a hit saves (tokens per chunk / this)",
    )
    policy: AdmissionName = Field(
        DEFAULT_ADMISSION,
        description="the admission policy: write every chunk below DRAM ('write-through'), or only prefixes "
        "seen before ('second-sighting'); see the admission page",
    )
    auto: bool = Field(False, description="resize DRAM within [dram_min, dram_max], switch policy as traffic changes")
    dram_min: Size | None = Field(None, description="smallest DRAM size auto mode may pick (default dram.capacity/8)")
    dram_max: Size | None = Field(None, description="largest DRAM size auto mode may pick (default dram.capacity)")
    interval: Duration = Field(30.0, ge=0, description="seconds between auto mode's decisions, at least")
    min_references: int = Field(20_000, ge=1, description="chunk lookups between auto mode's decisions, at least")
    knee: float = Field(0.95, gt=0, le=1, description="smallest DRAM size with this share of the largest one's gain")
    trace: Path | None = Field(None, description="append every chunk lookup to this trace file (for kvstore advise)")


class PlannerConfig(Section):
    """Load or recompute (see kvstore.engine.planner): a hit is loaded only if that beats computing it."""

    enabled: bool = Field(True, description="recompute a held chunk whose expected load is slower than its prefill")
    prefill_tokens_per_s: float | None = Field(
        None,
        gt=0,
        allow_inf_nan=False,
        description="pin the engine's prefill rate (tokens/s); by default the connectors measure it",
    )
    probe_interval: Duration = Field(
        30.0,
        gt=0,
        le=86400,
        description="seconds after which a tier's measured read speed is stale: a refused tier is probed again",
    )
    state_dir: Path | None = Field(
        default_factory=default_planner_dir,
        description=(
            "where each namespace's measured rates are kept (its tiers' reads, the engine's prefill), shared by "
            "an engine's processes and read again after a restart; '' or null: kept in memory only"
        ),
    )

    @field_validator("state_dir", mode="before")
    @classmethod
    def _empty_is_off(cls, value: object) -> object:
        """'' (as an environment variable gives it) turns sharing off; '~' is the user's home."""
        if isinstance(value, str) and not value.strip():
            return None
        return Path(value).expanduser() if isinstance(value, (str, Path)) else value
