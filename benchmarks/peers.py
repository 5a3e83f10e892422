"""kvstore beside LMCache, tier by tier: the same layout, the same bytes, the same servers, taken in turn.

LMCache (a pinned release from PyPI, in an environment of its own that ``scripts/lmcache_env.sh``
makes, so that its dependencies never meet kvstore's) runs through ``benchmarks/lmcache_driver.py``:
its ``StorageManager``, the layer its vLLM connector stores and retrieves through, with its CPU,
disk and remote (Redis, S3) backends. kvstore runs in this process through its public API
(``put`` + ``flush``, ``get_many``). Both move Llama-3-8B chunks (32 layers, 8 KV heads of 128,
bf16, 256 tokens: 32 MiB each), ``--chunks`` per measurement, to and from one ``redis-server``
and one S3 server (moto) started here. Every round runs LMCache, kvstore and the raw baseline of
each tier once (LMCache first in odd rounds, kvstore first in even ones); each figure is the best
of the rounds. What each side's put and get include, and why that is the fair counterpart, is in
``docs/benchmarks.md`` ("kvstore and LMCache").

The raw baselines, measured in the same run: a memcpy (DRAM), two threads of plain file writes
and ``readinto`` (disk), redis-py SET/GET and aiobotocore put/get of the same bytes (Redis, S3).

Run from the repository root, with kvstore's environment::

    .venv/bin/python -m benchmarks.peers --out peers.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import AsyncExitStack
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from kvstore import KVStore, StoreConfig, chunk_keys
from kvstore.bench.local import LAYOUTS, RAW_THREADS, RawFiles, _copy_all, _drop_cache, _sample_chunks, _timed
from kvstore.bench.machine import describe_machine
from kvstore.bench.remote import _bounded, store_config
from kvstore.bench.remote_servers import BUCKET, Remote, serve
from kvstore.keys import ChunkKey
from kvstore.util.buffers import tensor_bytes

ROOT = Path(__file__).resolve().parents[1]
LMCACHE_PYTHON = ROOT / ".venv-lmcache" / "bin" / "python"
LMCACHE_DRIVER = ROOT / "benchmarks" / "lmcache_driver.py"
LAYOUT = LAYOUTS["Llama-3-8B"]
TIERS = ("dram", "disk", "redis", "s3")
CONCURRENCY = 4  # requests in flight to a server: kvstore's io_threads default, and the raw clients'


@dataclass
class Timing:
    """One side's time for one operation on one tier, over every chunk of a measurement."""

    side: str  # "kvstore", "lmcache" or "raw"
    tier: str
    op: str  # "put", "get", "get_cold"
    seconds: float
    nbytes: int
    what: str  # the API or baseline timed


# -- LMCache ---------------------------------------------------------------------------------------


def lmcache_pass(tier: str, settings: dict[str, Any]) -> list[Timing]:
    """One pass of LMCache's driver on ``tier`` (its own environment); RuntimeError with its words if it fails."""
    chosen = {"tier": tier, "repeats": 1, **settings}
    done = subprocess.run(
        [str(LMCACHE_PYTHON), str(LMCACHE_DRIVER), json.dumps(chosen)],
        capture_output=True, text=True, timeout=900, check=False,
    )  # fmt: skip
    lines = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    errors = [line["error"] for line in lines if "error" in line]
    if done.returncode != 0 or errors:
        raise RuntimeError(f"LMCache on {tier}: {'; '.join(errors) or done.stderr[-2000:]}")
    # LMCache's store path copies the engine's tensor into its memory object before the put, and its
    # retrieve path copies the object into the engine's tensor after the get; kvstore's put and get_many
    # make those copies themselves: both are in each side's figure.
    return [
        Timing(
            "lmcache",
            tier,
            line["op"],
            line["seconds"] + line.get("prep_copy_seconds", 0.0) + line.get("copy_out_seconds", 0.0),
            line["bytes"],
            line["api"],
        )
        for line in lines
        if line.get("op") in ("put", "get", "get_cold")
    ]


# -- kvstore and the raw baselines -----------------------------------------------------------------


class KvstoreSide:
    """kvstore's store and the raw baseline for each tier, one pass at a time, fresh keys each pass."""

    def __init__(self, chunks: int, directory: Path, remotes: dict[str, Remote], fsync: bool) -> None:
        self.chunks, self.directory, self.remotes, self.fsync = chunks, directory, remotes, fsync
        self.sources = _sample_chunks(LAYOUT, chunks, seed=3)
        self.source_bytes = [tensor_bytes(source) for source in self.sources]
        self.outs = [torch.zeros(LAYOUT.chunk_shape, dtype=LAYOUT.dtype) for _ in range(chunks)]  # pre-touched
        self.nbytes = chunks * LAYOUT.chunk_nbytes
        self.passes = 0
        self.executor = ThreadPoolExecutor(RAW_THREADS, thread_name_prefix="raw-io")
        self.raw_files = RawFiles(directory / "raw", self.executor)

    def fresh_keys(self) -> list[ChunkKey]:
        self.passes += 1
        half = LAYOUT.chunk_tokens // 2
        return [k for i in range(self.chunks) for k in chunk_keys([self.passes, i] * half, LAYOUT, "peers")]

    def config(self, tier: str) -> StoreConfig:
        """One tier below (or only) DRAM, identity codec (the bytes LMCache moves), room for every chunk."""
        if tier in ("redis", "s3"):
            return store_config(self.remotes[tier], LAYOUT, self.chunks, CONCURRENCY)
        disk = {"path": self.directory / "tier", "capacity": 1 << 50, "fsync": self.fsync}
        return StoreConfig(
            dram={"capacity": (self.chunks + 2) * LAYOUT.chunk_nbytes, "pin_memory": "never"},
            disk=disk if tier == "disk" else {"enabled": False},
            adaptive={"track": False},
        )

    async def kvstore_pass(self, tier: str) -> list[Timing]:
        """``put`` (+ ``flush`` below DRAM) of every chunk, then ``get_many`` into the caller's tensors from the
        tier (DRAM emptied first below DRAM), checked bit-exact; for disk also cold (page cache dropped)."""
        keys = self.fresh_keys()
        timings: list[Timing] = []
        async with KVStore(self.config(tier), LAYOUT, namespace="peers") as store:
            start = time.perf_counter()
            for key, source in zip(keys, self.sources, strict=True):
                if not await store.put(key, source):
                    raise RuntimeError("kvstore's DRAM refused a put during the benchmark")
            if tier != "dram":
                await store.flush()
            put = time.perf_counter() - start
            what = "put" if tier == "dram" else "put of each chunk, then flush (on the tier)"
            timings.append(Timing("kvstore", tier, "put", put, self.nbytes, what))
            for op in ("get", "get_cold") if tier == "disk" else ("get",):
                if tier != "dram":
                    for key in keys:
                        store.pool.discard(key)  # the chunks come from the tier
                if op == "get_cold":
                    _drop_cache([store.tiers[0].backend.path_for(key) for key in keys])  # type: ignore[attr-defined]
                for out in self.outs:
                    out.zero_()
                start = time.perf_counter()
                got = await store.get_many(keys, self.outs)
                seconds = time.perf_counter() - start
                if any(result is None for result in got) or not self.exact():
                    raise RuntimeError(f"kvstore's {tier} tier did not give every chunk back exactly")
                timings.append(Timing("kvstore", tier, op, seconds, self.nbytes, "get_many(keys, outs)"))
                await store.flush()  # the promotions to DRAM of this get, outside the timings
            for tier_object in store.tiers:
                for key in keys:
                    await tier_object.backend.delete(key)
        return timings

    def exact(self) -> bool:
        return all(
            torch.equal(out.view(torch.int16), source.view(torch.int16))
            for out, source in zip(self.outs, self.sources, strict=True)
        )

    async def raw_pass(self, tier: str) -> list[Timing]:
        """The baseline of each operation on ``tier``, moving the same bytes."""
        if tier == "dram":
            return [
                Timing("raw", tier, op, self.memcpy(), self.nbytes, "memcpy (Tensor.copy_)") for op in ("put", "get")
            ]
        if tier == "disk":
            what = f"{RAW_THREADS} threads, {'write+fsync' if self.fsync else 'write'}"
            put = await self.raw_files.write(self.source_bytes, self.chunks, self.fsync)
            timings = [Timing("raw", tier, "put", put, self.nbytes, what)]
            outs = [tensor_bytes(out) for out in self.outs]
            for op, cold in (("get", False), ("get_cold", True)):
                seconds = await self.raw_files.read(outs, cold)
                timings.append(Timing("raw", tier, op, seconds, self.nbytes, f"{RAW_THREADS} threads, readinto"))
            return timings
        return await self.raw_remote(tier)

    def memcpy(self) -> float:
        return _timed(lambda: _copy_all(self.outs, self.sources))

    async def raw_remote(self, tier: str) -> list[Timing]:
        names = [f"raw-{self.passes}-{i}" for i in range(self.chunks)]
        data = [bytes(view) for view in self.source_bytes]
        async with AsyncExitStack() as stack:
            raw = await self.remotes[tier].open_raw(stack)
            put = await _bounded(CONCURRENCY, self.chunks, lambda i: raw.put(names[i], data[i]))

            async def one(i: int) -> None:
                if await raw.get(names[i]) != data[i]:
                    raise RuntimeError(f"the raw {tier} client's round trip changed the data")

            get = await _bounded(CONCURRENCY, self.chunks, one)
            for name in names:
                await raw.delete(name)
        return [
            Timing("raw", tier, "put", put, self.nbytes, raw.label[0]),
            Timing("raw", tier, "get", get, self.nbytes, raw.label[1]),
        ]


# -- the run ---------------------------------------------------------------------------------------


def ensure_lmcache() -> str:
    """Make LMCache's environment (once; scripts/lmcache_env.sh) and say what it holds."""
    done = subprocess.run(["bash", str(ROOT / "scripts" / "lmcache_env.sh")], capture_output=True, text=True,
                          timeout=1800, check=False)  # fmt: skip
    if done.returncode != 0:
        raise RuntimeError(f"scripts/lmcache_env.sh failed:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}")
    return done.stdout.strip().splitlines()[-1]


async def run(tiers: Sequence[str], chunks: int, rounds: int, fsync: bool, directory: Path) -> list[Timing]:
    """Every round: LMCache, kvstore and the raw baseline on each tier (see the module docstring)."""
    timings: list[Timing] = []
    with serve(["redis", "moto"], CONCURRENCY) as started:
        remotes = {"redis" if remote.name == "redis" else "s3": remote for remote in started}
        redis_url = remotes["redis"].settings["redis"]["url"]
        s3 = remotes["s3"].settings["s3"]
        async with AsyncExitStack() as stack:  # LMCache needs the bucket to exist
            raw = await remotes["s3"].open_raw(stack)
            await raw.client.create_bucket(Bucket=BUCKET)  # type: ignore[union-attr]
        side = KvstoreSide(chunks, directory, remotes, fsync)
        settings = {
            "chunks": chunks,
            "fsync": fsync,
            "disk_path": str(directory / "lmcache"),
            "redis_url": redis_url,
            "s3_endpoint": s3["endpoint_url"],
            "s3_bucket": BUCKET,
        }
        (directory / "lmcache").mkdir()
        for number in range(rounds):
            for tier in tiers:
                sides: list[Callable[[], Awaitable[list[Timing]]]] = [
                    lambda tier=tier: asyncio.to_thread(lmcache_pass, tier, settings),  # type: ignore[misc]
                    lambda tier=tier: side.kvstore_pass(tier),  # type: ignore[misc]
                ]
                for measure in sides if number % 2 == 0 else reversed(sides):
                    timings += await measure()
                timings += await side.raw_pass(tier)
                print(f"round {number + 1}/{rounds}: {tier} done", file=sys.stderr, flush=True)
        side.executor.shutdown()
    return timings


def best(timings: Sequence[Timing]) -> dict[tuple[str, str, str], Timing]:
    """The fastest timing of each (side, tier, operation)."""
    chosen: dict[tuple[str, str, str], Timing] = {}
    for timing in timings:
        key = (timing.side, timing.tier, timing.op)
        if key not in chosen or timing.seconds < chosen[key].seconds:
            chosen[key] = timing
    return chosen


def markdown_table(timings: Sequence[Timing]) -> str:
    """A row per tier and operation: both sides' GB/s, kvstore ÷ LMCache, and the raw baseline."""
    fastest = best(timings)
    lines = [
        "| tier | operation | kvstore GB/s | LMCache GB/s | kvstore ÷ LMCache | raw baseline | raw GB/s |",
        "|---|---|---:|---:|---:|---|---:|",
    ]
    for tier in TIERS:
        for op in ("put", "get", "get_cold"):
            ours, theirs, raw = (fastest.get((side, tier, op)) for side in ("kvstore", "lmcache", "raw"))
            if ours is None or theirs is None:
                continue
            rate = lambda t: t.nbytes / t.seconds / 1e9  # noqa: E731
            label = {"get": "get (page cache warm)" if tier == "disk" else "get", "get_cold": "get (cold)"}
            lines.append(
                f"| {tier} | {label.get(op, op)} | {rate(ours):.2f} | {rate(theirs):.2f} "
                f"| {theirs.seconds / ours.seconds:.2f}x | {raw.what if raw else '-'} "
                f"| {f'{rate(raw):.2f}' if raw else '-'} |"
            )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.peers", description=__doc__.split("\n")[0])
    parser.add_argument("--tiers", default=",".join(TIERS), help="comma-separated, from dram,disk,redis,s3")
    parser.add_argument("--chunks", type=int, default=8, help="Llama-3-8B chunks (32 MiB) per measurement")
    parser.add_argument("--rounds", type=int, default=3, help="each figure is the best of this many rounds")
    parser.add_argument("--fsync", action="store_true", help="disk: both sides fsync each file before a put ends")
    parser.add_argument("--dir", type=Path, default=None, help="where the disk tiers write (default: a temporary)")
    parser.add_argument("--out", type=Path, default=None, help="also write every timing to this JSON file")
    args = parser.parse_args(argv)
    tiers = [tier.strip() for tier in args.tiers.split(",") if tier.strip()]
    unknown = sorted(set(tiers) - set(TIERS))
    if unknown:
        parser.error(f"unknown tiers {', '.join(unknown)}; choose from {', '.join(TIERS)}")
    lmcache = ensure_lmcache()
    machine = describe_machine()
    print(f"machine: {machine}\n{lmcache}", flush=True)
    with tempfile.TemporaryDirectory(prefix="kvstore-peers-", dir=args.dir) as directory:
        timings = asyncio.run(run(tiers, args.chunks, args.rounds, args.fsync, Path(directory)))
    print(markdown_table(timings))
    if args.out:
        chosen = {**vars(args), "dir": str(args.dir), "out": str(args.out)}
        report = {"machine": machine, "lmcache": lmcache, "args": chosen, "timings": [asdict(t) for t in timings]}
        args.out.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
