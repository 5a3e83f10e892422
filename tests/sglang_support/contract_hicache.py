"""kvstore's SGLang HiCache backend against SGLang's real interface and host pools (run in .venv-sglang).

Every backend is built as SGLang builds one: ``StorageBackendFactory.create_backend("dynamic", ...)``
with ``backend_name``/``module_path``/``class_name`` in the extra config, then
``register_mem_pool_host`` with the host pool. The pools are SGLang's own, on the CPU:
``MHATokenToKVPool`` / ``MLATokenToKVPool`` and their host pools, tiny (3 layers, 2 heads of 8,
pages of 4 tokens). A "fresh" backend has a store of its own (an empty DRAM tier) on the same
disk directory: what a restarted SGLang, or another rank, sees. Run by tests/test_sglang.py.
"""

from __future__ import annotations

import time
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory
from sglang.srt.observability.metrics_collector import StorageMetrics

from kvstore.connectors.sglang import KVStoreHiCacheStorage
from kvstore.errors import ConfigError
from kvstore.testing.servers import RedisServer

PAGE, LAYERS, HEADS, HEAD_DIM, DEVICE_TOKENS = 4, 3, 2, 8, 64
LAYOUTS = ("layer_first", "page_first", "page_first_direct")


def device_pool(mla: bool = False) -> Any:
    if mla:
        return MLATokenToKVPool(
            size=DEVICE_TOKENS, page_size=PAGE, dtype=torch.bfloat16, kv_lora_rank=16, qk_rope_head_dim=8,
            layer_num=LAYERS, device="cpu", enable_memory_saver=False,
        )  # fmt: skip
    return MHATokenToKVPool(
        size=DEVICE_TOKENS, page_size=PAGE, dtype=torch.bfloat16, head_num=HEADS, head_dim=HEAD_DIM,
        layer_num=LAYERS, device="cpu", enable_memory_saver=False,
    )  # fmt: skip


def host_pool(layout: str = "layer_first", mla: bool = False, seed: int | None = 0) -> Any:
    """SGLang's host pool for a tiny device pool (132 tokens: 33 pages), filled with random KV (``seed``) or zeros."""
    common = dict(
        host_to_device_ratio=2.0, host_size=0, page_size=PAGE, layout=layout, pin_memory=False, device="cpu",
        device_capacity_tokens=DEVICE_TOKENS, start_layer=0, end_layer=LAYERS,
    )  # fmt: skip
    if mla:
        pool = MLATokenToKVPoolHost(device_pool(True)._mla_buffer_info(), target_layer_num=LAYERS, **common)
    else:
        pool = MHATokenToKVPoolHost(device_pool()._mha_buffer_info(), **common)
    if seed is None:
        pool.kv_buffer.zero_()
    else:
        generator = torch.Generator().manual_seed(seed)
        pool.kv_buffer.copy_(torch.randn(pool.kv_buffer.shape, generator=generator).to(pool.kv_buffer.dtype))
    return pool


def storage_config(
    extra: dict[str, Any], model: str = "tiny-model", tp_rank: int = 0, tp_size: int = 1, mla: bool = False
) -> HiCacheStorageConfig:
    return HiCacheStorageConfig(
        tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
        is_mla_model=mla, enable_storage_metrics=True, is_page_first_layout=False, model_name=model,
        extra_config=extra,
    )  # fmt: skip


def extra_config(disk: Path, **more: Any) -> dict[str, Any]:
    """What a user passes in --hicache-storage-backend-extra-config."""
    return {
        "backend_name": "kvstore",
        "module_path": "kvstore.connectors.sglang",
        "class_name": "KVStoreHiCacheStorage",
        "interface_v1": 1,
        "kvstore_config": {"dram": {"capacity": "1MiB", "pin_memory": "never"}, "disk": {"path": str(disk)}},
        **more,
    }


OPENED: list[KVStoreHiCacheStorage] = []


def backend(disk: Path, pool: Any, extra: dict[str, Any] | None = None, **config: Any) -> KVStoreHiCacheStorage:
    """A backend as SGLang's cache controller makes one (attach_storage_backend)."""
    extra = extra or extra_config(disk)
    made = StorageBackendFactory.create_backend("dynamic", storage_config(extra, **config), pool)
    made.register_mem_pool_host(pool)
    assert isinstance(made, KVStoreHiCacheStorage)
    OPENED.append(made)
    return made


@pytest.fixture(autouse=True)
def close_backends() -> Any:
    yield
    while OPENED:
        OPENED.pop().close()


def page_keys(count: int) -> list[str]:
    """SGLang-style page names: chained SHA-256 hex, one per page."""
    return [uuid.uuid4().hex * 2 for _ in range(count)]


def indices(pages: list[int]) -> torch.Tensor:
    """Host token indices of ``pages`` (page numbers), as SGLang hands them over."""
    return torch.cat([torch.arange(page * PAGE, (page + 1) * PAGE, dtype=torch.int64) for page in pages])


def kv_order(pool: Any, page: int) -> torch.Tensor:
    """Page ``page`` as SGLang's own ``get_data_page`` sees it, in one order for every layout:
    MHA ``[2, layers, tokens, heads, dim]``, MLA ``[layers, tokens, 1, dim]``; the raw bits (uint16)."""
    data = pool.get_data_page(page * PAGE, flat=False)
    mla = isinstance(pool, MLATokenToKVPoolHost)
    if pool.layout == "page_first":
        data = data.transpose(0, 1) if mla else data.transpose(1, 2)
    elif pool.layout == "page_first_direct":
        data = data[0] if mla else data[:, 0]
    return data.contiguous().view(torch.int16)


def assert_same_pages(source: Any, source_pages: list[int], target: Any, target_pages: list[int]) -> None:
    for a, b in zip(source_pages, target_pages, strict=True):
        assert torch.equal(kv_order(source, a), kv_order(target, b)), f"page {a} read back into page {b} differs"


@pytest.mark.parametrize("write_layout", LAYOUTS)
def test_pages_round_trip_byte_exact_through_dram_and_disk(tmp_path: Path, write_layout: str) -> None:
    """Pages written from one host pool read back, byte for byte, into other pages of a fresh pool: from the
    writer's DRAM tier, and from disk by a fresh backend whose pool has another layout (chunks are canonical)."""
    source = host_pool(write_layout, seed=1)
    writer = backend(tmp_path, source)
    keys = page_keys(4)
    assert writer.batch_set_v1(keys, indices([5, 2, 9, 7])) == [True] * 4
    assert writer.batch_get_v1(keys, indices([20, 21, 22, 23])) == [True] * 4  # from the writer's DRAM tier
    assert_same_pages(source, [5, 2, 9, 7], source, [20, 21, 22, 23])
    assert writer.store.stats()["store"]["hits"] == 4
    same = host_pool(write_layout, seed=None)
    reader_same = backend(tmp_path, same)
    writer.store.flush()
    assert reader_same.batch_get_v1(keys, indices([10, 11, 12, 13])) == [True] * 4
    assert_same_pages(source, [5, 2, 9, 7], same, [10, 11, 12, 13])
    for read_layout in LAYOUTS:
        target = host_pool(read_layout, seed=None)
        reader = backend(tmp_path, target)
        assert reader.batch_get_v1(keys, indices([30, 0, 31, 4])) == [True] * 4
        assert_same_pages(source, [5, 2, 9, 7], target, [30, 0, 31, 4])
        assert reader.store.stats()["store"]["hits"] == 4


def test_batch_exists_counts_the_leading_run_of_stored_pages(tmp_path: Path) -> None:
    pool = host_pool()
    writer = backend(tmp_path, pool)
    keys = page_keys(4)
    assert writer.batch_set_v1(keys[:2], indices([0, 1])) == [True, True]
    assert writer.batch_set_v1(keys[3:], indices([3])) == [True]
    assert writer.batch_exists(keys) == 2
    assert writer.batch_exists(keys[3:]) == 1
    assert writer.batch_exists(keys[2:]) == 0
    writer.store.flush()
    assert backend(tmp_path, host_pool()).batch_exists(keys) == 2  # from disk


def test_a_stored_page_is_not_written_again(tmp_path: Path) -> None:
    writer = backend(tmp_path, host_pool())
    keys = page_keys(3)
    assert writer.batch_set_v1(keys[:2], indices([0, 1])) == [True, True]
    assert writer.batch_set_v1(keys, indices([0, 1, 2])) == [True] * 3
    assert writer.store.stats()["store"]["puts"] == 3


def test_another_model_or_tensor_parallel_rank_does_not_see_the_pages(tmp_path: Path) -> None:
    pool = host_pool()
    keys = page_keys(3)
    writer = backend(tmp_path, pool, tp_rank=0, tp_size=2)
    assert writer.batch_set_v1(keys, indices([0, 1, 2])) == [True] * 3
    writer.store.flush()
    assert backend(tmp_path, host_pool(seed=None), tp_rank=0, tp_size=2).batch_exists(keys) == 3
    for other in ({"model": "other-model", "tp_rank": 0, "tp_size": 2}, {"tp_rank": 1, "tp_size": 2}, {}):
        reader = backend(tmp_path, host_pool(seed=None), **other)
        assert reader.batch_exists(keys) == 0, other
        assert reader.batch_get_v1(keys, indices([0, 1, 2])) == [False] * 3, other


def test_mla_rank_1_writes_nothing_and_reads_rank_0s_pages(tmp_path: Path) -> None:
    keys = page_keys(3)
    rank1_source = host_pool(mla=True, seed=2)
    rank1 = backend(tmp_path, rank1_source, mla=True, tp_rank=1, tp_size=2)
    assert rank1.batch_set_v1(keys, indices([0, 1, 2])) == [True] * 3  # success, as SGLang expects
    rank1.close()
    assert not [path for path in tmp_path.rglob("*") if path.is_file()]
    assert backend(tmp_path, host_pool(mla=True, seed=None), mla=True).batch_exists(keys) == 0

    source = host_pool(mla=True, seed=3)
    rank0 = backend(tmp_path, source, mla=True, tp_rank=0, tp_size=2)
    assert rank0.batch_set_v1(keys, indices([4, 5, 6])) == [True] * 3
    rank0.store.flush()
    target = host_pool("page_first", mla=True, seed=None)
    reader = backend(tmp_path, target, mla=True, tp_rank=1, tp_size=2)
    assert reader.batch_exists(keys) == 3
    assert reader.batch_get_v1(keys, indices([7, 8, 9])) == [True] * 3
    assert_same_pages(source, [4, 5, 6], target, [7, 8, 9])


def test_a_corrupt_stored_chunk_is_a_miss_not_wrong_kv(tmp_path: Path) -> None:
    source = host_pool(seed=4)
    keys = page_keys(2)
    writer = backend(tmp_path, source)
    assert writer.batch_set_v1(keys, indices([0, 1])) == [True, True]
    writer.close()
    files = [path for path in tmp_path.rglob("*") if path.is_file()]
    assert len(files) == 2
    for path in files:  # one bit of KV flipped in each chunk file
        data = bytearray(path.read_bytes())
        data[-100] ^= 0x01
        path.write_bytes(bytes(data))
    target = host_pool(seed=None)
    reader = backend(tmp_path, target)
    assert reader.batch_get_v1(keys, indices([2, 3])) == [False, False]
    disk = reader.store.stats()["disk"]
    assert disk["corrupt"] == 2, disk


def test_a_frozen_tier_is_a_miss_within_the_timeout_not_a_hang(tmp_path: Path) -> None:
    """Redis as the only tier below DRAM, frozen (SIGSTOP) under a fresh backend: its lookup and reads end as
    misses, counted as the tier's timeouts (the subprocess's own timeout guards against a hang)."""
    server = RedisServer().start()
    try:
        extra = extra_config(tmp_path)
        extra["kvstore_config"] = {
            "dram": {"capacity": "1MiB", "pin_memory": "never"},
            "disk": {"enabled": False},
            "redis": {"enabled": True, "url": server.url, "connect_timeout": 0.5},
            "timeouts": {"get": 0.3, "put": 2.0, "close": 1.0},
        }
        keys = page_keys(3)
        writer = backend(tmp_path, host_pool(), extra)
        assert writer.batch_set_v1(keys, indices([0, 1, 2])) == [True] * 3
        writer.close()
        reader = backend(tmp_path, host_pool(seed=None), extra)
        assert reader.batch_exists(keys) == 3  # the tier answers
        server.pause()
        try:
            assert reader.batch_exists(keys) == 0
            assert reader.batch_get_v1(keys, indices([3, 4, 5])) == [False] * 3
            assert reader.store.stats()["redis"]["timeouts"] >= 2
        finally:
            server.resume()
    finally:
        server.close()


def test_get_stats_gives_sglangs_metrics_and_kvstores_counters(tmp_path: Path) -> None:
    made = backend(tmp_path, host_pool())
    keys = page_keys(3)
    made.batch_set_v1(keys, indices([0, 1, 2]))
    assert made.batch_get_v1(keys + page_keys(1), indices([3, 4, 5, 6])) == [True, True, True, False]
    stats = made.get_stats()
    assert isinstance(stats, StorageMetrics)
    assert (stats.backup_pgs, stats.prefetch_pgs) == ([3], [3])
    assert stats.kvstore["store"]["hits"] == 3 and stats.kvstore["store"]["misses"] == 1
    assert made.get_stats().prefetch_pgs == []  # since the last call


def test_a_misspelled_option_names_itself_and_the_fix(tmp_path: Path) -> None:
    extra = extra_config(tmp_path)
    extra["kvstore_confg"] = extra.pop("kvstore_config")
    with pytest.raises(ConfigError, match=r"'kvstore_confg'.*did you mean 'kvstore_config'"):
        StorageBackendFactory.create_backend("dynamic", storage_config(extra), host_pool())
    extra = extra_config(tmp_path)
    extra["kvstore_config"]["dram"]["capasity"] = "1MiB"
    with pytest.raises(ConfigError, match="capasity"):
        StorageBackendFactory.create_backend("dynamic", storage_config(extra), host_pool())


def test_an_unsupported_host_layout_is_refused_by_name(tmp_path: Path) -> None:
    made = StorageBackendFactory.create_backend("dynamic", storage_config(extra_config(tmp_path)), None)
    with pytest.raises(ValueError, match=r"'page_head'.*layer_first, page_first, page_first_direct"):
        made.register_mem_pool_host(host_pool("page_head", seed=None))


def test_the_interfaces_not_served_say_why(tmp_path: Path) -> None:
    made = backend(tmp_path, host_pool())
    with pytest.raises(NotImplementedError, match='"interface_v1": 1'):
        made.batch_get(page_keys(1), [torch.zeros(8)])
    with pytest.raises(NotImplementedError, match="sidecar pools"):
        made.batch_exists_v2(page_keys(1), [])


def test_with_events_on_only_the_first_rank_publishes_pages_by_sglangs_hashes(tmp_path: Path) -> None:
    """Two TP ranks with one events endpoint: rank 1 opens no socket (it would take rank 0's port);
    rank 0 advertises each page by SGLang's own page hash, parent linked (a router's replay shows it)."""
    import socket

    import zmq

    from kvstore.events.wire import decode_batch

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    extra = extra_config(tmp_path)
    extra["kvstore_config"]["events"] = {
        "enabled": True, "endpoint": f"tcp://*:{port}", "replay_endpoint": "tcp://127.0.0.1:*",
    }  # fmt: skip
    first = backend(tmp_path, host_pool(), extra, tp_rank=0, tp_size=2)
    second = backend(tmp_path / "rank1", host_pool(), extra, tp_rank=1, tp_size=2)  # a second bind would fail
    assert not second.store.publishes_events
    keys = page_keys(2)
    assert first.batch_set_v1(keys, indices([0, 1])) == [True, True]
    publisher = first.store._store.events.publisher
    deadline = time.monotonic() + 30  # a bound, not an expectation
    while publisher.batches == 0 and time.monotonic() < deadline:
        time.sleep(0.005)
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.connect(publisher.replay_endpoint)
    dealer.send_multipart((b"", (0).to_bytes(8, "big")))
    stored, topics = [], set()
    while True:
        assert dealer.poll(30_000)
        _, topic, seq, payload = dealer.recv_multipart()
        if seq == (-1).to_bytes(8, "big", signed=True):
            break
        topics.add(topic)
        stored += [event for event in decode_batch(payload).events if event.medium == "CPU"]
    dealer.close(linger=0)
    assert len(topics) == 1 and topics.pop().endswith(b"@tiny-model")  # SGLang's model name
    assert [(e.block_hashes, e.parent_block_hash, e.block_size) for e in stored] == [
        ([bytes.fromhex(keys[0])], None, PAGE),
        ([bytes.fromhex(keys[1])], bytes.fromhex(keys[0]), PAGE),
    ]
