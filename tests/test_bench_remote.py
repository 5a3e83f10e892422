"""`kvstore bench --remote`: the remote tiers run beside their raw clients on real dev servers.

Smoke tests at a tiny size: every target and public-API operation (put+flush, get_many) gets a row
with a finite ratio (the run itself raises if the store drops, misses or changes a chunk), and the
codec rows show compression on real KV. No timing thresholds (this machine is shared and noisy).
A dev server that cannot start fails these tests: they never skip.
"""

from __future__ import annotations

import asyncio
import math
import re

import torch
from typer.testing import CliRunner

from kvstore.bench.remote import REMOTE_CODECS, run_remote
from kvstore.bench.remote_servers import parse_remotes, serve
from kvstore.cli import app

runner = CliRunner()


def test_run_remote_returns_a_row_per_target_and_operation_and_codec_rows(real_kv: torch.Tensor) -> None:
    with serve(["redis", "moto"], concurrency=2) as remotes:
        results = asyncio.run(
            run_remote(remotes, mib=8, repeats=1, layouts=["SmolLM2-135M"], sample=real_kv, concurrency=2, codec_mib=8)
        )
    assert [row.operation for row in results.rows] == [
        f"{server} {operation}"
        for server in ("redis", "moto")
        for operation in ("put+flush", "put, tier only (internal)", "get_many")
    ]
    for row in results.rows:
        assert row.layout == "SmolLM2-135M" and row.nbytes >= 8 << 20
        assert row.gbps > 0 and row.baseline_gbps > 0
        assert math.isfinite(row.ratio) and row.ratio > 0
        assert row.target == (None if "internal" in row.operation else 0.9)
    assert [(c.server, c.codec) for c in results.codec_rows] == [
        (server, codec) for server in ("redis", "moto") for codec in REMOTE_CODECS
    ]
    for codec_row in results.codec_rows:
        assert codec_row.put_mbps > 0 and codec_row.get_mbps > 0
        if codec_row.codec == "identity":
            assert 0.99 < codec_row.ratio <= 1.0  # the container header is the only overhead
        if codec_row.codec in ("bytesplit", "fp8", "fp8+zstd"):
            assert codec_row.ratio > 1.2, codec_row
        if codec_row.codec == "byteplanes":  # the default remote codec: >= 1.44x on this sample, less the header
            assert codec_row.ratio > 1.4, codec_row


def test_cli_prints_the_remote_tables() -> None:
    args = ["bench", "--no-local", "--remote", "redis,moto", "--mib", "8", "--repeats", "1"]
    result = runner.invoke(app, [*args, "--remote-layout", "SmolLM2-135M", "--concurrency", "2"])
    assert result.exit_code == 0, result.output
    for operation in ("redis put+flush", "redis get_many", "moto put+flush", "moto get_many"):
        assert re.search(rf"{re.escape(operation)}\s*│\s*\d+\s*│", result.output), result.output
    # the internal put rows too, and each codec row's get against identity's
    assert len(re.findall(r"\d+\.\d\dx", result.output)) == 6 + 2 * len(REMOTE_CODECS)
    bytesplit = re.findall(r"bytesplit\s*│\s*yes\s*│\s*(\d+\.\d+)", result.output)
    assert len(bytesplit) == 2 and all(float(ratio) > 1 for ratio in bytesplit), result.output
    identity = re.findall(r"identity\s*│\s*yes\s*│.*│\s*1\.00x", result.output)
    byteplanes = re.findall(r"byteplanes\s*│\s*yes\s*│\s*(\d+\.\d+)\s*│.*│\s*\d+\.\d\dx", result.output)
    assert len(identity) == 2 and len(byteplanes) == 2, result.output
    assert all(float(ratio) > 1.4 for ratio in byteplanes), result.output


def test_remote_names() -> None:
    assert parse_remotes("all") == ["redis", "moto", "seaweedfs"]
    assert parse_remotes("moto, redis") == ["moto", "redis"]
    result = runner.invoke(app, ["bench", "--no-local", "--remote", "minio"])
    assert result.exit_code != 0 and "unknown remote" in result.output
