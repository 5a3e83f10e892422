"""The disk tier's byte budget: an LRU index of one namespace's chunk files, and the bytes of writes in flight.

Files are named by their path below the disk root (``ns/ab/cd/key.kvc``). A write reserves its
bytes before it starts (:meth:`FileBudget.reserve`), evicting the least recently used files
first, and either commits them to its file or releases them: so the directory never holds more
than the budget, however many writers run at once. Evicted files are unlinked under the lock,
so no reservation is granted against bytes still on disk.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterable

from kvstore.backends.files import unlink_quietly


class FileBudget:
    """The LRU index and byte count of one disk tier (see the module docstring); thread-safe."""

    def __init__(self, root: str, capacity: int) -> None:
        self.root = root
        self.capacity = capacity
        self.lock = threading.Lock()  # held while evicting: nothing else moves meanwhile
        self._room = threading.Condition(self.lock)  # notified when a write in flight ends
        self._index: OrderedDict[str, int] = OrderedDict()  # relative path -> size, least recent first
        self.used = 0  # the index's bytes plus those reserved by writes in flight
        self.evictions = self.disk_full = 0

    def load(self, files: Iterable[tuple[str, int]]) -> None:
        """Replace the index with ``files`` (relative path, size), least recently used first."""
        with self.lock:
            self._index = OrderedDict(files)
            self.used = sum(self._index.values())

    def holds(self, relative: str) -> bool:
        with self.lock:
            return relative in self._index

    def remember(self, relative: str, size: int) -> None:
        """A file found on disk (perhaps another process's): in the index, most recent."""
        with self.lock:
            self.used += size - self._index.pop(relative, 0)
            self._index[relative] = size

    def forget(self, relative: str) -> None:
        """A file that is gone (deleted here, or by another process)."""
        with self.lock:
            self.used -= self._index.pop(relative, 0)

    def mark_used(self, relative: str, size: int | None = None) -> bool:
        """Make a file the most recent; one not indexed is added when its ``size`` is known. True if added."""
        with self.lock:
            if relative in self._index:
                self._index.move_to_end(relative)
                return False
            if size is None:
                return False
            self._index[relative] = size
            self.used += size
            return True

    # -- writes ----------------------------------------------------------------------------------

    def reserve(self, size: int) -> None:
        """Count ``size`` bytes of a write about to start, evicting least recently used files to make room.

        When only other writes in flight hold the budget, waits for one of them to end (each
        ends: it commits or releases). ``size`` must not exceed the capacity.
        """
        with self._room:
            while self.used + size > self.capacity:
                if not self._evict_oldest(kept=None):
                    self._room.wait()
            self.used += size

    def release(self, size: int) -> None:
        """Give back the reservation of a write that failed."""
        with self._room:
            self.used -= size
            self._room.notify_all()

    def commit(self, relative: str, size: int) -> None:
        """A reserved write is in place: its bytes now belong to its file, the most recent."""
        with self._room:
            self.used -= self._index.pop(relative, 0)  # an older copy it replaced (its size was counted)
            self._index[relative] = size
            self._room.notify_all()

    def free_for_full_disk(self, size: int, kept: str) -> tuple[int, int]:
        """ENOSPC: evict at least ``size`` bytes of least recently used files, never ``kept``; (files, bytes)."""
        freed = files = 0
        with self.lock:
            self.disk_full += 1
            while freed < size:
                before = self.used
                if not self._evict_oldest(kept):
                    break
                freed, files = freed + before - self.used, files + 1
        return files, freed

    # -- eviction --------------------------------------------------------------------------------

    def evict_to_capacity(self, kept: str | None) -> int:
        """Evict least recently used files (never ``kept``) until the index and reservations fit; bytes freed."""
        with self.lock:
            before = self.used
            while self.used > self.capacity and self._evict_oldest(kept):
                pass
            return before - self.used

    def _evict_oldest(self, kept: str | None) -> bool:
        """Remove the least recently used file other than ``kept`` (the lock held); False if there is none."""
        victim = next((k for k in self._index if k != kept), None)
        if victim is None:
            return False
        self.used -= self._index.pop(victim)
        self.evictions += 1
        unlink_quietly(f"{self.root}/{victim}")
        return True

    def stats(self) -> dict[str, int | float | str]:
        with self.lock:
            return {
                "files": len(self._index),
                "bytes_used": self.used,
                "capacity": self.capacity,
                "evictions": self.evictions,
                "disk_full": self.disk_full,
            }
