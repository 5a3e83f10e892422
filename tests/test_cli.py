"""The `kvstore` command: the demo and the benchmark run end to end and report what they measured."""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

import pytest
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


# -- the operator commands on a disk directory, without servers ----------------------------------


def disk_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, Path]:
    """A kvstore TOML with only a disk tier under tmp_path (no KVSTORE_* variable from outside), and its root."""
    for name in list(os.environ):
        if name.upper().startswith("KVSTORE"):
            monkeypatch.delenv(name)
    root = tmp_path / "disk"
    config = tmp_path / "kvstore.toml"
    config.write_text(f'[disk]\npath = "{root}"\n')
    return config, root


def chunk_file(root: Path, namespace: str = "m", size: int = 5000, age: float = 0.0) -> Path:
    """A file where the disk tier keeps a chunk (gc lists by name and size; the contents do not matter)."""
    key = os.urandom(32).hex()
    path = root / namespace / key[:2] / key[2:4] / f"{key}.kvc"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"x" * size)
    if age:
        os.utime(path, (time.time() - age, time.time() - age))
    return path


@pytest.mark.parametrize(
    "option, value, problem",
    [
        ("--max-bytes", "12,5GB", "decimal point as '.'"),  # was read as 12 bytes: nearly everything deleted
        ("--max-bytes", "-5", "cannot be negative"),
        ("--max-bytes", "5 XB", "unknown unit 'XB'"),
        ("--max-bytes", "", "an empty size"),
        ("--max-age", "-5", "cannot be negative"),
        ("--max-age", "10 fortnights", "unknown unit"),
    ],
)
def test_gc_refuses_a_size_or_duration_it_cannot_read_whole(tmp_path, monkeypatch, option, value, problem) -> None:
    config, root = disk_only(tmp_path, monkeypatch)
    kept = chunk_file(root)
    result = runner.invoke(app, ["gc", option, value, "--yes", "--config", str(config)])
    output = " ".join(re.sub(r"[│╭╮╰╯─]", " ", result.output).split())  # rich boxes the usage error
    assert result.exit_code == 2, output
    assert f"Invalid value for '{option}'" in output and problem in output and "e.g." in output, output
    assert kept.exists()


def test_gc_reads_decimal_sizes_and_worded_durations(tmp_path, monkeypatch) -> None:
    config, root = disk_only(tmp_path, monkeypatch)
    old, new = chunk_file(root, age=3600), chunk_file(root)
    result = runner.invoke(app, ["gc", "--max-age", "30 minutes", "--max-bytes", "0.005MB", "-y", "-c", str(config)])
    assert result.exit_code == 0, result.output
    assert not old.exists() and new.exists()
