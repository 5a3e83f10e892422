"""Synthetic chunk-lookup workloads with known behaviour, and the exact LRU simulator they are checked against.

Why: the miss-ratio estimator (:mod:`kvstore.sizing.mrc`), the advice and auto mode are judged on
traffic whose answer is known. Each generator returns *chains*: one array of chunk ids per
request (lookup), prefix-chained like real keys, so two requests share ids exactly as far as
their contents agree. :func:`kvstore.sizing.traces.flatten` turns chains into the reference
stream, and :func:`kvstore.sizing.traces.write_trace` into a trace file ``kvstore advise`` reads.

Every generator is deterministic for a given ``seed``, and different workloads or seeds never
share ids. ``exact_lru_hit_rates`` is the slow, obviously correct reference. Pure numpy and
stdlib: nothing here needs torch, a GPU or an engine.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np

_GOLDEN = 0x9E3779B97F4A7C15
_MASK64 = (1 << 64) - 1


# ---------------------------------------------------------------------------------------------
# Prefix chaining
# ---------------------------------------------------------------------------------------------
def _fmix(z: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser, elementwise on uint64 (wrapping arithmetic)."""
    with np.errstate(over="ignore"):
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


def _mix(previous: np.ndarray, content: np.ndarray) -> np.ndarray:
    """The next id of each chain from its previous id and the next chunk's content."""
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


def _contents(rows: int, *blocks: np.ndarray) -> np.ndarray:
    """Content blocks laid side by side as ``rows`` requests (each block: rows x its own columns, as uint64).

    A block of one row (a shared system prompt) is repeated for every request. Contents are chunk
    identities: equal numbers in equal positions, after equal prefixes, give equal ids.
    """
    return np.hstack([np.broadcast_to(np.asarray(block).astype(np.uint64), (rows, block.shape[1])) for block in blocks])


def _chained_requests(workload: str, seed: int, rows: int, *blocks: np.ndarray) -> list[np.ndarray]:
    """One chain per request from the content blocks (see :func:`_contents`), salted by workload and seed."""
    return list(_chain_rows(_contents(rows, *blocks), _salt(workload, seed)))


def _fresh(first: int, rows: int, columns: int) -> np.ndarray:
    """Contents no other request has: ``first``, ``first + 1``, ... laid out ``rows`` x ``columns``."""
    return first + np.arange(rows * columns, dtype=np.uint64).reshape(rows, columns)


def chain(contents: np.ndarray | Sequence[int], salt: int) -> np.ndarray:
    """Prefix-chained ids, like real keys: id_i depends on contents 0..i, so only equal prefixes share ids."""
    return _chain_rows(np.asarray(contents, dtype=np.uint64).reshape(1, -1), salt)[0]


# ---------------------------------------------------------------------------------------------
# Workloads
# ---------------------------------------------------------------------------------------------
def _zipf_probabilities(n: int, alpha: float) -> np.ndarray:
    """Zipf(``alpha``) probabilities of ranks 1..``n`` (index 0 is the most popular)."""
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
    shared = picked[:, None] * prefix_chunks + np.arange(prefix_chunks)
    tails = _fresh(prefixes * prefix_chunks, requests, suffix_chunks)
    return _chained_requests("zipf_prefixes", seed, requests, shared, tails)


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
    system = np.arange(system_chunks)[None, :]
    # A session's requests are prefixes of its row: the system prompt, then every turn so far.
    turns_contents = _fresh(system_chunks, sessions, high * turn_chunks)
    ids = _chain_rows(_contents(sessions, system, turns_contents), _salt("multi_turn", seed))

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
    system = np.arange(system_chunks)[None, :]
    retrieved = (system_chunks + drawn[:, :, None] * doc_chunks + np.arange(doc_chunks)).reshape(requests, -1)
    questions = _fresh(system_chunks + documents * doc_chunks, requests, 1)
    return _chained_requests("rag", seed, requests, system, retrieved, questions)


def all_unique(requests: int, chunks: int = 8, seed: int = 0) -> list[np.ndarray]:
    """No id ever repeats: every hit rate is 0, the floor of any estimator."""
    return _chained_requests("all_unique", seed, requests, _fresh(0, requests, chunks))


def phase_change(*phases: list[np.ndarray]) -> list[np.ndarray]:
    """One workload after another (build them with different seeds): tests how fast an estimator adapts."""
    return [request for phase in phases for request in phase]


# ---------------------------------------------------------------------------------------------
# Exact LRU: the reference the estimators are checked against
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
