"""Helpers shared by the test modules: real servers, and raw clients that reach under kvstore.

Fixtures stay in ``conftest.py``; test modules import these helpers from here (``from tests.support
import ...``), never from ``conftest``. Helpers for tiers and listings are in :mod:`kvstore.testing`.
"""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

import boto3
import pytest
from botocore.config import Config

from kvstore.errors import ServerError
from kvstore.testing.servers import DevServer, S3Server

TEST_BUCKET = "kvstore-test"  # made on every session S3 server (conftest.py)


def start_server(server: DevServer) -> DevServer:
    """Start ``server``; a server that cannot start fails the test (remote-tier tests never skip)."""
    try:
        return server.start()
    except ServerError as exc:
        pytest.fail(f"could not start {server.name} for the remote-tier tests: {exc}", pytrace=False)


def raw_s3_client(server: S3Server):  # a boto3 S3 client (boto3 has no static type for it)
    """A plain boto3 client, for tests that reach under kvstore (making buckets, corrupting objects)."""
    return boto3.client(
        "s3",
        endpoint_url=server.endpoint_url,
        aws_access_key_id=server.access_key,
        aws_secret_access_key=server.secret_key,
        region_name=server.region,
        config=Config(s3={"addressing_style": "path"}, retries={"max_attempts": 5, "mode": "standard"}),
    )


def chunk_file(root: Path, namespace: str = "m", size: int = 5000, age: float = 0.0) -> Path:
    """A file where the disk tier keeps a chunk (gc lists by name and size; the contents do not matter)."""
    key = os.urandom(32).hex()
    path = root / namespace / key[:2] / key[2:4] / f"{key}.kvc"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"x" * size)
    if age:
        os.utime(path, (time.time() - age, time.time() - age))
    return path


def check_remote_tier(out: str, tier: str, stores: str) -> None:
    """4 chunks stored compressed (lossless, > 1.3x: bf16 exponent bytes), found and streamed back bit-exact."""
    stored = re.search(
        rf"^put 4 chunks; {tier} stores 4 {stores}: ([\d.]+) MiB for 22.5 MiB of KV, ([\d.]+)x", out, re.M
    )
    assert stored is not None, out
    assert float(stored[2]) > 1.3, out  # measured 1.44x; real SmolLM2 KV gets the same
    assert "finds 4 of 4 chunks of the prompt" in out, out
    assert "4 of 4 chunks streamed back exactly, layer by layer" in out, out
