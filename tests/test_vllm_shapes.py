"""The engine shapes production runs, through KVStoreConnector in real vLLM (CPU): tensor
parallelism with a cache reused across TP degrees, MLA, hybrid sliding-window models, fp8 KV.
"""

from __future__ import annotations

import json
import os
import subprocess
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch
from vllm_engines import (
    ENGINE_TIMEOUT,
    REUSABLE_CHUNKS,
    ROOT,
    SUPPORT,
    TP2_ENV,
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


# -- MLA ------------------------------------------------------------------------------------------
# vLLM's CPU backend runs MLA with its AMX kernels (AMX_MLA: bfloat16 weights, blocks of 128) where
# the CPU has AMX, else with its portable ones (CPU_MLA: any dtype, blocks of 16). Each test runs
# both: the engine's own choice on this CPU (in bfloat16 where that is AMX_MLA, which takes no
# other dtype; else in float32), and the portable kernels, chosen with vLLM's documented
# --attention-backend CPU_MLA, in float32. (CPU_MLA in bfloat16 continues a loaded prefix through
# a path whose rounding differs from a recompute's: see warn_of_another_compute_path.)
KERNELS = {  # (dtype, attention backend): None lets vLLM choose
    "engine_choice": (None, None),
    "portable": ("float32", "CPU_MLA"),
}


def mla_dtype(kernels: str, vllm_cpu: dict[str, bool]) -> str:
    """The test model's dtype for these kernels on this CPU: bfloat16 where the engine picks AMX_MLA."""
    return KERNELS[kernels][0] or ("bfloat16" if vllm_cpu["amx"] else "float32")


@pytest.mark.parametrize("kernels", list(KERNELS))
def test_layout_for_vllm_of_an_mla_model_and_what_it_refuses(vllm_python, vllm_cpu, tiny_mla, kernels):
    """From vLLM's own configuration, without an engine: an MLA model's chunk is one latent plane
    of one head, in whole blocks of the size vLLM picked (read, not assumed: it differs by CPU); pipeline and context
    parallelism, fp8 MLA caches and sparse MLA are refused, naming the limit and what to do; fp8
    KV is refused on a CPU without AVX-512 or AMX (simulated) and stored as fp8 values elsewhere."""
    dtype, backend = mla_dtype(kernels, vllm_cpu), KERNELS[kernels][1]
    result = subprocess.run(
        [str(vllm_python), str(SUPPORT / "layout_check.py"), str(tiny_mla), dtype, *([backend] if backend else [])],
        capture_output=True, text=True, timeout=ENGINE_TIMEOUT, env={**os.environ, "HF_HUB_OFFLINE": "1"}, cwd=ROOT,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["layout"] == [2, 1, 1, 512 + 64]  # layers, planes, heads, kv_lora_rank + qk_rope_head_dim
    assert report["format"] == "mla_latent"
    assert 256 % report["block_size"] == 0  # a chunk is whole blocks of the size vLLM picked, whatever it is
    if backend:  # the kernels this test asked for are the ones the engine would run
        assert report["backend"] == f"{backend.replace('_', '')}Backend"
    assert "pipeline parallelism (pipeline_parallel_size=2)" in report["pipeline"]
    assert "use pipeline_parallel_size 1" in report["pipeline"]
    assert "context parallelism (prefill_context_parallel_size=1, decode_context_parallel_size=2)" in report["context"]
    assert "use tensor parallelism (tensor_parallel_size) instead" in report["context"]
    assert "cannot store an MLA model's fp8 latents" in report["fp8_mla"]
    if vllm_cpu["fp8_kv"]:  # vLLM's CPU build runs fp8 KV here: stored as its e4m3 values
        assert report["fp8"] == "torch.float8_e4m3fn"
    else:
        assert "needs, on a CPU, x86 with AVX-512 or AMX" in report["fp8"]
    assert "needs, on a CPU, x86 with AVX-512 or AMX" in report["fp8_without_avx512"]
    assert "use kv_cache_dtype 'auto'" in report["fp8_without_avx512"].lower()
    assert "cannot store kv_cache_dtype 'int8_per_token_head'" in report["int8"]
    assert "not sparse ones" in report["sparse"] and "without kvstore" in report["sparse"]


@pytest.mark.parametrize("kernels", list(KERNELS))
def test_connector_mla_a_fresh_engine_loads_the_latents_from_disk(vllm_python, vllm_cpu, tiny_mla, tmp_path, kernels):
    """A DeepSeek-style MLA model with YaRN rope (as every real DeepSeek-V2/V3) stores one latent
    plane per layer; a fresh engine loads it from disk and generates what the first computed.
    Both engines run in vLLM's default multiprocessing, as users run it: the scheduler and the
    workers are processes of their own, and vLLM's model code rewrites the rope type in the
    workers only: one namespace on both sides or nothing loads. The engine's kernels at TP=1 (a
    worker process of its own all the same), the portable ones at TP=2 (float32 at TP=2 is what
    every x86 CPU of this kind has run; bfloat16 at TP=2 was not run on one without AVX-512).

    The stored latent is checked against the model's own: layer 0's compressed KV (the first
    ``kv_lora_rank`` values of a token's latent) is the normalized down-projection of the
    token's embedding, computed here from the checkpoint's weights.
    """
    from kvstore import KVLayout
    from tests.vllm_support.mla_reference import layer0_compressed_kv

    dtype, backend = mla_dtype(kernels, vllm_cpu), KERNELS[kernels][1]
    tp = 1 if kernels == "engine_choice" else 2
    choice = ("--attention-backend", backend) if backend else ()
    options = ("--dtype", dtype, "--tensor-parallel-size", str(tp), *choice)
    env = TP2_ENV if tp > 1 else None
    extra = disk_extra(tmp_path / "disk")
    first = run_engine(
        vllm_python, tiny_mla, tmp_path, extra, "gen,other,flush", env, options=options, processes="default"
    )
    computed, other = first["runs"]
    assert computed["cached_tokens"] == 0
    assert other["tokens"] != computed["tokens"]  # the output depends on the prompt: equality below means something
    assert first["stats"]["connector"]["saved_chunks"] == 2 * REUSABLE_CHUNKS
    assert first["stats"]["disk"]["writes"] == 2 * REUSABLE_CHUNKS
    fresh = run_engine(vllm_python, tiny_mla, tmp_path, extra, "gen", env, options=options, processes="default")
    run, stats = fresh["runs"][0], fresh["stats"]
    print(f"MLA ({fresh['attention']}, blocks of {fresh['block_size']}) fresh engine stats", json.dumps(stats))
    assert 256 % fresh["block_size"] == 0  # read from the engine: vLLM picks it with its kernels, by CPU
    if backend:  # the kernels this test asked for are the ones the engine ran
        assert fresh["attention"] == backend
    assert run["tokens"] == computed["tokens"]
    assert run["cached_tokens"] == REUSABLE_CHUNKS * 256
    assert [rank["loaded_tokens"] for rank in stats["ranks"]] == [REUSABLE_CHUNKS * 256] * tp
    assert stats["scheduler"]["hit_tokens"] == REUSABLE_CHUNKS * 256
    assert stats["connector"]["load_failures"] == 0 and stats["disk"]["corrupt"] == 0
    assert stats["store"]["streamed"] == REUSABLE_CHUNKS and stats["store"]["streamed_from_dram"] == 0

    config = json.loads((tiny_mla / "config.json").read_text())
    rank, rope = config["kv_lora_rank"], config["qk_rope_head_dim"]
    layout = KVLayout(num_layers=2, num_kv_heads=1, head_dim=rank + rope, dtype=getattr(torch, dtype), kv_planes=1)
    store_config = StoreConfig(dram={"capacity": "16MiB"}, disk={"path": tmp_path / "disk"})
    with SyncKVStore(store_config, layout, namespace=first["namespace"]) as store:
        chunk = store.get(store.chunk_keys(prompt(0, 1000))[0])
    assert chunk is not None and chunk.shape == (2, 1, 256, 1, rank + rope)
    got, want = chunk[0, 0, :, 0, :rank].float(), layer0_compressed_kv(tiny_mla, prompt(0, 256))
    tolerance = 1e-4 if dtype == "float32" else 0.05  # bfloat16 keeps 8 bits of mantissa: ~0.02 seen
    assert torch.allclose(got, want, atol=tolerance, rtol=tolerance / 2), (got - want).abs().max()


# -- fp8 KV ---------------------------------------------------------------------------------------


def test_connector_an_fp8_kv_cache_is_stored_as_the_engines_fp8_values(vllm_python, vllm_cpu, tiny_llama, tmp_path):
    """kv_cache_dtype fp8 (e4m3, scale 1.0 without a calibrated checkpoint): chunks hold the engine's
    own fp8 bytes, read as K and V (layer 0's are transformers' K and V rounded to fp8, read back
    from the disk tier), and once vLLM forgets the prompt it is loaded from kvstore and gives what
    was computed. vLLM's CPU build runs fp8 KV only on x86 with AVX-512 or AMX; elsewhere the
    engine stops at start, saying so."""
    extra = disk_extra(tmp_path / "disk")
    if not vllm_cpu["fp8_kv"]:
        failed = run_engine(vllm_python, tiny_llama, tmp_path, extra, "gen", expect_failure=True, kv_cache_dtype="fp8")
        assert "kv_cache_dtype 'fp8' needs, on a CPU, x86 with AVX-512 or AMX" in failed["output"]
        return
    report = run_engine(vllm_python, tiny_llama, tmp_path, extra, "gen,other,flush,reset,gen", kv_cache_dtype="fp8")
    (computed, other, run), stats = report["runs"], report["stats"]
    print(f"fp8 KV ({report['attention']}) stats", json.dumps(stats))
    assert other["tokens"] != computed["tokens"]
    assert run["tokens"] == computed["tokens"] and run["cached_tokens"] == REUSABLE_CHUNKS * 256
    assert stats["connector"]["loaded_chunks"] == REUSABLE_CHUNKS and stats["connector"]["load_failures"] == 0
    assert stats["disk"]["writes"] == 2 * REUSABLE_CHUNKS

    from transformers import AutoModelForCausalLM

    from kvstore import KVLayout

    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
    config = model.config
    layout = KVLayout(
        num_layers=config.num_hidden_layers, num_kv_heads=config.num_key_value_heads,
        head_dim=config.hidden_size // config.num_attention_heads, dtype=torch.float8_e4m3fn,
    )  # fmt: skip
    store_config = StoreConfig(dram={"capacity": "16MiB"}, disk={"path": tmp_path / "disk"})
    with SyncKVStore(store_config, layout, namespace=report["namespace"]) as store:  # from the disk, decoded
        chunk = store.get(store.chunk_keys(prompt(0, 1000))[0])
    assert chunk is not None and chunk.dtype == torch.float8_e4m3fn
    with torch.no_grad():
        cache = model(torch.tensor([prompt(0, 256)]), use_cache=True).past_key_values
    # Layer 0 only: later layers' K and V follow attention over fp8 KV in vLLM, over exact KV in transformers.
    for plane, hf in enumerate((cache.layers[0].keys, cache.layers[0].values)):
        want = hf[0].transpose(0, 1)  # [heads, tokens, dim] -> [tokens, heads, dim]
        got = chunk[0, plane].float()
        # e4m3 keeps 3 bits of mantissa: within one step (1/8 of the value's power of two) of the exact value
        assert torch.all((got - want).abs() <= want.abs() / 8 + 1 / 64), (plane, (got - want).abs().max())


# -- hybrid models --------------------------------------------------------------------------------
# A Gemma-3-style model: layers 0 and 2 attend to a sliding window of 256 tokens, 1 and 3 to all;
# vLLM's hybrid KV cache manager (on by default) keeps them in two KV cache groups.


def corrupt_chunks_of(disk: Path, keys: list[str]) -> int:
    """Flip one byte in the middle of each of these chunks' files; returns how many."""
    files = [path for key in keys for path in disk.rglob(f"{key}*")]
    for path in files:
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0xFF
        path.write_bytes(bytes(data))
    return len(files)


@pytest.mark.parametrize("chunk_tokens", [256, 512])
def test_connector_hybrid_model_a_fresh_engine_loads_every_group(vllm_python, tiny_gemma, tmp_path, chunk_tokens):
    """Prompt of 1000 tokens, window 256. Chunks of 256: 3 reusable, the sliding layers' rows all
    stored. Chunks of 512: 1 reusable, the sliding layers store only their last 256 rows of it
    (zeros before: no window reaches them), under a namespace of their own; the fresh engine runs
    at TP=2 (one KV head per worker). The writer prefills in steps of 384 tokens, so vLLM frees
    sliding-window blocks between the steps that save them. Chunks of 256: a prompt whose chunks
    are corrupt fails its whole prefix (per request) and is recomputed, the same tokens."""
    extra = disk_extra(tmp_path / "disk")
    extra["kvstore_chunk_tokens"] = chunk_tokens
    reusable = (1000 - 1) // chunk_tokens
    broken = chunk_tokens == 256  # the fresh engine also runs a prompt whose chunks are all corrupt
    steps = "gen,third,flush" if broken else "gen,flush"
    first = run_engine(vllm_python, tiny_gemma, tmp_path, extra, steps, options=("--max-batched-tokens", "384"))
    if broken:
        assert corrupt_chunks_of(tmp_path / "disk", first["prompt_keys"]["third"]) == reusable
    tp = 2 if chunk_tokens == 512 else 1
    env = TP2_ENV if tp > 1 else None
    options = ("--tensor-parallel-size", str(tp))
    fresh = run_engine(
        vllm_python, tiny_gemma, tmp_path, extra, "gen,other,third" if broken else "gen,other", env, options=options
    )
    (run, other, *third), stats = fresh["runs"], fresh["stats"]
    print(json.dumps(first["stats"]), json.dumps(stats))
    assert first["kv_cache_groups"] == [{"layers": [0, 2], "window": 256}, {"layers": [1, 3], "window": None}]
    assert first["runs"][0]["cached_tokens"] == 0 and first["stats"]["scheduler"]["unsaveable_chunks"] == 0
    assert first["stats"]["connector"]["saved_chunks"] == reusable * len(first["runs"])
    assert other["tokens"] != run["tokens"]  # the output depends on the prompt
    assert run["tokens"] == first["runs"][0]["tokens"]
    assert run["cached_tokens"] == reusable * chunk_tokens
    assert [rank["loaded_chunks"] for rank in stats["ranks"]] == [reusable] * tp
    assert all(rank["load_failures"] == int(broken) for rank in stats["ranks"])
    assert stats["disk"]["hits"] == reusable
    assert fresh["namespace"].endswith("#rows=in-window:w256+0") == (chunk_tokens == 512)  # window 256, extra 0
    if broken:  # recomputed whole, the same tokens
        assert third[0]["tokens"] == first["runs"][1]["tokens"] and third[0]["cached_tokens"] == 0
        assert stats["disk"]["corrupt"] >= 1


def test_connector_sliding_window_only_model_loads_whole_prefixes(vllm_python, tiny_gemma_sliding, tmp_path):
    """Every layer on a window of 256 (Mistral-7B-v0.1 style): one KV cache group, of sliding layers.
    Its loads are whole prefixes too (a block-level failure would make vLLM recompute from a block
    whose window it no longer holds): a fresh engine loads the 3 chunks of one prompt, the same
    tokens; another prompt's chunks are all corrupt: that request is recomputed whole, the same tokens."""
    extra = disk_extra(tmp_path / "disk")
    first = run_engine(vllm_python, tiny_gemma_sliding, tmp_path, extra, "gen,third,flush")
    assert corrupt_chunks_of(tmp_path / "disk", first["prompt_keys"]["third"]) == REUSABLE_CHUNKS
    fresh = run_engine(vllm_python, tiny_gemma_sliding, tmp_path, extra, "gen,third")
    (run, broken), stats = fresh["runs"], fresh["stats"]["connector"]
    assert fresh["kv_cache_groups"] == [{"layers": [0, 1, 2, 3], "window": 256}]
    assert run["tokens"] == first["runs"][0]["tokens"] and run["cached_tokens"] == REUSABLE_CHUNKS * 256
    assert broken["tokens"] == first["runs"][1]["tokens"] and broken["cached_tokens"] == 0
    assert stats["loaded_chunks"] == REUSABLE_CHUNKS
    assert stats["load_failures"] == 1 and stats["failed_blocks"] == 0  # the whole request, not blocks
