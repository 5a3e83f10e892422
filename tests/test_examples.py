"""The examples run as written (smaller sizes where the defaults take minutes)."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

from support import TEST_BUCKET, check_remote_tier

from kvstore.sizing.traces import read_trace
from kvstore.testing.servers import RedisServer, SeaweedFSServer

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
VLLM_PYTHON = Path(__file__).resolve().parents[1] / ".venv-vllm" / "bin" / "python"
SERVER_VARIABLES = ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "REDIS_URL")


def run_example(
    name: str, *args: str, timeout: float = 600, env: dict[str, str] | None = None, python: Path | None = None
) -> str:
    done = subprocess.run(
        [str(python or sys.executable), str(EXAMPLES / name), *args],
        capture_output=True, text=True, timeout=timeout, check=False, env=env,
    )  # fmt: skip
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
    done = subprocess.run(
        [str(VLLM_PYTHON), str(EXAMPLES / "vllm_prefix_cache.py"), "--tokens", "1024", "--layers", "2"],
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


def without_servers(**variables: str) -> dict[str, str]:
    """This environment with no S3 endpoint or Redis URL set (the examples then start their own), plus ``variables``."""
    return {**{k: v for k, v in os.environ.items() if k not in SERVER_VARIABLES}, **variables}


def test_s3_tier_on_a_given_endpoint(seaweedfs_server: SeaweedFSServer):
    """SeaweedFS checks signatures: the example's requests carry the caller's AWS credentials."""
    keys = {k: v for k, v in seaweedfs_server.credentials_env().items() if k not in SERVER_VARIABLES}
    out = run_example(
        "s3_tier.py", "--endpoint", seaweedfs_server.endpoint_url, "--bucket", TEST_BUCKET, env=without_servers(**keys)
    )
    assert f"using the S3 server at {seaweedfs_server.endpoint_url}, bucket '{TEST_BUCKET}'" in out, out
    check_remote_tier(out, "S3", "objects")


# Without a server configured, the examples start their own: the quickstart's commands (tests/test_docs_commands.py).


def test_redis_tier_on_redis_url(redis_server: RedisServer):
    out = run_example("redis_tier.py", "--ttl", "0.5", env=without_servers(REDIS_URL=redis_server.url))
    assert f"using the Redis server at {redis_server.url}" in out, out
    check_remote_tier(out, "Redis", "values")
    assert "with ttl 0.5 s: 4 of 4 chunks written; 1 s unread, 0 left" in out, out


def test_vllm_config_second_engine_loads_the_prefix_from_disk():
    """As written, under vLLM's environment: the printed config is valid JSON, and a fresh engine reuses 3 chunks."""
    out = run_example("vllm_config.py", python=VLLM_PYTHON, timeout=900)
    serve = next(line for line in out.splitlines() if line.startswith("python -m vllm.entrypoints.openai.api_server "))
    assert "--skip-tokenizer-init" in serve and "--kv-cache-memory-bytes" in serve, serve  # what the CPU build needs
    transfer = json.loads(shlex.split(serve)[-1])
    assert transfer["kv_connector"] == "KVStoreConnector", serve
    assert transfer["kv_connector_module_path"] == "kvstore.connectors.vllm", serve
    toml = transfer["kv_connector_extra_config"]["kvstore_config_file"]
    assert f"# {toml} (removed when this script ends: copy it to keep it)\n[dram]" in out, out  # the file it names
    assert "engine 1: computed the 1000-token prompt (0 tokens from kvstore); kvstore saved 3 chunk files" in out, out
    second = re.search(r"^engine 2 \(a fresh process\): (\d+) of 1000 prompt tokens loaded from kvstore, "
                       r"not computed; (\w+) (\d+) output tokens as engine 1$", out, re.M)  # fmt: skip
    assert second is not None, out
    assert (int(second[1]), second[2], int(second[3])) == (768, "same", 16), out  # 3 chunks of 256; the rest computed


def test_adaptive_sizing_decides_advises_and_writes_a_trace(tmp_path: Path):
    trace = tmp_path / "lookups.kvtrace"
    out = run_example("adaptive_sizing.py", "--trace", str(trace), "--sessions", "1200")
    decisions = re.search(r"auto mode: (\d+) decisions", out)
    assert decisions and int(decisions[1]) >= 2, out
    assert "<- recommended" in out and "hit rate" in out, out
    lookups = int(re.search(r"\(([\d,]+) chunk lookups\)", out)[1].replace(",", ""))
    assert len(read_trace(trace)) == lookups > 0
    # The docs' command on this trace: 32 MiB chunks of the trace's 256 tokens (Llama-3-8B's), a table back.
    from typer.testing import CliRunner

    from kvstore.cli import app

    args = ["advise", str(trace), "--chunk-bytes", "32MiB", "--dram", "32GiB", "--disk", "1TiB"]
    advised = CliRunner().invoke(app, args, env={"KVSTORE_CONFIG": "", "COLUMNS": "200"})
    assert advised.exit_code == 0, advised.output
    assert "chunk lookups of 32.0 MiB (256 tokens)" in advised.output and "recommendation: DRAM" in advised.output


def test_examples_use_the_recommended_codecs_and_state_their_duration():
    """What the docs recommend (byteplanes or identity) is what the examples configure; each says how long it takes."""
    for path in sorted(EXAMPLES.glob("*.py")):
        text = path.read_text()
        assert "bytesplit" not in text, f"{path.name}: use byteplanes (lossless) or identity, as the docs recommend"
        docstring = text.split('"""')[1]
        assert re.search(r"\d+ (s|min|minutes|seconds)\b", docstring), f"{path.name}: its docstring states no duration"
