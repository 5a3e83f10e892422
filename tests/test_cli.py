"""The `kvstore` command: the demo and the benchmark run end to end and report what they measured."""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from support import chunk_file, start_server
from typer.testing import CliRunner

from kvstore.cli import app
from kvstore.cli.console import EXIT_UNREACHABLE
from kvstore.testing.servers import RedisServer, free_port

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
    threads = torch.get_num_threads()
    options = ["--mib", "8", "--repeats", "1", "--dir", str(tmp_path), "--disk-parts", "--torch-threads", "1"]
    result = runner.invoke(app, ["bench", *options])
    assert result.exit_code == 0, result.output
    machine = r"^machine: .*; flags .*; \d+ cores; torch threads 1; load average [\d.]+; NUMA nodes \S+; transparent"
    machine += r" huge pages \S+; memcpy (glibc [\d.]+(: .+|, thresholds \?)|not glibc)$"  # sizes: per CPU and glibc
    assert re.search(machine, result.output, re.M)
    assert torch.get_num_threads() == threads, "--torch-threads holds for the run only"
    operations = ("DRAM put", "DRAM get", "disk put+flush", "disk get_many (warm)", "disk get_many (cold)")
    for operation in (*operations, "internal: tier write", "internal: tier read (warm)", "internal: tier read (cold)"):
        assert operation in result.output
    assert len(re.findall(r"│\s+\d+\.\d\dx │", result.output)) == 16  # one ratio per layout and operation
    # --disk-parts: each stage of a disk put, per layout, and the path's ratio to each baseline
    assert len(re.findall(r"checksums \+ write, a run at a time \(the tier\)", result.output)) == 2
    assert len(re.findall(r"put \+ flush at \d+\.\d\dx", result.output)) == 6
    assert "bytesplit" in result.output and "rms rel" in result.output
    assert list(tmp_path.iterdir()) == []  # the benchmark cleans up after itself


def test_the_machine_line_names_how_glibc_copies_as_this_process_has_it_tuned() -> None:
    """The sizes come from the dynamic loader, with this environment's GLIBC_TUNABLES (what moves DRAM copies).

    Both CPU kinds this project runs on are x86-64 with glibc 2.33 or later, whose loader lists them."""
    code = "from kvstore.bench.machine import describe_memcpy; print(describe_memcpy())"
    environment = {**os.environ, "GLIBC_TUNABLES": "glibc.cpu.x86_non_temporal_threshold=0x300000"}
    described = subprocess.run(
        [sys.executable, "-c", code], env=environment, capture_output=True, text=True, check=True
    )
    assert described.stdout.endswith("non-temporal stores from 3.0 MiB (GLIBC_TUNABLES set)\n"), described.stdout


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


def test_ls_reads_the_codec_from_each_chunk_header_and_names_what_is_not_a_chunk(tmp_path, monkeypatch) -> None:
    config, root = disk_only(tmp_path, monkeypatch)
    chunk_file(root, "junk", size=5000)  # a file named like a chunk, holding no chunk header
    chunk_file(root, "junk", size=10)
    result = runner.invoke(app, ["ls", "--json", "--config", str(config)])
    assert result.exit_code == 0, result.output
    (row,) = json.loads(result.stdout)  # stdout is the JSON alone; what was read is said on stderr
    assert row["namespace"] == "junk" and row["chunks"] == 2 and row["codecs"] == {"(not a chunk)": 2}
    assert result.stderr == f"read from disk: {root}\n"


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


# -- a tier that cannot be used: one line naming it, exit code 5, no secret -----------------------

PASSWORD = "s3cret-redis-password"
SECRET_KEY = "s3cret-aws-secret-access-key"
TOOLS = [["ls"], ["stats"], ["gc", "--max-age", "1d", "--yes"], ["verify"]]


@pytest.fixture(scope="module")
def redis_with_password() -> Iterator[RedisServer]:
    server = RedisServer("--requirepass", PASSWORD)
    start_server(server)
    try:
        yield server
    finally:
        server.close()


def remote_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, section: str) -> Path:
    """A TOML with one remote tier (``section``, a TOML table's body), short timeouts and a secret AWS key set."""
    for name in list(os.environ):
        if name.upper().startswith("KVSTORE"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIDEXAMPLE")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET_KEY)
    config = tmp_path / "kvstore.toml"
    config.write_text(f'[disk]\nenabled = false\n[timeouts]\nget = "500ms"\n{section}\nconnect_timeout = "500ms"\n')
    return config


def run_tool(args: list[str], config: Path, caplog: pytest.LogCaptureFixture) -> tuple[int, str, str]:
    """Exit code, stdout and stderr of a tool; no warning may have been logged beside the one error line."""
    with caplog.at_level(logging.WARNING, logger="kvstore"):
        result = runner.invoke(app, [*args, "--config", str(config)])
    assert not [record.getMessage() for record in caplog.records], "the engine's warnings leak into the tool"
    return result.exit_code, result.stdout, result.stderr


def assert_one_line(code: int, out: str, err: str, *fragments: str) -> None:
    assert code == EXIT_UNREACHABLE, (code, out, err)
    assert err.count("\n") == 1 and "Traceback" not in err, err
    for fragment in fragments:
        assert fragment in err, (fragment, err)
    assert PASSWORD not in out + err and SECRET_KEY not in out + err


@pytest.mark.parametrize("args", TOOLS, ids=lambda args: args[0])
def test_a_redis_nobody_listens_on_is_one_line_and_exit_5(tmp_path, monkeypatch, caplog, args) -> None:
    port = free_port()
    url = f"redis://:{PASSWORD}@127.0.0.1:{port}/0"
    config = remote_only(tmp_path, monkeypatch, f'[redis]\nenabled = true\nurl = "{url}"')
    code, out, err = run_tool(args, config, caplog)
    assert_one_line(code, out, err, "the redis tier", f"127.0.0.1:{port}", "Connect call failed")


@pytest.mark.parametrize("args", TOOLS, ids=lambda args: args[0])
def test_an_s3_endpoint_nobody_listens_on_is_one_line_and_exit_5(tmp_path, monkeypatch, caplog, args) -> None:
    port = free_port()
    section = f'[s3]\nenabled = true\nbucket = "kv"\nendpoint_url = "http://127.0.0.1:{port}"\nmax_attempts = 1'
    code, out, err = run_tool(args, remote_only(tmp_path, monkeypatch, section), caplog)
    assert_one_line(code, out, err, "the s3 tier", f"bucket 'kv' at http://127.0.0.1:{port}", "Could not connect")


@pytest.mark.parametrize("password", ["wrong-password", None], ids=["wrong", "missing"])
def test_a_redis_refusing_the_password_is_one_line_and_exit_5(
    tmp_path, monkeypatch, caplog, redis_with_password, password
) -> None:
    url = redis_with_password.url.replace("redis://", f"redis://:{password}@" if password else "redis://")
    config = remote_only(tmp_path, monkeypatch, f'[redis]\nenabled = true\nurl = "{url}"')
    code, out, err = run_tool(["ls"], config, caplog)
    assert_one_line(code, out, err, "the redis tier", f"127.0.0.1:{redis_with_password.port}")
    assert "password" in err.lower() or "NOAUTH" in err or "Authentication" in err, err
    assert password is None or password not in err


def test_the_right_redis_password_lists(tmp_path, monkeypatch, caplog, redis_with_password) -> None:
    url = redis_with_password.url.replace("redis://", f"redis://:{PASSWORD}@")
    config = remote_only(tmp_path, monkeypatch, f'[redis]\nenabled = true\nurl = "{url}"')
    code, out, err = run_tool(["ls"], config, caplog)
    assert code == 0 and err == "" and "no chunks stored" in out, (code, out, err)
    assert PASSWORD not in out


def test_the_exit_codes_are_in_the_help() -> None:
    result = runner.invoke(app, ["--help"])
    assert result.exit_code == 0
    assert "Exit codes" in result.output and "5 a tier's server could not be reached" in " ".join(result.output.split())


# -- temporary files a killed writer left -----------------------------------------------------------


def temporaries(root: Path) -> tuple[Path, Path]:
    """A stale temporary (a writer killed 20 minutes ago) and a fresh one (a write in progress)."""
    chunk = chunk_file(root)
    chunk.unlink()  # only its name: the temporaries are the files of two writes of it
    stale = chunk.with_name(f"{chunk.name}.tmp-4242-deadbeef")
    fresh = chunk.with_name(f"{chunk.name}.tmp-4343-cafef00d")
    stale.write_bytes(b"y" * 3000)
    fresh.write_bytes(b"z" * 3000)
    past = time.time() - 20 * 60  # older than the bound a store's open sweeps with (disk.STALE_TMP_SECONDS)
    os.utime(stale, (past, past))
    return stale, fresh


@pytest.mark.parametrize("args", [["gc", "--max-age", "1d", "--yes"], ["verify"]], ids=["gc", "verify"])
def test_gc_and_verify_remove_stale_temporaries_and_leave_fresh_ones(tmp_path, monkeypatch, args) -> None:
    """They were skipped by the listing and only went when a store opened on the directory."""
    config, root = disk_only(tmp_path, monkeypatch)
    stale, fresh = temporaries(root)
    result = runner.invoke(app, [*args, "--config", str(config)])
    assert result.exit_code == 0, result.output
    assert not stale.exists() and fresh.exists()
    output = " ".join(result.stdout.split())
    assert "removed 1 stale temporary files (2.9 KiB), older than 10 min" in output, output
    assert "left 1 temporary files younger than 10 min" in output, output


def test_a_gc_dry_run_only_reports_stale_temporaries(tmp_path, monkeypatch) -> None:
    config, root = disk_only(tmp_path, monkeypatch)
    stale, fresh = temporaries(root)
    result = runner.invoke(app, ["gc", "--max-age", "1d", "--dry-run", "--config", str(config)])
    assert result.exit_code == 0, result.output
    assert stale.exists() and fresh.exists()
    assert "dry run: would remove 1 stale temporary files" in " ".join(result.stdout.split()), result.stdout


@pytest.mark.parametrize("dram, problem", [("12,5MB", "Invalid value for '--dram'"), ("0", "dram.capacity = '0'")])
def test_demo_refuses_a_dram_size_it_cannot_use_without_a_traceback(tmp_path, dram, problem) -> None:
    result = runner.invoke(app, ["demo", "--dram", dram, "--dir", str(tmp_path)])
    assert result.exit_code == 2 and problem in result.output and "Traceback" not in result.output, result.output
