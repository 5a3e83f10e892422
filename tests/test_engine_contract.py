"""The engine-facing contract: connectors use ``SyncKVStore`` and nothing behind it.

Read with ``ast`` where it is about the code's shape (every attribute and import counts, in
any function); the rest drives a real store (DRAM and a disk tier) through the contract's calls.
"""

from __future__ import annotations

import ast
import asyncio
import gc
import warnings
from pathlib import Path

import pytest
import torch

from kvstore import KVLayout, KVStore, StoreConfig, SyncKVStore, chain_parents, chunk_keys
from kvstore.engine.planner import DRAM, LoadPlan, LoadPlanner
from kvstore.errors import StoreClosedError
from kvstore.events import ChunkIdentity

PACKAGE = Path(__file__).resolve().parents[1] / "kvstore"
CONNECTORS = sorted((PACKAGE / "connectors").rglob("*.py"))
# What a connector may import from the engine: the contract, the planner's value types, and the one
# table of the store's metrics (an engine's own /metrics shows them under its names).
ENGINE_FOR_CONNECTORS = {"kvstore.engine.sync", "kvstore.engine.planner", "kvstore.engine.metrics"}
LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=16, chunk_tokens=32)


def _reaches_behind(node: ast.AST) -> bool:
    """``x._store`` (the contract's private store), or ``x.store.store`` (its old public name)."""
    if not isinstance(node, ast.Attribute):
        return False
    if node.attr == "_store":
        return True
    return node.attr == "store" and isinstance(node.value, ast.Attribute) and node.value.attr == "store"


def test_no_connector_reaches_past_the_contract() -> None:
    """No connector module touches the asynchronous store, its tiers, planner or events, or imports
    the engine beyond the contract (a reach in any function fails here)."""
    assert len(CONNECTORS) > 10  # the walk found the connectors
    found = []
    for path in CONNECTORS:
        tree = ast.parse(path.read_text(), str(path))
        where = path.relative_to(PACKAGE.parent)
        for node in ast.walk(tree):
            if _reaches_behind(node):
                found.append(f"{where}:{node.lineno}: {ast.unparse(node)}")
            modules = []
            if isinstance(node, ast.ImportFrom) and node.module:
                modules = [node.module]
            elif isinstance(node, ast.Import):
                modules = [alias.name for alias in node.names]
            for module in modules:
                inside = module.startswith(("kvstore.engine", "kvstore.storage", "kvstore.backends"))
                if inside and module not in ENGINE_FOR_CONNECTORS:
                    found.append(f"{where}:{node.lineno}: imports {module}")
    assert found == []


def test_the_asynchronous_store_is_private_to_the_contract(tmp_path: Path) -> None:
    """Nothing public on a SyncKVStore is the KVStore, a tier, or the planner."""
    with SyncKVStore(_config(tmp_path), LAYOUT, "contract") as store:
        public = {name: value for name, value in vars(store).items() if not name.startswith("_")}
        assert not [name for name, value in public.items() if isinstance(value, KVStore | LoadPlanner)]
        assert not hasattr(store, "store") and not hasattr(store, "submit")


def test_the_contract_says_what_the_store_is_and_how_long_a_layer_may_take(tmp_path: Path) -> None:
    config = _config(tmp_path)
    with SyncKVStore(config, LAYOUT, "contract") as store:
        assert store.layout == LAYOUT
        assert store.tier_names == ("dram", "disk")
        assert store.local_tiers == {"dram", "disk"}  # a load from these alone may run inside a forward pass
        # every tier's header read, and the layer's own read: (1 tier + 2) bounded reads
        assert store.layer_wait_timeout == 3 * config.timeouts.get
        assert store.call_timeout > config.timeouts.get
        assert not store.publishes_events
        store.name_chunks({"k": ChunkIdentity(b"n" * 32, None, ())})  # events off: a no-op, not an error


def test_futures_prepare_and_finish_on_the_loop(tmp_path: Path) -> None:
    """``put_many_future(prepare=, then=)`` puts what ``prepare`` made; ``get_many_future(then=)`` resolves to
    what ``then`` made of the reads, with the chunks in the caller's ``outs``."""
    keys = chunk_keys(list(range(3 * LAYOUT.chunk_tokens)), LAYOUT, "contract")
    raw = [torch.full(LAYOUT.chunk_shape, float(i), dtype=LAYOUT.dtype) for i in range(3)]
    with SyncKVStore(_config(tmp_path), LAYOUT, "contract") as store:
        put = store.put_many_future(keys, raw, parents=chain_parents(keys), prepare=lambda kv: kv + 10, then=sum)
        assert put.result(timeout=60) == 3
        outs = [torch.zeros(LAYOUT.chunk_shape, dtype=LAYOUT.dtype) for _ in keys]
        got = store.get_many_future(keys, outs, then=lambda chunks: [c is not None for c in chunks])
        assert got.result(timeout=60) == [True, True, True]
        assert [float(out[0, 0, 0, 0, 0]) for out in outs] == [10.0, 11.0, 12.0]
        assert store.lookup_future(keys).result(timeout=60) == 3
        with pytest.raises(ValueError, match="3 keys but 2 chunks"):
            store.put_many_future(keys, raw[:2], prepare=lambda kv: kv).result(timeout=60)


def test_a_blocking_call_from_the_loop_thread_raises_instead_of_hanging(tmp_path: Path) -> None:
    """A ``then=`` callback runs on the store's loop: a blocking call made there would wait on itself."""
    with SyncKVStore(_config(tmp_path), LAYOUT, "contract") as store:

        def then(_: list[object]) -> list[str]:
            refused = []
            for call in (lambda: store.put_many([], []), lambda: store.lookup([]), lambda: store.get_many([])):
                try:
                    call()
                except RuntimeError as exc:
                    refused.append(str(exc))
            return refused

        refused = store.get_many_future([], [], then=then).result(timeout=60)
        assert len(refused) == 3 and all("its own event-loop thread" in text for text in refused)


def test_a_call_on_a_closed_store_raises_and_leaves_no_coroutine_behind(tmp_path: Path) -> None:
    store = SyncKVStore(_config(tmp_path), LAYOUT, "contract")
    store.close()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a coroutine never awaited warns when it is collected
        calls = (
            lambda: store.get_many_future([], [], then=len),
            lambda: store.put_many_future([], [], then=len),
            lambda: store.lookup_future([]),
        )
        for call in calls:
            with pytest.raises(StoreClosedError):
                call()
        gc.collect()


def test_call_within_stops_a_late_call_and_treats_it_as_a_miss(tmp_path: Path) -> None:
    with SyncKVStore(_config(tmp_path), LAYOUT, "contract") as store:
        store.call_timeout = 0.1  # the bound under test; the call below never ends by itself
        late = store._submit(asyncio.sleep(3600))
        assert store.call_within(late, "lookup") is None
        assert late.cancelled()  # stopped before call_within returned
        assert store.call_within(store.lookup_future([]), "lookup") == 0


def test_a_load_the_engine_timed_goes_to_the_tier_expected_to_cost_the_most() -> None:
    """``observe_load``: the other tiers' chunks are taken at their expected time, the rest is the slowest's."""
    from kvstore.config import PlannerConfig

    chunk = LAYOUT.chunk_nbytes
    planner = LoadPlanner(PlannerConfig(), chunk, LAYOUT.chunk_tokens, dram_bytes_per_s=1e12)
    before = planner.estimate("disk").reads
    plan = LoadPlan((DRAM, "disk", "disk", "disk"), load=3, load_seconds=0.0, recompute_seconds=1.0)
    planner.observe_load(plan, 2.0)
    disk = planner.estimate("disk")
    assert disk.reads == before + 1
    assert planner.dram.reads == 0  # DRAM's share was taken at its expected time, not observed
    planner.observe_load(LoadPlan((), 0, 0.0, 0.0), 1.0)  # nothing loaded: nothing to observe
    assert planner.estimate("disk").reads == before + 1


def _config(tmp_path: Path) -> StoreConfig:
    return StoreConfig(dram={"capacity": 8 * LAYOUT.chunk_nbytes}, disk={"path": tmp_path / "disk"})
