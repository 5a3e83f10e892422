"""benchmarks/peers.py without LMCache: kvstore's side of every tier on real servers, and the table it prints.

LMCache's side needs its own 2 GB environment (scripts/lmcache_env.sh), which the suite does not
make; its driver's options are checked with every benchmark's (test_benchmarks.py).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from benchmarks import peers
from kvstore.bench.remote_servers import serve


def test_kvstore_side_moves_every_tier_exactly_and_the_baselines_the_same_bytes(tmp_path: Path) -> None:
    """Two chunks through each tier and its raw baseline (redis-server and moto started here): every put and get
    timed, every chunk read back equal (kvstore_pass raises otherwise)."""

    async def passes() -> list[peers.Timing]:
        with serve(["redis", "moto"], peers.CONCURRENCY) as started:
            remotes = {"redis" if remote.name == "redis" else "s3": remote for remote in started}
            side = peers.KvstoreSide(2, tmp_path, remotes, fsync=False)
            try:
                timings = []
                for tier in peers.TIERS:
                    timings += await side.kvstore_pass(tier) + await side.raw_pass(tier)
                return timings
            finally:
                side.executor.shutdown()

    timings = asyncio.run(passes())
    done = {(t.side, t.tier, t.op) for t in timings}
    for tier in peers.TIERS:
        ops = ("put", "get", "get_cold") if tier == "disk" else ("put", "get")
        assert {(side, tier, op) for side in ("kvstore", "raw") for op in ops} <= done
    assert all(t.seconds > 0 and t.nbytes == 2 * peers.LAYOUT.chunk_nbytes for t in timings)


def test_the_table_has_a_row_per_tier_and_operation_with_the_ratio_of_the_best_times() -> None:
    def timing(side: str, tier: str, op: str, seconds: float) -> peers.Timing:
        return peers.Timing(side, tier, op, seconds, 2_000_000_000, f"{side} {op}")

    timings = [
        timing("kvstore", "disk", "put", 2.0),
        timing("kvstore", "disk", "put", 1.0),  # the best of the rounds is kept
        timing("lmcache", "disk", "put", 2.5),
        timing("raw", "disk", "put", 0.5),
        timing("kvstore", "redis", "get", 4.0),
        timing("lmcache", "redis", "get", 2.0),
    ]
    rows = peers.markdown_table(timings).splitlines()[2:]
    assert rows == [
        "| disk | put | 2.00 | 0.80 | 2.50x | raw put | 4.00 |",
        "| redis | get | 0.50 | 1.00 | 0.50x | - | - |",
    ]
