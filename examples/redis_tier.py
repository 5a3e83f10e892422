"""A Redis tier shared by engines, from an engine's thread (SyncKVStore), with chunks that expire (ttl).

Uses the Redis server in ``REDIS_URL`` or ``--url``; with neither, it starts a local
``redis-server`` (``apt-get install -y redis-server``) and says so. About 4 s on a 2-core machine,
1.5 of them waiting for a prompt's chunks to expire. Run:

    .venv/bin/python examples/redis_tier.py
    REDIS_URL=redis://127.0.0.1:6379/0 .venv/bin/python examples/redis_tier.py --ttl 5
"""

from __future__ import annotations

import argparse
import contextlib
import os
import time
import uuid

import torch

from kvstore import KVLayout, StoreConfig, SyncKVStore, chunk_keys
from kvstore.testing.servers import RedisServer

LAYOUT = KVLayout(num_layers=30, num_kv_heads=3, head_dim=64, dtype=torch.bfloat16)  # SmolLM2-135M
NAMESPACE = "smollm2-135m"
MIB = 1 << 20


def redis_store(url: str, prefix: str, ttl: float) -> StoreConfig:
    """Engines on several hosts share one Redis: the disk tier is off, so everything below DRAM is Redis."""
    redis = {
        "enabled": True,
        "url": url,
        # lossless, ~1.46x on bf16 KV (the remote default); where the network is fast and capacity is no
        # concern, "identity" (no compression) reads faster
        "codec": "byteplanes",
        "ttl": ttl,  # seconds a chunk lives after it was written or last read in full (None: never)
        "prefix": prefix,  # value names: <prefix>:<namespace>:<key>
    }
    return StoreConfig(dram={"capacity": "64MiB"}, disk={"enabled": False}, redis=redis)


def run(url: str, ttl: float) -> None:
    prefix = f"kvstore-example-{uuid.uuid4().hex[:8]}"  # this run's values only
    config = redis_store(url, prefix, ttl=60)  # a minute to read the prompt back here; hours in practice
    prompt = list(range(1100))  # token ids: 4 full chunks of 256 (the last 76 tokens have no key)
    keys = chunk_keys(prompt, LAYOUT, namespace=NAMESPACE)
    generator = torch.Generator().manual_seed(0)  # stand-in KV: compresses like real SmolLM2 KV
    chunks = [(torch.randn(LAYOUT.chunk_shape, generator=generator) * 2).to(LAYOUT.dtype) for _ in keys]

    # SyncKVStore runs kvstore's event loop in a background thread: plain calls, no asyncio, as in an engine.
    with SyncKVStore(config, LAYOUT, namespace=NAMESPACE) as store:  # engine A computed the prompt
        for key, kv in zip(keys, chunks, strict=True):
            store.put(key, kv)  # copies into DRAM and returns; the write to Redis happens behind it
        store.flush()
        stats = store.stats()["redis"]
    raw, stored = stats["writes"] * LAYOUT.chunk_nbytes, stats["bytes_written"]
    print(
        f"put {len(keys)} chunks; Redis stores {stats['writes']} values: {stored / MIB:.1f} MiB for "
        f"{raw / MIB:.1f} MiB of KV, {raw / stored:.2f}x smaller with codec {stats['codec']}"
    )

    with SyncKVStore(config, LAYOUT, namespace=NAMESPACE) as store:  # engine B, same prompt, empty DRAM
        n = store.lookup(keys)  # one pipelined round trip of EXISTS
        print(f"another store finds {n} of {len(keys)} chunks of the prompt in Redis")
        exact = [True] * n
        with store.prefetch(keys[:n], depth=4) as stream:
            for layer in range(LAYOUT.num_layers):  # the engine's layer loop
                kv_layer = stream.wait_layer(layer)  # blocks only if layer `layer` has not arrived yet
                for i, part in enumerate(kv_layer.split(LAYOUT.chunk_tokens, dim=1)):
                    exact[i] &= torch.equal(part, chunks[i][layer])
        requests = store.stats()["redis"]["requests"]
        print(f"{sum(exact)} of {n} chunks streamed back exactly, layer by layer ({requests} Redis requests)")

    # Another prompt, written with a short ttl, that nobody reads for longer: Redis drops its chunks.
    short = redis_store(url, prefix, ttl)
    other = chunk_keys(list(range(5000, 6100)), LAYOUT, namespace=NAMESPACE)
    with SyncKVStore(short, LAYOUT, namespace=NAMESPACE) as store:
        for key, kv in zip(other, chunks, strict=True):
            store.put(key, kv)
        store.flush()
        written = store.stats()["redis"]["writes"]
    time.sleep(ttl + 0.5)
    with SyncKVStore(short, LAYOUT, namespace=NAMESPACE) as store:
        left = store.lookup(other)
    print(f"with ttl {ttl:g} s: {written} of {len(other)} chunks written; {ttl + 0.5:g} s unread, {left} left")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--url", default=os.environ.get("REDIS_URL"), help="redis:// URL (default: $REDIS_URL)")
    parser.add_argument("--ttl", type=float, default=1.0, help="seconds a chunk lives unread (hours in practice)")
    args = parser.parse_args()
    with contextlib.ExitStack() as stack:
        url = args.url
        if url is None:
            url = stack.enter_context(RedisServer()).url
            print(f"no REDIS_URL or --url: started redis-server at {url}")
        else:
            print(f"using the Redis server at {url}")
        run(url, args.ttl)


if __name__ == "__main__":
    main()
