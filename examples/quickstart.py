"""The public API in one page: put a prompt's KV, find its prefix, read it back.

Runs as written on the embedded default (DRAM + a local disk tier in a temporary directory), in
about 3 s on a 2-core machine:

    .venv/bin/python examples/quickstart.py
"""

import asyncio
import tempfile

import torch

from kvstore import KVLayout, KVStore, StoreConfig, chunk_keys


async def main() -> None:
    layout = KVLayout(num_layers=30, num_kv_heads=3, head_dim=64, dtype=torch.bfloat16)  # SmolLM2-135M
    with tempfile.TemporaryDirectory() as cache_dir:
        config = StoreConfig(dram={"capacity": "256MiB"}, disk={"path": cache_dir})
        prompt = list(range(1000))  # token ids: 3 full chunks of 256 tokens (the last 232 have no key)
        keys = chunk_keys(prompt, layout, namespace="smollm2")

        async with KVStore(config, layout, namespace="smollm2") as store:
            for i, key in enumerate(keys):
                kv = torch.full(layout.chunk_shape, float(i), dtype=layout.dtype)  # the engine's KV
                await store.put(key, kv)  # returns at once; the disk write happens behind it
            await store.flush()

        async with KVStore(config, layout, namespace="smollm2") as store:  # as after a restart
            n = await store.lookup(keys)
            out = torch.empty(layout.chunk_shape, dtype=layout.dtype)
            kv = await store.get(keys[2], out=out)
            assert kv is not None and bool((kv == 2).all())
            print(f"{n} of {len(keys)} chunks found after a restart; chunk 2 read back exactly")
            print(store.stats()["disk"])


asyncio.run(main())
