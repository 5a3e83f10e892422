"""Redis-specific behaviour of RedisBackend on a real redis-server and a real 3-node Redis Cluster.

The put/get/exists/delete/list conformance suite shared by every backend lives elsewhere; here:
TTLs, byte ranges, pipelines spread over cluster nodes, password masking, reconnects, bounded
timeouts on a frozen server, and a cluster losing and regaining a node. Servers come from
kvstore.testing.servers; a server that cannot start fails the test (it is never skipped).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import shutil
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from functools import partial

import numpy as np
import pytest
import redis
from redis.exceptions import AuthenticationError, RedisError, ResponseError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from kvstore.backends.redis import RedisBackend
from kvstore.backends.redis_connection import mask_url
from kvstore.backends.redis_get_into import receives_in_place
from kvstore.testing import listed_keys
from kvstore.testing.servers import RedisClusterServer, RedisServer
from kvstore.util.buffers import Buffer

TTL = 100.0
FAST = {"socket_timeout": 0.5, "connect_timeout": 0.25}  # each call returns or raises within 1.0 s


def chunk_key(i: int) -> str:
    return hashlib.sha256(f"chunk {i}".encode()).hexdigest()


def relax_coverage(cluster: RedisClusterServer) -> None:
    """Let the surviving primaries serve their slots while one is down (Redis' default refuses all)."""
    for port in cluster.ports:
        with redis.Redis(port=port) as node:
            node.config_set("cluster-require-full-coverage", "no")


def node_of(cluster: RedisClusterServer, name: str) -> int:
    """The port of the primary that owns ``name``'s slot, per CLUSTER KEYSLOT and CLUSTER SLOTS."""
    with redis.Redis(port=cluster.ports[0]) as node:
        slot = node.cluster("keyslot", name)
        for first, last, primary, *_ in node.execute_command("CLUSTER", "SLOTS"):
            if first <= slot <= last:
                return int(primary[1])
    raise AssertionError(f"slot {slot} is not covered")


def keys_on_every_node(cluster: RedisClusterServer, prefix: str, per_node: int = 3) -> tuple[list[str], dict[str, int]]:
    """Chunk keys whose values land on every primary (at least ``per_node`` each), and their owners."""
    owners: dict[str, int] = {}
    i = 0
    while min((list(owners.values()).count(port) for port in cluster.ports), default=0) < per_node:
        key = chunk_key(i)
        owners[key] = node_of(cluster, f"{prefix}:{key}")
        i += 1
    return list(owners), owners


def local_keys(port: int, prefix: str) -> set[str]:
    """Keys stored on one node itself (a plain, non-cluster SCAN sees only that node's keys)."""
    with redis.Redis(port=port) as node:
        return {name.decode()[len(prefix) + 1 :] for name in node.scan_iter(match=f"{prefix}:*")}


def wait_until(condition: Callable[[], bool], timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.05)


def _node_failed_seen_by(survivor: redis.Redis) -> bool:
    """Whether ``survivor`` has marked some node FAIL (not just PFAIL)."""
    return any("fail" in str(node["flags"]).split(",") for node in survivor.cluster("nodes").values())


async def elapsed_raising(
    call: Callable[[], Awaitable[object]],
    error: type[BaseException] | tuple[type[BaseException], ...] = RedisError,
) -> float:
    start = time.monotonic()
    with pytest.raises(error):
        await call()
    return time.monotonic() - start


# -- servers (module scope: ~30 ms for one server, ~1-2 s for a cluster) -------------------------


@pytest.fixture(scope="module")
def server() -> Iterator[RedisServer]:
    with RedisServer() as running:
        yield running


@pytest.fixture(scope="module")
def cluster() -> Iterator[RedisClusterServer]:
    with RedisClusterServer(nodes=3) as running:
        relax_coverage(running)
        yield running


@pytest.fixture(params=["single", "cluster"])
def target(request: pytest.FixtureRequest) -> tuple[str, bool]:
    """(url, cluster?) for the tests that must hold on both."""
    if request.param == "single":
        return request.getfixturevalue("server").url, False
    return request.getfixturevalue("cluster").url, True


@pytest.fixture
async def make_backend(request: pytest.FixtureRequest) -> AsyncIterator[Callable[..., RedisBackend]]:
    """Opened backends with a prefix private to the test; all closed afterwards."""
    made: list[RedisBackend] = []
    prefix = "t" + hashlib.sha1(request.node.nodeid.encode()).hexdigest()[:12]

    def make(url: str, **options: object) -> RedisBackend:
        options.setdefault("prefix", prefix)
        backend = RedisBackend(url, **options)  # type: ignore[arg-type]
        made.append(backend)
        return backend

    yield make
    for backend in made:
        await backend.close()


def raw_client(url: str, cluster: bool) -> redis.Redis | redis.RedisCluster:
    return redis.RedisCluster.from_url(url) if cluster else redis.Redis.from_url(url)


# -- TTL ------------------------------------------------------------------------------------------


async def test_ttl_set_and_refreshed(target: tuple[str, bool], make_backend: Callable[..., RedisBackend]) -> None:
    url, is_cluster = target
    backend = make_backend(url, cluster=is_cluster, ttl=TTL)
    plain = make_backend(url, cluster=is_cluster)
    await backend.open()
    key, other = chunk_key(1), chunk_key(2)
    value = bytes(range(256)) * 40
    with raw_client(url, is_cluster) as raw:
        name = f"{backend.prefix}:default:{key}"
        await backend.set(key, [value])
        assert 0.9 * TTL * 1000 < raw.pttl(name) <= TTL * 1000

        for read in (
            lambda: backend.get(key),  # GETEX
            lambda: backend.get(key, (0, 100)),  # a layer-streamed load starts with the header
            lambda: backend.get_many([key, other]),
        ):
            raw.pexpire(name, 5000)
            await read()
            assert raw.pttl(name) > 0.9 * TTL * 1000

        raw.pexpire(name, 5000)
        assert await backend.get(key, (100, 200)) == value[100:200]  # later layers do not refresh
        assert raw.pttl(name) <= 5000
        assert await backend.exists(key) and raw.pttl(name) <= 5000

        await plain.set(other, [b"no ttl", b" here"])
        assert raw.pttl(f"{plain.prefix}:default:{other}") == -1  # persistent
        assert await plain.get(other) == b"no ttl here" and raw.pttl(f"{plain.prefix}:default:{other}") == -1

    with pytest.raises(ValueError):
        RedisBackend(url, ttl=0)


# -- byte ranges ----------------------------------------------------------------------------------


async def test_byte_ranges(target: tuple[str, bool], make_backend: Callable[..., RedisBackend]) -> None:
    url, is_cluster = target
    backend = make_backend(url, cluster=is_cluster)
    key = chunk_key(3)
    value = np.random.default_rng(0).integers(0, 256, 10_000, dtype=np.uint8).tobytes()
    await backend.set(key, [value])

    assert await backend.get(key, (0, 1)) == value[:1]
    assert await backend.get(key, (1234, 5678)) == value[1234:5678]
    assert await backend.get(key, (9_999, 10_000)) == value[-1:]  # the last byte (GETRANGE's end is inclusive)
    assert await backend.get(key, (0, 10_000)) == value
    assert await backend.get(key, (9_990, 20_000)) == value[9_990:]  # clipped at the end, like a file read
    assert await backend.get(key, (50, 50)) == b""  # an empty range of a present object
    assert await backend.get(key) == value

    missing = chunk_key(4)
    assert await backend.get(missing, (0, 10)) is None  # GETRANGE answers b"" for a missing key
    assert await backend.get(missing, (5, 5)) is None
    assert await backend.get(missing) is None
    with pytest.raises(ValueError):
        await backend.get(key, (10, 5))
    with pytest.raises(ValueError):
        await backend.get(key, (-1, 5))


async def test_get_into_reads_pieces_into_caller_buffers(
    target: tuple[str, bool], make_backend: Callable[..., RedisBackend]
) -> None:
    url, is_cluster = target
    backend = make_backend(url, cluster=is_cluster, ttl=TTL)
    key = chunk_key(7)
    value = np.random.default_rng(1).integers(0, 256, 5_000_001, dtype=np.uint8).tobytes()  # 3 pieces of 2 MiB
    await backend.set(key, [value])
    out = bytearray(len(value) + 100)
    views = [memoryview(out)[:10], memoryview(out)[10:10], memoryview(out)[10:3_000_000], memoryview(out)[3_000_000:]]
    with raw_client(url, is_cluster) as raw:
        raw.pexpire(f"{backend.prefix}:default:{key}", 5000)
        assert await backend.get_into(key, views) == len(value)
        assert raw.pttl(f"{backend.prefix}:default:{key}") > 0.9 * TTL * 1000  # a whole read refreshes the TTL
    assert bytes(out[: len(value)]) == value and out[len(value) :] == bytes(100)

    small = bytearray(1000)  # smaller buffers: the leading bytes, and the object's full size
    assert await backend.get_into(key, [memoryview(small)]) == len(value)
    assert bytes(small) == value[:1000]
    assert await backend.get_into(chunk_key(8), [memoryview(small)]) is None


@pytest.mark.parametrize("protocol", [2, 3])
async def test_a_get_received_in_place_reads_exactly_its_reply(
    server: RedisServer, make_backend: Callable[..., RedisBackend], protocol: int
) -> None:
    """The GET the socket receives into the caller's memory (a single server) takes its reply and nothing more:
    on one pooled connection, a value longer than the buffers, an absent key and a wrong-type key each leave
    the next call, by hand or through redis-py, a clean reply; a pooled connection the server closed is
    replaced at once (RESP2 and RESP3 alike: redis-py's pool does not check RESP3 connections for that)."""
    backend = make_backend(f"{server.url}?protocol={protocol}", max_connections=1)
    assert receives_in_place(backend._connect())
    key, other = chunk_key(50), chunk_key(51)
    value = np.random.default_rng(5).integers(0, 256, 3_000_003, dtype=np.uint8).tobytes()
    await backend.set(key, [value])
    small, out = bytearray(100_003), bytearray(len(value))
    assert await backend.get_into(key, [memoryview(small)]) == len(value) and bytes(small) == value[:100_003]
    assert await backend.get_into(key, [memoryview(out)]) == len(value) and bytes(out) == value
    assert await backend.get_into(other, [memoryview(small)]) is None
    with raw_client(server.url, False) as raw:
        raw.hset(f"{backend.prefix}:default:{other}", "field", "value")
    with pytest.raises(ResponseError, match="WRONGTYPE"):
        await backend.get_into(other, [memoryview(small)])
    assert await backend.get(key) == value  # redis-py's parser, on the same pool
    out[:] = bytes(len(out))
    assert await backend.get_into(key, [memoryview(out)[:7], memoryview(out)[7:]]) == len(value)
    assert bytes(out) == value

    with raw_client(server.url, False) as raw:  # the server closes the idle pooled connection (as its timeout does)
        assert raw.client_kill_filter(_type="normal", skipme=True) >= 1
    (idle,) = backend._connect().connection_pool._available_connections
    for _ in range(500):  # until the loop has taken the server's EOF on it (its transport then stops reading)
        if idle._reader is None or idle._reader.at_eof():
            break
        await asyncio.sleep(0.01)
    out[:] = bytes(len(out))  # a stale connection is retried on a fresh one, not waited on until the deadline
    assert await backend.get_into(key, [memoryview(out)]) == len(value) and bytes(out) == value
    assert int(backend.stats()["timeouts"]) == 0


async def test_a_unix_socket_url_reads_and_writes(make_backend: Callable[..., RedisBackend]) -> None:
    """``unix://`` URLs: the tier opens, writes and reads (the GET received in place too)."""
    socket_dir = tempfile.mkdtemp(prefix="kvr-", dir="/tmp")  # a socket's path must stay short
    path = f"{socket_dir}/redis.sock"
    try:
        with RedisServer("--unixsocket", path, "--unixsocketperm", "700"):
            backend = make_backend(f"unix://{path}?db=0")
            await backend.open()
            assert receives_in_place(backend._connect())
            await backend.set(chunk_key(60), [b"over ", b"a unix socket"])
            into = memoryview(bytearray(32))
            assert await backend.get_into(chunk_key(60), [into]) == 18 and bytes(into[:18]) == b"over a unix socket"
            assert await backend.get(chunk_key(60)) == b"over a unix socket"
            await backend.close()
    finally:
        shutil.rmtree(socket_dir, ignore_errors=True)


async def test_multi_part_set_is_sent_without_gathering(
    server: RedisServer, make_backend: Callable[..., RedisBackend]
) -> None:
    """On one server the parts go out in a hand-built request: exact bytes, no scratch buffer, TTL kept."""
    backend = make_backend(server.url, ttl=60)
    payload = np.arange(3_000_000, dtype=np.uint8)
    parts: list[Buffer] = [b"header", payload[:1_000_000].data, payload[1_000_000:], bytearray(b"tail")]
    expected = b"header" + payload.tobytes() + b"tail"
    await backend.set(chunk_key(5), parts)
    await backend.set(chunk_key(6), parts[1:3])
    assert await backend.get(chunk_key(5)) == expected
    assert await backend.get(chunk_key(6)) == expected[6:-4]
    assert not backend._scratch
    raw = redis.Redis.from_url(server.url)
    assert 0 < raw.pttl(f"{backend.prefix}:default:{chunk_key(6)}") <= 60_000
    raw.close()
    server.stop()
    server.start()  # the pooled connection is now dead: the next SET retries on a fresh one
    await backend.set(chunk_key(7), parts)
    assert await backend.get(chunk_key(7)) == expected
    assert int(backend.stats()["bytes_out"]) == 2 * len(expected) + len(expected) - 10


async def test_multi_part_set_on_a_cluster_gathers_into_reused_scratch(
    cluster: RedisClusterServer, make_backend: Callable[..., RedisBackend]
) -> None:
    backend = make_backend(cluster.url, cluster=True)
    payload = np.arange(3_000_000, dtype=np.uint8)
    parts: list[Buffer] = [b"header", payload[:1_000_000].data, payload[1_000_000:], bytearray(b"tail")]
    expected = b"header" + payload.tobytes() + b"tail"
    await backend.set(chunk_key(5), parts)
    await backend.set(chunk_key(6), parts[1:3])  # a smaller object reuses the same scratch buffer
    assert await backend.get(chunk_key(5)) == expected
    assert await backend.get(chunk_key(6)) == expected[6:-4]
    assert len(backend._scratch) == 1


# -- cluster: keys spread over all nodes ------------------------------------------------------------


async def test_cluster_pipelines_span_all_nodes(
    cluster: RedisClusterServer, make_backend: Callable[..., RedisBackend]
) -> None:
    backend = make_backend(cluster.url, cluster=True)
    keys, owners = keys_on_every_node(cluster, f"{backend.prefix}:default")
    assert set(owners.values()) == set(cluster.ports)  # CLUSTER KEYSLOT + CLUSTER SLOTS: three owners
    for key in keys:
        await backend.set(key, [key.encode()])
    for port in cluster.ports:  # and each node really holds its share
        assert local_keys(port, f"{backend.prefix}:default") == {k for k in keys if owners[k] == port}

    requests = int(backend.stats()["requests"])
    assert await backend.get_many(keys) == [key.encode() for key in keys]
    assert await backend.prefix_count(keys) == len(keys)
    assert backend.stats()["requests"] == requests + 2  # one pipeline each, split by redis-py per node

    missing = chunk_key(10_000)
    mixed = keys[:4] + [missing] + keys[4:]
    assert await backend.get_many(mixed) == [k.encode() for k in keys[:4]] + [None] + [k.encode() for k in keys[4:]]
    assert await backend.prefix_count(mixed) == 4
    assert await backend.prefix_count([missing, *keys]) == 0
    assert await backend.get_many([]) == [] and await backend.prefix_count([]) == 0

    listed = await listed_keys(backend)  # SCAN on every primary
    assert sorted(listed) == sorted(keys)
    assert sorted(await listed_keys(backend, keys[0][:3])) == sorted(k for k in keys if k.startswith(keys[0][:3]))


async def test_list_keys_escapes_glob_characters(
    server: RedisServer, make_backend: Callable[..., RedisBackend]
) -> None:
    odd = make_backend(server.url, prefix="kv[1]*?")
    near = make_backend(server.url, prefix="kv1xx")  # would match the unescaped pattern kv[1]*?:*
    await odd.set(chunk_key(20), [b"a"])
    await near.set(chunk_key(21), [b"b"])
    assert await listed_keys(odd) == [chunk_key(20)]
    assert await listed_keys(odd, "*") == []


# -- passwords ----------------------------------------------------------------------------------


async def test_password_never_shown(
    make_backend: Callable[..., RedisBackend], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    secret, wrong = "s3cret-Pa55word", "wr0ng-Pa55word"
    with RedisServer("--requirepass", secret) as guarded:
        good_url = f"redis://:{secret}@127.0.0.1:{guarded.port}/0"
        good = make_backend(good_url)
        await good.open()
        await good.set(chunk_key(30), [b"ok"])
        assert await good.get(chunk_key(30)) == b"ok"
        assert secret not in repr(good) and secret not in good.url and "***" in good.url

        for url in (
            f"redis://:{wrong}@127.0.0.1:{guarded.port}/0",
            f"redis://default:{wrong}@127.0.0.1:{guarded.port}/0",
            f"redis://127.0.0.1:{guarded.port}/0?password={wrong}",
        ):
            bad = make_backend(url)
            await bad.open()  # warns, does not raise
            with pytest.raises(AuthenticationError) as caught:
                await bad.get(chunk_key(30))
            texts = [repr(bad), bad.url, str(caught.value), repr(caught.value), str(bad.stats())]
            assert not any(wrong in text for text in texts), texts

        guarded.stop()  # and while it is down, the connection errors do not show it either
        with pytest.raises(RedisConnectionError) as down:
            await good.get(chunk_key(30))
        assert secret not in str(down.value)
    logged = caplog.text
    assert "not reachable yet" in logged and "unreachable" in logged
    assert secret not in logged and wrong not in logged


def test_mask_url() -> None:
    assert mask_url("redis://:pw@host:6379/0") == "redis://:***@host:6379/0"
    assert mask_url("rediss://user:p%40ss@host:6380/1") == "rediss://user:***@host:6380/1"
    assert mask_url("redis://host:6379/0?password=pw&db=2") == "redis://host:6379/0?password=***&db=2"
    assert mask_url("redis://user@host/0") == "redis://user@host/0"
    assert mask_url("redis://127.0.0.1:6379/0") == "redis://127.0.0.1:6379/0"


def test_url_from_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("REDIS_URL", "redis://:envsecret@10.0.0.1:7000/3")
    assert RedisBackend().url == "redis://:***@10.0.0.1:7000/3"
    assert "envsecret" not in repr(RedisBackend())
    monkeypatch.delenv("REDIS_URL")
    assert RedisBackend().url == "redis://127.0.0.1:6379/0"


# -- losing the server ----------------------------------------------------------------------------


async def test_reconnects_after_restart(make_backend: Callable[..., RedisBackend]) -> None:
    with RedisServer() as flaky:
        backend = make_backend(flaky.url, **FAST)
        await backend.open()
        await backend.set(chunk_key(40), [b"before"])
        assert await backend.get(chunk_key(40)) == b"before"

        flaky.stop()
        took = await elapsed_raising(lambda: backend.get(chunk_key(40)), RedisConnectionError)
        assert took < backend.operation_timeout + 2.0
        into = memoryview(bytearray(16))
        took = await elapsed_raising(lambda: backend.get_into(chunk_key(40), [into]), RedisConnectionError)
        assert took < backend.operation_timeout + 2.0
        took = await elapsed_raising(lambda: backend.set(chunk_key(41), [b"x"]), RedisConnectionError)
        assert took < backend.operation_timeout + 2.0

        flaky.start()  # same port, empty (no persistence): the same object works again, no reopen
        assert await backend.get(chunk_key(40)) is None
        await backend.set(chunk_key(40), [b"after"])
        assert await backend.get(chunk_key(40)) == b"after"
        assert await backend.get_into(chunk_key(40), [into]) == 5 and bytes(into[:5]) == b"after"
        stats = backend.stats()
        assert int(stats["connection_errors"]) >= 2 and int(stats["errors"]) >= 2

        await backend.close()
        with pytest.raises(RedisConnectionError, match="closed"):
            await backend.get(chunk_key(40))
        await backend.open()  # a closed backend opens again
        assert await backend.get(chunk_key(40)) == b"after"


async def test_open_while_server_is_down(make_backend: Callable[..., RedisBackend]) -> None:
    with RedisServer() as late:
        late.stop()
        backend = make_backend(late.url, **FAST)
        started = time.monotonic()
        await backend.open()  # a store must start without its remote tier
        assert time.monotonic() - started < backend.operation_timeout + 2.0
        with pytest.raises(RedisConnectionError):
            await backend.exists(chunk_key(50))
        late.start()
        await backend.set(chunk_key(50), [b"up"])
        assert await backend.get(chunk_key(50)) == b"up"


@pytest.mark.parametrize("is_cluster", [False, True], ids=["single", "cluster"])
async def test_frozen_server_bounded(is_cluster: bool, make_backend: Callable[..., RedisBackend]) -> None:
    frozen = RedisClusterServer(nodes=3) if is_cluster else RedisServer()
    with frozen:
        await _check_frozen(frozen, frozen.url, is_cluster, make_backend)


async def _check_frozen(
    frozen: RedisServer | RedisClusterServer, url: str, is_cluster: bool, make_backend: Callable[..., RedisBackend]
) -> None:
    backend = make_backend(url, cluster=is_cluster, **FAST)
    await backend.set(chunk_key(60), [b"v"])
    bound = 5 * FAST["socket_timeout"]  # the hard limit is 1.0 s; the rest is slack for a loaded machine
    frozen.pause()  # SIGSTOP: connections stay open, nothing answers
    try:
        assert await elapsed_raising(lambda: backend.get(chunk_key(60)), RedisTimeoutError) < bound
        assert await elapsed_raising(lambda: backend.get_many([chunk_key(60)]), RedisTimeoutError) < bound
        assert await elapsed_raising(lambda: backend.prefix_count([chunk_key(60)]), RedisTimeoutError) < bound
        fresh = make_backend(url, cluster=is_cluster, **FAST)  # new connections to a frozen server
        started = time.monotonic()
        await fresh.open()
        assert time.monotonic() - started < bound
        assert await elapsed_raising(lambda: fresh.get(chunk_key(60)), RedisError) < bound
        started = time.monotonic()
        await asyncio.gather(*(backend.get(chunk_key(60)) for _ in range(10)), return_exceptions=True)
        assert time.monotonic() - started < bound
        assert int(backend.stats()["timeouts"]) >= 3
    finally:
        frozen.resume()
    assert await backend.get(chunk_key(60)) == b"v"
    assert await fresh.get(chunk_key(60)) == b"v"
    frozen.pause()
    try:
        started = time.monotonic()
        await backend.close()  # shutdown does not hang on a frozen server
        assert time.monotonic() - started < bound
    finally:
        frozen.resume()


async def test_more_concurrent_calls_than_connections(
    target: tuple[str, bool], make_backend: Callable[..., RedisBackend]
) -> None:
    url, is_cluster = target
    backend = make_backend(url, cluster=is_cluster, max_connections=2)
    keys = [chunk_key(70 + i) for i in range(40)]
    await asyncio.gather(*(backend.set(key, [key.encode()] * 3) for key in keys))
    values = await asyncio.gather(*(backend.get(key) for key in keys))
    assert values == [key.encode() * 3 for key in keys]


# -- cluster: one node down -----------------------------------------------------------------------


async def test_cluster_survives_losing_a_node(make_backend: Callable[..., RedisBackend]) -> None:
    with RedisClusterServer(nodes=3) as shaky:
        relax_coverage(shaky)
        backend = make_backend(shaky.url, cluster=True, **FAST)
        keys, owners = keys_on_every_node(shaky, f"{backend.prefix}:default")
        for key in keys:
            await backend.set(key, [key.encode()])
        lost = shaky.ports[1]
        alive = [k for k in keys if owners[k] != lost]
        gone = [k for k in keys if owners[k] == lost]

        shaky.stop_node(1)
        for settle in ("at once", "after the others marked it failed"):
            if settle != "at once":
                with redis.Redis(port=shaky.ports[0]) as survivor:
                    wait_until(partial(_node_failed_seen_by, survivor))
            for key in alive:
                assert await backend.get(key) == key.encode(), settle
                assert await backend.exists(key)
                await backend.set(key, [b"new ", key.encode()])
                assert await backend.get(key, (0, 4)) == b"new "
            assert await backend.get_many(alive) == [b"new " + k.encode() for k in alive]
            assert await backend.prefix_count(alive) == len(alive)
            # A dead node answers "refused" or nothing (the cluster client retries its slot map first, which
            # on a loaded machine can outlast the deadline): either way the call fails, within the deadline.
            down = (RedisConnectionError, RedisTimeoutError)
            for key in gone:
                took = await elapsed_raising(partial(backend.get, key), down)
                assert took < backend.operation_timeout + 2.0
            took = await elapsed_raising(partial(backend.get_many, keys), down)  # a batch touching it fails whole
            assert took < backend.operation_timeout + 2.0
            for key in alive:
                await backend.set(key, [key.encode()])

        shaky.start_node(1)  # it comes back empty (no persistence) and rejoins
        for key in gone:
            assert await backend.get(key) is None
            await backend.set(key, [key.encode()])
        assert await backend.get_many(keys) == [key.encode() for key in keys]
        assert await backend.prefix_count(keys) == len(keys)
        assert sorted(await listed_keys(backend)) == sorted(keys)
