"""The harness of the vLLM engine tests: the models, one engine per process, and what they share.

vLLM lives in its own virtual environment (``.venv-vllm``, made by scripts/test.sh: its torch
and transformers pins differ from ours), so each engine runs as a subprocess of that
environment's Python (tests/vllm_support/run_engine.py) and reports output tokens, how many
prompt tokens vLLM did not compute, and kvstore's counters. The models are made locally (random
weights, a tokenizer trained here: no downloads): a tiny Llama (2 KV heads, or 4 for tensor
parallelism), a DeepSeek-V2-style MLA model and a Gemma-3-style hybrid model. The fixtures are
registered for every test module by tests/conftest.py.

A prompt of 1000 tokens has 3 full chunks of 256 that may be reused (the last token is always
computed); vLLM's block size is 128 (16 for the MLA model on vLLM's portable CPU_MLA kernels).

vLLM's CPU backend chooses kernels by instruction set: with AMX (``amx_tile``) it runs AMX
attention and MLA kernels, which take bfloat16 (not float32) weights and blocks of a multiple of
32 tokens; without, the portable ones. The tests read the backend, block size and paged format
from the engine and assert what kvstore guarantees on either, and they run the portable MLA
kernels too (``--attention-backend CPU_MLA``, vLLM's documented setting), so both paths run on
whichever CPU runs the suite. ``TEST_VLLM_CPU_KERNELS=portable`` makes every engine choose the
portable kernels (the whole suite as on a CPU without AMX).
"""

from __future__ import annotations

import json
import os
import subprocess
import uuid
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
SUPPORT = Path(__file__).resolve().parent / "vllm_support"
# Not KVSTORE_*: StoreConfig refuses unknown KVSTORE_* variables (a typo there must not pass silently).
VLLM_PYTHON = Path(os.environ.get("TEST_VLLM_PYTHON", ROOT / ".venv-vllm" / "bin" / "python"))
REUSABLE_CHUNKS = 3  # (1000 - 1) // 256
ENGINE_TIMEOUT = 600
# vLLM's CPU build runs tensor parallelism with one worker pinned per core.
TP2_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}


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
def vllm_cpu(vllm_python: Path) -> dict[str, bool]:
    """What vLLM's CPU backend runs here, as it decides: AMX kernels (``amx``; not where
    ``TEST_VLLM_CPU_KERNELS=portable`` forces the portable ones), fp8 KV (AVX-512 or AMX)."""
    probe = (
        "import json, torch; amx = torch.cpu._is_amx_tile_supported(); "
        "print(json.dumps({'amx': amx, 'fp8_kv': amx or torch.cpu._is_avx512_supported()}))"
    )
    result = subprocess.run([str(vllm_python), "-c", probe], check=True, capture_output=True, text=True)
    found = json.loads(result.stdout.strip().splitlines()[-1])
    if os.environ.get("TEST_VLLM_CPU_KERNELS") == "portable":  # the engines are told not to use them
        found["amx"] = False
    return found


@pytest.fixture(scope="session")
def tiny_models(vllm_python: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Every tiny model, made in one process under vLLM's environment (tests/vllm_support/tiny_models.py)."""
    path = tmp_path_factory.mktemp("models")
    made = subprocess.run(
        [str(vllm_python), str(SUPPORT / "tiny_models.py"), str(path)], check=True, capture_output=True, text=True
    )
    return {name: Path(directory) for name, directory in json.loads(made.stdout.strip().splitlines()[-1]).items()}


@pytest.fixture(scope="session")
def tiny_llama(tiny_models: dict[str, Path]) -> Path:
    """A Llama with 2 KV heads of 32 (4 attention heads), 2 layers."""
    return tiny_models["llama"]


@pytest.fixture(scope="session")
def tiny_llama_4kv(tiny_models: dict[str, Path]) -> Path:
    """The tiny Llama with 4 KV heads (8 attention heads): tensor parallelism of 2 splits them 2 + 2."""
    return tiny_models["llama_4kv"]


@pytest.fixture(scope="session")
def tiny_mla(tiny_models: dict[str, Path]) -> Path:
    """A DeepSeek-V2-style MLA model (tests/vllm_support/tiny_mla.py): latent 512 + 64, YaRN rope."""
    return tiny_models["mla"]


@pytest.fixture(scope="session")
def tiny_gemma(tiny_models: dict[str, Path]) -> Path:
    """A Gemma-3-style hybrid model (tests/vllm_support/tiny_gemma.py): sliding window 256, full attention."""
    return tiny_models["gemma"]


@pytest.fixture(scope="session")
def tiny_gemma_sliding(tiny_models: dict[str, Path]) -> Path:
    """The tiny Gemma with every layer on the sliding window: one KV cache group, sliding."""
    return tiny_models["gemma_sliding"]


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
    processes: str | None = None,
) -> dict[str, Any]:
    """One vLLM engine in a fresh process; its report (see run_engine.py), or its output if it failed.

    ``processes`` (run_engine.py's ``--processes``): ``"default"`` is vLLM's default
    multiprocessing, as users run it; ``"workers"`` keeps the engine core in the engine's first
    process and starts each worker in its own, the same split for kvstore (scheduler and workers
    apart), ~7 s faster; ``"one"`` puts everything at TP=1 in one process. By default connector
    engines run ``workers`` and tier engines ``one`` (the tier lives in vLLM's scheduler, where
    only an in-process engine core lets a test read its counters). ``options``: more of
    run_engine.py's arguments (``--tensor-parallel-size 2``, ``--max-tokens 8``, ``--dtype
    bfloat16``, ``--attention-backend CPU_MLA``).
    """
    if processes is None:
        processes = "one" if mode == "tier" else "workers"
    out = workdir / f"report-{uuid.uuid4().hex[:8]}.json"
    command = [
        str(python), str(SUPPORT / "run_engine.py"), "--model", str(model), "--mode", mode,
        "--extra", json.dumps(extra), "--steps", steps, "--out", str(out), "--freeze-pid", str(freeze_pid),
        "--block-size", str(block_size), "--kv-cache-dtype", kv_cache_dtype,
        "--processes", processes, *options,
    ]  # fmt: skip
    result = subprocess.run(
        command, env={**os.environ, **(env or {})}, capture_output=True, text=True, timeout=ENGINE_TIMEOUT, cwd=ROOT
    )
    if expect_failure:
        assert result.returncode != 0, "the engine was expected to refuse to start"
        return {"output": result.stdout + result.stderr}
    if result.returncode != 0:
        pytest.fail(f"vLLM engine failed ({result.returncode}):\n{result.stdout[-3000:]}\n{result.stderr[-6000:]}")
    return {**json.loads(out.read_text()), "output": result.stdout + result.stderr}


def run_support_tests(python: Path, *names: str) -> str:
    """pytest on ``tests/vllm_support/<name>`` files under vLLM's environment (files that import vLLM's types,
    so kvstore's own test run does not collect them), in one interpreter; its output, after asserting it passed."""
    command = [
        str(python), "-m", "pytest", "-q", "-p", "no:cacheprovider", "--noconftest", "-c", os.devnull,
        "--rootdir", str(SUPPORT), *(str(SUPPORT / name) for name in names),
    ]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, timeout=ENGINE_TIMEOUT, cwd=ROOT)
    print(result.stdout[-2000:])
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
    return result.stdout


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


def remove_chunk_files(disk: Path, keys: list[str]) -> int:
    """Delete the disk tier's files of these chunk keys (so that the next engine must find them elsewhere)."""
    files = [path for key in keys for path in disk.rglob(f"{key}*")]
    for path in files:
        path.unlink()
    return len(files)
