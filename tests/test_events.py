"""KV events (kvstore.events): the publisher's framing and replay, and what a store publishes per tier.

A real ZeroMQ subscriber on loopback reads every message. The store's publisher connects to the
test's bound SUB socket (``endpoint`` without ``*``) and holds its first batch until the
subscription has come, so none is lost to the subscriber's late join. That vLLM's own classes
decode these bytes: tests/vllm_support/contract_events.py; a real engine: tests/test_vllm_events.py.
"""

from __future__ import annotations

import asyncio
import hashlib
import queue
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import zmq
from support import TEST_BUCKET

from kvstore import KVLayout, KVStore, StoreConfig
from kvstore.errors import ConfigError
from kvstore.events import NO_EVENTS, ChunkEvents, ChunkIdentity
from kvstore.events.publisher import END_OF_REPLAY, EventPublisher, offset_port
from kvstore.events.wire import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch, decode_batch
from kvstore.keys import key_to_bytes
from kvstore.storage.container import encode_header, header_length, header_name, parse_header

LAYOUT = KVLayout(num_layers=2, num_kv_heads=1, head_dim=8, dtype=torch.float16, chunk_tokens=16)
WAIT_S = 30  # a bound on a receive, never an expectation of speed


class Router:
    """A SUB socket bound on a free loopback port, read all the time by a thread (as a router reads it).

    (A socket handles a new connection only when its thread calls into it: a SUB nobody reads
    would not send its subscription to a publisher that connects, which then drops its batches.)
    """

    def __init__(self) -> None:
        self.sub = zmq.Context.instance().socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.address = f"tcp://127.0.0.1:{self.sub.bind_to_random_port('tcp://127.0.0.1')}"
        self.messages: queue.Queue[tuple[bytes, int, KVEventBatch]] = queue.Queue()
        self._running = True
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        while self._running:
            if self.sub.poll(20):
                topic, seq, payload = self.sub.recv_multipart()
                self.messages.put((topic, int.from_bytes(seq, "big"), decode_batch(payload)))

    def close(self) -> None:
        self._running = False
        self._thread.join()
        self.sub.close(linger=0)

    def receive(self, count: int) -> list[tuple[bytes, int, KVEventBatch]]:
        return [self.messages.get(timeout=WAIT_S) for _ in range(count)]

    def events_until(self, last: Callable[[object], bool]) -> list[object]:
        """Every event up to the first for which ``last`` is true (one connection keeps the publisher's order)."""
        found: list[object] = []
        while not any(last(event) for event in found):
            found.extend(self.messages.get(timeout=WAIT_S)[2].events)
        return found


@pytest.fixture
def router():
    router = Router()
    yield router
    router.close()


def test_batches_are_framed_as_vllm_frames_them(router):
    publisher = EventPublisher(router.address, topic="kv@e1@m", data_parallel_rank=0)
    publisher.publish([AllBlocksCleared()])
    publisher.close()
    [(topic, seq, batch)] = router.receive(1)
    assert (topic, seq, batch.events, batch.data_parallel_rank) == (b"kv@e1@m", 0, [AllBlocksCleared()], 0)


def test_a_subscriber_that_missed_batches_gets_them_from_the_replay_socket():
    context = zmq.Context.instance()
    publisher = EventPublisher("tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*", topic="t", linger=0)
    for i in range(3):  # three batches, none seen by any subscriber: each published once the one before was sent
        publisher.publish([BlockRemoved(block_hashes=[i], medium="CPU")])
        deadline = time.monotonic() + WAIT_S  # a bound, not an expectation
        while publisher.batches <= i and time.monotonic() < deadline:
            time.sleep(0.001)
    dealer = context.socket(zmq.DEALER)
    try:
        dealer.connect(publisher.replay_endpoint)
        dealer.send_multipart((b"", (1).to_bytes(8, "big")))  # "I have 0; send from 1 on"
        replies = []
        while True:
            assert dealer.poll(WAIT_S * 1000)
            _, topic, seq, payload = dealer.recv_multipart()
            if seq == END_OF_REPLAY:
                break
            replies.append((topic, int.from_bytes(seq, "big"), decode_batch(payload).events[0].block_hashes))
        assert replies == [(b"t", 1, [1]), (b"t", 2, [2])]
    finally:
        dealer.close(linger=0)
        publisher.close()


@pytest.mark.parametrize(
    "events, named",
    [
        ({"endpoint": "tcp://*:99999"}, ["events.endpoint", "99999", "0 to 65535"]),  # ZeroMQ bound port 34463
        ({"endpoint": "tcp://*:-1"}, ["events.endpoint", "-1", "0 to 65535"]),  # bound port 65535
        ({"replay_endpoint": "tcp://*:70000"}, ["events.replay_endpoint", "70000"]),
        ({"admin_endpoint": "tcp://router:65536"}, ["events.admin_endpoint", "65536"]),
        (  # rank 7 on port 65535 bound port 6
            {"endpoint": "tcp://*:65535", "data_parallel_rank": 7},
            ["events.endpoint", "events.data_parallel_rank = 7", "65542", "at most 65528"],
        ),
        (
            {"replay_endpoint": "tcp://*:65530", "data_parallel_rank": 6},
            ["events.replay_endpoint", "events.data_parallel_rank = 6", "65536"],
        ),
    ],
)
def test_an_event_port_out_of_range_is_a_config_error_naming_the_key(events, named):
    with pytest.raises(ConfigError) as excinfo:
        StoreConfig(events=events)
    assert all(part in str(excinfo.value) for part in named), str(excinfo.value)


def test_a_rank_that_pushes_a_port_out_of_range_is_refused_when_assigned_too():
    config = StoreConfig(events={"endpoint": "tcp://*:65530"})
    with pytest.raises(ConfigError, match=r"events.endpoint = 'tcp://\*:65530' with events.data_parallel_rank = 6"):
        config.events.data_parallel_rank = 6  # as the vLLM connector sets it
    assert config.events.data_parallel_rank == 0  # a refused value changes nothing
    with pytest.raises(ConfigError, match="past 65535"):
        offset_port("tcp://*:65535", 1)  # a publisher opened with an endpoint of its own is refused too


@pytest.mark.parametrize("endpoint", ["tcp://*:0", "tcp://*:65528", "tcp://127.0.0.1:*", "ipc:///tmp/kv-events"])
def test_port_zero_a_wildcard_port_and_ports_in_range_stay_valid_with_a_rank(endpoint):
    config = StoreConfig(events={"endpoint": endpoint, "replay_endpoint": endpoint, "data_parallel_rank": 7})
    assert config.events.endpoint == endpoint
    assert offset_port("tcp://*:0", 7) == "tcp://*:0"  # a free port for every rank


def test_an_endpoint_that_cannot_be_opened_names_the_option(tmp_path):
    with pytest.raises(ConfigError, match=r"events.endpoint = 'tcp://\*:notaport'"):
        EventPublisher("tcp://*:notaport")
    held = EventPublisher("tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*", linger=0)
    try:
        with pytest.raises(ConfigError, match="events.replay_endpoint"):  # its port is taken
            EventPublisher("tcp://127.0.0.1:*", replay_endpoint=held.replay_endpoint, linger=0)
    finally:
        held.close()


def chunk(value: float) -> torch.Tensor:
    return torch.full(LAYOUT.chunk_shape, value, dtype=LAYOUT.dtype)


def config(tmp_path: Path, address: str, slots: int = 2) -> StoreConfig:
    return StoreConfig(
        dram={"capacity": slots * LAYOUT.chunk_nbytes},
        disk={"path": str(tmp_path / "disk")},
        events={"enabled": True, "endpoint": address, "engine_id": "engine-1"},
    )


def test_a_store_publishes_each_tiers_stores_and_removals(tmp_path, router):
    """DRAM (CPU) and disk (STORAGE) stores, a DRAM eviction, a corrupt disk chunk removed, the DRAM
    tier closed; an attributed chunk is named by its engine's hash, in events and in its header."""
    address = router.address

    async def run() -> tuple[list[str], Path]:
        async with KVStore(config(tmp_path, address), LAYOUT, namespace="m") as store:
            keys = store.chunk_keys(list(range(48)))
            assert isinstance(store.events, ChunkEvents)
            store.events.attribute(keys[0], ChunkIdentity(7, None, range(16), lora_name="adapter"))
            for i, key in enumerate(keys):
                assert await store.put(key, chunk(i))
                await store.flush()  # on disk before the next put evicts from DRAM
            disk = store.tiers[0].backend
            assert header_name(disk.path_for(keys[0]).read_bytes()[:4096]) == 7
            assert header_name(disk.path_for(keys[1]).read_bytes()[:4096]) is None  # no engine named it
            damaged = disk.path_for(keys[2])
            data = bytearray(damaged.read_bytes())
            data[-1] ^= 0xFF
            damaged.write_bytes(bytes(data))
            store.pool.discard(keys[2])
            assert await store.get(keys[2]) is None  # corrupt: a miss, removed
            return keys, damaged

    keys, damaged = asyncio.run(run())
    assert not damaged.exists()
    names = {keys[0]: 7, keys[1]: key_to_bytes(keys[1]), keys[2]: key_to_bytes(keys[2])}
    closed = [names[keys[1]]]  # the DRAM tier's chunks are removed as the store closes, last
    events = router.events_until(
        lambda e: isinstance(e, BlockRemoved) and e.medium == "CPU" and e.block_hashes == closed
    )
    summary = [
        (type(e).__name__, e.medium, e.locality, tuple(e.block_hashes))
        for e in events
        if not isinstance(e, AllBlocksCleared)
    ]
    stored_cpu = [("BlockStored", "CPU", "LOCAL", (names[k],)) for k in keys]
    stored_disk = [("BlockStored", "STORAGE", "LOCAL", (names[k],)) for k in keys]
    assert [s for s in summary if s[:2] == ("BlockStored", "CPU")] == stored_cpu
    assert [s for s in summary if s[:2] == ("BlockStored", "STORAGE")] == stored_disk
    removed = [s for s in summary if s[0] == "BlockRemoved"]
    # the first chunk evicted by the third put, the third discarded, the second gone with the store
    assert removed == [
        ("BlockRemoved", "CPU", "LOCAL", (names[keys[0]],)),
        ("BlockRemoved", "CPU", "LOCAL", (names[keys[2]],)),
        ("BlockRemoved", "STORAGE", "LOCAL", (names[keys[2]],)),
        ("BlockRemoved", "CPU", "LOCAL", (names[keys[1]],)),
    ]
    first = next(e for e in events if isinstance(e, BlockStored))
    assert (first.token_ids, first.block_size, first.lora_name, first.ownership) == (
        list(range(16)),
        16,
        "adapter",
        "kvstore",
    )


def test_the_disk_budgets_evictions_are_published_under_the_names_the_headers_keep(tmp_path, router):
    """After a restart the store no longer remembers the engine's names: the evicted files' headers give them."""
    settings = config(tmp_path, router.address, slots=4)
    settings.disk.codec = "identity"

    async def fill(keys: list[str], named: dict[str, int]) -> None:
        async with KVStore(settings, LAYOUT, namespace="m") as store:
            for i, key in enumerate(keys):
                if key in named:
                    store.events.attribute(key, ChunkIdentity(named[key], None, range(16)))
                assert await store.put(key, chunk(i))
                await store.flush()

    keys = KVStore(settings, LAYOUT, namespace="m").chunk_keys(list(range(48)))
    asyncio.run(fill(keys[:2], {keys[0]: 11}))
    settings.disk.capacity = 2 * (4096 + LAYOUT.chunk_nbytes) + 100  # two chunk files, header and all
    asyncio.run(fill(keys[2:], {}))  # a new store: the third file evicts the oldest, named 11 in its header
    second_close = [key_to_bytes(keys[2])]  # after the second store's eviction, on its connection
    events = router.events_until(lambda e: isinstance(e, BlockRemoved) and e.block_hashes == second_close)
    removed = [e.block_hashes for e in events if isinstance(e, BlockRemoved) and e.medium == "STORAGE"]
    assert removed == [[11]]


def test_a_failed_batch_costs_its_events_not_the_publisher(router):
    publisher = EventPublisher(router.address, topic="t")
    unencodable = BlockStored([1], None, [], 16, None, "CPU", None, extra_keys=[(object(),)])
    publisher.publish([unencodable])
    publisher.publish([AllBlocksCleared()])
    [(_, seq, batch)] = router.receive(1)
    assert (seq, batch.events) == (0, [AllBlocksCleared()])  # the thread goes on; the bad batch took no number
    publisher.close()
    assert publisher.dropped == 1
    publisher.publish([AllBlocksCleared()])  # after close: dropped, counted, never raised
    assert publisher.dropped == 2


def test_events_off_open_no_socket(tmp_path):
    async def run() -> None:
        async with KVStore(StoreConfig(disk={"path": str(tmp_path)}), LAYOUT, namespace="m") as store:
            assert store.events is NO_EVENTS
            assert store.tiers[0].events is NO_EVENTS

    asyncio.run(run())


def test_the_engines_name_rides_in_the_header_padding_old_readers_skip():
    key = hashlib.sha256(b"k").hexdigest()
    from kvstore.storage.container import Segment

    segments = [Segment(0, 10, LAYOUT.layer_nbytes, 0), Segment(10, 10, LAYOUT.layer_nbytes, 0)]
    plain = encode_header(LAYOUT, key, "identity", segments)
    for name in (bytes(range(32)), 2**64 - 1, 0):
        named = encode_header(LAYOUT, key, "identity", segments, name=name)
        assert len(named) == len(plain) == header_length(named)  # the length any reader expects
        assert parse_header(named, LAYOUT, key).segments == parse_header(plain, LAYOUT, key).segments
        assert header_name(named) == name
    assert header_name(plain) is None
    for unnameable in (2**64, -1, b"", bytes(33)):  # no engine names a block so: left out, not mangled
        assert header_name(encode_header(LAYOUT, key, "identity", segments, name=unnameable)) is None
    many = KVLayout(num_layers=125, num_kv_heads=1, head_dim=8, dtype=torch.float16, chunk_tokens=16)
    full = [Segment(i * 10, 10, many.layer_nbytes, 0) for i in range(125)]  # 6 bytes of padding: no room
    assert header_name(encode_header(many, key, "identity", full, name=5)) is None


def test_the_remote_tiers_publish_their_stores_as_remote(tmp_path, router, redis_server, moto_server, monkeypatch):
    """A chunk written to real Redis and S3 servers is stored there as REDIS and S3, locality REMOTE."""
    for name, value in moto_server.credentials_env().items():
        monkeypatch.setenv(name, value)
    settings = StoreConfig(
        dram={"capacity": 2 * LAYOUT.chunk_nbytes},
        disk={"enabled": False},
        redis={"enabled": True, "url": redis_server.url, "prefix": f"events-{uuid.uuid4().hex[:8]}"},
        s3={"enabled": True, "bucket": TEST_BUCKET, "prefix": f"events-{uuid.uuid4().hex[:8]}", "create_bucket": True},
        events={"enabled": True, "endpoint": router.address},
    )

    async def run() -> str:
        async with KVStore(settings, LAYOUT, namespace="m") as store:
            [key] = store.chunk_keys(list(range(16)))
            assert await store.put(key, chunk(1))
            await store.flush()
            return key

    key = asyncio.run(run())
    events = router.events_until(lambda e: isinstance(e, BlockRemoved) and e.medium == "CPU")
    stored = {
        (e.medium, e.locality) for e in events if isinstance(e, BlockStored) and e.block_hashes == [key_to_bytes(key)]
    }
    assert stored == {("CPU", "LOCAL"), ("REDIS", "REMOTE"), ("S3", "REMOTE")}
