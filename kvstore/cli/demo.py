"""``kvstore demo``: the full cascade on the embedded default (DRAM + local disk, no servers).

An "engine" prefills a few prompts and puts their KV chunks; the store keeps the newest in
DRAM and cascades every chunk to disk. Then the store is closed and a new one opened on the
same directory, as after a restart: the prompts' prefixes are found again, loaded from disk,
checked bit for bit, and promoted to DRAM for the next read.

The KV is synthetic but deterministic (seeded per chunk), so the demo can regenerate what it
wrote and compare without holding hundreds of MB in memory. :func:`run_demo` returns what happened
(:class:`DemoReport`); ``kvstore demo`` (:mod:`kvstore.cli.trying`) prints it. This is the
command's work, as :mod:`kvstore.cli.inventory` is the admin commands'; it imports torch, so the command
imports it inside the call.
"""

from __future__ import annotations

import asyncio
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from kvstore.config import StoreConfig
from kvstore.engine.store import KVStore
from kvstore.layout import KVLayout
from kvstore.util.units import per_second

LAYOUT = KVLayout(num_layers=30, num_kv_heads=3, head_dim=64, dtype=torch.bfloat16)  # SmolLM2-135M
NAMESPACE = "demo/SmolLM2-135M"


def _prompt_tokens(prompt: int, tokens: int) -> list[int]:
    """Prompts share a 512-token system prefix, then diverge, as chat requests do."""
    shared = [(7 * i) % 49152 for i in range(512)]
    own = [(prompt * 7919 + 31 * i) % 49152 for i in range(tokens - 512)]
    return shared + own


def _prefill(seed_text: str) -> torch.Tensor:
    """Stand-in for the engine's prefill of one chunk: deterministic KV from the chunk's key."""
    generator = torch.Generator().manual_seed(int(seed_text[:15], 16))
    return torch.randn(LAYOUT.chunk_shape, generator=generator).to(LAYOUT.dtype)


@dataclass(frozen=True)
class DemoStep:
    """One phase of the demo: how many chunks, how many bytes in how long, and where they came from."""

    phase: str
    chunks: str  # a count, or "found/looked up"
    nbytes: int | None  # KV bytes the phase moved; None for a lookup, which moves none
    seconds: float
    gbps: float | None  # None where the time is a wait (for writes behind the engine), not a transfer
    source: str


@dataclass
class DemoReport:
    """What :func:`run_demo` did: the setting, each phase, closing notes, and whether every chunk came back exact."""

    layout: str
    dram: str
    directory: Path
    steps: list[DemoStep] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    ok: bool = True


async def run_demo(*, prompts: int, tokens: int, dram: str, directory: Path | None) -> DemoReport:
    """Prefill ``prompts`` prompts of ``tokens`` tokens, restart the store, and read everything back.

    ``directory`` holds the disk tier (kept); by default a temporary one, removed at the end. The
    store is DRAM and that directory alone, whatever the environment says (:meth:`StoreConfig.isolated`).
    Raises ValueError if ``tokens`` leaves no chunk past the shared 512-token prefix.
    """
    if tokens < 512 + LAYOUT.chunk_tokens:
        raise ValueError(f"--tokens must be at least {512 + LAYOUT.chunk_tokens}")
    workdir = Path(directory) if directory else Path(tempfile.mkdtemp(prefix="kvstore-demo-"))
    # Its own store only: KVSTORE_*, $KVSTORE_CONFIG, REDIS_URL or AWS_* in the shell never send the demo's
    # chunks to a server (nor turn its disk tier off).
    config = StoreConfig.isolated(dram={"capacity": dram}, disk={"path": workdir, "capacity": "4GiB"})
    report = DemoReport(LAYOUT.describe(), dram, workdir)
    steps = report.steps
    try:
        # 1. Prefill and put. Prompts share their first two chunks, so those are stored once.
        async with KVStore(config, LAYOUT, namespace=NAMESPACE) as store:
            all_keys = [store.chunk_keys(_prompt_tokens(p, tokens)) for p in range(prompts)]
            put_seconds = prefill_seconds = 0.0
            unique: dict[str, None] = {}
            for keys in all_keys:
                for key in keys:
                    if key in unique:
                        continue
                    unique[key] = None
                    start = time.perf_counter()
                    kv = await asyncio.to_thread(_prefill, key)  # engines compute off the event loop
                    middle = time.perf_counter()
                    await store.put(key, kv)
                    prefill_seconds += middle - start
                    put_seconds += time.perf_counter() - middle
            nbytes = len(unique) * LAYOUT.chunk_nbytes
            rate = per_second(nbytes, put_seconds)
            steps.append(
                DemoStep("put (engine -> DRAM)", str(len(unique)), nbytes, put_seconds, rate, "copied into DRAM slots")
            )
            start = time.perf_counter()
            await store.flush()
            flush_seconds = time.perf_counter() - start
            stats = store.stats()
            disk = stats["disk"]
            rejected = stats["store"]["put_rejected"]
            behind = f"written behind the engine; {disk['drops']} dropped, {rejected} puts rejected"
            written = str(disk["writes"])
            steps.append(
                DemoStep("cascade (DRAM -> disk)", written, disk["bytes_written"], flush_seconds, None, behind)
            )
            in_dram = stats["dram"]["chunks"]

        # 2. A new store on the same directory: an engine restart. DRAM starts empty.
        async with KVStore(config, LAYOUT, namespace=NAMESPACE) as store:
            start = time.perf_counter()
            found = [await store.lookup(keys) for keys in all_keys]
            lookup_seconds = time.perf_counter() - start
            looked_up = f"{sum(found)}/{sum(len(k) for k in all_keys)}"
            steps.append(
                DemoStep("lookup after restart", looked_up, None, lookup_seconds, None, "prefixes found on disk")
            )
            out = torch.empty(LAYOUT.chunk_shape, dtype=LAYOUT.dtype)
            # Second pass newest-first: what the first pass promoted is still in DRAM.
            passes = (("get after restart", all_keys), ("get again, newest first", all_keys[::-1]))
            for label, prompts_keys in passes:
                before = store.stats()
                seconds = 0.0
                exact = loaded = 0
                for keys in prompts_keys:
                    for key in keys:
                        start = time.perf_counter()
                        found_chunk = await store.get(key, out=out)
                        seconds += time.perf_counter() - start
                        if found_chunk is not None:
                            loaded += 1
                            exact += torch.equal(out, _prefill(key))
                after = store.stats()
                from_disk = after["disk"]["hits"] - before["disk"]["hits"]
                total_bytes = loaded * LAYOUT.chunk_nbytes
                where = f"{loaded - from_disk} DRAM, {from_disk} disk; {exact}/{loaded} bit-exact"
                steps.append(
                    DemoStep(label, str(loaded), total_bytes, seconds, per_second(total_bytes, seconds), where)
                )
                report.ok &= exact == loaded == sum(len(k) for k in all_keys)
            final = store.stats()
        report.notes = [
            f"Before the restart DRAM held {in_dram} of {len(unique)} chunks; every chunk came back from disk. "
            f"Stand-in prefill cost {prefill_seconds:.2f} s for these chunks; "
            f"a real SmolLM2 prefill of 2K tokens takes ~6.6 s on this kind of machine.",
            f"corrupt objects seen: {final['disk']['corrupt']}, errors: {final['disk']['errors']}",
        ]
        return report
    finally:
        if directory is None:
            shutil.rmtree(workdir, ignore_errors=True)
