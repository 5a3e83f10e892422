"""The `kvstore` command: the demo and the benchmark run end to end and report what they measured."""

from __future__ import annotations

import re
from pathlib import Path

from typer.testing import CliRunner

from kvstore.cli import app

runner = CliRunner()


def test_demo_runs_the_cascade_and_every_chunk_comes_back(tmp_path: Path) -> None:
    result = runner.invoke(
        app, ["demo", "--prompts", "3", "--tokens", "1024", "--dram", "16MiB", "--dir", str(tmp_path)]
    )
    assert result.exit_code == 0, result.output
    assert "demo ok" in result.output
    # 3 prompts x 4 chunks, the first 2 shared: 8 unique chunks reach disk, all 12 are found after the restart.
    assert re.search(r"cascade \(DRAM -> disk\)\s*│\s*8\b", result.output), result.output
    assert "12/12" in result.output
    assert "12/12 bit-exact" in result.output
    assert len(list(tmp_path.rglob("*.kvc"))) == 8


def test_bench_prints_ratios_against_baselines_measured_in_the_same_run(tmp_path: Path) -> None:
    result = runner.invoke(app, ["bench", "--mib", "8", "--repeats", "1", "--dir", str(tmp_path)])
    assert result.exit_code == 0, result.output
    for operation in ("DRAM put", "DRAM get", "disk write", "disk read (warm)", "disk read (cold)"):
        assert operation in result.output
    assert len(re.findall(r"\d+\.\d\dx", result.output)) == 10  # one ratio per layout and operation
    assert "bytesplit" in result.output and "rms rel" in result.output
    assert list(tmp_path.iterdir()) == []  # the benchmark cleans up after itself


def test_version() -> None:
    result = runner.invoke(app, ["version"])
    assert result.exit_code == 0 and re.fullmatch(r"\d+\.\d+\.\d+\n", result.output)
