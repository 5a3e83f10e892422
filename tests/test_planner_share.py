"""The planner's measured rates, shared by an engine's processes and kept across restarts (engine/planner_share.py).

Under vLLM's default multiprocessing the scheduler's store only looks chunks up while the worker's
reads them, and the scheduler times the prefill: each store writes what it measured into one file
per namespace (``planner.state_dir``) and takes what it did not measure from it. Real stores on a
real disk and a real redis-server; two stores open at once stand for the scheduler's and the worker's.
"""

from __future__ import annotations

import asyncio
import json
import stat
import uuid
from pathlib import Path

import pytest
import torch

from kvstore import KVLayout, KVStore, StoreConfig
from kvstore.engine.planner_share import state_path

LAYOUT = KVLayout(num_layers=4, num_kv_heads=4, head_dim=64, dtype=torch.float16, chunk_tokens=128)  # 512 KiB
NAMESPACE = "share-test"


def config(tmp_path: Path, *, disk: bool = True, redis: str | None = None, dram: str = "16MiB") -> StoreConfig:
    tiers: dict[str, object] = {"disk": {"enabled": disk, "path": tmp_path / "disk"}}
    if redis is not None:
        tiers["redis"] = {"enabled": True, "url": redis, "prefix": f"share-{uuid.uuid4().hex[:8]}", "codec": "identity"}
    return StoreConfig(dram={"capacity": dram}, planner={"state_dir": tmp_path / "state"}, **tiers)  # type: ignore[arg-type]


async def put_chunks(store: KVStore, tokens: list[int]) -> None:
    for index, key in enumerate(store.chunk_keys(tokens)):
        await store.put(key, torch.full(LAYOUT.chunk_shape, float(index), dtype=LAYOUT.dtype))
    await store.flush()


async def test_a_restarted_store_plans_with_the_prefill_rate_its_last_run_measured(tmp_path):
    async with KVStore(config(tmp_path), LAYOUT, NAMESPACE) as store:
        assert store.planner.prefill_tokens_per_s is None  # nothing measured yet, nothing kept from before
        for seconds in (0.5, 0.25, 0.5):
            store.planner.observe_prefill(1000, seconds)
        measured = store.planner.prefill_tokens_per_s
    assert measured == 2000.0
    async with KVStore(config(tmp_path), LAYOUT, NAMESPACE) as store:
        assert store.planner.prefill_tokens_per_s == measured, "a restart must keep the prefill rate"
    async with KVStore(config(tmp_path), LAYOUT, "another-model") as store:
        assert store.planner.prefill_tokens_per_s is None, "another namespace's rate is not this one's"
    path = state_path(tmp_path / "state", NAMESPACE, LAYOUT.fingerprint)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700


async def test_the_scheduler_s_store_plans_with_the_read_rate_the_worker_s_store_measured(tmp_path, redis_server):
    """The worker's store reads from Redis; the scheduler's, open at the same time, never reads: within a few
    exchanges (every planner_share.SHARE_INTERVAL seconds) it holds the worker's measured rate."""
    url = redis_server.url
    writer_config = config(tmp_path, disk=False, redis=url)
    async with KVStore(writer_config, LAYOUT, NAMESPACE) as writer:
        await put_chunks(writer, list(range(1024)))
    scheduler_config = writer_config.model_copy(deep=True)
    scheduler_config.dram.capacity = LAYOUT.chunk_nbytes  # type: ignore[assignment]  # as a lookup-only store's
    async with (
        KVStore(writer_config, LAYOUT, NAMESPACE) as worker,
        KVStore(scheduler_config, LAYOUT, NAMESPACE) as scheduler,
    ):
        keys = scheduler.chunk_keys(list(range(1024)))
        assert (await scheduler.plan(keys)).tiers == ("redis",) * 8
        assert scheduler.planner.estimate("redis", local=False).reads == 0
        loaded = await worker.get_many(keys)
        assert [int(chunk[0, 0, 0, 0, 0]) for chunk in loaded] == list(range(8))  # type: ignore[index]
        for _ in range(100):  # a bound, not a timing: the rate arrives at the second exchange or so
            await asyncio.sleep(0.2)
            await scheduler.plan(keys)
            if scheduler.planner.estimate("redis", local=False).reads:
                break
        mine, borrowed = worker.planner.estimate("redis", local=False), scheduler.planner.estimate("redis", False)
        assert borrowed.reads == mine.reads > 0 and borrowed.borrowed and not mine.borrowed
        assert borrowed.bytes_per_s == pytest.approx(mine.bytes_per_s)


@pytest.mark.parametrize(
    "content",
    [
        "not json",
        json.dumps({"format": "something-else/9", "prefill_rates": [1e9]}),
        json.dumps({"format": "kvstore-planner/1", "prefill_rates": [-1, "x", None, float("inf")], "tiers": []}),
        json.dumps(
            {
                "format": "kvstore-planner/1",
                "tiers": {"disk": {"latency_s": 0, "bytes_per_s": "fast", "reads": 1, "at": 1}, "redis": 3},
            }
        ),
    ],
)
async def test_a_foreign_or_corrupt_state_file_is_ignored_and_written_anew(tmp_path, content, caplog):
    path = state_path(tmp_path / "state", NAMESPACE, LAYOUT.fingerprint)
    path.parent.mkdir(mode=0o700)
    path.write_text(content)
    async with KVStore(config(tmp_path), LAYOUT, NAMESPACE) as store:
        assert store.planner.prefill_tokens_per_s is None
        assert store.planner.estimate("disk").reads == 0
        store.planner.observe_prefill(100, 1.0)
        store.planner.observe_prefill(100, 1.0)
    assert json.loads(path.read_text())["prefill_rates"] == [100.0, 100.0]


async def test_state_dir_null_keeps_the_rates_in_memory(tmp_path):
    off = config(tmp_path)
    off.planner.state_dir = None
    async with KVStore(off, LAYOUT, NAMESPACE) as store:
        store.planner.observe_prefill(100, 1.0)
        store.planner.observe_prefill(100, 1.0)
    assert not (tmp_path / "state").exists()
    assert StoreConfig.load(planner={"state_dir": ""}).planner.state_dir is None


def test_the_default_state_dir_is_the_user_s_state_directory(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path))
    assert StoreConfig().planner.state_dir == tmp_path / "kvstore" / "planner"
    monkeypatch.delenv("XDG_STATE_HOME")
    assert StoreConfig().planner.state_dir == Path.home() / ".local" / "state" / "kvstore" / "planner"
