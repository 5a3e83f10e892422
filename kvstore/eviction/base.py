"""The eviction policy interface: which cached entry leaves when a tier needs room.

A tier (the DRAM slab pool, the disk tier's byte budget) keeps its own entries and decides
*when* something must leave; its policy only decides *what*. The tier reports every change:

- :meth:`EvictionPolicy.insert` when an entry is stored (or stored again: a rewrite, or a file
  found on disk), with its size in the tier's unit (slots for DRAM, bytes for disk);
- :meth:`EvictionPolicy.touch` on a hit;
- :meth:`EvictionPolicy.remove` when an entry goes for another reason (deleted, found corrupt,
  dropped by a shrink): it is forgotten, not remembered as evicted;
- :meth:`EvictionPolicy.evict` when the tier needs room: the policy picks a victim, forgets it
  and returns its key; the tier then frees it. ``held`` names entries that cannot go now (a
  DRAM slot referenced by an in-flight transfer, the disk file being written): they are
  skipped and stay cached; None means every entry is held.
- :meth:`EvictionPolicy.resize` when the tier's capacity changes (DRAM auto mode).

Threading: a policy is not thread-safe. Its tier calls it under the tier's own lock, so every
method is short, never blocks, does no I/O and calls nothing but ``held`` (which must be as
cheap, and must not take the tier's lock again). Each operation is O(1), amortised; ``evict``
also steps over the held entries it meets, as the inline LRU it replaces did.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Hashable
from typing import ClassVar, Generic, TypeVar

K = TypeVar("K", bound=Hashable)

Held = Callable[[K], bool]
"""Whether a cached entry is pinned now (may not be evicted); asked under the tier's lock."""


def _never_held(key: object) -> bool:
    return False


class EvictionPolicy(ABC, Generic[K]):
    """Orders one tier's entries for eviction (see the module docstring for the contract).

    ``capacity`` is in the unit of the sizes given to :meth:`insert`: the policies that split the
    cache into parts (a probation queue, a frequency target) size those parts from it.
    """

    name: ClassVar[str]
    """The registry name, as the ``eviction`` config key takes it."""
    scan_resistant: ClassVar[bool]
    """Whether a burst of entries seen once (a scan) can flush entries that were reused."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"an eviction policy needs a capacity of at least 1, got {capacity}")
        self.capacity = capacity

    @abstractmethod
    def insert(self, key: K, size: int = 1) -> None:
        """``key`` is stored now with ``size``; if already cached, its size is updated and it counts as a hit."""

    @abstractmethod
    def touch(self, key: K) -> None:
        """A hit on ``key``; a key not cached is ignored."""

    @abstractmethod
    def remove(self, key: K) -> None:
        """``key`` left for a reason other than eviction (not remembered as evicted); a key not cached is ignored."""

    @abstractmethod
    def evict(self, held: Held[K] = _never_held) -> K | None:
        """Pick a cached key that is not ``held``, forget it and return it; None if every cached key is held."""

    def resize(self, capacity: int) -> None:
        """The tier holds ``capacity`` now (the tier evicts down to it itself, through :meth:`evict`)."""
        if capacity < 1:
            raise ValueError(f"an eviction policy needs a capacity of at least 1, got {capacity}")
        self.capacity = capacity

    @abstractmethod
    def __contains__(self, key: object) -> bool:
        """Whether ``key`` is cached (ghost entries a policy remembers do not count)."""

    @abstractmethod
    def __len__(self) -> int:
        """How many keys are cached."""
