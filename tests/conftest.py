"""Shared fixtures: the real KV sample, and real servers for the remote tiers."""

from collections.abc import Iterator
from pathlib import Path

import boto3
import numpy as np
import pytest
import torch
from botocore.config import Config

from kvstore.devtools.servers import DevServer, MotoServer, RedisClusterServer, RedisServer, S3Server, SeaweedFSServer
from kvstore.errors import ServerError

# ---------------------------------------------------------------------------------------------
# Real KV sample for codec and container tests (test_codecs.py, test_format.py).
# ---------------------------------------------------------------------------------------------
REAL_KV_PATH = Path(__file__).resolve().parents[1].parent / "shared" / "kv_smollm2_512tok_bf16bits.npy"
REAL_KV_SHAPE = (30, 2, 512, 3, 64)  # [layer, k_or_v, token, kv_head, head_dim] of SmolLM2-135M


@pytest.fixture(scope="session")
def real_kv() -> torch.Tensor:
    """512 tokens of real SmolLM2-135M KV, bf16, shape [30, 2, 512, 3, 64]. Missing file = failure."""
    if not REAL_KV_PATH.is_file():
        pytest.fail(
            f"the real KV sample {REAL_KV_PATH} is missing: codec and format tests need it "
            "(it lives in the shared/ folder beside the repository; see DESIGN.md)",
            pytrace=False,
        )
    bits = np.load(REAL_KV_PATH)  # allow_pickle stays False: the file is plain data
    assert bits.dtype == np.uint16 and bits.shape == REAL_KV_SHAPE, (bits.dtype, bits.shape)
    return torch.from_numpy(bits).view(torch.bfloat16)


# ---------------------------------------------------------------------------------------------
# Real servers (kvstore.devtools.servers), one of each per test session. A server that cannot start
# fails the tests that need it: remote-tier tests never skip.
# ---------------------------------------------------------------------------------------------
TEST_BUCKET = "kvstore-test"


def start_server(server: DevServer) -> DevServer:
    try:
        return server.start()
    except ServerError as exc:
        pytest.fail(f"could not start {server.name} for the remote-tier tests: {exc}", pytrace=False)


def raw_s3_client(server: S3Server):
    """A plain boto3 client, for tests that reach under kvstore (making buckets, corrupting objects)."""
    return boto3.client(
        "s3",
        endpoint_url=server.endpoint_url,
        aws_access_key_id=server.access_key,
        aws_secret_access_key=server.secret_key,
        region_name=server.region,
        config=Config(s3={"addressing_style": "path"}, retries={"max_attempts": 5, "mode": "standard"}),
    )


def _serve(server: DevServer) -> Iterator[DevServer]:
    start_server(server)
    try:
        if isinstance(server, S3Server):
            raw_s3_client(server).create_bucket(Bucket=TEST_BUCKET)
        yield server
    finally:
        server.close()


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    yield from _serve(RedisServer())


@pytest.fixture(scope="session")
def redis_cluster() -> Iterator[RedisClusterServer]:
    yield from _serve(RedisClusterServer())


@pytest.fixture(scope="session")
def moto_server() -> Iterator[MotoServer]:
    yield from _serve(MotoServer())


@pytest.fixture(scope="session")
def seaweedfs_server() -> Iterator[SeaweedFSServer]:
    yield from _serve(SeaweedFSServer())
