"""Eviction policies by name: what the ``dram.eviction`` and ``disk.eviction`` config keys take.

The config keys are a ``Literal`` of these names (:data:`EvictionName`), so a typo fails at
start listing the choices; :func:`make_policy` refuses an unknown name the same way for code
that builds a tier directly. A new policy is a module with one :class:`EvictionPolicy` subclass,
added to :data:`BUILTIN_POLICIES` and to :data:`EvictionName` (a test checks the two agree).
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping
from types import MappingProxyType
from typing import Literal

from kvstore.eviction.arc import ArcPolicy
from kvstore.eviction.base import EvictionPolicy
from kvstore.eviction.lru import LruPolicy
from kvstore.eviction.s3fifo import S3FifoPolicy

EvictionName = Literal["lru", "s3fifo", "arc"]
"""The names the ``eviction`` config keys accept."""
DEFAULT_EVICTION: EvictionName = "lru"

BUILTIN_POLICIES: tuple[type[EvictionPolicy], ...] = (LruPolicy, S3FifoPolicy, ArcPolicy)
POLICIES: Mapping[str, type[EvictionPolicy]] = MappingProxyType({policy.name: policy for policy in BUILTIN_POLICIES})


def make_policy(name: str, capacity: int) -> EvictionPolicy[Hashable]:
    """A fresh policy ``name`` for a tier of ``capacity`` units; ValueError naming the choices if unknown."""
    policy = POLICIES.get(name)
    if policy is None:
        raise ValueError(f"unknown eviction policy {name!r}; choose one of: {', '.join(POLICIES)}")
    return policy(capacity)
