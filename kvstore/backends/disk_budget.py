"""The disk tier's byte budget: an index of one namespace's chunk files, its eviction policy, and writes in flight.

Files are named by their path below the disk root (``ns/ab/cd/key.kvc``). A write reserves its
bytes before it starts (:meth:`FileBudget.reserve`), evicting files first, and either commits
them to its file or releases them: so the directory never holds more than the budget, however
many writers run at once. Which file goes is the eviction policy's choice (``disk.eviction``,
see :mod:`kvstore.eviction`; least recently used by default), in bytes: the policy sees each
file's size and the capacity. Evicted files are unlinked under the lock, so no reservation is
granted against bytes still on disk.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Sequence

from kvstore.backends.files import unlink_quietly
from kvstore.eviction import DEFAULT_EVICTION, EvictionName, EvictionPolicy, make_policy


class FileBudget:
    """The index, eviction policy and byte count of one disk tier (see the module docstring); thread-safe."""

    def __init__(self, root: str, capacity: int, eviction: EvictionName | str = DEFAULT_EVICTION) -> None:
        self.root = root
        self.capacity = capacity
        self.lock = threading.Lock()  # held while evicting: nothing else moves meanwhile
        self._room = threading.Condition(self.lock)  # notified when a write in flight ends
        self._index: dict[str, int] = {}  # relative path -> size
        self._policy: EvictionPolicy[str] = make_policy(eviction, max(1, capacity))  # the index's eviction order
        self.used = 0  # the index's bytes plus those reserved by writes in flight
        self.evictions = self.disk_full = 0
        # told each file evicted, just before its removal (the lock held)
        self.on_evicted: Callable[[str], None] = lambda relative: None

    @property
    def eviction(self) -> str:
        """The name of the eviction policy."""
        return self._policy.name

    def load(self, files: Iterable[tuple[str, int]]) -> None:
        """Replace the index with ``files`` (relative path, size), least recently used first."""
        with self.lock:
            self._index = dict(files)
            self._policy = make_policy(self._policy.name, max(1, self.capacity))
            for relative, size in self._index.items():
                self._policy.insert(relative, size)
            self.used = sum(self._index.values())

    def holds(self, relative: str) -> bool:
        with self.lock:
            return relative in self._index

    def remember(self, relative: str, size: int) -> None:
        """A file found on disk (perhaps another process's): in the index, as if just stored."""
        with self.lock:
            self.used += size - self._index.pop(relative, 0)
            self._index[relative] = size
            self._policy.insert(relative, size)

    def forget(self, relative: str) -> None:
        """A file that is gone (deleted here, or by another process)."""
        with self.lock:
            self.used -= self._index.pop(relative, 0)
            self._policy.remove(relative)

    def mark_used(self, relative: str, size: int | None = None, hit: bool = True) -> bool:
        """A hit on a file; one not indexed is added when its ``size`` is known. True if added.

        ``hit=False``: only add it if new; an indexed file's hit is told later, with the rest of its batch
        (:meth:`mark_used_in_order`).
        """
        with self.lock:
            if relative in self._index:
                if hit:
                    self._policy.touch(relative)
                return False
            if size is None:
                return False
            self._index[relative] = size
            self._policy.insert(relative, size)
            self.used += size
            return True

    def mark_used_in_order(self, relatives: Sequence[str], blocking: bool = True) -> bool:
        """Hits on a batch of files, a prefix's chunks in order: told to the policy last to first, so of them
        the head is the most recent and the tail goes first (a chunk is loaded only after the ones before it).

        ``blocking=False``: only if the lock is free now (a writer may hold it across an eviction's unlink);
        False if it was not, and nothing was done.
        """
        if not self.lock.acquire(blocking=blocking):
            return False
        try:
            for relative in reversed(relatives):
                if relative in self._index:
                    self._policy.touch(relative)
        finally:
            self.lock.release()
        return True

    # -- writes ----------------------------------------------------------------------------------

    def reserve(self, size: int) -> None:
        """Count ``size`` bytes of a write about to start, evicting files to make room.

        When only other writes in flight hold the budget, waits for one of them to end (each
        ends: it commits or releases). ``size`` must not exceed the capacity.
        """
        with self._room:
            while self.used + size > self.capacity:
                if not self._evict_one(kept=None):
                    self._room.wait()
            self.used += size

    def release(self, size: int) -> None:
        """Give back the reservation of a write that failed."""
        with self._room:
            self.used -= size
            self._room.notify_all()

    def commit(self, relative: str, size: int) -> None:
        """A reserved write is in place: its bytes now belong to its file (stored, or stored again)."""
        with self._room:
            self.used -= self._index.pop(relative, 0)  # an older copy it replaced (its size was counted)
            self._index[relative] = size
            self._policy.insert(relative, size)
            self._room.notify_all()

    def free_for_full_disk(self, size: int, kept: str) -> tuple[int, int]:
        """ENOSPC: evict at least ``size`` bytes of files the policy picks, never ``kept``; (files, bytes)."""
        freed = files = 0
        with self.lock:
            self.disk_full += 1
            while freed < size:
                before = self.used
                if not self._evict_one(kept):
                    break
                freed, files = freed + before - self.used, files + 1
        return files, freed

    # -- eviction --------------------------------------------------------------------------------

    def evict_to_capacity(self, kept: str | None) -> int:
        """Evict files the policy picks (never ``kept``) until the index and reservations fit; bytes freed."""
        with self.lock:
            before = self.used
            while self.used > self.capacity and self._evict_one(kept):
                pass
            return before - self.used

    def _evict_one(self, kept: str | None) -> bool:
        """Remove the file the policy picks, never ``kept`` (the lock held); False if there is none."""
        victim = self._policy.evict(lambda relative: relative == kept)
        if victim is None:
            return False
        self.used -= self._index.pop(victim)
        self.evictions += 1
        self.on_evicted(victim)  # before the file goes: it may be read for its name
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
                "eviction": self._policy.name,
            }
