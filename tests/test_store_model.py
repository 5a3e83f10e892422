"""The store against a model: random puts, gets, lookups, evictions, restarts and corruption.

Whatever the sequence, a chunk that comes back is exactly the chunk put under that key, a
lookup never claims a chunk that a get then cannot return, and no DRAM slot stays referenced
once the store is idle. Small DRAM and disk budgets force both tiers to evict all the time.
"""

from __future__ import annotations

import asyncio
import shutil
import tempfile
import threading
from pathlib import Path

import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from kvstore import KVLayout, KVStore, StoreConfig, SyncKVStore, chunk_keys

LAYOUT = KVLayout(num_layers=3, num_kv_heads=1, head_dim=8, chunk_tokens=16)
CHUNKS = 8
KEYS = chunk_keys(list(range(CHUNKS * LAYOUT.chunk_tokens)), LAYOUT, "model")
FILE_BYTES = 4096 + LAYOUT.chunk_nbytes  # page-aligned header + identity payload


def chunk(i: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1000 + i)
    return torch.randn(LAYOUT.chunk_shape, generator=generator).to(LAYOUT.dtype)


class StoreModel(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.directory = Path(tempfile.mkdtemp(prefix="kvstore-model-"))
        self.config = StoreConfig(
            dram={"capacity": 3 * LAYOUT.chunk_nbytes},
            disk={"path": self.directory, "capacity": 5 * FILE_BYTES},
            queue_depth=4,
            timeouts={"get": 5, "put": 5, "close": 5},
        )
        self.loop = asyncio.new_event_loop()
        self.store = self._open()
        self.ever_put: set[int] = set()

    def _run(self, coroutine):  # type: ignore[no-untyped-def]
        return self.loop.run_until_complete(coroutine)

    def _open(self) -> KVStore:
        return self._run(KVStore(self.config, LAYOUT, namespace="model").open())

    @rule(indexes=st.lists(st.integers(0, CHUNKS - 1), min_size=1, max_size=4))
    def put(self, indexes: list[int]) -> None:
        async def puts() -> list[bool]:
            return [await self.store.put(KEYS[i], chunk(i)) for i in indexes]

        accepted = self._run(puts())
        self.ever_put.update(i for i, ok in zip(indexes, accepted, strict=True) if ok)

    @rule(indexes=st.lists(st.integers(0, CHUNKS - 1), min_size=1, max_size=5), batched=st.booleans())
    def get(self, indexes: list[int], batched: bool) -> None:
        keys = [KEYS[i] for i in indexes]

        async def concurrent_gets() -> list[torch.Tensor | None]:
            return list(await asyncio.gather(*(self.store.get(key) for key in keys)))

        results = self._run(self.store.get_many(keys) if batched else concurrent_gets())
        for i, result in zip(indexes, results, strict=True):
            if result is not None:
                assert i in self.ever_put, f"chunk {i} was never put but came back"
                assert torch.equal(result, chunk(i)), f"chunk {i} came back different"

    @rule(start=st.integers(0, CHUNKS - 1))
    def lookup_then_load(self, start: int) -> None:
        keys = KEYS[start:]
        found = self._run(self.store.lookup(keys))
        assert 0 <= found <= len(keys)
        # Everything lookup claimed is loadable now, unless the small DRAM pool ran out of
        # slots for the batch (then get_many reports misses rather than waiting).
        results = self._run(self.store.get_many(keys[:found]))
        for offset, result in enumerate(results):
            if result is not None:
                assert torch.equal(result, chunk(start + offset))

    @rule()
    def flush(self) -> None:
        self._run(self.store.flush())

    @rule(index=st.integers(0, CHUNKS - 1))
    def evict_from_dram(self, index: int) -> None:
        self.store.pool.discard(KEYS[index])

    @rule()
    def restart(self) -> None:
        self._run(self.store.close())
        self.store = self._open()

    @rule(index=st.integers(0, CHUNKS - 1), position=st.integers(0, FILE_BYTES - 1), bit=st.integers(0, 7))
    def corrupt_a_file(self, index: int, position: int, bit: int) -> None:
        # Draws stay independent of what the cascade has written so far (hypothesis replays them).
        self._run(self.store.flush())
        path = self.store.tiers[0].backend.path_for(KEYS[index])
        if path.exists():
            raw = bytearray(path.read_bytes())
            raw[position % len(raw)] ^= 1 << bit
            path.write_bytes(bytes(raw))

    @invariant()
    def idle_store_holds_no_references(self) -> None:
        self._run(self.store.flush())
        stats = self.store.stats()
        assert stats["dram"]["referenced"] == 0
        assert stats["disk"]["bytes_used"] <= 5 * FILE_BYTES
        assert stats["disk"]["errors"] == 0 and stats["disk"]["timeouts"] == 0

    def teardown(self) -> None:
        self._run(self.store.close())
        self.loop.close()
        shutil.rmtree(self.directory, ignore_errors=True)


TestStoreModel = StoreModel.TestCase
TestStoreModel.settings = settings(
    max_examples=200,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


def test_engine_threads_share_one_store_and_always_read_exact_chunks(tmp_path: Path) -> None:
    """Four engine threads put and read overlapping prefixes through one SyncKVStore."""
    config = StoreConfig(
        dram={"capacity": 4 * LAYOUT.chunk_nbytes},
        disk={"path": tmp_path, "capacity": 64 * FILE_BYTES},
    )
    errors: list[BaseException] = []
    reads = [0]
    with SyncKVStore(config, LAYOUT, "model") as store:

        def engine(seed: int) -> None:
            try:
                generator = torch.Generator().manual_seed(seed)
                for _ in range(60):
                    i = int(torch.randint(0, CHUNKS, (1,), generator=generator))
                    if torch.rand(1, generator=generator) < 0.4:
                        store.put(KEYS[i], chunk(i))
                    else:
                        got = store.get(KEYS[i])
                        if got is not None:
                            assert torch.equal(got, chunk(i)), f"chunk {i} came back different"
                            reads[0] += 1
            except BaseException as exc:  # reported below, from the test's thread
                errors.append(exc)

        threads = [threading.Thread(target=engine, args=(seed,)) for seed in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        store.flush()
        stats = store.stats()
    assert not errors, errors[0]
    assert reads[0] > 0
    assert stats["dram"]["referenced"] == 0
    assert stats["disk"]["corrupt"] == 0 and stats["disk"]["errors"] == 0
