"""kvstore's counters on vLLM's own ``/metrics``: a real ``vllm serve`` with the native tier, scraped.

The connector reports through vLLM's connector stats (``get_kv_connector_stats``, its
``build_prom_metrics``), the native tier through the offloading tier's ``get_stats`` and
``build_metric_definitions`` (tests/vllm_support/contract_tier.py checks both call by call). Here
a tier server serves two requests, and ``/metrics`` must show kvstore's metrics with the values those
requests make certain: chunks put, the tiers' health. The connector's are checked on the server of
docs/vllm-first-hit.md (tests/test_vllm_first_hit.py).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from vllm_engines import ENGINE_TIMEOUT

from benchmarks.serving import (
    CPU_WORKER_PATH,
    ROOT,
    Sizing,
    _get,
    _post,
    serve_command,
    server,
    wait_healthy,
)
from kvstore.testing.servers import free_port
from tests.vllm_support.prompts import prompt

PROMPTS = [prompt(1, 600), prompt(2, 600)]  # 600 tokens each: two full chunks of 256


def samples(text: str, prefix: str = "vllm:kvstore_") -> dict[str, float]:
    """``name{labels}`` -> value for every kvstore sample on a Prometheus page, the engine's labels dropped."""
    found = {}
    for line in text.splitlines():
        if line.startswith(prefix):
            name_labels, value = line.rsplit(" ", 1)
            name, _, labels = name_labels.partition("{")
            kept = ",".join(part for part in labels.rstrip("}").split(",") if part.startswith("tier="))
            found[f"{name}{{{kept}}}" if kept else name] = float(value)
    return found


def test_kvstores_metrics_are_on_vllms_metrics_page(vllm_python: Path, tiny_llama: Path, tmp_path) -> None:
    integration = "tier"  # the connector's: tests/test_vllm_first_hit.py, on the first-hit page's server
    port = free_port()
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), str(CPU_WORKER_PATH)]),
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
    }
    command = serve_command(vllm_python, tiny_llama, port, integration, Sizing(layers=2), tmp_path)
    log = tmp_path / "server.log"
    with server(command, env, log) as process:
        wait_healthy(process, port, time.monotonic() + ENGINE_TIMEOUT, log)
        for tokens in PROMPTS:  # the second request's steps report what the first left
            request = {"model": "bench", "prompt": tokens, "max_tokens": 2}
            _post(f"http://127.0.0.1:{port}/v1/completions", request, timeout=ENGINE_TIMEOUT)
        page = _get(f"http://127.0.0.1:{port}/metrics")
    found = samples(page)
    (tmp_path / "metrics.txt").write_text(page)
    assert found.get('vllm:kvstore_tier_up{tier="disk"}') == 1, sorted(found)
    assert found.get("vllm:kvstore_dram_capacity_bytes", 0) > 0, sorted(found)
    assert found.get("vllm:kvstore_chunks_put_total", 0) >= 2, found  # the first prompt's two chunks, at least
