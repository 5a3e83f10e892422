"""The examples run as written (smaller sizes where the defaults take minutes)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def run_example(name: str, *args: str, timeout: float = 600) -> str:
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / name), *args], capture_output=True, text=True, timeout=timeout, check=False
    )
    assert done.returncode == 0, f"{name} failed:\n{done.stdout}\n{done.stderr[-4000:]}"
    return done.stdout


def test_quickstart():
    assert "3 of 3 chunks found after a restart; chunk 2 read back exactly" in run_example("quickstart.py")


def test_hf_prefix_cache_prints_a_row_per_tier():
    out = run_example("hf_prefix_cache.py", "--tokens", "512", "--tiers", "dram,disk,redis,s3", "--repeats", "1")
    rows = re.findall(r"^\| 512 \| (\S+) \| (\d+) \| ([\d.]+) s \| ([\d.]+)x \|", out, re.MULTILINE)
    assert [source for source, *_ in rows] == ["recompute", "dram", "disk", "redis", "s3"], out
    for source, reused, _, _ in rows[1:]:
        assert int(reused) == 512, f"{source}: the whole document should be loaded, not computed"


def test_vllm_prefix_cache_prints_a_row_per_source():
    """Runs under vLLM's environment (.venv-vllm, made by scripts/vllm_env.sh); 2 layers, 1K tokens."""
    vllm_python = Path(__file__).resolve().parents[1] / ".venv-vllm" / "bin" / "python"
    done = subprocess.run(
        [str(vllm_python), str(EXAMPLES / "vllm_prefix_cache.py"), "--tokens", "1024", "--layers", "2"],
        capture_output=True, text=True, timeout=900, check=False,
    )  # fmt: skip
    assert done.returncode == 0, f"vllm_prefix_cache.py failed:\n{done.stdout}\n{done.stderr[-4000:]}"
    rows = re.findall(r"^\| 1024 \| ([^|]+) \| (\d+) \| [\d.]+ s \| [\d.]+x \| (\w+) \|", done.stdout, re.MULTILINE)
    assert [name.strip() for name, *_ in rows] == [
        "vLLM alone (recompute)",
        "kvstore miss (recompute + save)",
        "kvstore DRAM",
        "kvstore disk (fresh engine)",
    ], done.stdout
    assert [int(cached) for _, cached, _ in rows] == [0, 0, 768, 768]
    assert all(same == "yes" for *_, same in rows)  # the same first token, loaded or computed
