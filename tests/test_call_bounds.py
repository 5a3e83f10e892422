"""Every call is bounded and nothing leaks when a caller gives up (issue 15, items 1, 2, 7 and 15's engine parts).

A layer stream whose reader is cancelled closes within ``timeouts.close`` and leaves no slot,
file or task behind; ``get_many`` and ``lookup`` wait at most one ``timeouts.get`` per call,
whatever the number of chunks; bad arguments are rejected with short, clear messages.
The time bounds below are upper limits guarding against hangs, not performance targets.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from support import start_server

from kvstore import KVLayout, KVStore, StoreConfig
from kvstore.backends.base import ObjectFile, ObjectRead
from kvstore.backends.disk import DiskBackend
from kvstore.codecs import make_codec
from kvstore.devtools.servers import RedisServer
from kvstore.storage.tier import ChunkTier
from kvstore.testing import MemoryBackend

LAYOUT = KVLayout(num_layers=4, num_kv_heads=2, head_dim=16, chunk_tokens=32, dtype=torch.bfloat16)


def chunk(seed: int) -> torch.Tensor:
    return torch.randn(LAYOUT.chunk_shape, generator=torch.Generator().manual_seed(seed)).to(LAYOUT.dtype)


def keys_of(store: KVStore, count: int, seed: int = 0) -> list[str]:
    tokens = torch.randint(0, 30_000, (count * LAYOUT.chunk_tokens,), generator=torch.Generator().manual_seed(seed))
    return store.chunk_keys(tokens.tolist())


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


# -- item 1: a layer stream whose reader is cancelled --------------------------------------------


async def test_cancelling_a_stream_reader_at_random_moments_never_hangs(tmp_path: Path) -> None:
    """The issue's repro: prefetch disk chunks in a task, cancel it at a random moment, close; 300 rounds."""
    cfg = StoreConfig(
        dram={"capacity": LAYOUT.chunk_nbytes * 8},
        disk={"path": tmp_path / "disk"},
        timeouts={"close": 2.0},
    )
    async with KVStore(cfg, LAYOUT, "cancel") as store:
        keys = keys_of(store, 4)
        for i, key in enumerate(keys):
            assert await store.put(key, chunk(i))
        await store.flush()
    rng = random.Random(15)
    async with KVStore(cfg, LAYOUT, "cancel") as store:  # DRAM empty: every stream reads the files
        fds = open_fds()
        async with asyncio.timeout(60):  # a hang fails the test instead of hanging the suite
            for _ in range(300):
                stream = store.prefetch(keys, depth=1)

                async def consume(stream=stream) -> None:
                    async for _ in stream:
                        await asyncio.sleep(0)

                task = asyncio.create_task(consume())
                await asyncio.sleep(rng.random() * 0.002)  # a random moment: opening, reading, or waiting
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                await stream.close()
        assert store.stats()["dram"]["referenced"] == 0, "every stream released its slots"
        assert open_fds() == fds, "every stream closed its files"
