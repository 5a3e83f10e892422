"""A router's side of KV events, decoded with vLLM's own classes (``vllm.distributed.kv_events``).

Run under vLLM's environment by tests/test_vllm_events.py, as a router would consume events:

    python subscribe_events.py replay --handshake H --replay NAME=tcp://host:port ... --out events.json

waits for ``H.ready`` (the engine has run its prompts), asks each replay socket for every batch from
sequence 0 (a subscriber that joined late: the gap is every batch so far), writes what it got and
then ``H.go`` (the engine may go on and exit);

    python subscribe_events.py listen --bind tcp://127.0.0.1:port --ready R --out events.json

binds a SUB socket (a ``connect`` publisher such as ``kvstore gc`` sends to it), writes ``R`` once
bound, and takes batches until one holds a ``BlockRemoved`` (at most 5 minutes).

Each batch is written as {"topic", "seq", "events": [{"type", "block_hashes" (hex), "medium",
"locality", "ownership", "parent_block_hash", "token_ids", "block_size"}]}.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any

import msgspec
import zmq
from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

DECODER = msgspec.msgpack.Decoder(KVEventBatch)
END = (-1).to_bytes(8, "big", signed=True)
WAIT_S = 300


def hex_of(block_hash: Any) -> str | int | None:
    return block_hash.hex() if isinstance(block_hash, bytes) else block_hash


def described(topic: bytes, seq: bytes, payload: bytes) -> dict[str, Any]:
    batch = DECODER.decode(payload)  # vLLM's classes: a format vLLM cannot read fails here
    events = []
    for event in batch.events:
        assert isinstance(event, BlockStored | BlockRemoved | AllBlocksCleared), type(event)
        row: dict[str, Any] = {"type": type(event).__name__}
        if not isinstance(event, AllBlocksCleared):
            row.update(
                block_hashes=[hex_of(h) for h in event.block_hashes],
                medium=event.medium,
                locality=event.locality,
                ownership=event.ownership,
            )
        if isinstance(event, BlockStored):
            row.update(
                parent_block_hash=hex_of(event.parent_block_hash),
                token_ids=list(event.token_ids),
                block_size=event.block_size,
                extra_keys=event.extra_keys,
            )
        events.append(row)
    return {
        "topic": topic.decode(),
        "seq": int.from_bytes(seq, "big"),
        "rank": batch.data_parallel_rank,
        "events": events,
    }


def replay_all(context: zmq.Context, endpoint: str) -> list[dict[str, Any]]:
    """Every batch the publisher still buffers, from sequence 0 (DEALER: vLLM's replay protocol)."""
    dealer = context.socket(zmq.DEALER)
    dealer.connect(endpoint)
    dealer.send_multipart((b"", (0).to_bytes(8, "big")))
    batches = []
    while True:
        if not dealer.poll(WAIT_S * 1000):
            raise SystemExit(f"no replay from {endpoint}")
        _, topic, seq, payload = dealer.recv_multipart()
        if seq == END:
            break
        batches.append(described(topic, seq, payload))
    dealer.close(linger=0)
    return batches


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["replay", "listen"])
    parser.add_argument("--handshake", default="")
    parser.add_argument("--replay", nargs="*", default=[], help="NAME=ENDPOINT")
    parser.add_argument("--bind", default="")
    parser.add_argument("--ready", default="")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    context = zmq.Context.instance()
    found: dict[str, list[dict[str, Any]]] = {}
    if args.mode == "replay":
        waited = time.monotonic()
        while not os.path.exists(args.handshake + ".ready"):
            if time.monotonic() - waited > WAIT_S:
                raise SystemExit("the engine never reached its handshake")
            time.sleep(0.05)
        for item in args.replay:
            name, _, endpoint = item.partition("=")
            found[name] = replay_all(context, endpoint)
        with open(args.out, "w") as f:
            json.dump(found, f)
        with open(args.handshake + ".go", "w"):
            pass
        return
    sub = context.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.bind(args.bind)
    with open(args.ready, "w"):
        pass
    batches: list[dict[str, Any]] = []
    deadline = time.monotonic() + WAIT_S
    while not any(e["type"] == "BlockRemoved" for b in batches for e in b["events"]):
        if not sub.poll(max(1, int((deadline - time.monotonic()) * 1000))):
            break
        batches.append(described(*sub.recv_multipart()))
    with open(args.out, "w") as f:
        json.dump({"listen": batches}, f)


if __name__ == "__main__":
    main()
