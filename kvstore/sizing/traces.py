"""Chunk-reference traces: the file a live store records and ``kvstore advise`` reads, and chunk key ids.

A trace is the stream of chunk ids the engine looks up, one lookup (request) after another. Miss-ratio
curves are estimated from it online, or offline from the file. The synthetic workloads with known
behaviour, and the exact LRU simulator they are checked against, are in :mod:`kvstore.sizing.workloads`.
Pure numpy and stdlib: nothing here needs torch, a GPU or an engine.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

import numpy as np

from kvstore.errors import TraceFormatError

TRACE_MAGIC = b"KVTRACE1"
TRACE_DTYPE = np.dtype([("time", "<f8"), ("request", "<u4"), ("id", "<u8")])
"""One reference: seconds since the trace began, the lookup it belongs to, the chunk key's identity."""
_HEADER_LENGTH = struct.Struct("<I")
_WRITE_BUFFER_BYTES = 1 << 20
_MASK64 = (1 << 64) - 1


# ---------------------------------------------------------------------------------------------
# Chunk key identities
# ---------------------------------------------------------------------------------------------
def key_id(key: str) -> int:
    """A chunk key's first 64 bits: SHA-256 output, so as unique as the key for any realistic cache."""
    if len(key) != 64:
        raise ValueError(f"a chunk key has 64 hex characters, got {len(key)}")
    return int(key[:16], 16)


def key_ids(keys: Sequence[str]) -> np.ndarray:
    """``key_id`` of many keys at once (one hex decode, no per-key int parsing): cheap on the lookup path."""
    if any(len(key) != 64 for key in keys):
        raise ValueError("a chunk key has 64 hex characters")
    return valid_key_ids(keys, len(keys))


def valid_key_ids(keys: Iterable[str], count: int) -> np.ndarray:
    """:func:`key_ids` of ``count`` keys already validated (the store checks every key it is given).

    One length check for all of them, not one per key: the tracker's batches take this path.
    """
    joined = "".join(keys)
    if len(joined) != 64 * count:
        raise ValueError("a chunk key has 64 hex characters")
    return np.frombuffer(bytes.fromhex(joined), dtype=">u8")[::4].astype(np.uint64)


_MIX = (0xBF58476D1CE4E5B9, 0x94D049BB133111EB)


def spread_ids(ids: np.ndarray) -> np.ndarray:
    """Well-spread 64-bit hashes of key ids (uint64, a new array), the same in every process.

    SplitMix64's finalizer: a real key's id is already uniform, a synthetic one (:func:`trace_key`)
    becomes so. Unlike ``hash()``, no per-process salt: the same traffic gives the same sampling,
    sighting counts and advice on every run.
    """
    hashed = ids.astype(np.uint64)
    hashed ^= hashed >> np.uint64(30)
    hashed *= np.uint64(_MIX[0])
    hashed ^= hashed >> np.uint64(27)
    hashed *= np.uint64(_MIX[1])
    hashed ^= hashed >> np.uint64(31)
    return hashed


def key_hash(key: str) -> int:
    """:func:`spread_ids` of one valid key's id, in plain integers (~1 us: the per-put path uses it)."""
    x = key_id(key)
    x = ((x ^ (x >> 30)) * _MIX[0]) & _MASK64
    x = ((x ^ (x >> 27)) * _MIX[1]) & _MASK64
    return x ^ (x >> 31)


def trace_key(id: int) -> str:
    """A valid chunk key whose ``key_id`` is ``id``: replays a synthetic trace into a real store."""
    return f"{id & _MASK64:016x}" * 4


# ---------------------------------------------------------------------------------------------
# Trace files
# ---------------------------------------------------------------------------------------------
class TraceWriter:
    """Appends references to a trace file; buffered so the event loop pays a few array copies per lookup.

    The file is created 0600 (it reveals which prompts share prefixes). Up to ~1 MiB of records is lost
    if the process dies; ``read_trace`` tolerates the resulting partial record.
    """

    def __init__(self, path: str | os.PathLike[str], meta: dict[str, Any]) -> None:
        if not isinstance(meta, dict):
            raise TypeError(f"trace metadata must be a dict, got {type(meta).__name__}")
        header = json.dumps(meta, separators=(",", ":")).encode()
        self.path = Path(path)
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        try:
            os.fchmod(fd, 0o600)  # O_CREAT's mode applies only to a new file
            self._file = os.fdopen(fd, "wb")
        except BaseException:
            os.close(fd)
            raise
        self._file.write(TRACE_MAGIC + _HEADER_LENGTH.pack(len(header)) + header)
        # One array per field: a slice assignment each, scalars broadcast for free; interleaved once per write.
        capacity = _WRITE_BUFFER_BYTES // TRACE_DTYPE.itemsize
        self._times = np.empty(capacity, dtype=np.float64)
        self._requests = np.empty(capacity, dtype=np.uint32)
        self._ids = np.empty(capacity, dtype=np.uint64)
        self._pending = 0
        self.records = 0
        self.closed = False

    def append(self, times: np.ndarray | float, requests: np.ndarray | int, ids: np.ndarray) -> None:
        """Buffer references; ``times`` and ``requests`` may be scalars shared by all of ``ids``.

        Request numbers are stored modulo 2**32: they only mark where one lookup ends and the next begins.
        """
        if self.closed:
            raise ValueError(f"trace writer for {self.path} is closed")
        ids = np.asarray(ids, dtype=np.uint64).reshape(-1)
        count = len(ids)
        if isinstance(requests, int):
            requests &= 0xFFFFFFFF  # request numbers wrap: only where they change matters
        per_record = bool(np.ndim(times) or np.ndim(requests))
        if per_record:
            times = np.broadcast_to(np.asarray(times, dtype=np.float64), (count,))
            requests = np.broadcast_to(np.asarray(requests, dtype=np.uint32), (count,))
        start = 0
        while start < count:
            pending, take = self._pending, min(len(self._ids) - self._pending, count - start)
            end = start + take
            self._times[pending : pending + take] = times[start:end] if per_record else times
            self._requests[pending : pending + take] = requests[start:end] if per_record else requests
            self._ids[pending : pending + take] = ids[start:end]
            self._pending += take
            start += take
            if self._pending == len(self._ids):
                self._write_pending()
        self.records += count

    def _write_pending(self) -> None:
        """Interleave the buffered fields into records and write them (one write)."""
        if self._pending:
            records = np.empty(self._pending, dtype=TRACE_DTYPE)
            records["time"] = self._times[: self._pending]
            records["request"] = self._requests[: self._pending]
            records["id"] = self._ids[: self._pending]
            self._file.write(records.tobytes())
            self._pending = 0

    def flush(self) -> None:
        """Hand buffered records to the OS (not fsync: a trace is a measurement, not data)."""
        if not self.closed:
            self._write_pending()
            self._file.flush()

    def close(self) -> None:
        """Flush and close the file; closing twice is harmless."""
        if self.closed:
            return
        try:
            self.flush()
        finally:
            self.closed = True
            self._file.close()

    def __enter__(self) -> TraceWriter:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


@dataclass
class Trace:
    """A trace read back: its metadata and one array per record field."""

    meta: dict[str, Any]
    times: np.ndarray
    requests: np.ndarray
    ids: np.ndarray
    truncated_bytes: int = 0
    """Bytes of a partial last record that were dropped (the writer died mid-write)."""
    path: str = field(default="")

    def __len__(self) -> int:
        return len(self.ids)

    def requests_as_chains(self) -> list[np.ndarray]:
        """The ids of each lookup, in order: consecutive records with the same request number."""
        if not len(self.ids):
            return []
        boundaries = np.flatnonzero(self.requests[1:] != self.requests[:-1]) + 1
        return np.split(self.ids, boundaries)


def read_trace(path: str | os.PathLike[str]) -> Trace:
    """Read a trace file; raises ``TraceFormatError`` naming the file. Only raw records, never pickles."""
    name = os.fspath(path)
    with open(name, "rb") as file:
        size = os.fstat(file.fileno()).st_size
        magic = file.read(len(TRACE_MAGIC))
        if magic[:7] != TRACE_MAGIC[:7]:
            raise TraceFormatError(f"{name}: not a kvstore trace (bad magic {magic[:8]!r})")
        if magic != TRACE_MAGIC:
            raise TraceFormatError(f"{name}: unsupported trace format {magic!r} (this reader knows {TRACE_MAGIC!r})")
        length_bytes = file.read(_HEADER_LENGTH.size)
        if len(length_bytes) != _HEADER_LENGTH.size:
            raise TraceFormatError(f"{name}: bad trace header (file ends inside the metadata length)")
        (length,) = _HEADER_LENGTH.unpack(length_bytes)
        header_end = len(TRACE_MAGIC) + _HEADER_LENGTH.size + length
        if header_end > size:
            raise TraceFormatError(f"{name}: bad trace header (metadata length {length} runs past the end)")
        try:
            meta = json.loads(file.read(length).decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as error:
            raise TraceFormatError(f"{name}: bad trace header (metadata is not UTF-8 JSON: {error})") from None
        if not isinstance(meta, dict):
            raise TraceFormatError(f"{name}: bad trace header (metadata is a {type(meta).__name__}, not a dict)")
        count, truncated = divmod(size - header_end, TRACE_DTYPE.itemsize)
        records = np.fromfile(file, dtype=TRACE_DTYPE, count=count)
    if len(records) != count:  # the file shrank while we read it
        raise TraceFormatError(f"{name}: expected {count} records, read {len(records)}")
    return Trace(
        meta=meta,
        times=records["time"].astype(np.float64),
        requests=records["request"].astype(np.uint32),
        ids=records["id"].astype(np.uint64),
        truncated_bytes=truncated,
        path=name,
    )


def write_trace(
    path: str | os.PathLike[str], chains: Sequence[np.ndarray], meta: dict[str, Any], rate: float = 1.0
) -> None:
    """Write synthetic chains as a trace: one request per chain, ``1 / rate`` seconds apart."""
    if rate <= 0:
        raise ValueError(f"rate must be positive, got {rate}")
    lengths = np.fromiter((len(chain) for chain in chains), dtype=np.int64, count=len(chains))
    numbers = np.repeat(np.arange(len(chains), dtype=np.int64), lengths)
    with TraceWriter(path, meta) as writer:
        writer.append(numbers / rate, (numbers & 0xFFFFFFFF).astype(np.uint32), flatten(chains))


def flatten(chains: Sequence[np.ndarray]) -> np.ndarray:
    """The reference stream of ``chains`` (one array of ids per request): every request's ids, in order.

    The inverse of :meth:`Trace.requests_as_chains`, and what :func:`write_trace` stores.
    """
    if not len(chains):
        return np.empty(0, dtype=np.uint64)
    return np.concatenate(chains).astype(np.uint64, copy=False)
