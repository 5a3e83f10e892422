"""Counters per tier, read by ``KVStore.stats()``, the CLI and (later) Prometheus."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass
class TierStats:
    hits: int = 0
    misses: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    writes: int = 0
    errors: int = 0  # an operation raised (I/O error, full disk, server down)
    timeouts: int = 0  # an operation ran past its configured timeout
    drops: int = 0  # a write skipped because the tier's queue was full or the store was closing
    corrupt: int = 0  # an object failed its checks: counted, removed, treated as a miss
    foreign: int = 0  # a valid object this store cannot open (another encryption key): a miss, left in place
    skipped: int = 0  # a write skipped because the tier already held the chunk

    def as_dict(self) -> dict[str, int]:
        return asdict(self)
