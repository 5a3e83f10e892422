"""An S3 archive tier: store a prompt's KV, then stream it back from S3 layer by layer in a fresh store.

Uses the S3 server your environment points at (``AWS_ENDPOINT_URL_S3`` or ``AWS_ENDPOINT_URL``,
or ``--endpoint``; credentials from the usual AWS chain) and ``--bucket``. With no endpoint set,
it starts a local moto server (``pip install 'moto[server]'``) and says so. About 5 s on a 2-core
machine with moto. Run:

    .venv/bin/python examples/s3_tier.py
    AWS_ENDPOINT_URL_S3=http://127.0.0.1:8333 .venv/bin/python examples/s3_tier.py --bucket kvstore
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import tempfile

import torch

from kvstore import KVLayout, KVStore, StoreConfig, chunk_keys
from kvstore.testing.servers import MotoServer, environment

LAYOUT = KVLayout(num_layers=30, num_kv_heads=3, head_dim=64, dtype=torch.bfloat16)  # SmolLM2-135M
NAMESPACE = "smollm2-135m"
MIB = 1 << 20


def fake_kv(seed: int) -> torch.Tensor:
    """Stand-in for one chunk of an engine's KV: random bf16 values that compress like real SmolLM2 KV."""
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(LAYOUT.chunk_shape, generator=generator) * 2).to(LAYOUT.dtype)


async def demo(s3: dict[str, object]) -> None:
    prompt = list(range(1100))  # token ids: 4 full chunks of 256 (the last 76 tokens have no key)
    keys = chunk_keys(prompt, LAYOUT, namespace=NAMESPACE)
    chunks = [fake_kv(i) for i in range(len(keys))]

    with tempfile.TemporaryDirectory() as disk:
        # The engine's store: DRAM, then local disk, then S3. put() returns at once; the cascade
        # writes to disk and to S3 (compressed by the tier's codec) behind it.
        config = StoreConfig(dram={"capacity": "64MiB"}, disk={"path": disk}, s3=s3)
        async with KVStore(config, LAYOUT, namespace=NAMESPACE) as store:
            for key, kv in zip(keys, chunks, strict=True):
                await store.put(key, kv)
            await store.flush()  # wait until every tier, S3 included, holds the chunks
            s3_stats = store.stats()["s3"]  # the tier's counters
        raw, stored = s3_stats["writes"] * LAYOUT.chunk_nbytes, s3_stats["bytes_written"]  # what S3 now holds
        print(
            f"put {len(keys)} chunks; S3 stores {s3_stats['writes']} objects: {stored / MIB:.1f} MiB for "
            f"{raw / MIB:.1f} MiB of KV, {raw / stored:.2f}x smaller with codec {s3_stats['codec']}"
        )

    # Another machine (or this one after a restart, its disk gone): DRAM and S3 only.
    config = StoreConfig(dram={"capacity": "64MiB"}, disk={"enabled": False}, s3=s3)
    async with KVStore(config, LAYOUT, namespace=NAMESPACE) as store:
        n = await store.lookup(keys)  # a few HEAD requests (a binary search), not one per chunk
        print(f"a fresh store with DRAM + S3 only finds {n} of {len(keys)} chunks of the prompt")
        exact = [True] * n
        # Layer 0 of every chunk arrives first, then layer 1...: an engine computes layer i while
        # later layers are still on the wire. Each layer is a verified byte range of its object.
        async with store.prefetch(keys[:n], depth=4) as stream:
            async for layer, kv_layer in stream:  # [2, n * 256 tokens, heads, head_dim]
                for i, part in enumerate(kv_layer.split(LAYOUT.chunk_tokens, dim=1)):
                    exact[i] &= torch.equal(part, chunks[i][layer])
        requests = store.stats()["s3"]["requests"]
        print(f"{sum(exact)} of {n} chunks streamed back exactly, layer by layer ({requests} S3 requests)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--endpoint", help="S3 endpoint URL (default: $AWS_ENDPOINT_URL_S3 / $AWS_ENDPOINT_URL)")
    parser.add_argument("--bucket", default="kvstore-example", help="bucket (created if missing)")
    args = parser.parse_args()
    s3 = {
        "enabled": True,
        "bucket": args.bucket,
        "endpoint_url": args.endpoint,  # None: botocore reads AWS_ENDPOINT_URL_S3 / AWS_ENDPOINT_URL
        # Lossless (the remote default): byteplanes stores the (incompressible) low mantissa bytes as
        # they are and entropy-codes the sign+exponent bytes with zstd; ~1.46x on bf16 KV.
        "codec": "byteplanes",
        "create_bucket": True,
        "prefix": "kvstore-example",  # object names: kvstore-example/<namespace>/<key>
    }
    endpoint = args.endpoint or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    with contextlib.ExitStack() as stack:
        if endpoint is None:
            server = stack.enter_context(MotoServer())
            stack.enter_context(environment(server.credentials_env()))  # the AWS chain finds it and its keys
            print(f"no S3 endpoint set (AWS_ENDPOINT_URL_S3 or --endpoint): started moto at {server.endpoint_url}")
        else:
            print(f"using the S3 server at {endpoint}, bucket {args.bucket!r}")
        asyncio.run(demo(s3))


if __name__ == "__main__":
    main()
