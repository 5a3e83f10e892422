"""kvstore.sizing.traces (trace files, key ids) and kvstore.sizing.workloads (synthetic workloads, exact LRU)."""

from __future__ import annotations

import hashlib
import os
import stat
import struct
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from kvstore.errors import TraceFormatError
from kvstore.sizing.traces import (
    TRACE_DTYPE,
    TRACE_MAGIC,
    TraceWriter,
    flatten,
    key_hash,
    key_id,
    key_ids,
    read_trace,
    spread_ids,
    trace_key,
    valid_key_ids,
    write_trace,
)
from kvstore.sizing.workloads import (
    all_unique,
    chain,
    cold_fraction,
    distinct,
    exact_lru_hit_rates,
    exact_lru_hits,
    multi_turn,
    phase_change,
    rag,
    zipf_prefixes,
)

META = {"chunk_tokens": 256, "chunk_bytes": 1_966_080, "namespace": "smollm2", "started": 1.7e9, "writer": "test"}


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


# ---------------------------------------------------------------------------------------------
# Trace files
# ---------------------------------------------------------------------------------------------
def test_record_dtype_is_packed() -> None:
    assert TRACE_DTYPE.itemsize == 20


def test_writer_reader_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "trace.kvt"
    rng = np.random.default_rng(1)
    big = rng.integers(0, 2**64, size=120_000, dtype=np.uint64)  # more than one 1 MiB buffer
    with TraceWriter(path, META) as writer:
        writer.append(np.array([0.5, 0.5, 0.5]), np.array([7, 7, 7]), np.array([1, 2, 2**64 - 1], dtype=np.uint64))
        writer.append(1.25, 8, np.array([3], dtype=np.uint64))  # scalars are shared by the batch
        writer.append(np.array([]), np.array([], dtype=np.uint32), np.array([], dtype=np.uint64))
        writer.append(2.0, 2**32 + 9, big)  # request numbers wrap
        assert path.stat().st_size > 1 << 20, "a full buffer is written without waiting for flush/close"
        assert writer.records == 120_004
    writer.close()  # idempotent
    with pytest.raises(ValueError, match="closed"):
        writer.append(3.0, 10, np.array([1], dtype=np.uint64))

    trace = read_trace(path)
    assert trace.meta == META
    assert len(trace) == 120_004
    assert trace.truncated_bytes == 0
    assert trace.ids.dtype == np.uint64 and trace.requests.dtype == np.uint32 and trace.times.dtype == np.float64
    np.testing.assert_array_equal(trace.ids[:4], np.array([1, 2, 2**64 - 1, 3], dtype=np.uint64))
    np.testing.assert_array_equal(trace.ids[4:], big)
    np.testing.assert_array_equal(trace.requests[:5], [7, 7, 7, 8, 9])
    np.testing.assert_array_equal(trace.times[:5], [0.5, 0.5, 0.5, 1.25, 2.0])
    chains = trace.requests_as_chains()
    assert [len(c) for c in chains] == [3, 1, 120_000]
    assert path.stat().st_size == len(TRACE_MAGIC) + 4 + len(trace_header(path)) + 120_004 * 20


def trace_header(path: Path) -> bytes:
    data = path.read_bytes()
    (length,) = struct.unpack("<I", data[8:12])
    return data[12 : 12 + length]


def test_trace_file_is_private(tmp_path: Path) -> None:
    fresh = tmp_path / "fresh.kvt"
    old_umask = os.umask(0)
    try:
        TraceWriter(fresh, META).close()
    finally:
        os.umask(old_umask)
    assert mode(fresh) == 0o600

    existing = tmp_path / "existing.kvt"
    existing.write_bytes(b"x" * 1000)
    existing.chmod(0o644)
    TraceWriter(existing, META).close()
    assert mode(existing) == 0o600
    assert len(read_trace(existing)) == 0, "an existing file is truncated"


def test_empty_trace(tmp_path: Path) -> None:
    path = tmp_path / "empty.kvt"
    TraceWriter(path, {}).close()
    trace = read_trace(path)
    assert len(trace) == 0 and trace.meta == {} and trace.truncated_bytes == 0
    assert trace.requests_as_chains() == []


def test_partial_last_record_is_dropped(tmp_path: Path) -> None:
    path = tmp_path / "cut.kvt"
    write_trace(path, [np.array([1, 2, 3], dtype=np.uint64), np.array([4], dtype=np.uint64)], META)
    with open(path, "ab") as file:
        file.write(b"\x01" * 7)  # the writer died mid-record
    trace = read_trace(path)
    assert trace.truncated_bytes == 7
    np.testing.assert_array_equal(trace.ids, [1, 2, 3, 4])


def test_write_trace_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "synthetic.kvt"
    chains = multi_turn(sessions=50, seed=3)
    write_trace(path, chains, META, rate=4.0)
    trace = read_trace(path)
    assert trace.meta == META
    got = trace.requests_as_chains()
    assert len(got) == len(chains)
    for a, b in zip(got, chains, strict=True):
        np.testing.assert_array_equal(a, b)
    starts = np.cumsum([0] + [len(c) for c in chains[:-1]])
    np.testing.assert_allclose(trace.times[starts], np.arange(len(chains)) / 4.0)


@pytest.mark.parametrize(
    "content, message",
    [
        (b"", "not a kvstore trace"),
        (b"KV", "not a kvstore trace"),
        (b"NOTATRACE" + bytes(100), "not a kvstore trace"),
        (bytes(np.random.default_rng(0).integers(0, 256, size=4096, dtype=np.uint8)), "not a kvstore trace"),
        (b"KVTRACE2" + struct.pack("<I", 2) + b"{}", "unsupported"),
        (TRACE_MAGIC + b"\x02\x00", "bad trace header"),
        (TRACE_MAGIC + struct.pack("<I", 1000) + b"{}", "past the end"),
        (TRACE_MAGIC + struct.pack("<I", 5) + b"[1,2]", "not a dict"),
        (TRACE_MAGIC + struct.pack("<I", 4) + b"{oops", "not UTF-8 JSON"),
        (TRACE_MAGIC + struct.pack("<I", 2) + b"\xff\xfe", "not UTF-8 JSON"),
    ],
)
def test_bad_files_raise_trace_format_error(tmp_path: Path, content: bytes, message: str) -> None:
    path = tmp_path / "bad.kvt"
    path.write_bytes(content)
    with pytest.raises(TraceFormatError, match=message) as info:
        read_trace(path)
    assert str(path) in str(info.value)
    assert isinstance(info.value, ValueError)


# ---------------------------------------------------------------------------------------------
# Key identities
# ---------------------------------------------------------------------------------------------
def test_key_ids_match_key_id() -> None:
    keys = [hashlib.sha256(str(i).encode()).hexdigest() for i in range(1000)]
    ids = key_ids(keys)
    assert ids.dtype == np.uint64
    assert ids.tolist() == [key_id(key) for key in keys]
    assert max(ids.tolist()) >= 2**63, "the high bit survives (no signed conversion)"
    assert key_ids([]).tolist() == []
    with pytest.raises(ValueError):
        key_ids(["ab" * 31])


def splitmix64_finalizer(x: int) -> int:
    """The reference: SplitMix64's output function, in plain Python integers."""
    mask = 2**64 - 1
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & mask
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & mask
    return x ^ (x >> 31)


def test_spread_ids_are_splitmix_of_the_key_ids_in_every_process() -> None:
    keys = [trace_key(i) for i in range(64)] + [hashlib.sha256(b"x").hexdigest(), trace_key(2**64 - 1)]
    hashed = spread_ids(valid_key_ids(iter(keys), len(keys)))
    assert hashed.dtype == np.uint64
    assert hashed.tolist() == [splitmix64_finalizer(key_id(key)) for key in keys]  # no per-process salt
    assert hashed.tolist() == [key_hash(key) for key in keys]  # one key at a time, the same
    low_bits = {h & 0xFFFF for h in hashed[:64].tolist()}
    assert len(low_bits) == 64 and max(h >> 32 for h in hashed[:64].tolist()) > 0, "small ids spread out"
    with pytest.raises(ValueError):
        valid_key_ids(["ab" * 31], 1)


def test_trace_key_round_trips() -> None:
    for i in [0, 1, 255, 2**63, 2**64 - 1, 0x0123456789ABCDEF]:
        key = trace_key(i)
        assert len(key) == 64 and set(key) <= set("0123456789abcdef")
        assert key_id(key) == i
        assert key_ids([key]).tolist() == [i]


# ---------------------------------------------------------------------------------------------
# Synthetic workloads
# ---------------------------------------------------------------------------------------------
def test_chaining_shares_exactly_the_common_prefix() -> None:
    a = chain([10, 11, 12, 13, 14], salt=5)
    b = chain([10, 11, 12, 99, 14], salt=5)
    assert a.dtype == np.uint64
    assert (a == b).tolist() == [True, True, True, False, False], "same content after a difference: new ids"
    assert not set(chain([10, 11, 12], salt=6).tolist()) & set(a.tolist()), "another salt shares nothing"
    assert not set(chain([11, 12, 13], salt=5).tolist()) & set(a.tolist()), "same content at another position"


def test_all_unique() -> None:
    ids = flatten(all_unique(5000, chunks=8))
    assert len(ids) == 40_000
    assert distinct(ids) == len(ids)
    assert cold_fraction(ids) == 1.0


def test_zipf_popularity() -> None:
    chains = zipf_prefixes(20_000, prefixes=1000, prefix_chunks=8, suffix_chunks=2, alpha=1.0, seed=0)
    assert len(chains) == 20_000 and all(len(c) == 10 for c in chains)
    counts = sorted(Counter(c[0] for c in chains).values(), reverse=True)
    assert len(counts) <= 1000
    assert counts[0] > 10 * counts[99], counts[:100:10]
    # the whole prefix is shared by the requests that share its first chunk; tails are unique
    by_first = {}
    for c in chains:
        by_first.setdefault(int(c[0]), c[:8])
        np.testing.assert_array_equal(c[:8], by_first[int(c[0])])
    tails = flatten([c[8:] for c in chains])
    assert distinct(tails) == len(tails)


def test_multi_turn_sessions_grow_and_interleave() -> None:
    system, turn, low, high, concurrent, sessions = 2, 2, 2, 8, 16, 300
    chains = multi_turn(sessions, turns=(low, high), turn_chunks=turn, system_chunks=system, concurrent=concurrent)
    assert all(np.array_equal(c[:system], chains[0][:system]) for c in chains), "one system prompt for all"
    session_of_last_id: dict[int, int] = {}
    latest: list[np.ndarray] = []
    spans: list[list[int]] = []
    for index, request in enumerate(chains):
        if len(request) == system + turn:
            session = len(latest)
            latest.append(request)
            spans.append([index, index])
        else:
            session = session_of_last_id[int(request[-turn - 1])]
            np.testing.assert_array_equal(request[:-turn], latest[session], "the previous request is a prefix")
            latest[session] = request
            spans[session][1] = index
        session_of_last_id[int(request[-1])] = session
    assert len(latest) == sessions
    assert all(low <= (len(c) - system) // turn <= high for c in latest)
    assert len(set((len(c) - system) // turn for c in latest)) > 3, "turn counts vary"
    open_sessions = np.zeros(len(chains) + 1, dtype=int)
    for first, last in spans:
        open_sessions[first] += 1
        open_sessions[last + 1] -= 1
    assert np.cumsum(open_sessions).max() == concurrent, "sessions interleave, at most `concurrent` at a time"


def test_rag_structure() -> None:
    chains = rag(5000, documents=500, docs_per_request=3, doc_chunks=4, system_chunks=2, alpha=0.9, seed=0)
    assert all(len(c) == 2 + 12 + 1 for c in chains)
    assert all(np.array_equal(c[:2], chains[0][:2]) for c in chains), "the system prompt is shared by all"
    questions = [int(c[-1]) for c in chains]
    assert len(set(questions)) == len(chains)
    # Zipf popularity: the most popular first document (p ~ 0.11) leads far more requests than 1/500
    first_docs = Counter(tuple(c[2:6].tolist()) for c in chains)
    assert first_docs.most_common(1)[0][1] > 0.05 * len(chains)
    # a document behind a different first document gets different ids (as real prefix keys do)
    assert distinct(flatten([c[6:10] for c in chains])) > 2 * distinct(flatten([c[2:6] for c in chains]))


@pytest.mark.parametrize(
    "make",
    [
        lambda seed: zipf_prefixes(500, prefixes=50, seed=seed),
        lambda seed: multi_turn(100, seed=seed),
        lambda seed: rag(500, documents=100, seed=seed),
        lambda seed: all_unique(500, seed=seed),
    ],
)
def test_determinism(make: Callable[[int], list[np.ndarray]]) -> None:
    a, b, c = flatten(make(1)), flatten(make(1)), flatten(make(2))
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)
    assert not set(a.tolist()) & set(c.tolist()), "different seeds share no ids"


def test_phase_change_phases_share_nothing() -> None:
    first, second = zipf_prefixes(2000, prefixes=20, seed=1), zipf_prefixes(2000, prefixes=20, seed=2)
    both = phase_change(first, second)
    assert len(both) == 4000
    assert both[0] is first[0] and both[2000] is second[0]
    assert not set(flatten(first).tolist()) & set(flatten(second).tolist())
    assert not set(flatten(rag(500, seed=0)).tolist()) & set(flatten(multi_turn(50, seed=0)).tolist())


# ---------------------------------------------------------------------------------------------
# Exact LRU
# ---------------------------------------------------------------------------------------------
def test_exact_lru_by_hand() -> None:
    ids = np.array([1, 2, 3, 1, 2, 4, 1, 2, 3, 4, 4], dtype=np.uint64)
    # Reuse distance (distinct ids since the last use, plus one) of each reference; a hit in LRU of size s iff <= s:
    #   1  2  3  1  2  4  1  2  3  4  4
    #   -  -  -  3  3  -  3  3  4  4  1     (- = first sighting, a miss at any size)
    # size 0: 0 hits; size 1: 1 (the last 4); size 2: 1; size 3: 4 + 1 = 5; size 4 and 10: 6 + 1 = 7 (all but 4 cold)
    assert exact_lru_hits(ids, [0, 1, 2, 3, 4, 10]) == [0, 1, 1, 5, 7, 7]
    assert exact_lru_hit_rates(ids, [0, 1, 3, 4]) == [0.0, 1 / 11, 5 / 11, 7 / 11]
    assert distinct(ids) == 4 and cold_fraction(ids) == 4 / 11
    assert exact_lru_hit_rates(np.array([], dtype=np.uint64), [0, 5]) == [0.0, 0.0]
    with pytest.raises(ValueError):
        exact_lru_hits(ids, [-1])


def list_lru_hits(stream: list[int], size: int) -> int:
    """The slowest possible LRU: a list, most recent last."""
    if size == 0:
        return 0
    cache: list[int] = []
    hits = 0
    for item in stream:
        if item in cache:
            hits += 1
            cache.remove(item)
        elif len(cache) == size:
            cache.pop(0)
        cache.append(item)
    return hits


def test_exact_lru_matches_a_list_lru() -> None:
    rng = np.random.default_rng(7)
    for _ in range(20):
        stream = rng.integers(0, 30, size=400).tolist()
        sizes = [0, 1, 2, 5, 10, 29, 30, 40]
        assert exact_lru_hits(np.array(stream, dtype=np.uint64), sizes) == [list_lru_hits(stream, s) for s in sizes]


def test_hit_rate_grows_with_size_and_saturates() -> None:
    ids = flatten(zipf_prefixes(3000, prefixes=300, prefix_chunks=4, suffix_chunks=1, alpha=0.8, seed=4))
    sizes = [0, 1, 4, 16, 64, 256, 512, 1024, 2048]
    rates = exact_lru_hit_rates(ids, sizes)
    assert rates == sorted(rates), rates
    assert rates[0] == 0.0 and rates[-2] > rates[3] > 0
    everything = distinct(ids)
    hits = exact_lru_hits(ids, [everything, everything + 100])
    assert hits == [len(ids) - everything] * 2, "with room for everything only first sightings miss"
    assert exact_lru_hit_rates(ids, [everything])[0] == pytest.approx(1 - cold_fraction(ids), abs=1e-15)
