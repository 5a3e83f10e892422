"""What a chunk costs this store, measured: the cost model auto mode and ``store.advise()`` weigh.

The model itself (:mod:`kvstore.sizing.advice`) knows sizes and bandwidths, not tiers; this module
reads them off the store's own tiers: each tier's read and write bandwidth from the latency it
has shown (once it has served 8 reads or taken 8 writes; until then this machine kind's
baselines stand in), its budget in chunks as it stores them, and one DRAM copy measured here.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence

import torch

from kvstore.layout import KVLayout
from kvstore.sizing.advice import DEFAULT_BANDWIDTH, CostModel, TierRates, cost_model
from kvstore.storage.tier import ChunkTier

MEASURED_AFTER = 8  # operations a tier must have done before its own timings replace the baselines


def measured_costs(layout: KVLayout, tiers: Sequence[ChunkTier], prefill_tokens_per_s: float) -> CostModel:
    """Seconds per chunk to recompute, copy into DRAM and use each of ``tiers`` (fastest first)."""
    chunk = layout.chunk_nbytes
    rates = []
    for tier in tiers:
        stats, latency, local = tier.stats, tier.latency, tier.is_local
        read = DEFAULT_BANDWIDTH["disk_read" if local else "remote"]
        if stats.hits >= MEASURED_AFTER:
            read = chunk * stats.hits / latency.read.sum if latency.read.sum > 0 else math.inf
        write = DEFAULT_BANDWIDTH["disk_write" if local else "remote"]
        writes = stats.writes + stats.skipped
        if writes >= MEASURED_AFTER:
            write = chunk * writes / latency.write.sum if latency.write.sum > 0 else math.inf
        capacity: float | None = tier.capacity_bytes  # None: unbounded (Redis, S3)
        if capacity is not None and stats.writes:  # a budget holds chunks as stored (compressed, maybe)
            capacity = capacity * chunk / max(1.0, stats.bytes_written / stats.writes)
        rates.append(TierRates(tier.name, capacity, read, write))
    return cost_model(chunk, layout.chunk_tokens, prefill_tokens_per_s, copy_bandwidth(), rates)


_copy_rate: float | None = None


def copy_bandwidth() -> float:
    """Bytes per second of a copy into pre-allocated memory, measured once per process (~10 ms).

    What a chunk costs to put into (or take out of) the DRAM pool.
    """
    global _copy_rate
    if _copy_rate is None:
        source, target = torch.ones(16 << 20, dtype=torch.uint8), torch.empty(16 << 20, dtype=torch.uint8)
        target.copy_(source)  # first touch
        start = time.perf_counter()
        for _ in range(4):
            target.copy_(source)
        _copy_rate = 4 * source.numel() / max(1e-6, time.perf_counter() - start)
    return _copy_rate


_bus_rate: float | None = None


def bus_bandwidth() -> float | None:
    """Bytes per second of pinned host memory to the current CUDA device, measured once per process (~20 ms).

    What a chunk costs to load from the DRAM pool into a GPU engine: the seed of the load planner's DRAM
    estimate there, a memcpy's rate being another path's (until the connector's own loads are measured).
    None without CUDA, or if the measurement fails.
    """
    global _bus_rate
    if _bus_rate is None and torch.cuda.is_available():
        try:
            source = torch.ones(16 << 20, dtype=torch.uint8).pin_memory()
            target = torch.empty(16 << 20, dtype=torch.uint8, device="cuda")
            target.copy_(source, non_blocking=True)  # the first copy sets things up
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(4):
                target.copy_(source, non_blocking=True)
            torch.cuda.synchronize()
            _bus_rate = 4 * source.numel() / max(1e-6, time.perf_counter() - start)
        except RuntimeError:  # a device that cannot be used here: the memcpy seed stands
            return None
    return _bus_rate
