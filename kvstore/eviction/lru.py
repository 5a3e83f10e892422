"""Least recently used: the oldest hit or insert leaves first (the tiers' behaviour before policies).

One ordered dict, least recent first. ``evict`` takes the first key that is not held, leaving
held keys where they are: exactly what the DRAM pool and the disk budget did inline. Not
scan-resistant: a burst of one-off entries as large as the cache flushes everything before it.
"""

from __future__ import annotations

from collections import OrderedDict

from kvstore.eviction.base import EvictionPolicy, Held, K, _never_held


class LruPolicy(EvictionPolicy[K]):
    """Least recently used first; held entries are stepped over and keep their place."""

    name = "lru"
    scan_resistant = False

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self._order: OrderedDict[K, None] = OrderedDict()  # least recent first

    def insert(self, key: K, size: int = 1) -> None:
        self._order[key] = None
        self._order.move_to_end(key)

    def touch(self, key: K) -> None:
        if key in self._order:
            self._order.move_to_end(key)

    def remove(self, key: K) -> None:
        self._order.pop(key, None)

    def evict(self, held: Held[K] = _never_held) -> K | None:
        victim = next((key for key in self._order if not held(key)), None)
        if victim is not None:
            del self._order[victim]
        return victim

    def __contains__(self, key: object) -> bool:
        return key in self._order

    def __len__(self) -> int:
        return len(self._order)
