"""Sharing through the archive tier: one process writes a prefix, another process with a fresh
store and empty DRAM reads it back bit-exact. Configured the way users configure it: KVSTORE_*
environment variables, credentials from the standard AWS variables, REDIS_URL."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid

import pytest
from support import TEST_BUCKET

ENGINE = r"""
import asyncio, json, sys
import torch
from kvstore import KVLayout, KVStore, StoreConfig

ROLE, TOKENS = sys.argv[1], 5 * 64
layout = KVLayout(num_layers=6, num_kv_heads=2, head_dim=32, chunk_tokens=64, dtype=torch.bfloat16)
tokens = torch.randint(0, 32_000, (TOKENS,), generator=torch.Generator().manual_seed(7)).tolist()

def expected(i):
    return torch.randn(layout.chunk_shape, generator=torch.Generator().manual_seed(1000 + i)).to(layout.dtype)

async def main():
    config = StoreConfig()  # everything from KVSTORE_* and the standard variables
    async with KVStore(config, layout, namespace="sharing-test") as store:
        keys = store.chunk_keys(tokens)
        if ROLE == "writer":
            for i, key in enumerate(keys):
                assert await store.put(key, expected(i))
            await store.flush()
            print(json.dumps({"stats": store.stats()}))
            return
        found = await store.lookup(keys)
        chunks = await store.get_many(keys[:found])
        exact = [kv is not None and torch.equal(kv.view(torch.int16), expected(i).view(torch.int16))
                 for i, kv in enumerate(chunks)]
        print(json.dumps({"found": found, "exact": exact, "stats": store.stats()}))

asyncio.run(main())
"""


def run_engine(role: str, env: dict[str, str]) -> dict:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("KVSTORE_", "AWS_", "REDIS_"))}
    result = subprocess.run(
        [sys.executable, "-c", ENGINE, role], env={**clean, **env}, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.fixture(params=["s3-moto", "s3-seaweedfs", "redis", "redis-cluster"])
def remote_env(request, tmp_path) -> tuple[str, dict[str, str]]:
    kind = request.param
    common = {"KVSTORE_DISK__ENABLED": "false", "KVSTORE_DRAM__CAPACITY": "64MiB", "HOME": str(tmp_path)}
    prefix = f"sharing-{uuid.uuid4().hex[:8]}"
    if kind.startswith("s3"):
        server = request.getfixturevalue("moto_server" if kind == "s3-moto" else "seaweedfs_server")
        env = {**server.credentials_env(), "KVSTORE_S3__ENABLED": "true", "KVSTORE_S3__BUCKET": TEST_BUCKET}
        return "s3", {**common, **env, "KVSTORE_S3__PREFIX": prefix}
    server = request.getfixturevalue("redis_cluster" if kind == "redis-cluster" else "redis_server")
    env = {"KVSTORE_REDIS__ENABLED": "true", "REDIS_URL": server.url, "KVSTORE_REDIS__PREFIX": prefix}
    if kind == "redis-cluster":
        env["KVSTORE_REDIS__CLUSTER"] = "true"
    return "redis", {**common, **env}


def test_a_second_process_reads_the_prefix_bit_exact(remote_env):
    tier, env = remote_env
    written = run_engine("writer", env)
    assert written["stats"][tier]["writes"] == 5 and written["stats"][tier]["errors"] == 0
    read = run_engine("reader", env)
    assert read["found"] == 5
    assert read["exact"] == [True] * 5
    assert read["stats"][tier]["hits"] == 5, "every chunk came from the remote tier (fresh DRAM)"
    assert read["stats"]["store"]["hits"] == 5


def test_encrypted_chunks_are_shared_only_with_the_key(redis_server):
    """Same tenant key: shared. Another key: a foreign miss, and the object is left for its owner."""
    key, other = os.urandom(32).hex(), os.urandom(32).hex()
    env = {
        "KVSTORE_DISK__ENABLED": "false",
        "KVSTORE_DRAM__CAPACITY": "64MiB",
        "KVSTORE_REDIS__ENABLED": "true",
        "REDIS_URL": redis_server.url,
        "KVSTORE_REDIS__PREFIX": f"sharing-{uuid.uuid4().hex[:8]}",
    }
    run_engine("writer", {**env, "KVSTORE_ENCRYPTION__KEY": key})
    wrong = run_engine("reader", {**env, "KVSTORE_ENCRYPTION__KEY": other})
    assert not any(wrong["exact"])
    assert wrong["stats"]["redis"]["foreign"] == wrong["found"] == 5 and wrong["stats"]["redis"]["corrupt"] == 0
    right = run_engine("reader", {**env, "KVSTORE_ENCRYPTION__KEY": key})
    assert right["found"] == 5 and right["exact"] == [True] * 5


async def test_a_tenant_salt_keeps_chunks_unfindable_by_other_tenants(redis_server):
    """Same prompt, same model, same archive: another tenant's salt yields other keys, so no hit."""
    import torch

    from kvstore import KVLayout, KVStore, StoreConfig

    layout = KVLayout(num_layers=2, num_kv_heads=1, head_dim=16, chunk_tokens=16, dtype=torch.bfloat16)
    section = {"enabled": True, "url": redis_server.url, "prefix": f"tenants-{uuid.uuid4().hex[:8]}"}
    config = StoreConfig(dram={"capacity": "1MiB"}, disk={"enabled": False}, redis=section)
    tokens = list(range(64))
    kv = torch.ones(layout.chunk_shape, dtype=layout.dtype)
    async with KVStore(config, layout, "shared-model", salt=b"tenant-a") as tenant_a:
        keys_a = tenant_a.chunk_keys(tokens)
        for key in keys_a:
            assert await tenant_a.put(key, kv)
        await tenant_a.flush()
    async with KVStore(config, layout, "shared-model", salt=b"tenant-b") as tenant_b:
        keys_b = tenant_b.chunk_keys(tokens)
        assert not set(keys_a) & set(keys_b)
        assert await tenant_b.lookup(keys_b) == 0
    async with KVStore(config, layout, "shared-model", salt=b"tenant-a") as tenant_a_again:
        assert await tenant_a_again.lookup(keys_a) == len(keys_a)
