"""An engine's scheduler never waits for kvstore's I/O: vLLM's KVStoreTier and SGLang's KVStoreHiCacheStorage.

The tiers are real: a ``redis-server`` reached through a :class:`SlowProxy` that the test holds, so
that Redis's replies (a lookup's, a chunk's) wait until it releases them. While a read is held,
every call the engine's scheduler thread makes into the integration is made on a thread of its own
and must return. A call that waited for the held read could only return once the test released it
(kvstore's ``timeouts.get`` is set longer than the guard), so the guard (``GUARD_S``) fails it
instead of hanging the run: no assertion is about time. Then the read is released, and its bytes
must arrive exactly.

- vLLM (``InVLLM``): the tier's ``lookup``, ``submit_load``, ``submit_store``, ``get_finished_jobs``,
  ``has_pending_work`` and ``get_stats`` (vLLM's ``SecondaryTierManager``, called on its scheduler
  thread), as tests/vllm_support/contract_tier.py makes them, on a plain array shaped like vLLM's
  primary buffer: a load is pending while held and lands byte-exact once released; a store is
  reported once in kvstore's DRAM, whatever Redis does; a lookup answers RETRY until kvstore's
  answer, which comes within ``timeouts.get``.
- SGLang (``InSGLang``): ``batch_get_v1`` runs on a thread of its own, as on SGLang's prefetch I/O
  thread, while the calls SGLang's scheduler thread makes (``get_stats``, ``clear``) return; a held
  read and a held ``batch_exists`` end as misses within ``timeouts.get`` and write nothing into the
  host pool afterwards.
- Both: the scheduler's calls return while kvstore's own event loop is stalled (a ``prepare`` that
  blocks it): none waits for a hop to that loop.

Both integrations import their engine, which lives in an environment of its own (``.venv-vllm``,
``.venv-sglang``). The ``test_*`` functions, in kvstore's environment, run this file's ``InVLLM`` or
``InSGLang`` checks under that environment's Python (one pytest process each, as tests/test_vllm_tier.py
and tests/test_sglang.py run their contracts), against this run's ``redis_server``; kvstore's own run
collects neither class (not ``Test*``). No engine starts.
"""

from __future__ import annotations

import concurrent.futures
import os
import re
import subprocess
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import pytest
import torch

from kvstore.testing.servers import RedisServer
from kvstore.testing.slow_proxy import SlowProxy

T = TypeVar("T")
HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
# Not KVSTORE_*: StoreConfig refuses unknown KVSTORE_* variables.
REDIS_PORT_ENV = "TEST_NEVER_BLOCK_REDIS_PORT"
GUARD_S = 30.0  # a call that returns at all while held passes; one that waits for the held read never would
HELD_GET_S = 2 * GUARD_S  # timeouts.get while a read is held: longer than the guard, so no timeout ends it first
BOUND_GET_S = 0.5  # timeouts.get where the bound itself is checked: a held call ends as a miss meanwhile
SUBPROCESS_TIMEOUT = 600


def on_scheduler(call: Callable[[], T], what: str) -> T:
    """``call()`` made on a thread of its own (an engine's scheduler), its result; fails if it has not returned
    within ``GUARD_S`` (it waits for held I/O), instead of hanging."""
    done = in_background(call, f"scheduler: {what}")
    try:
        return done.result(timeout=GUARD_S)
    except concurrent.futures.TimeoutError:
        pytest.fail(f"{what} did not return within {GUARD_S:.0f}s: it waits for kvstore's I/O or loop")


def in_background(call: Callable[[], T], name: str) -> concurrent.futures.Future[T]:
    """``call()`` on a thread of its own (an engine's I/O thread), as a future."""
    done: concurrent.futures.Future[T] = concurrent.futures.Future()

    def run() -> None:
        try:
            done.set_result(call())
        except BaseException as exc:
            done.set_exception(exc)

    threading.Thread(target=run, name=name, daemon=True).start()
    return done


def until(answer: Callable[[], T | None], what: str) -> T:
    """Poll ``answer()`` (each call guarded as :func:`on_scheduler`) until it is not None, within ``GUARD_S``."""
    deadline = time.monotonic() + GUARD_S
    while time.monotonic() < deadline:
        value = on_scheduler(answer, what)
        if value is not None:
            return value
        time.sleep(0.002)
    pytest.fail(f"{what}: no answer within {GUARD_S:.0f}s")


class StalledLoop:
    """kvstore's event loop stalled by a ``prepare`` that waits on a gate (``store.put_many_future``): the loop
    runs nothing else until :meth:`release`. Stands for a loop busy with other work."""

    def __init__(self, store: Any) -> None:
        self._gate, self._entered = threading.Event(), threading.Event()
        layout = store.layout
        chunk = torch.zeros(layout.chunk_shape, dtype=layout.dtype)

        def prepare(kv: torch.Tensor) -> torch.Tensor:
            self._entered.set()
            self._gate.wait(2 * GUARD_S)
            return kv

        self.call = store.put_many_future(["0" * 64], [chunk], prepare=prepare)
        assert self._entered.wait(GUARD_S), "kvstore's loop never ran the stalling put"

    def release(self) -> None:
        self._gate.set()
        self.call.result(timeout=GUARD_S)


def redis_config(port: int, prefix: str, get_s: float, **more: Any) -> dict[str, Any]:
    """kvstore's config: Redis (at ``port``: the server, or a proxy in front of it) below a small DRAM tier."""
    return {
        "dram": {"capacity": "4MiB", "pin_memory": "never"},
        "disk": {"enabled": False},
        "redis": {"enabled": True, "url": f"redis://127.0.0.1:{port}/0", "prefix": prefix, "codec": "identity"},
        "timeouts": {"get": get_s, "close": 5.0},
        **more,
    }


NO_BREAKER = {"breaker": {"enabled": False}}  # where a test makes a tier time out on purpose, then reads from it


@pytest.fixture(scope="module")
def redis_port() -> Iterator[int]:
    """The port of the outer run's ``redis_server`` (``TEST_NEVER_BLOCK_REDIS_PORT``), or of a server of its own."""
    port = os.environ.get(REDIS_PORT_ENV)
    if port:
        yield int(port)
        return
    server = RedisServer().start()
    try:
        yield server.port
    finally:
        server.close()


@pytest.fixture
def proxy(redis_port: int) -> Iterator[SlowProxy]:
    with SlowProxy("127.0.0.1", redis_port) as made:
        yield made


@pytest.fixture
def prefix() -> str:
    return f"never-block-{uuid.uuid4().hex[:8]}"


# -------------------------------------------------------------------------------------------------------------
# vLLM: KVStoreTier, a secondary tier of vLLM's OffloadingConnector (run under .venv-vllm)
# -------------------------------------------------------------------------------------------------------------


class InVLLM:
    """KVStoreTier's calls as vLLM's scheduler thread makes them (helpers: tests/vllm_support/contract_tier.py)."""

    @pytest.fixture
    def kit(self) -> Any:
        """contract_tier's spec, job and key helpers, and vLLM's types (importable only under .venv-vllm)."""
        from types import SimpleNamespace

        from vllm.v1.kv_offload.base import LookupResult, ReqContext
        from vllm_support import contract_tier

        from kvstore.connectors.vllm import KVStoreTier

        return SimpleNamespace(
            contract=contract_tier, Tier=KVStoreTier, LookupResult=LookupResult, context=ReqContext(req_id="r")
        )

    @pytest.fixture
    def primary(self, kit: Any) -> np.ndarray:
        """vLLM's primary buffer: rows 0-1 hold chunks (random bytes), the others zeros; rows are padded."""
        chunk_bytes = kit.contract.CHUNK_BYTES
        rows = np.zeros((kit.contract.ROWS, chunk_bytes + 4096), dtype=np.int8)
        rows[:2, :chunk_bytes] = np.random.default_rng(7).integers(-128, 127, (2, chunk_bytes), dtype=np.int8)
        return rows

    def tier(self, kit: Any, primary: np.ndarray, config: dict[str, Any]) -> Any:
        return kit.Tier(kit.contract.spec(), memoryview(primary), "KVStoreTier", kvstore_config=config)

    def finish(self, tier: Any) -> list[Any]:
        """Poll as vLLM's scheduler does, once per 'step', until a job is reported."""
        return until(lambda: list(tier.get_finished_jobs()) or None, "get_finished_jobs")

    def resolve(self, kit: Any, tier: Any, key: bytes) -> Any:
        """Ask as vLLM's scheduler does, once per 'step', until the answer is not RETRY."""
        retry = kit.LookupResult.RETRY
        return until(lambda: None if (found := tier.lookup(key, kit.context)) is retry else found, "lookup")

    def write(self, kit: Any, primary: np.ndarray, config: dict[str, Any], keys: list[bytes]) -> None:
        """Rows 0.. stored under ``keys`` by a tier of their own, written through to Redis, then closed."""
        writer = self.tier(kit, primary, config)
        try:
            writer.submit_store(kit.contract.job(1, keys, list(range(len(keys))), promotion=False))
            assert all(result.success for result in self.finish(writer))
            writer.store.flush(timeout=GUARD_S)
        finally:
            writer.shutdown()

    def check_a_load_from_held_redis_is_submitted_and_pending_then_lands_byte_exact(
        self, kit: Any, primary: np.ndarray, redis_port: int, proxy: SlowProxy, prefix: str
    ) -> None:
        key, job, chunk_bytes = kit.contract.key, kit.contract.job, kit.contract.CHUNK_BYTES
        self.write(kit, primary, redis_config(redis_port, prefix, HELD_GET_S), [key(1), key(2)])
        tier = self.tier(kit, primary, redis_config(proxy.port, prefix, HELD_GET_S))  # a fresh DRAM tier
        try:
            assert self.resolve(kit, tier, key(1)) is kit.LookupResult.HIT
            proxy.hold(0)  # every reply waits: the chunks', and a lookup's
            try:
                on_scheduler(lambda: tier.submit_load(job(2, [key(1), key(2)], [4, 5], promotion=True)), "submit_load")
                assert on_scheduler(lambda: list(tier.get_finished_jobs()), "get_finished_jobs") == []
                assert on_scheduler(tier.has_pending_work, "has_pending_work")
                retry = on_scheduler(lambda: tier.lookup(key(3), kit.context), "lookup")
                assert retry is kit.LookupResult.RETRY  # asked, not waited for
                assert on_scheduler(tier.get_stats, "get_stats") is not None
                assert not primary[4:6].any()  # nothing has arrived: the chunks' bytes are held
            finally:
                proxy.release()
            [loaded] = self.finish(tier)
            assert loaded.success and loaded.transfer_bytes == 2 * chunk_bytes
            assert np.array_equal(primary[4:6, :chunk_bytes], primary[:2, :chunk_bytes])
            assert not primary[4:6, chunk_bytes:].any()
            assert tier.stats()["redis"]["hits"] == 2
        finally:
            proxy.release()
            tier.shutdown()

    def check_a_store_is_reported_once_in_dram_while_redis_is_held_and_reaches_redis_on_release(
        self, kit: Any, primary: np.ndarray, redis_port: int, proxy: SlowProxy, prefix: str
    ) -> None:
        key, job, chunk_bytes = kit.contract.key, kit.contract.job, kit.contract.CHUNK_BYTES
        tier = self.tier(kit, primary, redis_config(proxy.port, prefix, HELD_GET_S))
        try:
            proxy.hold(0)  # Redis's acknowledgements too
            try:
                on_scheduler(lambda: tier.submit_store(job(1, [key(1)], [0], promotion=False)), "submit_store")
                [stored] = self.finish(tier)  # in kvstore's DRAM: the write to Redis goes on behind it
                assert stored.success and stored.transfer_bytes == chunk_bytes
            finally:
                proxy.release()
            tier.store.flush(timeout=GUARD_S)
        finally:
            proxy.release()
            tier.shutdown()
        reader = self.tier(kit, primary, redis_config(redis_port, prefix, HELD_GET_S))  # Redis itself
        try:
            assert self.resolve(kit, reader, key(1)) is kit.LookupResult.HIT
            reader.submit_load(job(2, [key(1)], [3], promotion=True))
            [loaded] = self.finish(reader)
            assert loaded.success and np.array_equal(primary[3, :chunk_bytes], primary[0, :chunk_bytes])
        finally:
            reader.shutdown()

    def check_a_lookup_held_at_redis_answers_retry_then_miss_within_timeouts_get(
        self, kit: Any, primary: np.ndarray, redis_port: int, proxy: SlowProxy, prefix: str
    ) -> None:
        key = kit.contract.key
        self.write(kit, primary, redis_config(redis_port, prefix, HELD_GET_S), [key(1)])
        tier = self.tier(kit, primary, redis_config(proxy.port, prefix, BOUND_GET_S, **NO_BREAKER))
        try:
            proxy.hold(0)  # the lookup's reply too
            try:
                first = on_scheduler(lambda: tier.lookup(key(1), kit.context), "lookup")
                assert first is kit.LookupResult.RETRY
                assert self.resolve(kit, tier, key(1)) is kit.LookupResult.MISS  # still held: timeouts.get ended it
                assert tier.store.stats_now()["redis"]["timeouts"] >= 1
            finally:
                proxy.release()
            assert self.resolve(kit, tier, key(1)) is kit.LookupResult.HIT  # a late answer is not remembered
        finally:
            proxy.release()
            tier.shutdown()

    def check_every_scheduler_call_returns_while_kvstores_loop_is_stalled(
        self, kit: Any, primary: np.ndarray, redis_port: int, prefix: str
    ) -> None:
        key, job = kit.contract.key, kit.contract.job
        tier = self.tier(kit, primary, redis_config(redis_port, prefix, HELD_GET_S))
        try:
            stalled = StalledLoop(tier.store)
            try:
                assert on_scheduler(lambda: tier.lookup(key(1), kit.context), "lookup") is kit.LookupResult.RETRY
                on_scheduler(lambda: tier.submit_store(job(1, [key(1)], [0], promotion=False)), "submit_store")
                on_scheduler(lambda: tier.submit_load(job(2, [key(2)], [4], promotion=True)), "submit_load")
                assert on_scheduler(lambda: list(tier.get_finished_jobs()), "get_finished_jobs") == []
                assert on_scheduler(tier.has_pending_work, "has_pending_work")
                on_scheduler(tier.get_stats, "get_stats")
            finally:
                stalled.release()
            results: dict[int, Any] = {}
            while len(results) < 2:
                results |= {result.job_id: result for result in self.finish(tier)}
            assert results[1].success and not results[2].success  # key(2) was never stored: vLLM recomputes
        finally:
            tier.shutdown()


# -------------------------------------------------------------------------------------------------------------
# SGLang: KVStoreHiCacheStorage, a HiCache storage backend (run under .venv-sglang)
# -------------------------------------------------------------------------------------------------------------


class InSGLang:
    """KVStoreHiCacheStorage's calls as SGLang's threads make them (SGLang 0.5.23's HiCacheController: the
    prefetch I/O thread reads with ``batch_get_v1``, the scheduler thread calls ``get_stats`` and ``clear``).
    SGLang's own host pools and backend factory, through tests/sglang_support/contract_hicache.py's helpers."""

    @pytest.fixture
    def hicache(self) -> Iterator[Any]:
        """contract_hicache's helpers (importable only under .venv-sglang); the backends opened are closed after."""
        from sglang_support import contract_hicache

        yield contract_hicache
        while contract_hicache.OPENED:
            contract_hicache.OPENED.pop().close()

    def backend(self, hicache: Any, pool: Any, config: dict[str, Any]) -> Any:
        """A backend as SGLang's cache controller makes one, with a store of its own (an empty DRAM tier)."""
        return hicache.backend(Path("unused"), pool, {**hicache.extra_config(Path("unused")), "kvstore_config": config})

    def written(self, hicache: Any, source: Any, port: int, prefix: str) -> list[str]:
        """Pages 0-2 of ``source`` written to Redis, through a backend of their own: their keys."""
        keys = hicache.page_keys(3)
        writer = self.backend(hicache, source, redis_config(port, prefix, HELD_GET_S))
        assert writer.batch_set_v1(keys, hicache.indices([0, 1, 2])) == [True] * 3
        writer.store.flush(timeout=GUARD_S)
        return keys

    def check_a_held_prefetch_read_never_holds_the_schedulers_calls_and_lands_byte_exact(
        self, hicache: Any, redis_port: int, proxy: SlowProxy, prefix: str
    ) -> None:
        source, target = hicache.host_pool(seed=1), hicache.host_pool(seed=None)
        keys = self.written(hicache, source, redis_port, prefix)
        reader = self.backend(hicache, target, redis_config(proxy.port, prefix, HELD_GET_S))
        assert reader.batch_exists(keys) == 3  # SGLang's prefetch thread asks first (its hit query)
        reader.get_stats()  # counted from here on
        proxy.hold(0)
        try:
            read = in_background(lambda: reader.batch_get_v1(keys, hicache.indices([5, 6, 7])), "prefetch-io")
            metrics = on_scheduler(reader.get_stats, "get_stats")
            assert metrics.prefetch_pgs == []  # nothing read yet
            on_scheduler(reader.clear, "clear")
            assert not read.done()  # the read waits for its bytes, on its own thread
            assert not target.kv_buffer.view(torch.int16).any()
        finally:
            proxy.release()
        assert read.result(timeout=GUARD_S) == [True] * 3
        hicache.assert_same_pages(source, [0, 1, 2], target, [5, 6, 7])
        assert reader.get_stats().prefetch_pgs == [3]

    def check_held_lookups_and_reads_are_misses_within_the_bound_and_write_nothing_late(
        self, hicache: Any, redis_port: int, proxy: SlowProxy, prefix: str
    ) -> None:
        """``timeouts.get`` bounds each call (``SyncKVStore.call_within`` stops one still running 5 s later)."""
        source, target = hicache.host_pool(seed=2), hicache.host_pool(seed=None)
        keys = self.written(hicache, source, redis_port, prefix)
        reader = self.backend(hicache, target, redis_config(proxy.port, prefix, BOUND_GET_S, **NO_BREAKER))
        proxy.hold(0)
        try:
            assert in_background(lambda: reader.batch_exists(keys), "prefetch").result(timeout=GUARD_S) == 0
            read = in_background(lambda: reader.batch_get_v1(keys, hicache.indices([5, 6, 7])), "prefetch-io")
            assert read.result(timeout=GUARD_S) == [False] * 3
            assert reader.store.stats_now()["redis"]["timeouts"] >= 2
        finally:
            proxy.release()
        assert reader.batch_exists(keys) == 3  # Redis answers again (what was held is not remembered)
        assert not target.kv_buffer.view(torch.int16).any()  # the late bytes were never written into the pool
        assert reader.batch_get_v1(keys, hicache.indices([5, 6, 7])) == [True] * 3
        hicache.assert_same_pages(source, [0, 1, 2], target, [5, 6, 7])

    def check_the_schedulers_calls_return_while_kvstores_loop_is_stalled(
        self, hicache: Any, redis_port: int, prefix: str
    ) -> None:
        backend = self.backend(hicache, hicache.host_pool(seed=None), redis_config(redis_port, prefix, HELD_GET_S))
        stalled = StalledLoop(backend.store)
        try:
            metrics = on_scheduler(backend.get_stats, "get_stats")
            assert "redis" in metrics.kvstore
            on_scheduler(backend.clear, "clear")
        finally:
            stalled.release()


# -------------------------------------------------------------------------------------------------------------
# kvstore's environment: each engine's checks, run under that engine's Python
# -------------------------------------------------------------------------------------------------------------


def checks(engine: type) -> int:
    return sum(name.startswith("check_") for name in vars(engine))


def run_inside(python: Path, engine: type, redis_port: int) -> str:
    """pytest on this file's ``engine`` class only, under ``python`` (the engine's environment); its output."""
    command = [
        str(python), "-m", "pytest", "-q", "-p", "no:cacheprovider", "--noconftest", "-c", os.devnull,
        "--rootdir", str(HERE), "-o", f"python_classes={engine.__name__}", "-o", "python_functions=check_*",
        str(Path(__file__)),
    ]  # fmt: skip
    env = {**os.environ, REDIS_PORT_ENV: str(redis_port)}
    result = subprocess.run(command, capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT, cwd=ROOT, env=env)
    print(result.stdout[-3000:])
    assert result.returncode == 0, result.stdout[-8000:] + result.stderr[-3000:]
    return result.stdout


def test_vllm_tier_never_waits_for_a_held_redis_nor_for_kvstores_loop(vllm_python: Path, redis_server: Any) -> None:
    output = run_inside(vllm_python, InVLLM, redis_server.port)
    assert re.search(rf"\b{checks(InVLLM)} passed\b", output), output[-2000:]


def test_sglang_backend_never_holds_the_scheduler_while_a_prefetch_read_is_held(
    sglang_python: Path, redis_server: Any
) -> None:
    output = run_inside(sglang_python, InSGLang, redis_server.port)
    assert re.search(rf"\b{checks(InSGLang)} passed\b", output), output[-2000:]
