"""``kvstore advise``: a recorded trace in, a size table, a verdict and a recommendation out."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from kvstore.cli import app
from kvstore.sizing.traces import write_trace
from kvstore.sizing.workloads import all_unique, zipf_prefixes

runner = CliRunner()
META = {"chunk_tokens": 256, "chunk_bytes": 1 << 20, "namespace": "test"}
# Small tiers so the short traces below span the interesting sizes; KVSTORE_* are cleared, so no config applies.
SIZES = ["--dram", "64MiB", "--disk", "1GiB"]


@pytest.fixture(autouse=True)
def _no_config(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith("KVSTORE_"):
            monkeypatch.delenv(name)


def trace(tmp_path: Path, chains: list[np.ndarray], meta: dict | None = None, name: str = "t.kvtrace") -> Path:
    path = tmp_path / name
    write_trace(path, chains, META if meta is None else meta)
    return path


def hot_zipf() -> list[np.ndarray]:
    """High reuse: 40 popular prefixes of 8 chunks and no unique tails."""
    return zipf_prefixes(6000, prefixes=40, prefix_chunks=8, suffix_chunks=0, alpha=1.1)


def invoke(*args: str) -> tuple[int, str]:
    result = runner.invoke(app, ["advise", *args], catch_exceptions=False)
    return result.exit_code, result.output


def test_table_lists_sizes_and_marks_current_and_recommended(tmp_path: Path) -> None:
    code, out = invoke(str(trace(tmp_path, hot_zipf())), *SIZES, "--exact")
    assert code == 0, out
    for size in ("8.0 MiB", "32.0 MiB", "64.0 MiB", "128.0 MiB", "512.0 MiB"):
        assert size in out
    assert "current" in out and "recommended" in out
    assert "recommendation: DRAM" in out
    assert "disk size" in out  # a disk tier is present: its table too


def test_all_unique_traffic_recommends_second_sighting(tmp_path: Path) -> None:
    code, out = invoke(str(trace(tmp_path, all_unique(4000))), *SIZES, "--policy", "write-through")
    assert code == 0, out
    assert "policy 'second-sighting'" in out
    assert "costs more than it returns" in " ".join(out.split())


def test_high_reuse_recommends_write_through_near_the_largest_hit_rate(tmp_path: Path) -> None:
    code, out = invoke(str(trace(tmp_path, hot_zipf())), *SIZES, "--exact", "--json")
    assert code == 0, out
    advice = json.loads(out)
    assert advice["recommended_policy"] == "write-through"
    rows = {row["dram_bytes"]: row for row in advice["rows"]}
    best = max(row["dram_hit_rate"] for row in advice["rows"])
    assert rows[advice["recommended_dram_bytes"]]["dram_hit_rate"] >= best - 0.05


def test_json_hit_rates_are_fractions_rising_with_size(tmp_path: Path) -> None:
    code, out = invoke(str(trace(tmp_path, hot_zipf())), *SIZES, "--json", "--remote")
    assert code == 0, out
    document = json.loads(out)
    for series in (document["rows"], document["curve"]):
        sizes = [point["dram_bytes"] for point in series]
        assert sizes == sorted(sizes)
        for key in ("dram_hit_rate", "hit_rate"):
            rates = [point[key] for point in series]
            assert all(0.0 <= rate <= 1.0 for rate in rates)
            assert (np.diff(rates) >= -1e-12).all(), key
    assert document["lookups"] == 6000 * 8 and document["verdict"]
    assert [tier["name"] for tier in document["cost"]["lower"]] == ["disk", "remote"]


def test_plot_writes_a_png(tmp_path: Path) -> None:
    import matplotlib  # noqa: F401  (the test extra installs it: a missing one fails here)

    png = tmp_path / "curve.png"
    code, out = invoke(str(trace(tmp_path, hot_zipf())), *SIZES, "--plot", str(png))
    assert code == 0, out
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


def test_a_file_that_is_not_a_trace_exits_2_naming_it(tmp_path: Path) -> None:
    bad = tmp_path / "notes.txt"
    bad.write_text("not a trace\n")
    code, out = invoke(str(bad), *SIZES)
    assert code == 2 and "notes.txt" in out and "not a kvstore trace" in out
    code, out = invoke(str(tmp_path / "missing.kvtrace"), *SIZES)
    assert code == 2 and "missing.kvtrace" in out


def test_an_empty_trace_exits_2(tmp_path: Path) -> None:
    code, out = invoke(str(trace(tmp_path, [])), *SIZES)
    assert code == 2 and "no lookups recorded" in out


def test_missing_chunk_bytes_exits_2_naming_the_option(tmp_path: Path) -> None:
    path = trace(tmp_path, hot_zipf(), meta={"chunk_tokens": 256})
    code, out = invoke(str(path), *SIZES)
    assert code == 2 and "--chunk-bytes" in out
    code, out = invoke(str(path), *SIZES, "--chunk-bytes", "1MiB")
    assert code == 0, out


def test_synthetic_workload_written_then_advised(tmp_path: Path) -> None:
    out_path = tmp_path / "zipf.kvtrace"
    code, out = invoke("--synthetic", "zipf", "--requests", "500", "--write-trace", str(out_path))
    assert code == 0 and out_path.exists(), out
    code, out = invoke(str(out_path), *SIZES)
    assert code == 0 and "5,000 chunk lookups" in out, out


def test_defaults_come_from_the_store_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = tmp_path / "kvstore.toml"
    config.write_text('[dram]\ncapacity = "32MiB"\n[disk]\nenabled = false\n[adaptive]\npolicy = "second-sighting"\n')
    monkeypatch.setenv("KVSTORE_CONFIG", str(config))
    code, out = invoke(str(trace(tmp_path, hot_zipf())))
    assert code == 0, out
    assert "now 32.0 MiB, 'second-sighting'" in out
    assert "disk size" not in out  # no disk tier configured: no disk table


def test_a_chunk_size_that_mixes_two_models_with_the_trace_exits_2_naming_the_fix(tmp_path: Path) -> None:
    # Recorded with 16-token chunks of a small model; --chunk-bytes 32MiB alone would mean 2 MiB of KV a
    # token, and advice comparing a 32 MiB load with a 16-token recompute (every hit a loss).
    path = trace(tmp_path, hot_zipf(), meta={"chunk_tokens": 16, "chunk_bytes": 16 * 15360, "namespace": "t"})
    code, out = invoke(str(path), *SIZES, "--chunk-bytes", "32MiB")
    assert code == 2, out
    assert "2.0 MiB of KV per token" in out and "--chunk-tokens" in out
    code, out = invoke(str(path), *SIZES, "--chunk-tokens", "4096")  # 60 bytes a token: no model either
    assert code == 2 and "--chunk-bytes" in out, out
    code, out = invoke(str(path), *SIZES, "--chunk-bytes", "32MiB", "--chunk-tokens", "256")  # both given: taken
    assert code == 0 and "of 32.0 MiB (256 tokens)" in out, out


def test_a_chunk_size_for_the_traces_tokens_is_taken(tmp_path: Path) -> None:
    path = trace(tmp_path, hot_zipf())  # 256-token chunks: 32 MiB is Llama-3-8B's 128 KiB a token
    code, out = invoke(str(path), *SIZES, "--chunk-bytes", "32MiB")
    assert code == 0 and "of 32.0 MiB (256 tokens)" in out, out


def test_choices_are_shown_and_checked(tmp_path: Path) -> None:
    help_text = runner.invoke(app, ["advise", "--help"], env={"COLUMNS": "250"}).output
    assert "zipf|multi-turn|rag|unique|phase" in help_text and "write-through|second-sighting" in help_text
    code, out = invoke("--synthetic", "ragg")
    assert code == 2 and "'ragg' is not one of" in out, out


def test_the_output_says_its_curves_assume_lru_and_names_a_tier_configured_otherwise(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = str(trace(tmp_path, hot_zipf()))
    code, out = invoke(path, *SIZES)
    assert code == 0, out
    assert "hit rates assume LRU eviction" in out and "the config sets" not in out
    config = tmp_path / "kvstore.toml"
    config.write_text('[dram]\neviction = "s3fifo"\n[disk]\neviction = "arc"\n')
    monkeypatch.setenv("KVSTORE_CONFIG", str(config))
    code, out = invoke(path, *SIZES)
    assert code == 0, out
    out = " ".join(out.split())  # the console wraps long lines
    assert "the config sets dram.eviction = 's3fifo', disk.eviction = 'arc', whose hit rates differ" in out
    code, out = invoke(path, *SIZES, "--json")
    document = json.loads(out)
    assert document["curve_eviction"] == "lru"
    assert document["configured_eviction"] == {"dram": "s3fifo", "disk": "arc"}
