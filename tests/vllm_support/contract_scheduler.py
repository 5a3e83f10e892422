"""The vLLM connector's scheduler: which loads run in the forward pass and which in the background (vLLM's environment).

tests/test_vllm_tier.py runs this file with contract_tier.py under ``.venv-vllm/bin/python -m pytest`` (the
connector's package imports vLLM). A real store with its chunks on its disk tier only (DRAM empty), and
``ConnectorScheduler`` called as vLLM's scheduler calls it, with stand-ins for vLLM's request and block
objects (only the attributes the scheduler reads). The Redis and S3 cases run in real engines
(tests/test_vllm.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from kvstore import KVLayout, StoreConfig, SyncKVStore
from kvstore.connectors.attention_groups import AttentionGroup
from kvstore.connectors.vllm.scheduler import ConnectorScheduler
from kvstore.engine.planner import PrefillClock

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=16, chunk_tokens=32, dtype=torch.float32)
CHUNKS = 3
PROMPT = 2 * CHUNKS * LAYOUT.chunk_tokens  # two prompts of 3 chunks and one token each share nothing


@pytest.fixture
def store(tmp_path: Path) -> Iterator[SyncKVStore]:
    """A fresh store whose two prompts' chunks are on its disk only (put by another store)."""
    config = StoreConfig(
        dram={"capacity": LAYOUT.chunk_nbytes * 16},
        disk={"path": tmp_path / "disk"},
        planner={"prefill_tokens_per_s": 1, "state_dir": None},  # every hit loaded: where is the question
    )
    with SyncKVStore(config, LAYOUT, "scheduler") as writer:
        for first in (0, PROMPT):
            keys = writer.chunk_keys(list(range(first, first + CHUNKS * LAYOUT.chunk_tokens)))
            assert writer.put_many(keys, [torch.zeros(LAYOUT.chunk_shape)] * CHUNKS) == [True] * CHUNKS
        writer.flush()
    with SyncKVStore(config, LAYOUT, "scheduler") as fresh:
        yield fresh


def scheduler(store: SyncKVStore, max_stall_s: float | None, max_background_bytes: int = 1 << 30) -> Any:
    counters = dict.fromkeys(
        ("lookups", "lookup_errors", "hit_tokens", "unsaveable_chunks", "recomputed_chunks", "background_loads"), 0
    )
    return ConnectorScheduler(
        held_store=lambda: store,
        groups=[AttentionGroup(0, (0, 1), block_size=16)],
        chunk_tokens=LAYOUT.chunk_tokens,
        hybrid=False,
        saved_limit=16,
        prefill_clock=PrefillClock(None, LAYOUT.chunk_tokens),
        identity="scheduler",
        counters=counters,
        max_stall_s=max_stall_s,
        max_background_bytes=max_background_bytes,
    )


def request(name: str, first: int = 0) -> Any:
    tokens = list(range(first, first + CHUNKS * LAYOUT.chunk_tokens + 1))  # 3 full chunks and one token more
    return SimpleNamespace(request_id=name, prompt_token_ids=tokens, lora_request=None, mm_features=[], cache_salt=None)


def matched(connector: Any, req: Any) -> tuple[int | None, bool]:
    """vLLM's question, asked again while the lookup is out (a bound, not a timing)."""
    for _ in range(10_000):
        answer = connector.get_num_new_matched_tokens(req, 0)
        if answer[0] is not None:
            return answer
        connector._requests[req.request_id].lookup.result(timeout=30)  # the lookup's future: back, then ask again
    raise AssertionError("the lookup never came back")


def allocate(connector: Any, req: Any, tokens: int) -> None:
    blocks = SimpleNamespace(get_block_ids=lambda: (list(range(1, 1 + tokens // 16)),))
    connector.update_state_after_alloc(req, blocks, tokens)


HIT = CHUNKS * LAYOUT.chunk_tokens


def test_a_small_load_from_a_cold_local_disk_runs_in_the_forward_pass(store):
    # 3 chunks of 16 KiB at the disk's seed rate (2 GB/s): ~25 us, far within 50 ms.
    assert matched(scheduler(store, 0.05), request("a")) == (HIT, False)


def test_a_stall_budget_of_zero_sends_every_load_to_the_background(store):
    connector = scheduler(store, 0.0)
    assert matched(connector, request("a")) == (HIT, True)
    allocate(connector, request("a"), HIT)
    assert connector.counters["background_loads"] == 1


def test_a_disk_measured_slow_loads_in_the_background_and_no_budget_keeps_it_in_the_forward_pass(store):
    store._store.planner.observe_read("disk", 1.0, LAYOUT.chunk_nbytes)  # one chunk a second, as a read measured
    assert store.expected_load_seconds(["disk"] * CHUNKS) > 0.05
    assert matched(scheduler(store, 0.05), request("a")) == (HIT, True)
    assert matched(scheduler(store, None), request("a")) == (HIT, False)


def test_background_loads_stage_at_most_their_budget_and_the_next_waits_until_one_is_done(store):
    connector = scheduler(store, 0.0, max_background_bytes=CHUNKS * LAYOUT.chunk_nbytes)  # one load's chunks
    first, second = request("a"), request("b", PROMPT)
    assert matched(connector, first) == (HIT, True)
    allocate(connector, first, HIT)
    connector.get_num_new_matched_tokens(second, 0)  # its lookup goes out
    connector._requests["b"].lookup.result(timeout=30)  # and is back: a None now is the budget's
    assert connector.get_num_new_matched_tokens(second, 0) == (None, False)  # asked again next step
    done = SimpleNamespace(finished_recving={"a"}, failed_recving=set(), invalid_block_ids=set())
    connector.update_connector_output(done)
    assert connector.get_num_new_matched_tokens(second, 0) == (HIT, True)
