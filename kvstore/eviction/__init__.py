"""Eviction policies: which entry a tier (the DRAM pool, the disk budget) drops when it needs room.

See :mod:`kvstore.eviction.base` for the contract, :mod:`kvstore.eviction.registry` for the
names, and ``docs/eviction.md`` for measured hit ratios.
"""

from kvstore.eviction.arc import ArcPolicy
from kvstore.eviction.base import EvictionPolicy, Held
from kvstore.eviction.lru import LruPolicy
from kvstore.eviction.registry import DEFAULT_EVICTION, POLICIES, EvictionName, make_policy
from kvstore.eviction.s3fifo import S3FifoPolicy

__all__ = [
    "DEFAULT_EVICTION",
    "POLICIES",
    "ArcPolicy",
    "EvictionName",
    "EvictionPolicy",
    "Held",
    "LruPolicy",
    "S3FifoPolicy",
    "make_policy",
]
