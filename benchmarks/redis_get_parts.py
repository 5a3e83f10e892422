"""Where a ``get_many`` from Redis spends its time, stage by stage, beside what any client could reach.

The peers benchmark (``benchmarks/peers.py``) times kvstore's Redis get against LMCache's; this one
takes kvstore's apart on the same bytes (Llama-3-8B chunks, 32 MiB, identity codec, ``--chunks`` per
measurement, 4 requests in flight) on one ``redis-server`` started here. Each round times, in turn:

- ``get_many(keys, outs)``, the public API, with DRAM emptied first (every chunk from Redis);
- the tier's request alone: ``RedisBackend.get_into`` of each chunk into its header and a chunk (on a
  single server, one GET whose reply the socket receives in place: ``kvstore.backends.redis_get_into``);
- the request a Cluster or a TLS connection makes instead: a MULTI/EXEC of EXISTS, STRLEN and 2 MiB
  GETRANGEs, the replies left where redis-py put them (not even copied into place);
- the checksums the tier verifies (xxh3 of every layer), from memory, one thread;
- the copy of every chunk from its DRAM slot into the caller's tensor, one thread;

and two baselines: redis-py's ``GET`` of each whole value (the peers table's raw row), and a GET read by
hand off the socket straight into memory (``sock_recv_into``, no parsing library): about the most the
server gives one process. Every figure is the best of ``--rounds``.

Run from the repository root::

    .venv/bin/python -m benchmarks.redis_get_parts --rounds 5
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from urllib.parse import urlsplit

import torch
import xxhash

from kvstore import KVStore, chunk_keys
from kvstore.backends.redis import READ_PIECE, RedisBackend
from kvstore.bench.local import LAYOUTS, _sample_chunks, _timed
from kvstore.bench.machine import describe_machine
from kvstore.bench.remote import _bounded, store_config
from kvstore.bench.remote_servers import Remote, serve
from kvstore.layout import KVLayout
from kvstore.storage.container import header_length
from kvstore.util.buffers import copy_between, tensor_bytes

IN_FLIGHT = 4  # requests at once, kvstore's and the baselines' alike (the peers benchmark's)
HEADER_ROOM = 16 << 10  # more than a chunk's header: room ahead of the chunk in the hand-read baseline


@dataclass
class Stage:
    """One stage's best time over the rounds; ``kind``: "api", "part" or "baseline"."""

    name: str
    kind: str
    seconds: float


async def measure(remote: Remote, layout: KVLayout, chunks: int, rounds: int) -> list[Stage]:
    """Every stage and baseline once per round, in turn; the best of ``rounds`` each. Chunks are checked equal."""
    sources = _sample_chunks(layout, chunks, seed=5)
    outs = [torch.zeros_like(source) for source in sources]
    slots = [torch.zeros_like(source) for source in sources]
    whole = [memoryview(bytearray(HEADER_ROOM + layout.chunk_nbytes)) for _ in range(chunks)]  # header and chunk
    best: dict[tuple[str, str], float] = {}
    async with KVStore(store_config(remote, layout, chunks, IN_FLIGHT), layout, namespace="get-parts") as store:
        keys = [k for i in range(chunks) for k in chunk_keys([9, i] * (layout.chunk_tokens // 2), layout, "parts")]
        for key, source in zip(keys, sources, strict=True):
            await store.put(key, source)
        await store.flush()
        backend = store.tiers[0].backend
        if not isinstance(backend, RedisBackend):
            raise RuntimeError("the store's tier below DRAM is not Redis")
        client = backend._connect()  # the tier's own client and connection pool
        head = await backend.fetch(keys[0], (0, HEADER_ROOM))
        heads = [memoryview(bytearray(header_length(head or b""))) for _ in range(chunks)]  # as the tier reads
        names = [backend._name(key) for key in keys]
        raw_hand = await HandReader.open(remote.settings["redis"]["url"], IN_FLIGHT)
        try:

            async def api() -> None:
                for key in keys:
                    store.pool.discard(key)  # every chunk comes from Redis
                if any(found is None for found in await store.get_many(keys, outs)):
                    raise RuntimeError("a chunk went missing from Redis during the benchmark")
                _check(outs, sources)

            async def tier_request(i: int) -> None:
                await backend.get_into(keys[i], [heads[i], tensor_bytes(slots[i])])

            async def same_multi(i: int) -> None:
                pipe = client.pipeline(transaction=True)
                pipe.exists(names[i]).strlen(names[i])
                capacity = HEADER_ROOM + layout.chunk_nbytes
                for start in range(0, capacity, READ_PIECE):
                    pipe.getrange(names[i], start, min(start + READ_PIECE, capacity) - 1)
                await pipe.execute()

            async def redis_py_get(i: int) -> None:
                await client.get(names[i])

            stages: list[tuple[str, str, Callable[[], Awaitable[float]]]] = [
                ("get_many(keys, outs) (the API)", "api", lambda: _clocked(api)),
                ("the tier's request: get_into (one GET, received in place)", "part",
                 lambda: _bounded(IN_FLIGHT, chunks, tier_request)),
                ("on a Cluster or TLS: a MULTI of 2 MiB GETRANGEs, replies not copied", "part",
                 lambda: _bounded(IN_FLIGHT, chunks, same_multi)),
                ("checksums of every layer (xxh3), one thread", "part",
                 lambda: _done(_timed(lambda: _checksums(slots, layout)))),
                ("copy of every chunk into the caller's tensors, one thread", "part",
                 lambda: _done(_timed(lambda: _copies(outs, slots)))),
                ("redis-py GET of each whole value (the peers table's raw row)", "baseline",
                 lambda: _bounded(IN_FLIGHT, chunks, redis_py_get)),
                ("GET read off the socket straight into memory (sock_recv_into)", "baseline",
                 lambda: raw_hand.get_all(names, whole)),
            ]  # fmt: skip
            for _ in range(rounds):
                for name, kind, run in stages:
                    seconds = await run()
                    best[(name, kind)] = min(seconds, best.get((name, kind), float("inf")))
        finally:
            raw_hand.close()
            for key in keys:
                await backend.delete(key)
    return [Stage(name, kind, seconds) for (name, kind), seconds in best.items()]


async def _clocked(work: Callable[[], Awaitable[None]]) -> float:
    start = time.perf_counter()
    await work()
    return time.perf_counter() - start


async def _done(seconds: float) -> float:
    """A stage timed in place (blocking, ``_timed``), in the shape of the awaited ones."""
    return seconds


def _checksums(slots: Sequence[torch.Tensor], layout: KVLayout) -> None:
    for slot in slots:
        data = tensor_bytes(slot)
        for layer in range(layout.num_layers):
            xxhash.xxh3_64_intdigest(data[layer * layout.layer_nbytes : (layer + 1) * layout.layer_nbytes])


def _copies(outs: Sequence[torch.Tensor], slots: Sequence[torch.Tensor]) -> None:
    for out, slot in zip(outs, slots, strict=True):
        copy_between(out, slot)


def _check(outs: Sequence[torch.Tensor], sources: Sequence[torch.Tensor]) -> None:
    for out, source in zip(outs, sources, strict=True):
        if not torch.equal(out.view(torch.int16), source.view(torch.int16)):
            raise RuntimeError("get_many did not give a chunk back exactly")


class HandReader:
    """GETs written and read by hand on plain sockets, each value received straight into the caller's memory.

    The baseline for what the server gives: no client library, no copy after the kernel's. One
    connection per request in flight; a single server without TLS or a password (the one started here).
    """

    def __init__(self, sockets: list[socket.socket]) -> None:
        self._sockets = sockets

    @classmethod
    async def open(cls, url: str, connections: int) -> HandReader:
        parts = urlsplit(url)
        sockets = [
            socket.create_connection((parts.hostname or "localhost", parts.port or 6379)) for _ in range(connections)
        ]
        for sock in sockets:
            sock.setblocking(False)
        return cls(sockets)

    async def get_all(self, names: Sequence[str], targets: Sequence[memoryview]) -> float:
        """Seconds to GET every name into its target, a request per connection at a time."""
        indices = iter(range(len(names)))

        async def worker(sock: socket.socket) -> None:
            for i in indices:
                await self._get(sock, names[i], targets[i])

        start = time.perf_counter()
        await asyncio.gather(*(worker(sock) for sock in self._sockets))
        return time.perf_counter() - start

    async def _get(self, sock: socket.socket, name: str, target: memoryview) -> None:
        loop = asyncio.get_running_loop()
        key = name.encode()
        await loop.sock_sendall(sock, b"*2\r\n$3\r\nGET\r\n$%d\r\n%s\r\n" % (len(key), key))
        head = bytearray()
        while not head.endswith(b"\r\n"):  # "$<length>\r\n", a byte at a time (a few bytes per value)
            head += await loop.sock_recv(sock, 1)
        if not head.startswith(b"$") or int(head[1:-2]) < 0:
            raise RuntimeError(f"unexpected reply to GET {name}: {bytes(head)!r}")
        length, received = int(head[1:-2]), 0
        if length > len(target):
            raise RuntimeError(f"{name}: {length} bytes do not fit in {len(target)}")
        while received < length:
            received += await loop.sock_recv_into(sock, target[received:length])
        tail = bytearray(2)
        taken = 0
        while taken < 2:
            taken += await loop.sock_recv_into(sock, memoryview(tail)[taken:])

    def close(self) -> None:
        for sock in self._sockets:
            sock.close()


def markdown_table(stages: Sequence[Stage], nbytes: int) -> str:
    """Each stage's ms and GB/s, and its share of the API's time (parts) or the API's speed against it (baselines)."""
    api = next(stage.seconds for stage in stages if stage.kind == "api")
    lines = ["| stage | ms | GB/s | of get_many |", "|---|---:|---:|---:|"]
    for stage in stages:
        share = f"get_many at {stage.seconds / api:.2f}x" if stage.kind == "baseline" else f"{stage.seconds / api:.0%}"
        lines.append(f"| {stage.name} | {stage.seconds * 1e3:.1f} | {nbytes / stage.seconds / 1e9:.2f} | {share} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.redis_get_parts", description=__doc__.splitlines()[0])
    parser.add_argument("--chunks", type=int, default=8, help="Llama-3-8B chunks (32 MiB each) per measurement")
    parser.add_argument("--rounds", type=int, default=5, help="each figure is the best of this many rounds")
    parser.add_argument("--layout", default="Llama-3-8B", choices=sorted(LAYOUTS), help="the chunks' model layout")
    args = parser.parse_args(argv)
    layout = LAYOUTS[args.layout]
    print(f"machine: {describe_machine()}")
    with serve(["redis"], IN_FLIGHT) as (remote, *_):
        stages = asyncio.run(measure(remote, layout, args.chunks, args.rounds))
    print(markdown_table(stages, args.chunks * layout.chunk_nbytes))


if __name__ == "__main__":
    main()
