"""The vLLM connector's background loads (``WholeChunkLoads``) against a real store (vLLM's environment).

tests/test_vllm_tier.py runs this file with contract_tier.py under ``.venv-vllm/bin/python -m pytest`` (the
connector's package imports vLLM). ``start`` and ``poll`` are called as the connector calls them: ``start``
when a step's metadata names the load, ``poll`` at the end of every step, here every few milliseconds
until the load is reported. The caches are plain CPU tensors in the GPU backends' ``kv_split`` block
layout. Real engines load in the background in tests/test_vllm.py (Redis) and test_vllm_shapes.py (hybrid).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from kvstore import KVLayout, StoreConfig, SyncKVStore
from kvstore.connectors.paged import PagedLayer
from kvstore.connectors.vllm import whole_loads
from kvstore.connectors.vllm.step_metadata import BlockRun, LoadSpec
from kvstore.connectors.vllm.tensor_parallel import TensorParallelRanks
from kvstore.connectors.vllm.whole_loads import WholeChunkLoads
from kvstore.connectors.vllm.worker_context import WorkerContext
from kvstore.testing.servers import RedisServer
from kvstore.testing.slow_proxy import SlowProxy

LAYOUT = KVLayout(num_layers=4, num_kv_heads=2, head_dim=16, chunk_tokens=32, dtype=torch.float32)
BLOCK = 16  # two blocks per chunk
NO_PLANNER_FILE = {"state_dir": None}  # this file runs without tests/conftest.py: nothing goes to ~/.local/state


def chunk(seed: int) -> torch.Tensor:
    return torch.randn(LAYOUT.chunk_shape, generator=torch.Generator().manual_seed(seed)).to(LAYOUT.dtype)


def put_chunks(config: StoreConfig, count: int, skip: int | None = None) -> tuple[list[str], list[torch.Tensor]]:
    """``count`` chunks of one prompt written through a store of ``config`` (all but chunk ``skip``): keys, chunks."""
    with SyncKVStore(config, LAYOUT, "whole") as writer:
        keys = writer.chunk_keys(list(range(count * LAYOUT.chunk_tokens)))
        chunks = [chunk(i) for i in range(count)]
        kept = [i for i in range(count) if i != skip]
        assert writer.put_many([keys[i] for i in kept], [chunks[i] for i in kept]) == [True] * len(kept)
        writer.flush()
    return keys, chunks


class Worker:
    """One rank's background loads into its own paged caches, and the store it reads from."""

    def __init__(self, store: SyncKVStore, blocks: int) -> None:
        self.counters: Counter[str] = Counter()
        self.caches = [torch.zeros(blocks, LAYOUT.num_kv_heads, BLOCK, 2 * LAYOUT.head_dim) for _ in range(4)]
        layers = [PagedLayer(cache, "kv_split", LAYOUT.head_dim) for cache in self.caches]
        context = WorkerContext(LAYOUT, TensorParallelRanks(), store, layers, [0] * len(layers), self.counters)
        self.loads = WholeChunkLoads(context)

    def load(self, keys: list[str], blocks: list[int], limit_s: float = 30.0) -> tuple[list[set[str]], float]:
        """Start one load and poll as steps end until it is reported: each poll's finished set, and the seconds."""
        start = time.monotonic()
        self.loads.start(LoadSpec("req", keys, [BlockRun(0, blocks)], len(blocks) * BLOCK, background=True))
        polls: list[set[str]] = []
        while not polls or not polls[-1]:
            assert time.monotonic() - start < limit_s, f"the load was not reported within {limit_s} s"
            finished, failed = self.loads.poll()
            assert failed <= finished
            polls.append(finished)
            if failed:
                polls[-1] = {f"failed:{req}" for req in failed}
            time.sleep(0.002)
        return polls, time.monotonic() - start

    def block_rows(self, layer: int, block: int) -> torch.Tensor:
        """A block's rows as ``[planes, block_size, heads, head_dim]``."""
        return self.caches[layer][block].unflatten(-1, (2, LAYOUT.head_dim)).permute(2, 1, 0, 3)

    def holds(self, chunks: list[torch.Tensor], blocks: list[int]) -> bool:
        return all(
            torch.equal(self.block_rows(layer, block), chunks[i // 2][layer][:, (i % 2) * BLOCK : (i % 2 + 1) * BLOCK])
            for layer in range(LAYOUT.num_layers)
            for i, block in enumerate(blocks)
        )


@pytest.fixture
def disk_config(tmp_path: Path) -> StoreConfig:
    return StoreConfig(
        dram={"capacity": LAYOUT.chunk_nbytes * 32}, disk={"path": tmp_path / "disk"}, planner=NO_PLANNER_FILE
    )


@pytest.fixture(scope="module")
def redis_url() -> Iterator[str]:
    with RedisServer() as redis:
        yield redis.url


def test_a_load_reads_chunk_by_chunk_and_is_reported_once_every_layer_is_in_its_blocks(disk_config, monkeypatch):
    """Every chunk lands in its blocks exactly; the copy into the blocks is spread over steps (here one layer a
    step), and the request is reported finished only after the last layer's copy, never before."""
    keys, chunks = put_chunks(disk_config, 6)
    monkeypatch.setattr(whole_loads, "COPY_BYTES_PER_STEP", len(keys) * LAYOUT.layer_nbytes)  # one layer a step
    blocks = [13, 2, 7, 4, 11, 0, 9, 1, 3, 5, 6, 8]  # two per chunk, scattered
    with SyncKVStore(disk_config, LAYOUT, "whole") as store:
        worker = Worker(store, 16)
        polls, _ = worker.load(keys, blocks)
        copying = [finished for finished in polls if not finished]
        assert polls[-1] == {"req"} and worker.holds(chunks, blocks)
        assert len(copying) >= LAYOUT.num_layers - 1, "a layer a step: reported at the copy of the last layer"
        assert worker.counters["loaded_chunks"] == len(keys) and worker.counters["load_failures"] == 0
        assert store.stats()["store"]["gets"] == len(keys)  # each chunk read once


def test_a_chunk_missing_fails_the_load_with_no_later_chunk_read_and_no_block_written(disk_config):
    """Chunk 1 of 12 is not stored: the request is reported failed (vLLM recomputes it), nothing was copied into
    its blocks, and no more reads started than those in flight when the miss came."""
    keys, _ = put_chunks(disk_config, 12, skip=1)
    blocks = list(range(24))
    with SyncKVStore(disk_config, LAYOUT, "whole") as store:
        worker = Worker(store, 24)
        polls, _ = worker.load(keys, blocks)
        assert polls[-1] == {"failed:req"}
        assert worker.counters["load_failures"] == 1 and worker.counters["loaded_chunks"] == 0
        assert all(not cache.any() for cache in worker.caches), "a failed load writes nothing into the blocks"
        assert store.stats()["store"]["gets"] <= 2 + whole_loads.READS_IN_FLIGHT < len(keys)


def test_a_prefix_longer_on_a_slow_link_than_one_get_timeout_still_loads(redis_url):
    """A 16-chunk prefix behind a 256 kB/s link takes longer than ``timeouts.get`` (1 s) in all; each chunk's read
    has that timeout for itself, so the load succeeds (read in one ``get_many``, it timed out and was recomputed)."""
    no_disk = {"enabled": False}  # (the default is one in ~/.cache)
    write = StoreConfig(
        dram={"capacity": LAYOUT.chunk_nbytes * 32}, disk=no_disk, redis={"enabled": True, "url": redis_url}
    )
    keys, chunks = put_chunks(write, 16)
    blocks = list(range(32))
    host, port = redis_url.removeprefix("redis://").split("/")[0].split(":")
    with SlowProxy(host, int(port), total_bytes_per_s=256e3) as proxy:
        read: dict[str, Any] = {
            "dram": {"capacity": LAYOUT.chunk_nbytes * 32},
            "disk": no_disk,
            "redis": {"enabled": True, "url": f"redis://{host}:{proxy.port}/0"},
            "timeouts": {"get": 1.0},
            "planner": NO_PLANNER_FILE,
        }
        with SyncKVStore(StoreConfig(**read), LAYOUT, "whole") as store:
            worker = Worker(store, 32)
            polls, seconds = worker.load(keys, blocks)
            stored = store.stats()["redis"]
    assert polls[-1] == {"req"} and worker.holds(chunks, blocks), stored
    assert seconds > 1.0, "the premise: the prefix takes longer on the link than one timeout"
    assert worker.counters["load_failures"] == 0
