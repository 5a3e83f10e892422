"""``kvstore bench --remote``: a store whose archive is Redis or S3, against the raw client, in the same run.

Each kvstore figure times the public API of a :class:`~kvstore.KVStore` with DRAM in front and
the one remote tier below it (disk disabled, identity codec), beside the raw client moving the
very same container bytes (encoded once up front) with the same number of requests in flight
(the tier's connection limit), run alternately, best of N:

- put  ``store.put`` of every chunk then ``store.flush()`` (the chunks have reached the server)
  vs  redis-py ``SET`` (hiredis parser) / one aiobotocore ``put_object`` per chunk (below the S3
  tier's default multipart threshold, as kvstore's own upload)
- get  ``store.get_many(keys, outs)`` into caller tensors, DRAM not holding the chunks, checksums
  verified  vs  redis-py ``GET`` / ``get_object`` + ``body.read()`` (bytes left where the client put them)

An extra row per server and layout, labelled internal, times ``ChunkTier.write_many`` alone on
the same chunks (no store, no DRAM copy) against the same raw puts: it shows how much of a put
gap lies in the tier's path and how much in the store's copy into DRAM.

Then every codec through the tier (``ChunkTier``, internal) on real KV (the SmolLM2 sample):
compression ratio and logical (uncompressed) MB/s for put and get. The servers are real
processes on this machine, started and described, each with its raw client, by
:mod:`kvstore.bench.remote_servers` (``serve``, ``parse_remotes``). The functions return
rows; :mod:`kvstore.cli.bench` prints them.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field

import torch

from kvstore.bench.local import LAYOUTS, CodecRow, Row, _best_pair, _sample_chunks
from kvstore.bench.remote_servers import Remote
from kvstore.codecs import make_codec
from kvstore.config import StoreConfig
from kvstore.engine.store import KVStore
from kvstore.keys import ChunkKey, chunk_keys
from kvstore.layout import KVLayout
from kvstore.storage.container import encode_chunk
from kvstore.storage.tier import ChunkTier
from kvstore.util.buffers import tensor_bytes
from kvstore.util.progress import Progress
from kvstore.util.units import MB, per_second

CONCURRENCY = 4  # requests in flight, kvstore and raw client alike (the store's io_threads default)
TARGET = 0.9
REMOTE_CODECS = ["identity", "byteplanes", "bytesplit", "zstd", "fp8+zstd", "int8+zstd", "int4+zstd"]
CODEC_MIB = 64  # logical MiB per codec measurement (at most --mib): 7 codecs x 3 servers must stay quick
NAMESPACE = "bench"


class RemoteRow(Row):
    """A bench row whose target is the remote one (bench.TARGETS is keyed by local operation names)."""

    @property
    def target(self) -> float | None:
        """The remote ratio target, whatever the operation."""
        return TARGET


class InternalRow(Row):
    """An extra row timing ``ChunkTier`` alone (no store, no DRAM copy): it shows where a public-API gap lies."""

    @property
    def target(self) -> float | None:
        """None: the targets are the public API's."""
        return None


@dataclass
class RemoteResults:
    """What :func:`run_remote` measured: ratio rows per server and layout, then codec rows on real KV."""

    rows: list[Row] = field(default_factory=list)  # RemoteRow, and InternalRow extras
    codec_rows: list[CodecRow] = field(default_factory=list)


async def _bounded(concurrency: int, count: int, job: Callable[[int], Awaitable[None]]) -> float:
    """Seconds to run ``job(0..count-1)`` with ``concurrency`` of them in flight (workers pull the next index)."""
    indices = iter(range(count))

    async def worker() -> None:
        for index in indices:
            await job(index)

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(min(concurrency, count))))
    return time.perf_counter() - start


@asynccontextmanager
async def _tier(remote: Remote, codec: str, layout: KVLayout, executor: ThreadPoolExecutor) -> AsyncIterator[ChunkTier]:
    """An opened ChunkTier on ``remote`` with ``codec``, closed on exit."""
    tier = ChunkTier(remote.make_backend(), make_codec(codec), layout, executor)
    await tier.open()
    try:
        yield tier
    finally:
        await tier.close()


async def _tier_put(tier: ChunkTier, items: list[tuple[str, memoryview]], concurrency: int) -> float:
    """Seconds to write every item through the tier, ``concurrency`` at a time; RuntimeError if a write fails."""

    async def one(i: int) -> None:
        (outcome,) = await tier.write_many([items[i]])
        if outcome is not None:
            raise RuntimeError(f"the {tier.name} tier failed a write during the benchmark") from outcome

    return await _bounded(concurrency, len(items), one)


async def _tier_get(tier: ChunkTier, keys: list[str], slots: list[memoryview], concurrency: int) -> float:
    """Seconds to read every key into its slot, ``concurrency`` at a time; RuntimeError if a chunk is missing."""

    async def one(i: int) -> None:
        if not (await tier.read_many_into([keys[i]], [slots[i]]))[0]:
            raise RuntimeError(f"the {tier.name} tier lost a chunk during the benchmark ({tier.stats.as_dict()})")

    return await _bounded(concurrency, len(keys), one)


def store_config(remote: Remote, layout: KVLayout, chunks: int, concurrency: int = CONCURRENCY) -> StoreConfig:
    """A store with DRAM in front of ``remote`` alone: identity codec, room and queue for every chunk of a pass.

    ``concurrency`` is both the tier's connection limit (in ``remote.settings``) and its
    ``tier_workers`` (writes in flight): with the default two workers, four 32 MiB chunks went up
    two at a time (a worker takes what is queued when it wakes: often one chunk) where the raw
    client had four in flight. The deadlines are widened, so a slow moment on a shared machine
    is not a miss.
    """
    (section, settings), *_ = remote.settings.items()
    return StoreConfig(
        dram={"capacity": (2 * chunks + 8) * layout.chunk_nbytes, "pin_memory": "never"},
        disk={"enabled": False},
        **{section: {**settings, "codec": "identity"}},
        queue_depth=max(64, 2 * chunks),
        tier_workers=concurrency,
        timeouts={"get": 120, "put": 120},
        adaptive={"track": False},
    )


async def bench_api(
    remote: Remote, name: str, layout: KVLayout, chunks: int, repeats: int, concurrency: int
) -> list[Row]:
    """``put`` + ``flush`` and ``get_many(keys, outs)`` of a store on ``remote`` against the raw client.

    An extra internal row times ``ChunkTier.write_many`` alone on the same chunks (no DRAM copy).

    Every pass writes fresh keys (each side deletes its pass's objects after timing it), so
    neither overwrites on the server; before each get pass the chunks leave DRAM, so they come
    from the server. Raises RuntimeError if the store drops, fails or misses a chunk, or if
    either round trip changes a byte.
    """
    sources = _sample_chunks(layout, min(chunks, 4), seed=2)
    tensors = [sources[i % len(sources)] for i in range(chunks)]
    identity = make_codec("identity")
    keys_of_pass = iter(range(1, 1 << 30))

    def fresh_keys() -> list[ChunkKey]:
        number, half = next(keys_of_pass), layout.chunk_tokens // 2
        return [k for i in range(chunks) for k in chunk_keys([number, i] * half, layout, NAMESPACE)]

    get_keys = fresh_keys()
    containers = [  # what the identity tier stores: the raw client moves these very bytes
        b"".join(encode_chunk(layout, key, tensor_bytes(tensor), identity))
        for key, tensor in zip(get_keys, tensors, strict=True)
    ]
    names = [f"raw-{key}" for key in get_keys]
    outs = [torch.zeros(layout.chunk_shape, dtype=layout.dtype) for _ in range(chunks)]  # pre-touched
    async with AsyncExitStack() as stack:
        raw = await remote.open_raw(stack)
        store = await stack.enter_async_context(
            KVStore(store_config(remote, layout, chunks, concurrency), layout, NAMESPACE)
        )
        (tier,) = store.tiers

        async def store_puts(keys: list[ChunkKey]) -> float:
            before = dict(tier.stats.as_dict())
            start = time.perf_counter()
            for key, tensor in zip(keys, tensors, strict=True):
                if not await store.put(key, tensor):
                    raise RuntimeError("the DRAM pool rejected a put during the benchmark")
            await store.flush()
            seconds = time.perf_counter() - start
            after = tier.stats.as_dict()
            if after["writes"] - before["writes"] != chunks:
                raise RuntimeError(f"the {tier.name} tier did not write every chunk: {after}")
            for key in keys:
                store.pool.discard(key)  # out of DRAM: a get pass reads from the server
            return seconds

        async def kvstore_put() -> float:
            keys = fresh_keys()
            seconds = await store_puts(keys)
            for key in keys:
                await tier.backend.delete(key)
            return seconds

        async def raw_put() -> float:
            seconds = await _bounded(concurrency, chunks, lambda i: raw.put(f"{names[i]}-put", containers[i]))
            for i in range(chunks):
                await raw.delete(f"{names[i]}-put")
            return seconds

        async def kvstore_get() -> float:
            start = time.perf_counter()
            results = await store.get_many(get_keys, outs)
            seconds = time.perf_counter() - start
            if any(result is None for result in results):
                raise RuntimeError(f"the {tier.name} tier missed chunks during the benchmark ({store.stats()})")
            for key in get_keys:
                store.pool.discard(key)  # get_many promoted them: the next pass must read the server again
            return seconds

        async def raw_get() -> float:
            async def one(i: int) -> None:
                if len(await raw.get(names[i])) != len(containers[i]):
                    raise RuntimeError(f"raw {remote.name} get returned a short object")

            return await _bounded(concurrency, chunks, one)

        await store_puts(get_keys)  # what the get passes read, written once through the store
        await _bounded(concurrency, chunks, lambda i: raw.put(names[i], containers[i]))

        async def tier_put() -> float:  # internal: the tier alone, from the caller's tensors (no DRAM copy)
            items = list(zip(fresh_keys(), map(tensor_bytes, tensors), strict=True))
            seconds = await _tier_put(tier, items, concurrency)
            for key, _ in items:
                await tier.backend.delete(key)
            return seconds

        put_base, put_time, tier_time = await _best_of((raw_put, kvstore_put, tier_put), repeats)
        get_base, get_time = await _best_pair(raw_get, kvstore_get, repeats)
        if await raw.get(names[-1]) != containers[-1]:
            raise RuntimeError(f"raw {remote.name} round trip changed the data")
        for out, tensor in zip(outs, tensors, strict=True):
            if not torch.equal(out.view(torch.uint8), tensor.view(torch.uint8)):
                raise RuntimeError(f"{remote.name} store round trip changed the data")
        for i in range(chunks):
            await raw.delete(names[i])
            await tier.backend.delete(get_keys[i])
    total = sum(len(c) for c in containers)  # the bytes on the wire, on both sides
    return [
        RemoteRow(name, f"{remote.name} put+flush", total, put_time, put_base, raw.label[0]),
        InternalRow(name, f"{remote.name} put, tier only (internal)", total, tier_time, put_base, raw.label[0]),
        RemoteRow(name, f"{remote.name} get_many", total, get_time, get_base, raw.label[1]),
    ]


async def _best_of(runs: Sequence[Callable[[], Awaitable[float]]], repeats: int) -> list[float]:
    """Each run's best time, the runs taken in turn ``repeats`` times so that all see the same machine noise."""
    best = [math.inf] * len(runs)
    for _ in range(repeats):
        for index, run in enumerate(runs):
            best[index] = min(best[index], await run())
    return best


def real_chunks(sample: torch.Tensor, layout: KVLayout) -> list[torch.Tensor]:
    """The sample cut into whole chunks of ``layout.chunk_tokens`` tokens (dimension 2 is tokens)."""
    step = layout.chunk_tokens
    return [sample[:, :, s : s + step].contiguous() for s in range(0, sample.shape[2] - step + 1, step)]


async def bench_codecs_remote(
    remote: Remote,
    sample: torch.Tensor,
    mib: int,
    repeats: int,
    concurrency: int,
    executor: ThreadPoolExecutor,
    codecs: Sequence[str] = REMOTE_CODECS,
) -> list[CodecRow]:
    """Every codec through the tier on real KV (``mib`` MiB of it): stored size and logical MB/s each way.

    The codecs take turns within each of the ``repeats`` rounds (a put of every chunk, then a get
    of every chunk), so the rows compare in one run: a codec's get against identity's is the
    price of its decoding over moving raw KV.
    """
    layout = LAYOUTS["SmolLM2-135M"]  # the sample's model
    pieces = real_chunks(sample, layout)
    chunks = max(concurrency, -(-(mib << 20) // layout.chunk_nbytes))
    views = [tensor_bytes(pieces[i % len(pieces)]) for i in range(chunks)]
    destination = torch.zeros(chunks, layout.chunk_nbytes, dtype=torch.uint8)
    slots = [memoryview(destination[i].numpy()) for i in range(chunks)]
    keys = {
        codec: [k for i in range(chunks) for k in chunk_keys([i] * layout.chunk_tokens, layout, f"bench-real-{codec}")]
        for codec in codecs
    }
    put_time = dict.fromkeys(codecs, math.inf)
    get_time = dict.fromkeys(codecs, math.inf)
    stored = dict.fromkeys(codecs, 0)
    async with AsyncExitStack() as stack:
        tiers = {codec: await stack.enter_async_context(_tier(remote, codec, layout, executor)) for codec in codecs}
        try:
            for _ in range(max(1, repeats)):
                for codec, tier in tiers.items():
                    before = tier.stats.bytes_written
                    items = list(zip(keys[codec], views, strict=True))
                    put_time[codec] = min(put_time[codec], await _tier_put(tier, items, concurrency))
                    stored[codec] = tier.stats.bytes_written - before
                    get_time[codec] = min(get_time[codec], await _tier_get(tier, keys[codec], slots, concurrency))
                    if tier.codec.lossless:
                        for i in range(chunks):
                            if not torch.equal(destination[i], pieces[i % len(pieces)].view(torch.uint8).reshape(-1)):
                                raise RuntimeError(f"{codec} on {remote.name} is not bit-exact")
        finally:
            for codec, tier in tiers.items():
                for key in keys[codec]:
                    await tier.backend.delete(key)
    nbytes = chunks * layout.chunk_nbytes
    return [
        CodecRow(
            remote.name,
            codec,
            nbytes,
            stored[codec],
            per_second(nbytes, put_time[codec], MB),
            per_second(nbytes, get_time[codec], MB),
            tiers[codec].codec.lossless,
        )
        for codec in codecs
    ]


async def run_remote(
    remotes: Sequence[Remote],
    mib: int,
    repeats: int,
    layouts: Sequence[str] = tuple(LAYOUTS),
    sample: torch.Tensor | None = None,
    concurrency: int = CONCURRENCY,
    codec_mib: int = CODEC_MIB,
) -> RemoteResults:
    """Public-API rows for every remote and layout, then codec rows on real KV when a sample is given."""
    results = RemoteResults()
    steps = len(remotes) * (len(layouts) + (sample is not None))
    with (
        ThreadPoolExecutor(concurrency, thread_name_prefix="kvstore-bench") as executor,
        Progress("remote tiers", total=steps, keep=False) as progress,  # steps between the measurements
    ):
        for remote in remotes:
            for name in layouts:
                layout = LAYOUTS[name]
                chunks = max(concurrency, -(-(mib << 20) // layout.chunk_nbytes))
                progress.doing(f"{remote.name}, {name}")
                results.rows += await bench_api(remote, name, layout, chunks, repeats, concurrency)
                progress.step(f"{remote.name}, {name}: done")
            if sample is not None:
                progress.doing(f"{remote.name}, codecs on real KV")
                results.codec_rows += await bench_codecs_remote(
                    remote, sample, min(mib, codec_mib), repeats, concurrency, executor
                )
                progress.step(f"{remote.name}, codecs: done")
    return results
