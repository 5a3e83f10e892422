"""KVStoreTier against the SecondaryTierManager contract, call by call (run with vLLM's environment).

tests/test_vllm_tier.py runs this file with ``.venv-vllm/bin/python -m pytest``: it needs vLLM to import
the tier, so kvstore's own test run does not collect it. The primary tier's buffer is a plain
array shaped like vLLM's (chunks x row bytes); every call is made as vLLM's scheduler makes it.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from vllm.v1.kv_offload.base import LookupResult, ReqContext
from vllm.v1.kv_offload.tiering.base import TransferJob

from kvstore.connectors.vllm import KVStoreTier
from kvstore.errors import ConfigError

LAYERS, TOKENS, WIDTH = 2, 256, 64  # float32: 2 x 2 x 256 x 64 x 4 = 256 KiB per chunk
CHUNK_BYTES = LAYERS * 2 * TOKENS * WIDTH * 4
ROWS = 6


def spec(
    kv_cache_layout: str = "LBHNC",
    model: str = "tiny",
    tp: int = 1,
    pp: int = 1,
    canonical_layout: bool = False,
    heads_split: bool = True,
    dcp: int = 1,
    dtype: str = "float32",
) -> SimpleNamespace:
    """An OffloadingSpec as the tier reads it; ``heads_split``: each rank holds its own KV heads."""
    parallel = SimpleNamespace(
        rank=0, world_size=tp * pp * dcp, tp_size=tp, pp_size=pp, pcp_size=1, dcp_size=dcp,
        is_parallelism_agnostic=heads_split,
    )  # fmt: skip
    config = SimpleNamespace(
        model=SimpleNamespace(name=model, dtype=dtype),
        kv_cache_layout=kv_cache_layout,
        canonical_layout=canonical_layout,
        groups=(SimpleNamespace(layer_names=("l0", "l1"), tokens_per_block=128, group_id=0),),
        cache=SimpleNamespace(blocks_per_chunk=2, tokens_per_hash=128),
        worker_kv_bytes_per_block=CHUNK_BYTES // 2 // tp,  # a worker's pages of one block: its heads only
        parallel=parallel,
    )
    return SimpleNamespace(config=config, replicated_layout=False)


@pytest.fixture
def primary() -> np.ndarray:
    rows = np.zeros((ROWS, CHUNK_BYTES + 4096), dtype=np.int8)  # rows are padded, as vLLM's are
    rows[:, :CHUNK_BYTES] = np.random.default_rng(0).integers(-128, 127, (ROWS, CHUNK_BYTES), dtype=np.int8)
    return rows


@pytest.fixture
def tier(primary: np.ndarray, tmp_path: Path):
    config = {"dram": {"capacity": "4MiB"}, "disk": {"path": str(tmp_path / "disk")}}
    made = KVStoreTier(spec(), memoryview(primary), "KVStoreTier", kvstore_config=config)
    yield made
    made.shutdown()


def key(n: int) -> bytes:
    return bytes([n]) * 32 + (0).to_bytes(4, "big")


def job(job_id: int, keys: list[bytes], rows: list[int], promotion: bool) -> TransferJob:
    return TransferJob(job_id, keys, np.array(rows), promotion, ReqContext(req_id="r"))


def finish(tier: KVStoreTier, timeout: float = 10) -> list:
    """Poll as the scheduler does, once per 'step', until a result comes."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        results = list(tier.get_finished_jobs())
        if results:
            return results
        time.sleep(0.001)
    raise AssertionError("no job finished")


def resolve(tier: KVStoreTier, k: bytes) -> LookupResult:
    context = ReqContext(req_id="r")
    for _ in range(10_000):
        answer = tier.lookup(k, context)
        if answer is not LookupResult.RETRY:
            return answer
        time.sleep(0.001)
    raise AssertionError("lookup never resolved")


def test_a_lookup_answers_retry_until_kvstore_has_answered(tier):
    assert tier.lookup(key(1), ReqContext(req_id="r")) is LookupResult.RETRY  # never waits on I/O
    assert resolve(tier, key(1)) is LookupResult.MISS


def test_a_stored_chunk_is_pending_until_reported_then_loads_back_byte_exact(tier, primary):
    tier.submit_store(job(1, [key(1), key(2)], [0, 1], promotion=False))
    assert tier.has_pending_work()
    tier.drain_jobs()
    [stored] = finish(tier)
    assert stored.job_id == 1 and stored.success and stored.transfer_bytes == 2 * CHUNK_BYTES
    assert not tier.has_pending_work()
    assert resolve(tier, key(2)) is LookupResult.HIT
    tier.submit_load(job(2, [key(2), key(1)], [4, 5], promotion=True))
    [loaded] = finish(tier)
    assert loaded.success and loaded.successful_keys is None
    assert np.array_equal(primary[4, :CHUNK_BYTES], primary[1, :CHUNK_BYTES])
    assert np.array_equal(primary[5, :CHUNK_BYTES], primary[0, :CHUNK_BYTES])
    assert not primary[4, CHUNK_BYTES:].any()  # the row's padding is left alone


def test_a_partial_promotion_reports_the_keys_that_loaded_and_misses_the_rest_from_then_on(tier, primary):
    tier.submit_store(job(1, [key(1)], [0], promotion=False))
    finish(tier)
    before = primary[3].copy()
    tier.submit_load(job(2, [key(1), key(9)], [2, 3], promotion=True))
    [result] = finish(tier)
    assert not result.success and set(result.successful_keys) == {key(1)}
    assert np.array_equal(primary[2, :CHUNK_BYTES], primary[0, :CHUNK_BYTES])
    assert np.array_equal(primary[3], before)  # nothing written for the key that failed
    assert tier.lookup(key(9), ReqContext(req_id="r")) is LookupResult.MISS  # no promotion loop
    assert tier.stats()["tier"]["partial_loads"] == 1


def test_chunks_survive_a_new_tier_on_the_same_disk(primary, tmp_path):
    config = {"dram": {"capacity": "4MiB"}, "disk": {"path": str(tmp_path / "disk")}}
    first = KVStoreTier(spec(), memoryview(primary), "KVStoreTier", kvstore_config=config)
    first.submit_store(job(1, [key(7)], [0], promotion=False))
    finish(first)
    first.shutdown()  # flushes kvstore's writes
    second = KVStoreTier(spec(), memoryview(primary), "KVStoreTier", kvstore_config=config)
    try:
        assert resolve(second, key(7)) is LookupResult.HIT
        second.submit_load(job(2, [key(7)], [5], promotion=True))
        [result] = finish(second)
        assert result.success and np.array_equal(primary[5, :CHUNK_BYTES], primary[0, :CHUNK_BYTES])
    finally:
        second.shutdown()


@pytest.mark.parametrize("other", [{"kvstore_namespace": "b"}, {"kv_cache_layout": "LBNHC"}])
def test_another_namespace_or_block_layout_sees_none_of_the_chunks(primary, tmp_path, other):
    disk = {"path": str(tmp_path / "disk")}
    first = KVStoreTier(spec(), memoryview(primary), "KVStoreTier", kvstore_config={"disk": disk})
    first.submit_store(job(1, [key(7)], [0], promotion=False))
    finish(first)
    first.shutdown()
    layout = other.get("kv_cache_layout", "LBHNC")
    options = {name: value for name, value in other.items() if name.startswith("kvstore")}
    second = KVStoreTier(spec(layout), memoryview(primary), "KVStoreTier", kvstore_config={"disk": disk}, **options)
    try:
        assert resolve(second, key(7)) is LookupResult.MISS
    finally:
        second.shutdown()


def test_weights_swapped_at_the_models_path_see_none_of_the_chunks(primary, tmp_path, monkeypatch):
    """The tier's default namespace names the weights' bytes, not only the path."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "model.safetensors").write_bytes(b"W1" * 1000)
    disk = {"path": str(tmp_path / "disk")}
    first = KVStoreTier(spec(model=str(model)), memoryview(primary), "KVStoreTier", kvstore_config={"disk": disk})
    first.submit_store(job(1, [key(7)], [0], promotion=False))
    finish(first)
    first.shutdown()
    (model / "model.safetensors").write_bytes(b"W2" * 1000)  # the same size, other values
    second = KVStoreTier(spec(model=str(model)), memoryview(primary), "KVStoreTier", kvstore_config={"disk": disk})
    try:
        assert resolve(second, key(7)) is LookupResult.MISS
    finally:
        second.shutdown()


def test_a_row_written_at_tp2_loads_at_tp1_in_tp1_order_and_the_reverse(tmp_path):
    """vLLM's direct layout at TP=2 is rank-major (rank 0's pages of every layer and block, then
    rank 1's); the tier stores it in TP-1 order (each page: rank 0's heads, then rank 1's), the
    bytes and key a TP=1 engine has, and splits it back on load."""
    pages, ranks = LAYERS * 2, 2  # layers x blocks_per_chunk; CPU pages are head-major: [heads, tokens, K|V]
    tp1 = np.random.default_rng(1).integers(-128, 127, CHUNK_BYTES, dtype=np.int8)
    rank_major = tp1.reshape(pages, ranks, -1).transpose(1, 0, 2).reshape(-1)
    assert not np.array_equal(rank_major, tp1)
    at_tp1 = np.zeros((ROWS, CHUNK_BYTES + 4096), dtype=np.int8)
    at_tp2 = np.zeros_like(at_tp1)
    at_tp1[0, :CHUNK_BYTES], at_tp2[0, :CHUNK_BYTES] = tp1, rank_major
    config = {"dram": {"capacity": "4MiB"}, "disk": {"path": str(tmp_path / "disk")}}

    def tier(tp: int) -> KVStoreTier:
        return KVStoreTier(spec(tp=tp), memoryview(at_tp2 if tp == 2 else at_tp1), "KVStoreTier", kvstore_config=config)

    writer = tier(2)
    writer.submit_store(job(1, [key(7)], [0], promotion=False))
    assert finish(writer)[0].success
    writer.shutdown()
    reader = tier(1)
    try:
        assert resolve(reader, key(7)) is LookupResult.HIT  # one key for both degrees
        reader.submit_load(job(2, [key(7)], [3], promotion=True))
        assert finish(reader)[0].success and np.array_equal(at_tp1[3, :CHUNK_BYTES], tp1)
        reader.submit_store(job(3, [key(8)], [0], promotion=False))
        assert finish(reader)[0].success
    finally:
        reader.shutdown()
    writer = tier(2)
    try:
        writer.submit_load(job(4, [key(8)], [5], promotion=True))
        assert finish(writer)[0].success and np.array_equal(at_tp2[5, :CHUNK_BYTES], rank_major)
        assert not at_tp2[5, CHUNK_BYTES:].any()  # the row's padding is left alone
    finally:
        writer.shutdown()


@pytest.mark.parametrize(
    ("parallelism", "refusal"),
    [
        (
            {"tp": 1, "pp": 2},
            r"pipeline parallelism \(pipeline_parallel_size=2\).*tensor parallelism \(tensor_parallel",
        ),
        ({"dcp": 2}, r"context parallelism \(prefill_context_parallel_size=1, decode_context_parallel_size=2\)"),
        ({"tp": 2, "kv_cache_layout": "LBNHC"}, r"LBNHC are not head-major\); add \"canonical_layout\": true"),
        ({"tp": 2, "heads_split": False}, r"own KV heads.*add \"canonical_layout\": true"),
        ({"tp": 2, "heads_split": False, "canonical_layout": True}, r"not lay this model's KV out in TP-1 order"),
    ],
)
def test_parallelism_whose_rows_cannot_be_stored_in_tp1_order_is_refused_with_the_alternative(
    primary, parallelism, refusal
):
    with pytest.raises(ConfigError, match=refusal):
        KVStoreTier(spec(**parallelism), memoryview(primary), "KVStoreTier", kvstore_config={})


def test_an_fp8_cache_whose_cpu_kernels_the_tier_cannot_tell_is_refused(primary, monkeypatch):
    """On a CPU, fp8 blocks are laid out by AMX kernels for a bfloat16 model and by the portable
    ones otherwise: a tier that cannot see the engine's model dtype (here: no engine at all)
    refuses rather than risk reading one layout as the other; on a CPU without AVX-512 or AMX
    it refuses first for the missing kernels. Both CPU kinds are simulated, so the test asserts
    the same on an AMX Xeon and an AVX2-only EPYC. Other KV dtypes are refused by name."""
    import torch

    monkeypatch.setattr(torch.cpu, "_is_avx512_supported", lambda: True)  # a CPU with vLLM's fp8 KV kernels
    with pytest.raises(ConfigError, match=r"cannot tell which CPU kernels lay out this engine's fp8 KV blocks"):
        KVStoreTier(spec(dtype="fp8"), memoryview(primary), "KVStoreTier", kvstore_config={})
    monkeypatch.setattr(torch.cpu, "_is_avx512_supported", lambda: False)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    with pytest.raises(ConfigError, match=r"'fp8' needs, on a CPU, x86 with AVX-512 or AMX"):
        KVStoreTier(spec(dtype="fp8"), memoryview(primary), "KVStoreTier", kvstore_config={})
    with pytest.raises(ConfigError, match=r"KVStoreTier cannot store kv_cache_dtype 'int8'"):
        KVStoreTier(spec(dtype="int8"), memoryview(primary), "KVStoreTier", kvstore_config={})


def test_a_closed_store_fails_jobs_and_misses_lookups_without_raising(tier):
    tier.store.close()
    tier.submit_load(job(3, [key(1)], [0], promotion=True))
    [result] = finish(tier)
    assert not result.success
    assert tier.lookup(key(4), ReqContext(req_id="r")) is LookupResult.MISS


def test_a_misspelled_option_is_refused_with_its_name(primary):
    with pytest.raises(ConfigError, match="kvstore_confg"):
        KVStoreTier(spec(), memoryview(primary), "KVStoreTier", kvstore_confg={})
    with pytest.raises(ConfigError, match="dram.capcity"):
        KVStoreTier(spec(), memoryview(primary), "KVStoreTier", kvstore_config={"dram": {"capcity": "1GiB"}})
    with pytest.raises(ConfigError, match=r"'kvstroe_config' for kvstore \(did you mean 'kvstore_config'\?\)"):
        KVStoreTier(spec(), memoryview(primary), "KVStoreTier", kvstroe_config={})


def test_the_connector_refuses_every_key_it_and_vllm_do_not_define_with_the_closest_name():
    """Keys not starting with kvstore were ignored (the engine ran without its tiers)."""
    from kvstore.connectors.vllm._common import read_options

    for key in ("kv_store_config", "kvstroe_config", "store_config"):
        with pytest.raises(ConfigError, match=rf"{key!r} for kvstore \(did you mean 'kvstore_config'\?\)"):
            read_options({key: {}}, lambda: "ns")
    with pytest.raises(ConfigError, match=r"unknown vLLM option 'colour' for kvstore; valid options are"):
        read_options({"colour": 1}, lambda: "ns")
    # vLLM's own key (written by --kv-offloading-backend) is not kvstore's to refuse.
    assert read_options({"cpu_bytes_to_use": 1 << 30}, lambda: "ns").namespace == "ns"


def test_the_schedulers_lookup_only_store_starts_no_metrics_exporter_and_each_role_says_what_it_uses(tmp_path, caplog):
    """Where the worker has its own process, the scheduler's store must not take the exporter's port. Each role
    logs one line at start: the namespace, each tier with its place, size and codec, never a password."""
    from kvstore.connectors.vllm._common import read_options, shared_stores
    from kvstore.layout import KVLayout
    from kvstore.testing.servers import free_port

    port = free_port()
    sections = {
        "metrics": {"enabled": True, "port": port},
        "dram": {"capacity": "8MiB"},
        "disk": {"path": str(tmp_path), "capacity": "2GiB"},
        "redis": {"enabled": True, "url": f"redis://kv:hunter22@127.0.0.1:{free_port()}/0"},  # nobody there
    }
    options = read_options({"kvstore_config": sections}, lambda: "metrics-check")
    layout = KVLayout(num_layers=2, num_kv_heads=1, head_dim=64, chunk_tokens=16)
    caplog.set_level(logging.INFO, logger="kvstore.connectors.vllm")
    lookup = shared_stores.acquire(options, layout, "connector, scheduler", lookup_only=True)
    try:
        assert lookup.metrics_port is None
        worker = shared_stores.acquire(options, layout, "connector, worker rank 0")
        try:
            assert worker.metrics_port == port
        finally:
            shared_stores.release(worker)
    finally:
        shared_stores.release(lookup)
    lines = [r.getMessage() for r in caplog.records if r.name == "kvstore.connectors.vllm"]
    scheduler, worker_line = (next(line for line in lines if role in line) for role in ("scheduler", "worker rank 0"))
    assert "looks chunks up" in scheduler and "looks chunks up" not in worker_line
    for line in (scheduler, worker_line):
        assert "namespace 'metrics-check'" in line and "2 layers" in line, line
        assert f"disk {tmp_path}" in line and "2.0 GiB (identity)" in line, line
        assert "redis redis://kv:***@127.0.0.1" in line and "(byteplanes)" in line, line
    assert "dram 8.0 MiB (lru)" in worker_line, worker_line
    assert not [line for line in caplog.messages if "hunter22" in line], "a password was logged"


def test_the_tier_reports_its_stores_counters_for_vllms_metrics(tier):
    """get_stats gives what changed since the last call, under the names build_metric_definitions declares."""
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import OffloadingConnectorStats

    declared = KVStoreTier.build_metric_definitions({})
    assert {"vllm:kvstore_chunks_put", "vllm:kvstore_tier_up", "vllm:kvstore_tier_written_bytes"} <= set(declared)
    tier.submit_store(job(1, [key(1), key(2)], [0, 1], promotion=False))
    assert finish(tier)[0].success
    tier.store.flush(timeout=10)
    stats = tier.get_stats()
    assert isinstance(stats, OffloadingConnectorStats)
    values = stats.data["data"]
    assert set(values) <= set(declared)
    assert values["vllm:kvstore_chunks_put"][()] == 2
    assert values["vllm:kvstore_tier_written_bytes"][("disk",)] >= 2 * CHUNK_BYTES
    assert values["vllm:kvstore_tier_up"][("disk",)] == 1
    again = tier.get_stats().data["data"]  # only gauges: no counter moved since
    assert "vllm:kvstore_chunks_put" not in again and again["vllm:kvstore_tier_up"][("disk",)] == 1


def test_the_connector_keeps_cuda_graphs_piecewise_and_checks_its_options_when_vllm_asks():
    """vLLM asks ``requires_piecewise_for_cudagraph`` while building its configuration (GPU builds, full graphs)."""
    from kvstore.connectors.vllm import KVStoreConnector

    assert KVStoreConnector.requires_piecewise_for_cudagraph({"kvstore_config": {"dram": {"capacity": "1GiB"}}})
    with pytest.raises(ConfigError, match="unknown vLLM option 'kv_store_config' for kvstore .*'kvstore_config'"):
        KVStoreConnector.requires_piecewise_for_cudagraph({"kv_store_config": {}})


def test_the_connector_declines_sleep_mode():
    """vLLM 0.33 asks before enabling sleep mode, whose remap of the KV caches the connector has not run."""
    from kvstore.connectors.vllm import KVStoreConnector

    assert KVStoreConnector.supports_sleep_mode(SimpleNamespace(kv_connector_extra_config={})) is False


def test_the_connectors_metrics_register_and_observe_on_a_prometheus_registry():
    """KVStoreConnector.build_prom_metrics: every payload counter lands on the registry vLLM gives it."""
    from functools import partial

    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

    from kvstore.connectors.vllm import KVStoreConnector
    from kvstore.connectors.vllm.stats import StatsReport

    registry = CollectorRegistry()
    kinds = {kind: partial(kind, registry=registry) for kind in (Counter, Gauge, Histogram)}
    extra = {"kvstore_config": {"disk": {"path": "/nonexistent/kvstore"}, "redis": {"enabled": True}}}
    vllm_config = SimpleNamespace(kv_transfer_config=SimpleNamespace(kv_connector_extra_config=extra))
    prom = KVStoreConnector.build_prom_metrics(vllm_config, kinds, ["model_name", "engine"], {0: ["m", "0"]})
    value = registry.get_sample_value
    # Before any report every counter reads 0, per configured tier too; a gauge has no value yet.
    for tier in ("disk", "redis"):
        assert value("vllm:kvstore_tier_hits_total", {"model_name": "m", "engine": "0", "tier": tier}) == 0
    assert value("vllm:kvstore_chunk_hits_total", {"model_name": "m", "engine": "0"}) == 0
    assert value("vllm:kvstore_connector_loaded_chunks_total", {"model_name": "m", "engine": "0"}) == 0
    assert value("vllm:kvstore_tier_up", {"model_name": "m", "engine": "0", "tier": "disk"}) is None
    report = StatsReport()
    stats = {"connector": {"saved_chunks": 3}, "store": {"puts": 3}, "disk": {"bytes_written": 7, "breaker": {}}}
    payload = KVStoreConnector.build_kv_connector_stats(report.take(stats).data)
    prom.observe(payload.data, engine_idx=0)
    prom.observe(report.take({**stats, "store": {"puts": 5}}).data, engine_idx=0)
    assert value("vllm:kvstore_chunks_put_total", {"model_name": "m", "engine": "0"}) == 5
    assert value("vllm:kvstore_connector_saved_chunks_total", {"model_name": "m", "engine": "0"}) == 3
    assert value("vllm:kvstore_tier_written_bytes_total", {"model_name": "m", "engine": "0", "tier": "disk"}) == 7
    assert value("vllm:kvstore_tier_up", {"model_name": "m", "engine": "0", "tier": "disk"}) == 0
