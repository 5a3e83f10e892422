"""What KV events cost a store's puts: the public ``put`` with ``[events]`` on, against the same store with them off.

``python -m benchmarks.events`` puts ``--chunks`` chunks into a DRAM-only store whose
pool holds 64, so each put also evicts one: with events on, two events per put (a ``BlockStored``,
a ``BlockRemoved``), each chunk attributed as the vLLM connector attributes it (an engine hash,
its parent, 256 tokens), published on a bound loopback socket nobody reads. It prints the time
per put with events off (the baseline) and on, medians of ``--rounds`` alternating rounds, and
their ratio. The caller's own share is small (the events are made and encoded in the publisher's
thread); on a machine with few cores that thread's Python still competes for the interpreter.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import statistics
import time
from collections.abc import Sequence

import torch

from kvstore.config import StoreConfig
from kvstore.engine.store import KVStore
from kvstore.events import ChunkEvents, ChunkIdentity
from kvstore.layout import KVLayout


async def time_puts(layout: KVLayout, chunks: int, events: bool) -> float:
    """Seconds per ``put`` of ``chunks`` chunks into a 64-chunk DRAM pool (a store of its own)."""
    config = StoreConfig.isolated(
        dram={"capacity": 64 * layout.chunk_nbytes, "pin_memory": "never"},
        disk={"enabled": False},
        adaptive={"track": False},
        events={"enabled": events, "endpoint": "tcp://127.0.0.1:*"},
    )
    kv = torch.zeros(layout.chunk_shape, dtype=layout.dtype)
    async with KVStore(config, layout, namespace="bench-events") as store:
        keys = store.chunk_keys(list(range(layout.chunk_tokens * chunks)))
        if isinstance(store.events, ChunkEvents):
            for i, key in enumerate(keys):
                store.events.attribute(key, ChunkIdentity(i, i - 1 if i else None, range(layout.chunk_tokens)))
        start = time.perf_counter()
        for key in keys:
            await store.put(key, kv)
        return (time.perf_counter() - start) / len(keys)


async def run(chunks: int, rounds: int) -> None:
    layout = KVLayout(num_layers=4, num_kv_heads=2, head_dim=64, dtype=torch.float16, chunk_tokens=256)
    off: list[float] = []
    on: list[float] = []
    for _ in range(rounds):  # alternated, so drift in the machine's speed hits both alike
        off.append(await time_puts(layout, chunks, events=False))
        on.append(await time_puts(layout, chunks, events=True))
    base, with_events = statistics.median(off), statistics.median(on)
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores")
    print(
        f"{chunks} puts of {layout.chunk_nbytes // 1024} KiB chunks into a 64-chunk DRAM pool, median of {rounds}:\n"
        f"  events off (baseline)  {base * 1e6:8.1f} us/put\n"
        f"  events on              {with_events * 1e6:8.1f} us/put   {with_events / base:.2f}x "
        f"(+{(with_events - base) * 1e6:.1f} us/put: a BlockStored and a BlockRemoved)"
    )


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.events", description=__doc__.splitlines()[0])
    parser.add_argument("--chunks", type=int, default=4000, help="puts per round (default 4000)")
    parser.add_argument("--rounds", type=int, default=5, help="rounds of each, alternated (default 5)")
    args = parser.parse_args(argv)
    asyncio.run(run(args.chunks, args.rounds))


if __name__ == "__main__":
    main()
