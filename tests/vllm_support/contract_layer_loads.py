"""The vLLM connector's layer loads through a ring of layer buffers, against a real store (vLLM's environment).

tests/test_vllm_tier.py runs this file with contract_tier.py under ``.venv-vllm/bin/python -m pytest`` (the
loads import vLLM's metadata types), so kvstore's own test run does not collect it. The engine's tiny test
models have two layers, too few for a ring (``kvstore_prefetch_depth + 1`` buffers); here a six-layer
layout with depth 1 streams through two buffers into a paged cache in the GPU backends' ``kv_split``
block layout (CPU tensors), called layer by layer as ``wait_for_layer_load`` calls it.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import torch

from kvstore import KVLayout, StoreConfig, SyncKVStore
from kvstore.connectors.paged import PagedLayer
from kvstore.connectors.vllm.layer_loads import LayerStreamLoads
from kvstore.connectors.vllm.step_metadata import BlockRun, LoadSpec
from kvstore.connectors.vllm.tensor_parallel import TensorParallelRanks
from kvstore.connectors.vllm.worker_context import WorkerContext
from kvstore.storage.container import parse_header

LAYOUT = KVLayout(num_layers=6, num_kv_heads=2, head_dim=16, chunk_tokens=32, dtype=torch.float32)
BLOCK = 16  # two blocks per chunk
CHUNKS = 3


def chunk(seed: int) -> torch.Tensor:
    return torch.randn(LAYOUT.chunk_shape, generator=torch.Generator().manual_seed(seed)).to(LAYOUT.dtype)


def store_on_disk(tmp_path: Path) -> tuple[SyncKVStore, list[str], list[torch.Tensor]]:
    """A store whose three chunks are on its disk tier only (DRAM emptied): every layer is read from files."""
    config = StoreConfig(dram={"capacity": LAYOUT.chunk_nbytes * 16}, disk={"path": tmp_path / "disk"})
    store = SyncKVStore(config, LAYOUT, "ring")
    keys = store.chunk_keys(list(range(CHUNKS * LAYOUT.chunk_tokens)))
    chunks = [chunk(i) for i in range(CHUNKS)]
    assert store.put_many(keys, chunks) == [True] * CHUNKS
    store.flush()
    for key in keys:
        store._store.pool.discard(key)
    return store, keys, chunks


def load_all_layers(
    store: SyncKVStore, keys: list[str], blocks: list[int], device: str = "cpu"
) -> tuple[list[torch.Tensor], Counter[str], set[int]]:
    """One load of ``keys`` into ``blocks``, taken layer by layer as the forward pass takes it: the caches,
    the counters, the blocks reported failed. ``device``: where the ring's buffers are asked for."""
    counters: Counter[str] = Counter()
    worker = WorkerContext(LAYOUT, TensorParallelRanks(), store, [], [], counters)
    loads = LayerStreamLoads(worker, LAYOUT.chunk_tokens, BLOCK, 1, 30.0)
    loads.device = torch.device(device)
    caches = [torch.zeros(16, LAYOUT.num_kv_heads, BLOCK, 2 * LAYOUT.head_dim) for _ in range(LAYOUT.num_layers)]
    loads.start(LoadSpec("req", keys, [BlockRun(0, blocks)], len(blocks) * BLOCK))
    assert loads._loads[0].stream._stream.ring == 2, "depth 1: a ring of two layer buffers"
    for index, cache in enumerate(caches):
        loads.load_layer(index, PagedLayer(cache, "kv_split", LAYOUT.head_dim))
    loads.end_step()
    return caches, counters, loads.take_failed_blocks()


def block_rows(cache: torch.Tensor, block: int) -> torch.Tensor:
    """A block's rows as ``[planes, block_size, heads, head_dim]``."""
    return cache[block].unflatten(-1, (2, LAYOUT.head_dim)).permute(2, 1, 0, 3)


def test_every_layer_lands_in_its_blocks_through_a_ring_of_two(tmp_path):
    store, keys, chunks = store_on_disk(tmp_path)
    blocks = [9, 2, 7, 4, 11, 0]  # two per chunk, scattered
    with store:
        caches, counters, failed = load_all_layers(store, keys, blocks)
    assert not failed and counters["loaded_chunks"] == CHUNKS
    for layer, cache in enumerate(caches):
        for index, block in enumerate(blocks):
            source = chunks[index // 2][layer][:, (index % 2) * BLOCK : (index % 2 + 1) * BLOCK]
            assert torch.equal(block_rows(cache, block), source), f"layer {layer}, block {block}"


def test_a_chunk_corrupt_at_layer_three_is_recomputed_and_the_chunks_before_it_kept(tmp_path):
    """The stream restarts at layer 3 with the sound chunks: its ring lets layers 0-2 through unread."""
    store, keys, chunks = store_on_disk(tmp_path)
    path = store._store.tiers[0].backend.path_for(keys[2])
    data = bytearray(path.read_bytes())
    header = parse_header(data, LAYOUT, keys[2])
    data[header.header_len + header.segments[3].offset + 7] ^= 0x10
    path.write_bytes(bytes(data))
    blocks = [9, 2, 7, 4, 11, 0]
    with store:
        caches, counters, failed = load_all_layers(store, keys, blocks)
    assert failed == {11, 0} and counters["partial_loads"] == 1 and counters["loaded_chunks"] == 2
    for layer, cache in enumerate(caches):
        for index, block in enumerate(blocks[:4]):
            source = chunks[index // 2][layer][:, (index % 2) * BLOCK : (index % 2 + 1) * BLOCK]
            assert torch.equal(block_rows(cache, block), source), f"layer {layer}, block {block}"


def test_a_load_the_gpu_has_no_memory_for_goes_through_host_memory(tmp_path, monkeypatch):
    """vLLM holds the GPU's memory: a ring that cannot be had there is made in host memory, and counted."""
    empty = torch.empty

    def no_device_memory(*shape, device=None, **kwargs):
        if device is not None and torch.device(device).type == "cuda":
            raise torch.OutOfMemoryError("CUDA out of memory (a test's)")
        return empty(*shape, **kwargs)

    monkeypatch.setattr(torch, "empty", no_device_memory)
    store, keys, chunks = store_on_disk(tmp_path)
    with store:
        caches, counters, failed = load_all_layers(store, keys, [3, 1, 5, 0, 2, 4], device="cuda")
    assert not failed and counters["host_ring_loads"] == 1 and counters["loaded_chunks"] == CHUNKS
    assert torch.equal(block_rows(caches[5], 4), chunks[2][5][:, BLOCK:])
