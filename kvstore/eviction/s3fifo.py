"""S3-FIFO: a small probation queue, a main queue and a ghost queue (Yang et al., SOSP '23).

"FIFO queues are all you need for cache eviction": a new entry enters the *small* queue (10% of
the capacity). When the small queue is over its share, its oldest entry leaves: into the *main*
queue if it was hit while on probation, otherwise out of the cache, its key remembered in the
*ghost* queue. An entry inserted again while its key is a ghost goes straight to main. Main is a
FIFO with a 2-bit hit counter per entry: its oldest entry goes back to the head with the counter
decremented while the counter is above zero, and leaves once it is zero.

Why it is scan-resistant: a burst of entries seen once passes through the small queue only, and
leaves from there; entries that were reused sit in main, which the burst never reaches.

Held entries (see :mod:`kvstore.eviction.base`) go back to the head of their queue, their counter
untouched. Sizes count against the queues' shares, so byte-sized tiers work; the ghost queue
remembers keys of up to ``capacity`` units. O(1) amortised: each pass over an entry either evicts,
moves it, or spends one of its at most 3 counted hits.
"""

from __future__ import annotations

from collections import OrderedDict

from kvstore.eviction.base import EvictionPolicy, Held, K, _never_held

SMALL_SHARE = 0.1  # of the capacity, for the probation queue (the paper's default)
MAX_FREQUENCY = 3  # a 2-bit counter


class S3FifoPolicy(EvictionPolicy[K]):
    """Probation, main and ghost FIFO queues (see the module docstring)."""

    name = "s3fifo"
    scan_resistant = True

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self._small: OrderedDict[K, int] = OrderedDict()  # key -> size, oldest first
        self._main: OrderedDict[K, int] = OrderedDict()
        self._ghost: OrderedDict[K, int] = OrderedDict()  # evicted from probation: key -> size
        self._hits: dict[K, int] = {}  # cached key -> hits counted (0..MAX_FREQUENCY)
        self._small_size = self._main_size = self._ghost_size = 0

    def insert(self, key: K, size: int = 1) -> None:
        for queue in (self._small, self._main):
            if key in queue:
                self._resize_entry(queue, key, size)
                self.touch(key)
                return
        if key in self._ghost:  # it came back after leaving probation: it is reused
            self._ghost_size -= self._ghost.pop(key)
            self._main[key] = size
            self._main_size += size
        else:
            self._small[key] = size
            self._small_size += size
        self._hits[key] = 0

    def _resize_entry(self, queue: OrderedDict[K, int], key: K, size: int) -> None:
        change = size - queue[key]
        queue[key] = size
        if queue is self._small:
            self._small_size += change
        else:
            self._main_size += change

    def touch(self, key: K) -> None:
        hits = self._hits.get(key)
        if hits is not None and hits < MAX_FREQUENCY:
            self._hits[key] = hits + 1

    def remove(self, key: K) -> None:
        if self._hits.pop(key, None) is None:
            return
        if key in self._small:
            self._small_size -= self._small.pop(key)
        else:
            self._main_size -= self._main.pop(key)

    def evict(self, held: Held[K] = _never_held) -> K | None:
        # Held entries met since the last progress, per queue: once a queue's whole length was
        # stepped over without progress, every entry in it is held.
        small_held = main_held = 0
        while True:
            small_open = bool(self._small) and small_held < len(self._small)
            main_open = bool(self._main) and main_held < len(self._main)
            if small_open and (self._small_size >= SMALL_SHARE * self.capacity or not main_open):
                key, size = self._small.popitem(last=False)
                if held(key):
                    self._small[key] = size
                    small_held += 1
                    continue
                self._small_size -= size
                if self._hits[key] > 0:  # reused on probation: promoted, its hits spent
                    self._hits[key] = 0
                    self._main[key] = size
                    self._main_size += size
                    small_held = main_held = 0
                    continue
                del self._hits[key]
                self._remember_ghost(key, size)
                return key
            if main_open:
                key, size = self._main.popitem(last=False)
                if held(key):
                    self._main[key] = size
                    main_held += 1
                    continue
                hits = self._hits[key]
                if hits > 0:
                    self._hits[key] = hits - 1
                    self._main[key] = size
                    small_held = main_held = 0
                    continue
                self._main_size -= size
                del self._hits[key]
                return key
            return None

    def _remember_ghost(self, key: K, size: int) -> None:
        self._ghost[key] = size
        self._ghost_size += size
        while self._ghost_size > self.capacity and self._ghost:
            self._ghost_size -= self._ghost.popitem(last=False)[1]

    def resize(self, capacity: int) -> None:
        super().resize(capacity)
        while self._ghost_size > self.capacity and self._ghost:
            self._ghost_size -= self._ghost.popitem(last=False)[1]

    def __contains__(self, key: object) -> bool:
        return key in self._hits

    def __len__(self) -> int:
        return len(self._hits)
