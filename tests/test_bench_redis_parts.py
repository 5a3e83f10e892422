"""benchmarks/redis_get_parts.py on a small cut: every stage timed against a real redis-server, chunks checked."""

from __future__ import annotations

import asyncio

from benchmarks import redis_get_parts
from kvstore.bench.local import LAYOUTS
from kvstore.bench.remote_servers import serve


def test_every_stage_is_timed_and_the_table_relates_each_to_the_api() -> None:
    layout = LAYOUTS["SmolLM2-135M"]
    with serve(["redis"], redis_get_parts.IN_FLIGHT) as (remote, *_):
        stages = asyncio.run(redis_get_parts.measure(remote, layout, chunks=2, rounds=1))  # raises if a chunk differs
    assert [stage.kind for stage in stages] == ["api", "part", "part", "part", "part", "baseline", "baseline"]
    assert all(stage.seconds > 0 for stage in stages)
    table = redis_get_parts.markdown_table(stages, 2 * layout.chunk_nbytes).splitlines()
    assert len(table) == 2 + len(stages) and table[2].endswith("| 100% |")
    assert all("get_many at" in line for line in table[-2:])
