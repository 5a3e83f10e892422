"""Adaptive sizing: a store measures its own hit rate against DRAM size, advises, and (opt-in) resizes itself.

Replays a synthetic multi-turn chat workload (sessions whose every turn re-sends the whole
history) into a DRAM + disk store with auto mode on, records every lookup to a trace file,
then prints what the store decided and its advice. Takes about 40 s on a 2-core machine
(3000 sessions, 16,000 requests; ``--sessions 1200``: about 15 s), with its progress on stderr:

    .venv/bin/python examples/adaptive_sizing.py [--trace lookups.kvtrace]
    kvstore advise lookups.kvtrace --chunk-bytes 32MiB --plot mrc.png   # the same advice offline

Chunks here are 1 KiB (a tiny layout) so the replay is quick; the access pattern, and so the
curve, is the same for any model. Give ``kvstore advise`` your model's chunk size.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import tempfile
from pathlib import Path

import torch

from kvstore import KVLayout, KVStore, StoreConfig
from kvstore.sizing.traces import trace_key
from kvstore.sizing.workloads import multi_turn
from kvstore.util.progress import track

# 256-token chunks as an engine's, of 1 KiB (4 bytes a token) so the replay is quick: the trace records
# 256 tokens a chunk, and `kvstore advise --chunk-bytes 32MiB` then reads it as Llama-3-8B's chunks.
LAYOUT = KVLayout(num_layers=1, num_kv_heads=1, head_dim=1, chunk_tokens=256)
CHUNK = LAYOUT.chunk_nbytes


async def main(trace: Path, sessions: int) -> None:
    with tempfile.TemporaryDirectory(prefix="kvstore-adaptive-") as directory:
        config = StoreConfig(
            dram={"capacity": 1000 * CHUNK, "pin_memory": "never"},
            disk={"path": directory, "capacity": 40_000 * (CHUNK + 4096)},
            adaptive={
                "auto": True,  # resize DRAM within [dram_min, dram_max], switch the write policy
                "dram_min": 250 * CHUNK,
                "dram_max": 8000 * CHUNK,
                "interval": 0,  # decide as often as min_references allows (a real engine: the default 30 s)
                "min_references": 10_000,
                "trace": trace,  # every lookup, for `kvstore advise`
            },
        )
        chunk = torch.zeros(LAYOUT.chunk_shape, dtype=LAYOUT.dtype)
        async with KVStore(config, LAYOUT, "adaptive-example") as store:
            for chain in track(multi_turn(sessions, seed=1), "replaying requests"):  # what an engine does per request:
                keys = [trace_key(int(i)) for i in chain]
                found = await store.lookup(keys)  # the cached prefix...
                await store.get_many(keys[:found])  # ...is loaded
                for key in keys[found:]:  # the rest is computed and stored
                    await store.put(key, chunk)
            advice = store.advise(bounds=config.dram_bounds())
            stats = store.stats()
    auto = stats["adaptive"]
    print(
        f"auto mode: {auto['decisions']} decisions, {auto['resizes']} resizes, policy now {auto['policy']}; "
        f"DRAM {stats['dram']['capacity_bytes'] // CHUNK:,} chunks (started at 1,000)"
    )
    for row in advice.rows:
        mark = "  <- recommended" if row.dram_bytes == advice.recommended_dram_bytes else ""
        print(
            f"  DRAM {row.dram_bytes // CHUNK:>6,} chunks: {row.dram_hit_rate:6.1%} from DRAM, "
            f"{row.hit_rate:6.1%} from any tier{mark}"
        )
    for line in advice.verdict:
        print("-", line)
    print(f"trace: {trace} ({auto['lookups_tracked']:,} chunk lookups)")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trace", type=Path, default=Path("lookups.kvtrace"))
    parser.add_argument("--sessions", type=int, default=3000)
    arguments = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    logging.getLogger("kvstore.dram").setLevel(logging.WARNING)
    asyncio.run(main(arguments.trace, arguments.sessions))
