"""Replays synthetic traffic into real stores: fixed configurations against auto mode, and the tracker's cost.

``python -m benchmarks.adaptive`` prints, per workload:
the prefix hit rate, the DRAM hit rate and the bytes written below DRAM for each fixed DRAM
size under write-through and second-sighting, then for auto mode; and the time the tracking
adds to ``lookup`` against the same store with tracking off. It prints plain text: these figures
are for a developer's terminal or docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvstore.config import StoreConfig
from kvstore.engine.store import KVStore
from kvstore.layout import KVLayout
from kvstore.sizing import workloads
from kvstore.sizing.traces import trace_key
from kvstore.util.progress import Progress
from kvstore.util.units import MiB

LAYOUT = KVLayout(num_layers=2, num_kv_heads=1, head_dim=8, chunk_tokens=16)  # 1 KiB chunks: traffic, not bytes


@dataclass
class ReplayResult:
    """What one replay did: lookups, hits (all tiers, and DRAM), bytes written below DRAM, and auto mode's end state."""

    label: str
    references: int
    prefix_hits: int  # chunks lookup() found (the prefix an engine would load instead of computing)
    dram_hits: int  # of which, served from DRAM
    written_below: int  # bytes written to the tiers below DRAM
    rejected: int  # puts refused: every DRAM slot was held by a transfer (writes queued below, mostly)
    dram_bytes_end: int
    policy_end: str
    adaptive: dict[str, Any]

    @property
    def hit_rate(self) -> float:
        return self.prefix_hits / max(1, self.references)

    @property
    def dram_hit_rate(self) -> float:
        return self.dram_hits / max(1, self.references)


async def replay(store: KVStore, chains: Sequence[np.ndarray], label: str = "", settle: bool = False) -> ReplayResult:
    """Each chain as an engine would send it: lookup, load the prefix found, put the chunks it computed.

    The counts are this replay's, not the store's since it opened (a store may replay twice: to learn,
    then to be measured). ``settle`` waits for the writes below DRAM and for auto mode's decisions after
    each chain, so the outcome does not depend on timing.
    """
    before = _counts(store)
    chunk = torch.zeros(store.layout.chunk_shape, dtype=store.layout.dtype)
    outs = [torch.empty_like(chunk) for _ in range(max((len(c) for c in chains), default=0))]
    references = prefix_hits = 0
    for chain in chains:
        keys = [trace_key(int(i)) for i in chain]
        found = await store.lookup(keys)
        if settle:
            await store.flush()  # a decision this lookup started (a DRAM resize) ends before the chain goes on
        references += len(keys)
        prefix_hits += found
        if found:
            await store.get_many(keys[:found], outs[:found])
        for key in keys[found:]:
            await store.put(key, chunk)
        if settle:
            await store.flush()
    await store.flush()
    dram_hits, written_below, rejected = (after - start for after, start in zip(_counts(store), before, strict=True))
    return ReplayResult(
        label=label,
        references=references,
        prefix_hits=prefix_hits,
        dram_hits=dram_hits,
        written_below=written_below,
        rejected=rejected,
        dram_bytes_end=store.pool.capacity_bytes,
        policy_end=store.policy,
        adaptive=store.stats()["adaptive"],
    )


def _counts(store: KVStore) -> tuple[int, int, int]:
    """The store's DRAM hits, bytes written below DRAM and puts rejected, since it opened."""
    counters = store.stats()["store"]
    below = sum(tier.stats.hits for tier in store.tiers)
    written = sum(tier.stats.bytes_written for tier in store.tiers)
    return counters["hits"] - below, written, counters["put_rejected"]


def store_config(directory: Path, dram_chunks: int, disk_chunks: int, **adaptive: Any) -> StoreConfig:
    """A DRAM + disk store sized in chunks of :data:`LAYOUT`, with ``adaptive`` settings, its disk in ``directory``."""
    chunk = LAYOUT.chunk_nbytes
    return StoreConfig(
        dram={"capacity": dram_chunks * chunk, "pin_memory": "never"},
        disk={"path": directory, "capacity": disk_chunks * (chunk + 4096)},
        adaptive=adaptive,
        queue_depth=100_000,  # a replay outruns the disk; the comparison is about what is written, not drops
    )


async def run_config(chains: Sequence[np.ndarray], label: str, dram_chunks: int, disk_chunks: int, **adaptive: Any):
    with tempfile.TemporaryDirectory(prefix="kvstore-adaptive-") as directory:
        config = store_config(Path(directory), dram_chunks, disk_chunks, **adaptive)
        async with KVStore(config, LAYOUT, "bench") as store:
            return await replay(store, chains, label)


WORKLOADS = {
    "zipf prefixes": lambda n: workloads.zipf_prefixes(n, seed=1),
    "multi-turn": lambda n: workloads.multi_turn(max(1, n // 5), seed=2),
    "rag": lambda n: workloads.rag(n, seed=3),
    "all unique": lambda n: workloads.all_unique(n, seed=4),
    "phase change": lambda n: workloads.phase_change(
        workloads.zipf_prefixes(n // 2, seed=5), workloads.all_unique(n // 2, seed=6)
    ),
}


CONFIGS_PER_WORKLOAD = 5  # compare_one's rows


async def compare_one(
    chains: Sequence[np.ndarray], dram_chunks: int, disk_chunks: int, progress: Progress | None = None
) -> list[ReplayResult]:
    """Fixed write-through at 1/8x, 1x and 8x DRAM, fixed second-sighting at 1x, then auto within [1/8x, 8x].

    ``progress`` gets a step after each configuration's replay.
    """
    chunk = LAYOUT.chunk_nbytes
    rows = []

    async def run(label: str, dram: int, **adaptive: Any) -> None:
        if progress is not None:
            progress.doing(label)
        rows.append(await run_config(chains, label, dram, disk_chunks, **adaptive))
        if progress is not None:
            progress.step(label)

    for factor in (1 / 8, 1, 8):
        size = max(1, int(dram_chunks * factor))
        await run(f"write-through, {size:,} chunks", size, track=False)
    await run(f"second-sighting, {dram_chunks:,} chunks", dram_chunks, policy="second-sighting")
    auto = {
        "auto": True,
        "dram_min": max(1, dram_chunks // 8) * chunk,
        "dram_max": dram_chunks * 8 * chunk,
        "interval": 0,
        "min_references": 10_000,
        "half_life": 50_000,
    }
    await run(f"auto, {dram_chunks // 8:,}-{dram_chunks * 8:,} chunks", dram_chunks, **auto)
    return rows


async def lookup_overhead(
    lookups: int = 20_000, chain: int = 16, rounds: int = 3, progress: Progress | None = None
) -> dict[str, float]:
    """Seconds per ``lookup`` of a ``chain``-chunk prefix, tracking off and on; the median of ``rounds``.

    Two cases: every prefix in DRAM (the cheapest lookup there is, so the worst case for the
    tracker's share), and prefixes that miss DRAM and are found on disk. ``*_call`` is the lookup
    call alone (what the engine waits for); the others include the tracker's batches, which run
    right after a lookup returns (``asyncio.sleep(0)`` lets them, in both variants alike).
    ``progress`` gets a step after each round (between timings).
    """
    samples: dict[str, list[float]] = {}
    for number in range(rounds):
        for case, dram_chunks in (("dram", 64 * chain + 16), ("disk", 16)):
            for track in (False, True):
                label = f"{case}_{'tracked' if track else 'untracked'}"
                call, total = await _time_lookups(lookups, chain, dram_chunks, track)
                samples.setdefault(label, []).append(total)
                samples.setdefault(f"{label}_call", []).append(call)
        if progress is not None:
            progress.step(f"lookup overhead, round {number + 1} of {rounds}")
    return {label: float(np.median(values)) for label, values in samples.items()}


async def _time_lookups(lookups: int, chain: int, dram_chunks: int, track: bool) -> tuple[float, float]:
    """Seconds per lookup (the call alone, and with the tracker's batches) over stored prefixes of ``chain`` chunks."""
    chains = workloads.zipf_prefixes(lookups, prefixes=64, prefix_chunks=chain, suffix_chunks=0, seed=7)
    key_chains = [[trace_key(int(i)) for i in c] for c in chains]
    chunk = torch.zeros(LAYOUT.chunk_shape, dtype=LAYOUT.dtype)
    with tempfile.TemporaryDirectory(prefix="kvstore-adaptive-") as directory:
        config = store_config(Path(directory), dram_chunks, 100_000, track=track)
        async with KVStore(config, LAYOUT, "bench") as store:
            for keys in key_chains[:2000]:  # every prefix stored (in DRAM, or on disk past a small DRAM)
                for key in keys[await store.lookup(keys) :]:
                    await store.put(key, chunk)
            await store.flush()
            in_call = 0.0
            start = time.perf_counter()
            for keys in key_chains:
                before = time.perf_counter()
                await store.lookup(keys)
                in_call += time.perf_counter() - before
                await asyncio.sleep(0)
            total = time.perf_counter() - start
    return in_call / len(key_chains), total / len(key_chains)


_REPLAY_COLUMNS = ("configuration", "hit rate", "DRAM hit rate", "written below DRAM", "puts refused", "DRAM at end")
_REPLAY_LINE = "  {:<36} {:>9} {:>14} {:>19} {:>13} {:>15}  {}"  # the columns above, then the policy at the end


def _replay_cells(row: ReplayResult) -> tuple[str, ...]:
    """A replay's figures as printed, in the order of :data:`_REPLAY_COLUMNS` plus the policy at the end."""
    return (
        row.label,
        f"{row.hit_rate:.1%}",
        f"{row.dram_hit_rate:.1%}",
        f"{row.written_below / MiB:.1f} MiB",
        f"{row.rejected:,}",
        f"{row.dram_bytes_end // LAYOUT.chunk_nbytes:,} chunks",
        row.policy_end,
    )


def _overhead_lines(timings: dict[str, float]) -> list[str]:
    """:func:`lookup_overhead`'s timings as sentences: the tracker's cost per lookup, DRAM and disk cases."""
    lines = []
    for case, where in (("dram", "all in DRAM"), ("disk", "found on disk")):
        off, on = timings[f"{case}_untracked"], timings[f"{case}_tracked"]
        off_call, on_call = timings[f"{case}_untracked_call"], timings[f"{case}_tracked_call"]
        lines.append(
            f"lookup of 16 chunks, {where}: {off * 1e6:.1f} us untracked, {on * 1e6:.1f} us tracked "
            f"({on / off - 1:+.1%} with the tracker's batches); the call alone {off_call * 1e6:.1f} -> "
            f"{on_call * 1e6:.1f} us ({on_call / off_call - 1:+.1%})"
        )
    return lines


def main(argv: Sequence[str] | None = None) -> None:
    """Every workload through every configuration, then the tracker's overhead; printed as plain text.

    Its progress (a step per replay and per overhead round) goes to stderr.
    """
    parser = argparse.ArgumentParser(prog="python -m benchmarks.adaptive", description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=10_000, help="requests per workload (default 10000)")
    parser.add_argument(
        "--dram-chunks", type=int, default=1000, help="the 1x DRAM size: fixed at 1/8x, 1x, 8x; auto within them"
    )
    parser.add_argument("--disk-chunks", type=int, default=20_000, help="the disk tier's size (default 20000)")
    args = parser.parse_args(argv)
    requests, dram_chunks, disk_chunks = args.requests, args.dram_chunks, args.disk_chunks
    rounds = 3
    with Progress("bench_adaptive", total=len(WORKLOADS) * CONFIGS_PER_WORKLOAD + rounds, keep=False) as progress:
        for name, make in WORKLOADS.items():
            progress.description = f"bench_adaptive, {name}"
            rows = asyncio.run(compare_one(make(requests), dram_chunks, disk_chunks, progress))
            print(f"{name}: {rows[0].references:,} chunk lookups, disk {disk_chunks:,} chunks", flush=True)
            print(_REPLAY_LINE.format(*_REPLAY_COLUMNS, "policy"))
            for row in rows:
                print(_REPLAY_LINE.format(*_replay_cells(row)))
            print(flush=True)
        progress.description = "bench_adaptive, lookup overhead"
        timings = asyncio.run(lookup_overhead(rounds=rounds, progress=progress))
    for line in _overhead_lines(timings):
        print(line)


if __name__ == "__main__":
    main()
