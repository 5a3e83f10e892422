"""KV events from a real vLLM engine with kvstore's connector, read as a router reads them.

The subscriber runs under vLLM's environment and decodes with vLLM's own classes
(tests/vllm_support/subscribe_events.py); the wire format's byte-level contract is
tests/vllm_support/contract_events.py (run with the tier's contract, tests/test_vllm_tier.py).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from vllm_engines import REUSABLE_CHUNKS, ROOT, SUPPORT, disk_extra, run_engine

from tests.vllm_support.prompts import prompt

BLOCK = 128  # vLLM's block size in the engine tests: a 256-token chunk ends at every second block


def free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


def stored(batches: list[dict[str, Any]], medium: str) -> list[dict[str, Any]]:
    return [e for b in batches for e in b["events"] if e["type"] == "BlockStored" and e["medium"] == medium]


def test_a_router_joins_kvstores_events_with_vllms_and_sees_gc_remove_them(vllm_python, tiny_llama, tmp_path):
    """One prompt of 3 chunks: kvstore's DRAM (CPU) and disk (STORAGE) events name each chunk by
    vLLM's own hash of the chunk's last block, the hash vLLM's GPU events give that block; a
    subscriber that joined late gets every batch from the replay sockets; `kvstore gc` then
    publishes the disk chunks' removal under the same names (read from the chunks' headers)."""
    pub, replay, vllm_pub, vllm_replay, admin = free_ports(5)
    extra = disk_extra(tmp_path / "disk")
    extra["kvstore_config"]["events"] = {
        "enabled": True,
        "endpoint": f"tcp://*:{pub}",
        "replay_endpoint": f"tcp://*:{replay}",
        "engine_id": "engine-a",
    }
    handshake, caught_up = tmp_path / "handshake", tmp_path / "caught_up.json"
    subscriber = subprocess.Popen(
        [
            str(vllm_python), str(SUPPORT / "subscribe_events.py"), "replay", "--handshake", str(handshake),
            "--replay", f"kvstore=tcp://127.0.0.1:{replay}", f"vllm=tcp://127.0.0.1:{vllm_replay}",
            "--out", str(caught_up),
        ]
    )  # fmt: skip
    try:
        options = ("--kv-events", f"tcp://*:{vllm_pub},tcp://*:{vllm_replay}", "--handshake", str(handshake))
        report = run_engine(vllm_python, tiny_llama, tmp_path, extra, "gen,flush,handshake", options=options)
        assert subscriber.wait(timeout=60) == 0
    finally:
        subscriber.kill()
    assert report["stats"]["disk"]["writes"] == REUSABLE_CHUNKS
    events = json.loads(caught_up.read_text())
    ours, gpu = events["kvstore"], events["vllm"]
    assert [b["seq"] for b in ours] == list(range(len(ours))), "every batch from 0 on, none missing"
    assert {b["topic"] for b in ours} == {f"kv@engine-a@{tiny_llama}"}  # the engine and its served model
    # vLLM's own hashes of the prompt's blocks, in order (its GPU events)
    gpu_hashes = [h for e in stored(gpu, "GPU") for h in e["block_hashes"]]
    tokens = prompt(0, 1000)
    per_chunk = 256 // BLOCK
    for medium, locality in (("CPU", "LOCAL"), ("STORAGE", "LOCAL")):
        chunks = stored(ours, medium)
        assert len(chunks) == REUSABLE_CHUNKS, medium
        for i, event in enumerate(chunks):
            assert event["block_hashes"] == [gpu_hashes[(i + 1) * per_chunk - 1]], (medium, i)
            assert event["parent_block_hash"] == (gpu_hashes[i * per_chunk - 1] if i else None)
            assert event["token_ids"] == tokens[256 * i : 256 * (i + 1)] and event["block_size"] == 256
            assert event["locality"] == locality and event["ownership"] == "kvstore"

    # kvstore gc, as from cron, publishes the disk chunks' removal to the router's address.
    listened, ready = tmp_path / "removed.json", tmp_path / "listening"
    listener = subprocess.Popen(
        [
            str(vllm_python), str(SUPPORT / "subscribe_events.py"), "listen", "--bind", f"tcp://127.0.0.1:{admin}",
            "--ready", str(ready), "--out", str(listened),
        ]
    )  # fmt: skip
    try:
        while not ready.exists():
            assert listener.poll() is None, "the listener stopped before binding"
            time.sleep(0.05)
        env = {
            **os.environ,
            "KVSTORE_DISK__PATH": str(tmp_path / "disk"),
            "KVSTORE_EVENTS__ENABLED": "true",
            "KVSTORE_EVENTS__ADMIN_ENDPOINT": f"tcp://127.0.0.1:{admin}",
            "KVSTORE_EVENTS__ENGINE_ID": "engine-a",
            "KVSTORE_EVENTS__MODEL": str(tiny_llama),
        }
        gc = subprocess.run(
            [str(Path(sys.executable).parent / "kvstore"), "gc", "--tier", "disk", "--max-bytes", "0", "--yes"],
            env=env, capture_output=True, text=True, timeout=120, cwd=ROOT,
        )  # fmt: skip
        assert gc.returncode == 0, gc.stdout + gc.stderr
        assert listener.wait(timeout=300) == 0
    finally:
        listener.kill()
    removed = [
        e for b in json.loads(listened.read_text())["listen"] for e in b["events"] if e["type"] == "BlockRemoved"
    ]
    names = sorted(h for e in removed for h in e["block_hashes"])
    assert names == sorted(e["block_hashes"][0] for e in stored(ours, "STORAGE"))
    assert {(e["medium"], e["locality"], e["ownership"]) for e in removed} == {("STORAGE", "LOCAL", "kvstore")}
