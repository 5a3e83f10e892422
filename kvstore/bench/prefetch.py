"""``kvstore bench --prefetch``: how much of a layer stream's fetch time the engine's compute hides.

A simulated engine thread walks the layers of a cached prefix: wait for layer i (``wait_layer``),
then "compute" it for ``c`` seconds (a sleep, as an engine waiting on its GPU would; it holds no
GIL). Each tier is measured in the same run:

- ``f``: per-layer fetch time, from streaming the prefix with no compute at all;
- time to first layer (TTFL): from ``prefetch()`` to layer 0 in the engine's hands;
- overlap efficiency with compute ``c = k * f``: the share of the fetch time that the compute
  hid, ``(L*f + L*c - T) / (L*f)`` for a run that took ``T``. The first layer's fetch can never
  be hidden, so the ceiling is ``1 - TTFL/(L*f)``; the table also shows the share of the rest
  (``L*f - TTFL``) that was hidden. Target: >= 90% when f <= c.
"""

from __future__ import annotations

import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from kvstore.bench.local import LAYOUTS, _sample_chunks, parse_names
from kvstore.config import StoreConfig
from kvstore.engine.sync import SyncKVStore
from kvstore.layout import KVLayout
from kvstore.testing.servers import MotoServer, RedisServer, S3Server, environment
from kvstore.util.progress import Progress

TIERS = ("dram", "disk", "redis", "s3")
COMPUTE_FACTORS = (1.0, 2.0)
TARGET = 0.9
BUCKET = "kvstore-prefetch-bench"


@dataclass
class OverlapRow:
    """One tier at one compute time: fetch and compute per layer, time to layer 0 and the whole pass."""

    tier: str
    chunks: int
    fetch_per_layer: float  # f, seconds
    compute_per_layer: float  # c, seconds
    ttfl: float  # seconds to layer 0
    total: float  # T, seconds
    layers: int

    @property
    def efficiency(self) -> float:
        """The share of the fetch time the compute hid: ``(L*f + L*c - T) / (L*f)``."""
        fetch = self.layers * self.fetch_per_layer
        return (fetch + self.layers * self.compute_per_layer - self.total) / fetch

    @property
    def efficiency_after_first(self) -> float:
        """The same share of the fetch time that could be hidden: all of it but the time to layer 0."""
        fetch = self.layers * self.fetch_per_layer
        return (fetch + self.layers * self.compute_per_layer - self.total) / (fetch - self.ttfl)


def _engine_pass(store: SyncKVStore, keys: list[str], compute: float, depth: int) -> tuple[float, float, float]:
    """(time to layer 0, total time, time really spent computing) of one pass over the prefix.

    The compute actually slept is measured, not assumed: sleeps overshoot by tens of microseconds.
    """
    first = computed = 0.0
    layout = store.layout
    shape = (layout.kv_planes, len(keys) * layout.chunk_tokens, layout.num_kv_heads, layout.head_dim)
    outs = [torch.empty(shape, dtype=layout.dtype).fill_(0) for _ in range(layout.num_layers)]  # as an engine would
    started = time.perf_counter()
    with store.prefetch(keys, depth=depth, outs=outs) as stream:
        for layer in range(layout.num_layers):
            stream.wait_layer(layer)
            if layer == 0:
                first = time.perf_counter() - started
            if compute:
                before = time.perf_counter()
                time.sleep(compute)
                computed += time.perf_counter() - before
    return first, time.perf_counter() - started, computed


@contextmanager
def _tier_config(tier: str, workdir: Path, layout: KVLayout, chunks: int) -> Iterator[StoreConfig]:
    """A store config whose prefix loads come from ``tier`` (the lower tiers off, DRAM too small to hold it)."""
    dram = {"capacity": layout.chunk_nbytes * (chunks + 4)}
    prefix = f"prefetch-{uuid.uuid4().hex[:8]}"
    with ExitStack() as stack:
        if tier in ("dram", "disk"):
            yield StoreConfig(dram=dram, disk={"path": workdir / "disk"})
        elif tier == "redis":
            server = stack.enter_context(RedisServer())
            redis = {"enabled": True, "url": server.url, "prefix": prefix, "codec": "identity"}
            yield StoreConfig(dram=dram, disk={"enabled": False}, redis=redis)
        else:
            s3_server: S3Server = stack.enter_context(MotoServer())
            stack.enter_context(environment(s3_server.credentials_env()))
            s3 = {"enabled": True, "bucket": BUCKET, "prefix": prefix, "codec": "identity", "create_bucket": True}
            yield StoreConfig(dram=dram, disk={"enabled": False}, s3=s3)


def run_overlap(
    tiers: list[str], layout_name: str = "SmolLM2-135M", chunks: int = 8, repeats: int = 3, depth: int = 4
) -> list[OverlapRow]:
    """Measure each tier: f from a compute-free pass, then passes with c = k * f (best of ``repeats``)."""
    layout = LAYOUTS[layout_name]
    data = _sample_chunks(layout, chunks)
    rows: list[OverlapRow] = []
    with Progress("layer streams", total=len(tiers), keep=False) as progress:  # a step after each tier
        for tier in tiers:
            progress.doing(tier)
            with (
                tempfile.TemporaryDirectory(prefix="kvstore-prefetch-") as workdir,
                _tier_config(tier, Path(workdir), layout, chunks) as config,
            ):
                with SyncKVStore(config, layout, "bench") as writer:
                    keys = writer.chunk_keys(list(range(chunks * layout.chunk_tokens)))
                    for key, kv in zip(keys, data, strict=True):
                        writer.put(key, kv)
                    writer.flush()
                    if tier == "dram":
                        rows.extend(_measure(writer, keys, tier, repeats, depth))
                        progress.step(f"{tier}: done")
                        continue
                with SyncKVStore(config, layout, "bench") as reader:  # a fresh store: empty DRAM
                    rows.extend(_measure(reader, keys, tier, repeats, depth))
            progress.step(f"{tier}: done")
    return rows


def _measure(store: SyncKVStore, keys: list[str], tier: str, repeats: int, depth: int) -> list[OverlapRow]:
    """f from passes without compute, and passes with c = k * f, alternating; all at the same ``depth``.

    The depth shapes the fetch itself (how many layers a remote request may carry), so f is
    measured at the depth the compute passes use. A first pair of compute-free passes sets c;
    then each round runs one pass of every kind, so the machine's noise falls on f and on T
    alike, and each row takes the pass with the shortest total (the figure the hidden share is
    computed from; picking by time to layer 0 once printed a negative share). On every tier
    but DRAM the prefix is evicted from DRAM before each pass: a stream promotes what it reads,
    and the next pass would otherwise measure DRAM.
    """
    layers = store.layout.num_layers

    def one_pass(compute: float) -> tuple[float, float, float]:
        if tier != "dram":
            for key in keys:  # a measurement's reach behind the contract: no engine empties DRAM
                store._store.pool.discard(key)
        return _engine_pass(store, keys, compute, depth)

    fetch_passes = [one_pass(0.0) for _ in range(2)]  # f is the best of every compute-free pass: c >= k * f
    computes = [min(total for _, total, _ in fetch_passes) / layers * factor for factor in COMPUTE_FACTORS]
    compute_passes: list[list[tuple[float, float, float]]] = [[] for _ in computes]
    for _ in range(repeats):
        fetch_passes.append(one_pass(0.0))
        for passes, compute in zip(compute_passes, computes, strict=True):
            passes.append(one_pass(compute))
    fetch = min(total for _, total, _ in fetch_passes) / layers
    rows = []
    for passes in compute_passes:
        ttfl, total, computed = min(passes, key=lambda run: run[1])
        rows.append(OverlapRow(tier, len(keys), fetch, computed / layers, ttfl, total, layers))
    return rows


def parse_tiers(text: str) -> list[str]:
    """The --prefetch tiers (comma-separated, or ``all``); ValueError naming an unknown one."""
    return parse_names(text, TIERS, "tier(s)")
