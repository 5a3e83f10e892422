"""ARC: adaptive replacement between recency and frequency (Megiddo and Modha, FAST '03).

Two LRU lists of cached entries: ``recent`` (seen once since it was cached) and ``frequent``
(hit again since). Each has a ghost list of keys it evicted lately. A target share ``p`` of the
capacity for ``recent`` adapts: a new entry whose key is a ghost of ``recent`` means ``recent``
was too small (``p`` grows); a ghost of ``frequent``, that ``frequent`` was (``p`` shrinks). Such
an entry is cached straight into ``frequent``. The victim is the least recent of ``recent`` while
``recent`` holds more than ``p``, else the least recent of ``frequent``.

Why it is scan-resistant: a burst of entries seen once stays in ``recent``, and ``frequent`` keeps
its share unless the ghosts show that recency pays.

Sizes are in the tier's unit (the lists' sizes and ``p`` are sums of sizes), so byte-sized tiers
work. Held entries are stepped over in place; when the chosen list has none that can go, the
other list gives the victim. O(1) per operation, plus the held entries stepped over.
"""

from __future__ import annotations

from collections import OrderedDict

from kvstore.eviction.base import EvictionPolicy, Held, K, _never_held


class ArcPolicy(EvictionPolicy[K]):
    """Adaptive replacement cache (see the module docstring)."""

    name = "arc"
    scan_resistant = True

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self._recent: OrderedDict[K, int] = OrderedDict()  # T1: key -> size, least recent first
        self._frequent: OrderedDict[K, int] = OrderedDict()  # T2
        self._recent_ghosts: OrderedDict[K, int] = OrderedDict()  # B1
        self._frequent_ghosts: OrderedDict[K, int] = OrderedDict()  # B2
        self._sizes = {"recent": 0, "frequent": 0, "recent_ghosts": 0, "frequent_ghosts": 0}
        self.target = 0.0  # p: the share of the capacity ``recent`` may keep

    def insert(self, key: K, size: int = 1) -> None:
        for name, entries in (("recent", self._recent), ("frequent", self._frequent)):
            if key in entries:
                self._sizes[name] += size - entries[key]
                entries[key] = size
                self.touch(key)
                return
        if key in self._recent_ghosts:  # evicted from recent too early: recent deserves more
            ratio = max(1.0, len(self._frequent_ghosts) / len(self._recent_ghosts))
            self.target = min(float(self.capacity), self.target + ratio * size)
            self._sizes["recent_ghosts"] -= self._recent_ghosts.pop(key)
            self._add("frequent", self._frequent, key, size)
        elif key in self._frequent_ghosts:  # evicted from frequent too early
            ratio = max(1.0, len(self._recent_ghosts) / len(self._frequent_ghosts))
            self.target = max(0.0, self.target - ratio * size)
            self._sizes["frequent_ghosts"] -= self._frequent_ghosts.pop(key)
            self._add("frequent", self._frequent, key, size)
        else:
            self._add("recent", self._recent, key, size)
        self._trim_ghosts()

    def _add(self, name: str, entries: OrderedDict[K, int], key: K, size: int) -> None:
        entries[key] = size
        self._sizes[name] += size

    def touch(self, key: K) -> None:
        size = self._recent.pop(key, None)
        if size is not None:
            self._sizes["recent"] -= size
            self._add("frequent", self._frequent, key, size)
        elif key in self._frequent:
            self._frequent.move_to_end(key)

    def remove(self, key: K) -> None:
        for name, entries in (("recent", self._recent), ("frequent", self._frequent)):
            size = entries.pop(key, None)
            if size is not None:
                self._sizes[name] -= size
                return

    def evict(self, held: Held[K] = _never_held) -> K | None:
        from_recent = bool(self._recent) and (self._sizes["recent"] > self.target or not self._frequent)
        order = (("recent", self._recent, "recent_ghosts", self._recent_ghosts),) + (
            ("frequent", self._frequent, "frequent_ghosts", self._frequent_ghosts),
        )
        for name, entries, ghost_name, ghosts in order if from_recent else order[::-1]:
            victim = next((key for key in entries if not held(key)), None)
            if victim is None:
                continue
            size = entries.pop(victim)
            self._sizes[name] -= size
            ghosts[victim] = size
            self._sizes[ghost_name] += size
            self._trim_ghosts()
            return victim
        return None

    def _trim_ghosts(self) -> None:
        """Keep recent + its ghosts within the capacity, and everything within twice it (ARC's bounds)."""
        sizes = self._sizes
        while self._recent_ghosts and sizes["recent"] + sizes["recent_ghosts"] > self.capacity:
            sizes["recent_ghosts"] -= self._recent_ghosts.popitem(last=False)[1]
        while self._frequent_ghosts and sum(sizes.values()) > 2 * self.capacity:
            sizes["frequent_ghosts"] -= self._frequent_ghosts.popitem(last=False)[1]

    def resize(self, capacity: int) -> None:
        super().resize(capacity)
        self.target = min(self.target, float(capacity))
        self._trim_ghosts()

    def __contains__(self, key: object) -> bool:
        return key in self._recent or key in self._frequent

    def __len__(self) -> int:
        return len(self._recent) + len(self._frequent)
