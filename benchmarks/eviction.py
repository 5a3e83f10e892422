"""Hit ratio of each eviction policy against LRU, on synthetic workloads and a public KV-cache trace.

``python -m benchmarks.eviction`` replays every workload through every policy in
:mod:`kvstore.eviction` at several cache sizes (in chunks, as fractions of the workload's
distinct chunks) and prints one table: the hit ratio per policy and size, and each ratio over
LRU's. ``--store`` also replays one workload and the public trace through a real
:class:`~kvstore.engine.store.KVStore` per policy (``dram.eviction`` set in its config, a
DRAM-only store of 512-byte chunks) and prints its DRAM hit ratio beside the simulated one: they
are equal when the store evicts through the policy as the simulation does.

A replay treats each request as an engine does: the chunks it finds are hits (and loaded: a
touch), then the chunks it missed are stored, each evicting one chunk when the cache is full.

Workloads: the generators of :mod:`kvstore.sizing.workloads` (Zipf-popular prefixes, chat
sessions, RAG), Zipf prefixes interrupted by bursts of one-off documents (a scan), and the first
328 requests of the Mooncake FAST'25 conversation trace (vendored under
``benchmarks/traces``; ``--trace FILE`` replays a whole Mooncake JSONL file instead).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch

from kvstore.config import StoreConfig
from kvstore.engine.store import KVStore
from kvstore.eviction import POLICIES, make_policy
from kvstore.keys import chain_parents
from kvstore.layout import KVLayout
from kvstore.sizing import workloads
from kvstore.sizing.traces import flatten, trace_key

Chains = list[np.ndarray]
TRACES = Path(__file__).resolve().parent / "traces"
MOONCAKE_SLICE = TRACES / "mooncake_conversation_head.txt"
MOONCAKE_BLOCK_TOKENS = 512
SIZE_FRACTIONS = (0.01, 0.02, 0.05, 0.1, 0.2)  # of the workload's distinct chunks


# -- workloads ---------------------------------------------------------------------------------


def parse_runs(text: str) -> list[int]:
    """``"0,14-17"`` -> ``[0, 14, 15, 16, 17]`` (the vendored trace's form of ``hash_ids``)."""
    ids: list[int] = []
    for run in text.split(","):
        first, _, last = run.partition("-")
        ids.extend(range(int(first), int(last or first) + 1))
    return ids


def read_mooncake(path: Path = MOONCAKE_SLICE) -> list[tuple[int, int, list[int]]]:
    """(timestamp, input_length, hash_ids) per request of a Mooncake trace: the vendored slice, or a JSONL file."""
    requests = []
    with open(path, encoding="utf-8") as lines:
        for number, line in enumerate(lines, start=1):
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            try:
                if line.startswith("{"):
                    record = json.loads(line)
                    requests.append((int(record["timestamp"]), int(record["input_length"]), list(record["hash_ids"])))
                else:
                    timestamp, input_length, _, runs = line.split()
                    requests.append((int(timestamp), int(input_length), parse_runs(runs)))
            except (ValueError, KeyError, TypeError) as exc:
                raise ValueError(f"{path}:{number}: not a Mooncake trace line ({exc})") from None
    return requests


def mooncake_chains(path: Path = MOONCAKE_SLICE) -> Chains:
    return [np.asarray(ids, dtype=np.uint64) for _, _, ids in read_mooncake(path)]


def prefixes_with_scans(requests: int, burst: int = 200, every: int = 200, seed: int = 7) -> Chains:
    """Zipf-popular prefixes; after each ``every`` requests, ``burst`` requests of one-off documents (8 chunks each)."""
    reused = workloads.zipf_prefixes(requests, seed=seed)
    scans = workloads.all_unique((requests // every) * burst, chunks=8, seed=seed + 1)
    out: Chains = []
    for start in range(0, requests, every):
        out.extend(reused[start : start + every])
        first = (start // every) * burst
        out.extend(scans[first : first + burst])
    return out


def synthetic_workloads(requests: int) -> dict[str, Callable[[], Chains]]:
    return {
        "zipf prefixes": lambda: workloads.zipf_prefixes(requests, seed=1),
        "multi-turn": lambda: workloads.multi_turn(max(1, requests // 5), seed=2),
        "rag": lambda: workloads.rag(requests, seed=3),
        "prefixes + one-off scans": lambda: prefixes_with_scans(requests),
    }


# -- replay ------------------------------------------------------------------------------------


class Replay(NamedTuple):
    """What a replay hit: chunks found anywhere in their request, and chunks an engine could use."""

    hits: int  # chunks found in the cache
    usable: int  # chunks of each request's leading run found (lookup counts leading chunks: what is loaded)


def leading_run(found: Sequence[bool]) -> int:
    """How many of the first chunks were found: the prefix an engine loads instead of recomputing."""
    return next((index for index, hit in enumerate(found) if not hit), len(found))


def simulate(chains: Sequence[np.ndarray], policy: str, capacity: int, tail_first: bool = True) -> Replay:
    """Hits of a cache of ``capacity`` chunks evicting by ``policy``, each request found then stored.

    As the store reports a batch to its pool's policy: with ``tail_first`` (what it does) the request's
    hits are touched last to first and its misses inserted last to first, so of a request's chunks the
    tail is the least recent; ``tail_first=False`` is the order it used before (head first), for
    comparison. The misses are stored as one ``put_many``: room is made first (they are published
    unranked, so none of them is evicted for another), and those past the free slots are rejected.
    """
    cache = make_policy(policy, capacity)
    hits = usable = 0
    for chain in chains:
        ids = chain.tolist()
        found = [chunk in cache for chunk in ids]
        hits += sum(found)
        usable += leading_run(found)
        touched = [chunk for chunk, hit in zip(ids, found, strict=True) if hit]
        missed = [chunk for chunk, hit in zip(ids, found, strict=True) if not hit]
        for chunk in reversed(touched) if tail_first else touched:
            cache.touch(chunk)
        for _ in range(len(cache) + len(missed) - capacity):
            if cache.evict() is None:
                break
        stored = missed[: capacity - len(cache)]
        for chunk in reversed(stored) if tail_first else stored:
            cache.insert(chunk)
    return Replay(hits, usable)


async def replay_store(chains: Sequence[np.ndarray], policy: str, capacity: int) -> Replay:
    """DRAM hits of a real DRAM-only KVStore of ``capacity`` chunks with ``dram.eviction = policy``.

    Each request: ``get_many`` of its chunks (the hits are loaded, which the pool's policy sees),
    then one ``put_many`` of the ones it missed, each with its parent.
    """
    layout = KVLayout(num_layers=1, num_kv_heads=1, head_dim=8, chunk_tokens=16)  # 512-byte chunks: traffic, not bytes
    config = StoreConfig(
        dram={"capacity": capacity * layout.chunk_nbytes, "pin_memory": "never", "eviction": policy},
        disk={"enabled": False},
    )
    chunk = torch.zeros(layout.chunk_shape, dtype=layout.dtype)
    longest = max((len(chain) for chain in chains), default=0)
    outs = [torch.empty_like(chunk) for _ in range(longest)]
    hits = usable = 0
    async with KVStore(config, layout, "bench-eviction") as store:
        if store.pool.eviction != policy:
            raise RuntimeError(f"the store's DRAM pool evicts by {store.pool.eviction!r}, not dram.eviction {policy!r}")
        for chain in chains:
            keys = [trace_key(int(chunk_id)) for chunk_id in chain]
            found = [result is not None for result in await store.get_many(keys, outs[: len(keys)])]
            hits += sum(found)
            usable += leading_run(found)
            parents = chain_parents(keys)
            missed = [i for i, hit in enumerate(found) if not hit]
            await store.put_many([keys[i] for i in missed], [chunk] * len(missed), parents=[parents[i] for i in missed])
    return Replay(hits, usable)


# -- the table ---------------------------------------------------------------------------------


def sizes_for(chains: Sequence[np.ndarray], fractions: Sequence[float] = SIZE_FRACTIONS) -> list[int]:
    distinct = workloads.distinct(flatten(chains))
    return sorted({max(4, int(distinct * fraction)) for fraction in fractions})


def table(name: str, chains: Sequence[np.ndarray], policies: Sequence[str], sizes: Sequence[int]) -> list[str]:
    """One workload's rows: size; each policy's chunk hit ratio, then its usable hit ratio (the leading run an
    engine loads); each non-LRU policy's usable ratio over LRU's; and LRU's usable ratio with the head-first
    order the store used before (a prefix's head evicted first, its tail left unreachable)."""
    references = sum(len(chain) for chain in chains)
    distinct = workloads.distinct(flatten(chains))
    others = [policy for policy in policies if policy != "lru"]
    header = [
        "cache (chunks)",
        *(f"{policy} hits / usable" for policy in policies),
        *(f"{policy}/lru usable" for policy in others),
        "lru usable, head first",
    ]
    lines = [
        f"{name}: {len(chains):,} requests, {references:,} chunk references, {distinct:,} distinct "
        f"(an unbounded cache hits {1 - distinct / references:.1%})",
        "| " + " | ".join(header) + " |",
        "|" + "---|" * len(header),
    ]
    for size in sizes:
        replays = {policy: simulate(chains, policy, size) for policy in policies}
        head_first = simulate(chains, "lru", size, tail_first=False)
        usable_lru = replays["lru"].usable
        cells = [f"{size:,} ({size / distinct:.0%})"]
        cells += [f"{r.hits / references:.1%} / {r.usable / references:.1%}" for r in replays.values()]
        cells += [f"{replays[p].usable / usable_lru:.2f}x" if usable_lru else "n/a" for p in others]
        cells.append(f"{head_first.usable / references:.1%}")
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def store_check(name: str, chains: Chains, policies: Sequence[str], size: int) -> list[str]:
    """The real store's DRAM hit ratios per policy beside the simulation's, on one workload and size."""
    references = sum(len(chain) for chain in chains)
    lines = [
        f"through a real KVStore ({name}, DRAM of {size:,} chunks, dram.eviction set per row):",
        "| policy | KVStore hits / usable | simulated hits / usable |",
        "|---|---|---|",
    ]
    for policy in policies:
        stored, simulated = asyncio.run(replay_store(chains, policy, size)), simulate(chains, policy, size)
        lines.append(
            f"| {policy} | {stored.hits / references:.2%} / {stored.usable / references:.2%} | "
            f"{simulated.hits / references:.2%} / {simulated.usable / references:.2%} |"
        )
    return lines


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.eviction", description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=10_000, help="requests per synthetic workload")
    parser.add_argument(
        "--trace", type=Path, default=MOONCAKE_SLICE, help="a Mooncake trace (JSONL, or the vendored form)"
    )
    parser.add_argument(
        "--store", action="store_true", help="also replay a workload and the trace through a real KVStore per policy"
    )
    parser.add_argument("--store-requests", type=int, default=2_000, help="requests of that replay")
    args = parser.parse_args(argv)
    policies = list(POLICIES)
    print(f"machine: {platform.machine()}, {platform.processor() or 'cpu'}, Python {platform.python_version()}")
    print(
        f"policies: {', '.join(policies)}; sizes: {', '.join(f'{f:.0%}' for f in SIZE_FRACTIONS)} of distinct chunks\n"
    )
    named = synthetic_workloads(args.requests)
    named[f"mooncake conversation ({args.trace.name})"] = lambda: mooncake_chains(args.trace)
    for name, make in named.items():
        chains = make()
        for line in table(name, chains, policies, sizes_for(chains)):
            print(line, flush=True)
        print()
    if args.store:
        chains = prefixes_with_scans(args.store_requests, burst=40, every=40)
        for line in store_check("prefixes + one-off scans", chains, policies, sizes_for(chains, (0.05,))[0]):
            print(line, flush=True)
        print()
        trace = mooncake_chains(args.trace)  # the public trace, through the store too
        for line in store_check(
            f"mooncake conversation, {args.trace.name}", trace, policies, sizes_for(trace, (0.01,))[0]
        ):
            print(line, flush=True)


if __name__ == "__main__":
    main()
