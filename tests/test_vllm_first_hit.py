"""docs/vllm-first-hit.md, run as printed: the model made, ``vllm serve`` with kvstore, a prompt sent twice.

The page's commands are taken from its ``bash`` blocks, not copied here, so the page cannot drift
from what works. Only the port differs (a free one for 8000), and the first line of the set-up
(``bash scripts/vllm_env.sh``) is the one the suite's own set-up runs (scripts/test.sh sources it).
The second request's prefix must come from kvstore: ``cached_tokens``, the same text, the server's
log line and kvstore's counters on vLLM's ``/metrics`` all say so; the connector's counters on that
page are checked here too (the tier's in tests/test_vllm_metrics.py).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import time
from pathlib import Path

from vllm_engines import ENGINE_TIMEOUT

from benchmarks.serving import ROOT, _get, server, wait_healthy
from kvstore.testing.servers import free_port

PAGE = ROOT / "docs" / "vllm-first-hit.md"
PROMPT_CHUNKS = 3  # the page's prompt: 884 tokens, so 3 full chunks of 256 are loaded


def bash_blocks() -> list[str]:
    """The page's ``bash`` code blocks, in order."""
    return re.findall(r"```bash\n(.*?)```", PAGE.read_text(), flags=re.DOTALL)


def test_the_first_hit_page_runs_as_printed(vllm_python: Path, tmp_path: Path) -> None:
    def in_clone(command: str) -> str:
        """A command of the page, run in another directory: its ``.venv-vllm/bin/python`` is the suite's, and
        ``examples/`` the clone's."""
        return command.replace(".venv-vllm/bin/python", str(vllm_python)).replace(" examples/", f" {ROOT}/examples/")

    setup, serve, requests = bash_blocks()
    assert setup.splitlines()[0] == "bash scripts/vllm_env.sh"  # run by the suite's set-up
    environment = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    for line in setup.splitlines()[1:]:  # the model directory, in the working directory as on the page
        made = subprocess.run(
            in_clone(line), shell=True, cwd=tmp_path, env=environment, capture_output=True, text=True, timeout=600
        )
        assert made.returncode == 0, made.stdout[-2000:] + made.stderr[-3000:]
    assert (tmp_path / "smollm2-135m" / "config.json").is_file()

    port = free_port()
    command = [*shlex.split(in_clone(serve.replace("\\\n", " "))), "--port", str(port)]
    log = tmp_path / "server.log"
    with server(command, environment, log, cwd=tmp_path) as process:
        wait_healthy(process, port, time.monotonic() + ENGINE_TIMEOUT, log)
        sent = subprocess.run(
            ["bash", "-c", requests.replace("localhost:8000", f"localhost:{port}")],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=ENGINE_TIMEOUT,
        )
        assert sent.returncode == 0, sent.stdout[-2000:] + sent.stderr[-2000:]
        page = _get(f"http://127.0.0.1:{port}/metrics")
    output = log.read_text()
    first, second, *metrics = sent.stdout.splitlines()
    first, second = json.loads(first), json.loads(second)
    assert first["usage"]["prompt_tokens"] == 884
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == PROMPT_CHUNKS * 256, second
    assert second["choices"][0]["text"] == first["choices"][0]["text"]
    # What the page says the log shows: each role's store at start, then the load.
    assert re.search(r"kvstore connector, scheduler \(looks chunks up.*namespace 'vllm:smollm2-135m#id=", output)
    assert re.search(r"kvstore connector, worker rank 0: .*tiers: dram 1023\.8 MiB \(lru\), disk kvstore-disk", output)
    tokens = f"{PROMPT_CHUNKS * 256:,} tokens ({PROMPT_CHUNKS} chunks from dram) in the forward pass"
    assert re.search(rf"kvstore: request cmpl-\S+ loads {re.escape(tokens)}", output), output[-3000:]
    assert sorted(metrics) == sorted(
        [
            f'vllm:kvstore_connector_loaded_chunks_total{{engine="0",model_name="smollm2"}} {PROMPT_CHUNKS}.0',
            f'vllm:prompt_tokens_cached_total{{engine="0",model_name="smollm2"}} {PROMPT_CHUNKS * 256}.0',
        ]
    ), metrics
    # The rest of kvstore's counters on that page: what the first request saved, the disk tier's health,
    # and counters nothing moved, at 0 rather than absent.
    found = dict(line.rsplit(" ", 1) for line in page.splitlines() if line.startswith("vllm:kvstore_"))
    engine = 'engine="0",model_name="smollm2"'
    assert float(found[f"vllm:kvstore_connector_saved_chunks_total{{{engine}}}"]) >= PROMPT_CHUNKS, found
    assert float(found[f'vllm:kvstore_tier_up{{{engine},tier="disk"}}']) == 1, found
    assert float(found[f"vllm:kvstore_connector_load_failures_total{{{engine}}}"]) == 0, found
    assert float(found[f'vllm:kvstore_tier_timeouts_total{{{engine},tier="disk"}}']) == 0, found
