"""Chunk-reference traces: the file a live store records, synthetic workloads, and an exact LRU simulator.

A trace is the stream of chunk ids the engine looks up, one lookup (request) after another. Miss-ratio
curves are estimated from it online; the synthetic workloads here have known behaviour so the estimators
can be checked, and ``exact_lru_hit_rates`` is the slow, obviously correct reference they are checked
against. Pure numpy and stdlib: nothing here needs torch, a GPU or an engine.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from collections import OrderedDict
from collections.abc import Sequence
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
    raw = np.frombuffer(bytes.fromhex("".join(keys)), dtype=">u8")
    return raw[::4].astype(np.uint64)


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


# ---------------------------------------------------------------------------------------------
# Synthetic workloads
# ---------------------------------------------------------------------------------------------
_GOLDEN = 0x9E3779B97F4A7C15


def _fmix(z: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser, elementwise on uint64 (wrapping arithmetic)."""
    with np.errstate(over="ignore"):
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


def _mix(previous: np.ndarray, content: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        return _fmix(previous ^ _fmix(content + np.uint64(_GOLDEN)))


def _salt(workload: str, seed: int) -> int:
    """A workload's chain seed: different workloads or seeds never share ids."""
    return int.from_bytes(hashlib.blake2b(f"{workload}\x00{seed}".encode(), digest_size=8).digest(), "little")


def _chain_rows(contents: np.ndarray, salt: int) -> np.ndarray:
    """Chain each row of a 2-D content array (column by column, so vectorised across rows)."""
    contents = np.asarray(contents, dtype=np.uint64)
    ids = np.empty_like(contents)
    previous = np.full(contents.shape[0], salt & _MASK64, dtype=np.uint64)
    for column in range(contents.shape[1]):
        previous = ids[:, column] = _mix(previous, contents[:, column])
    return ids


def chain(contents: np.ndarray | Sequence[int], salt: int) -> np.ndarray:
    """Prefix-chained ids, like real keys: id_i depends on contents 0..i, so only equal prefixes share ids."""
    return _chain_rows(np.asarray(contents, dtype=np.uint64).reshape(1, -1), salt)[0]


def _zipf_probabilities(n: int, alpha: float) -> np.ndarray:
    if n < 1:
        raise ValueError(f"need at least one item to draw from, got {n}")
    weights = 1.0 / np.arange(1, n + 1, dtype=np.float64) ** alpha
    return weights / weights.sum()


def zipf_prefixes(
    requests: int,
    prefixes: int = 1000,
    prefix_chunks: int = 8,
    suffix_chunks: int = 2,
    alpha: float = 1.0,
    seed: int = 0,
) -> list[np.ndarray]:
    """Shared prefixes (system prompts, few-shot templates) of Zipf popularity, each followed by a unique tail."""
    rng = np.random.default_rng(seed)
    picked = rng.choice(prefixes, size=requests, p=_zipf_probabilities(prefixes, alpha))  # 0 is rank 1
    contents = np.empty((requests, prefix_chunks + suffix_chunks), dtype=np.uint64)
    contents[:, :prefix_chunks] = picked[:, None] * prefix_chunks + np.arange(prefix_chunks)
    unique = prefixes * prefix_chunks + np.arange(requests * suffix_chunks, dtype=np.uint64)
    contents[:, prefix_chunks:] = unique.reshape(requests, suffix_chunks)
    return list(_chain_rows(contents, _salt("zipf_prefixes", seed)))


def multi_turn(
    sessions: int = 2000,
    turns: tuple[int, int] = (2, 8),
    turn_chunks: int = 2,
    system_chunks: int = 2,
    concurrent: int = 64,
    seed: int = 0,
) -> list[np.ndarray]:
    """Chat sessions: each turn resends the whole history; up to ``concurrent`` sessions interleave."""
    low, high = turns
    if not 1 <= low <= high:
        raise ValueError(f"turns must be a range 1 <= low <= high, got {turns}")
    if concurrent < 1:
        raise ValueError(f"concurrent must be at least 1, got {concurrent}")
    rng = np.random.default_rng(seed)
    session_turns = rng.integers(low, high + 1, size=sessions)
    width = system_chunks + high * turn_chunks
    contents = np.empty((sessions, width), dtype=np.uint64)
    contents[:, :system_chunks] = np.arange(system_chunks)
    unique = system_chunks + np.arange(sessions * high * turn_chunks, dtype=np.uint64)
    contents[:, system_chunks:] = unique.reshape(sessions, high * turn_chunks)
    ids = _chain_rows(contents, _salt("multi_turn", seed))  # a session's requests are prefixes of its row

    total = session_turns.tolist()
    done = [0] * sessions
    active = list(range(min(concurrent, sessions)))
    next_session = len(active)
    out: list[np.ndarray] = []
    for draw in rng.random(int(session_turns.sum())).tolist():
        slot = int(draw * len(active))
        session = active[slot]
        done[session] += 1
        out.append(ids[session, : system_chunks + done[session] * turn_chunks].copy())
        if done[session] == total[session]:
            if next_session < sessions:
                active[slot] = next_session
                next_session += 1
            else:
                active[slot] = active[-1]
                active.pop()
    return out


def rag(
    requests: int,
    documents: int = 5000,
    docs_per_request: int = 3,
    doc_chunks: int = 4,
    system_chunks: int = 2,
    alpha: float = 0.9,
    seed: int = 0,
) -> list[np.ndarray]:
    """Retrieval-augmented prompts: system prompt, Zipf-popular documents in retrieval order, a unique question.

    A document's chunks are shared only when the documents before it are the same too, as with real keys.
    """
    if docs_per_request > documents:
        raise ValueError(f"cannot draw {docs_per_request} distinct documents out of {documents}")
    rng = np.random.default_rng(seed)
    probabilities = _zipf_probabilities(documents, alpha)
    drawn = rng.choice(documents, size=(requests, docs_per_request), p=probabilities)
    while True:  # a retriever returns distinct documents: redraw the rows with a repeat
        ordered = np.sort(drawn, axis=1)
        repeats = np.flatnonzero((ordered[:, 1:] == ordered[:, :-1]).any(axis=1))
        if not len(repeats):
            break
        drawn[repeats] = rng.choice(documents, size=(len(repeats), docs_per_request), p=probabilities)
    contents = np.empty((requests, system_chunks + docs_per_request * doc_chunks + 1), dtype=np.uint64)
    contents[:, :system_chunks] = np.arange(system_chunks)
    doc_contents = system_chunks + drawn[:, :, None] * doc_chunks + np.arange(doc_chunks)
    contents[:, system_chunks:-1] = doc_contents.reshape(requests, -1)
    contents[:, -1] = system_chunks + documents * doc_chunks + np.arange(requests)
    return list(_chain_rows(contents, _salt("rag", seed)))


def all_unique(requests: int, chunks: int = 8, seed: int = 0) -> list[np.ndarray]:
    """No id ever repeats: every hit rate is 0, the floor of any estimator."""
    contents = np.arange(requests * chunks, dtype=np.uint64).reshape(requests, chunks)
    return list(_chain_rows(contents, _salt("all_unique", seed)))


def phase_change(*phases: list[np.ndarray]) -> list[np.ndarray]:
    """One workload after another (build them with different seeds): tests how fast an estimator adapts."""
    return [request for phase in phases for request in phase]


def flatten(chains: Sequence[np.ndarray]) -> np.ndarray:
    """The reference stream: every request's ids, in order."""
    if not len(chains):
        return np.empty(0, dtype=np.uint64)
    return np.concatenate(chains).astype(np.uint64, copy=False)


# ---------------------------------------------------------------------------------------------
# Exact LRU
# ---------------------------------------------------------------------------------------------
def exact_lru_hits(ids: np.ndarray, sizes: Sequence[int]) -> list[int]:
    """Hits of an LRU cache of each size (in chunks), by direct simulation: one pass per size."""
    stream = np.asarray(ids, dtype=np.uint64).reshape(-1).tolist()
    result = []
    for size in sizes:
        if size < 0:
            raise ValueError(f"a cache size cannot be negative, got {size}")
        hits = 0
        if size > 0:
            cache: OrderedDict[int, None] = OrderedDict()
            move_to_end, evict_oldest = cache.move_to_end, cache.popitem
            for item in stream:
                if item in cache:
                    move_to_end(item)
                    hits += 1
                else:
                    cache[item] = None
                    if len(cache) > size:
                        evict_oldest(last=False)
        result.append(hits)
    return result


def exact_lru_hit_rates(ids: np.ndarray, sizes: Sequence[int]) -> list[float]:
    """Hit rate of an LRU cache of each size: the independent reference for estimated miss-ratio curves."""
    references = len(ids)
    return [hits / references if references else 0.0 for hits in exact_lru_hits(ids, sizes)]


def distinct(ids: np.ndarray) -> int:
    """How many different ids: the cache size beyond which LRU misses only on first sightings."""
    return len(np.unique(np.asarray(ids, dtype=np.uint64)))


def cold_fraction(ids: np.ndarray) -> float:
    """Fraction of references that are first sightings: misses in a cache of any size."""
    return distinct(ids) / len(ids) if len(ids) else 0.0
