"""``kvstore gc`` and ``kvstore verify --delete`` tell routers what they removed (with events on).

The commands run as a user runs them (the console script, in a process of its own) against a
disk tier a real store filled; a real ZeroMQ SUB socket stands in for the router, at
``events.admin_endpoint``. Each removed chunk must be named as its store named it: by the
engine's hash its header keeps, else by its key. The removal's own head reads are checked per
backend on the real servers too.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import zmq

from kvstore import KVLayout, KVStore, StoreConfig
from kvstore.cli.inventory import tool_backends
from kvstore.cli.removal_events import HEAD_BYTES, chunk_name
from kvstore.events import ChunkIdentity
from kvstore.events.wire import BlockRemoved, decode_batch
from kvstore.keys import key_to_bytes

LAYOUT = KVLayout(num_layers=1, num_kv_heads=1, head_dim=8, chunk_tokens=16)  # 4 KiB header + 512 bytes
KVSTORE = [str(Path(sys.executable).parent / "kvstore")]  # the console script, as a user runs it
ENGINE = "gc-test"


@pytest.fixture
def router() -> Iterator[tuple[zmq.Socket[bytes], str]]:
    """A bound SUB socket subscribed to everything (a router's), and its address."""
    socket = zmq.Context.instance().socket(zmq.SUB)
    socket.setsockopt(zmq.SUBSCRIBE, b"")
    port = socket.bind_to_random_port("tcp://127.0.0.1")
    yield socket, f"tcp://127.0.0.1:{port}"
    socket.close(linger=0)


Message = tuple[str, int, list[BlockRemoved]]  # topic, sequence number, events


def kvstore(config_file: Path, router: zmq.Socket[bytes], *args: str, batches: int) -> list[Message]:
    """Run the ``kvstore`` command (with ``config_file``, no KVSTORE_* variable from outside) while the
    router reads, as a router does all along (an idle SUB socket never subscribes to a new peer), until
    the command has exited and ``batches`` batches came (a generous bound, not a timing assertion)."""
    environment = {name: value for name, value in os.environ.items() if not name.upper().startswith("KVSTORE")}
    output = config_file.with_name("output.txt")
    with output.open("w") as sink:
        command = [*KVSTORE, *args, "--config", str(config_file)]
        process = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT, env=environment)
        received: list[Message] = []
        deadline = time.monotonic() + 120
        while (process.poll() is None or len(received) < batches) and time.monotonic() < deadline:
            if router.poll(50):
                topic, sequence, payload = router.recv_multipart()
                events = decode_batch(payload).events
                assert all(isinstance(event, BlockRemoved) for event in events), events
                received.append((topic.decode(), int.from_bytes(sequence, "big"), events))  # type: ignore[arg-type]
    assert process.wait(timeout=1) == 0, output.read_text()
    assert len(received) >= batches, f"{len(received)} of {batches} event batches came"
    return received


async def fill(config: StoreConfig, namespace: str, chunks: int, names: list[bytes | int | None]) -> list[str]:
    """Store ``chunks`` chunks in ``namespace``; the first ``len(names)`` attributed with those engine names."""
    async with KVStore(config, LAYOUT, namespace=namespace) as store:
        keys = store.chunk_keys([(hash(namespace) + i) % 30_000 for i in range(chunks * LAYOUT.chunk_tokens)])
        for key, name in zip(keys, names, strict=False):
            if name is not None:
                store.events.attribute(key, ChunkIdentity(block_hash=name, parent_block_hash=None, token_ids=range(16)))
        for key in keys:
            assert await store.put(key, torch.randn(LAYOUT.chunk_shape).to(LAYOUT.dtype))
        await store.flush()
    return keys


def test_gc_and_verify_publish_what_they_removed_named_as_the_store_named_it(tmp_path: Path, router) -> None:
    socket, address = router
    root = tmp_path / "disk"
    config_file = tmp_path / "kvstore.toml"
    config_file.write_text(
        f'[disk]\npath = "{root}"\n'
        f'[events]\nenabled = true\nendpoint = "tcp://*:0"\nadmin_endpoint = "{address}"\nengine_id = "{ENGINE}"\n'
    )
    config = StoreConfig(
        dram={"capacity": 8 * LAYOUT.chunk_nbytes},
        disk={"path": root},
        events={"enabled": True, "endpoint": "tcp://*:0", "engine_id": ENGINE},
    )
    damaged_name, kept_name = bytes(range(32)), 2**63 + 5  # vLLM's hashes are bytes or int
    damaged, _, unnamed = asyncio.run(fill(config, "model-a", 3, [damaged_name, kept_name, None]))
    (other,) = asyncio.run(fill(config, "model-b", 1, [None]))

    assert kvstore(config_file, socket, "gc", "--max-bytes", "0", "--dry-run", batches=0) == []
    path = next(root.rglob(f"{damaged}*"))
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF  # a payload byte: the header, and the name in it, still check out
    path.write_bytes(data)
    # The first batch is verify's: the dry run published nothing.
    ((topic, sequence, (removed,)),) = kvstore(config_file, socket, "verify", "--delete", "--yes", batches=1)
    assert (topic, sequence) == (f"kv@{ENGINE}@model-a", 0)
    assert removed.block_hashes == [damaged_name]
    assert (removed.medium, removed.locality, removed.ownership) == ("STORAGE", "LOCAL", "kvstore")

    collected = kvstore(config_file, socket, "gc", "--max-bytes", "0", "--yes", batches=2)
    assert not list(root.rglob("*.kvc"))
    assert [sequence for _, sequence, _ in collected] == [0, 0]  # a topic per namespace: its store's
    assert all(
        (e.medium, e.locality, e.ownership) == ("STORAGE", "LOCAL", "kvstore") for *_, es in collected for e in es
    )
    names = {topic: sorted((h for e in events for h in e.block_hashes), key=repr) for topic, _, events in collected}
    assert names == {
        f"kv@{ENGINE}@model-a": sorted([kept_name, key_to_bytes(unnamed)], key=repr),
        f"kv@{ENGINE}@model-b": [key_to_bytes(other)],
    }


@pytest.fixture(params=["disk", "redis", "s3"])
def tool_config(request, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> StoreConfig:
    """A configuration of one tier, on its real server where it has one, for the tools' backends."""
    (tmp_path / "disk").mkdir()
    sections: dict[str, object] = {"disk": {"path": tmp_path / "disk"}}
    if request.param == "redis":
        server = request.getfixturevalue("redis_server")
        sections = {"disk": {"enabled": False}, "redis": {"enabled": True, "url": server.url, "prefix": tmp_path.name}}
    elif request.param == "s3":
        from support import TEST_BUCKET

        server = request.getfixturevalue("moto_server")
        for name, value in server.credentials_env().items():
            monkeypatch.setenv(name, value)
        s3 = {"enabled": True, "bucket": TEST_BUCKET, "prefix": tmp_path.name}  # the endpoint: from the environment
        sections = {"disk": {"enabled": False}, "s3": s3}
    return StoreConfig(**sections)


async def test_a_removal_reads_each_removed_objects_head_just_before_and_says_which_went(tool_config) -> None:
    removed, gone, changed = (os.urandom(32).hex() for _ in range(3))
    async with tool_backends(tool_config) as backends:
        (tier, backend), *_ = backends.items()
        bodies = {key: os.urandom(HEAD_BYTES + 100) for key in (removed, gone, changed)}
        for key, body in bodies.items():
            await backend.set(key, [body])
        listed = [item async for page in backend.scan() for item in page]
        await backend.delete(gone)
        if tier != "redis":  # (Redis tells a rewrite by its idle time: seconds, not a test's business here)
            await backend.set(changed, [os.urandom(HEAD_BYTES + 200)])
        report = await backend.remove_unchanged(listed, head_bytes=HEAD_BYTES)
    went = [removed, changed] if tier == "redis" else [removed]
    assert {item.key: head for item, head in report.deleted} == {key: bodies[key][:HEAD_BYTES] for key in went}
    assert (report.removed, report.gone) == (len(report.deleted), 1) and not report.errors


def test_a_removed_chunk_is_named_by_its_header_else_by_its_key() -> None:
    key = os.urandom(32).hex()
    assert chunk_name(b"not a chunk header", key) == chunk_name(None, key) == key_to_bytes(key)
    assert chunk_name(None, "not-a-kvstore-key") is None
