"""The DRAM primary tier: a pre-allocated slab of chunk-sized slots with an eviction policy and ref-counts.

A pool larger than the memory available when it is built (``MemAvailable``, within the cgroup's
limit: :mod:`kvstore.util.memory`), or resizable past the machine's memory, is refused with a
ConfigError naming the key before anything is allocated.

Memory is allocated and touched once, when a segment is added: allocating per chunk would pay
the first-touch page faults (0.2-2.5 GB/s here) on every put. With CUDA present the slab is
pinned so copies to and from the GPU run at full PCIe speed. A slot referenced by an in-flight
transfer is never evicted (the policy steps over it); when every slot is referenced, ``reserve``
returns None at once (the caller counts a rejected put) instead of waiting for memory. Which
unreferenced chunk goes is the pool's eviction policy's choice (``dram.eviction``, see
:mod:`kvstore.eviction`): least recently used by default.

The slab is held in segments so that ``resize`` can change the budget while the store runs and
a shrink gives the memory back to the system, not only to the pool: growing allocates whole
segments; shrinking retires the highest ones, and a retired segment's tensor is dropped once the
last holder of one of its slots releases it. Without ``max_bytes`` the pool is one segment, as
big as asked. Slot ids are global (``segment * seg_slots + i``) and stable, and the usable slots
are always ``[0, num_slots)``. Per-slot views are built on first use, so opening a pool of
millions of small slots costs only the allocation.

Thread-safe: the sync facade and worker threads touch it, so state sits behind one lock; a
growing ``resize`` allocates outside it.
"""

from __future__ import annotations

import ctypes
import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any, Literal, TypeVar

import torch

from kvstore.errors import ConfigError
from kvstore.events import DRAM_MEDIUM, NO_EVENTS, TierEvents
from kvstore.eviction import DEFAULT_EVICTION, EvictionName, EvictionPolicy, make_policy
from kvstore.keys import ChunkKey
from kvstore.layout import KVLayout
from kvstore.util import memory
from kvstore.util.buffers import tensor_bytes
from kvstore.util.units import human_bytes

log = logging.getLogger("kvstore.dram")

SEGMENTS = 64
"""How many segments a resizable pool's ``max_bytes`` is cut into: the step of a resize."""

V = TypeVar("V")

try:  # glibc; elsewhere freed segments go back as the allocator sees fit
    _MALLOC_TRIM: Any = ctypes.CDLL(None).malloc_trim
except (AttributeError, OSError):  # pragma: no cover - not glibc
    _MALLOC_TRIM = None


def _should_pin(pin_memory: Literal["auto", "always", "never"]) -> bool:
    if pin_memory == "never":
        return False
    available = torch.cuda.is_available()
    if pin_memory == "always" and not available:
        raise RuntimeError("dram.pin_memory = 'always' needs CUDA, and torch.cuda.is_available() is False")
    return available


def _refuse_beyond_memory(capacity_bytes: int, max_bytes: int | None) -> None:
    """A ConfigError for a pool that cannot fit: ``capacity_bytes`` (allocated now) above the memory available
    now, or ``max_bytes`` (what auto mode may grow to) above the machine's. Unknown memory checks nothing."""
    available = memory.available_memory()
    if available is not None and capacity_bytes > available:
        raise ConfigError(
            f"dram.capacity {human_bytes(capacity_bytes)} ({capacity_bytes:,} bytes) is more than the memory "
            f"available now ({human_bytes(available)}); lower dram.capacity, or free memory"
        )
    total = memory.machine_memory()
    if max_bytes is not None and total is not None and max_bytes > total:
        raise ConfigError(
            f"adaptive.dram_max {human_bytes(max_bytes)} ({max_bytes:,} bytes) is more than this machine's memory "
            f"({human_bytes(total)}); lower adaptive.dram_max"
        )


class SlabPool:
    """Slots of ``layout.chunk_nbytes`` each, in segments; a key maps to at most one published slot.

    ``max_bytes`` is the most ``resize`` may grow to, cut into SEGMENTS (64) segments; without it the pool is
    one segment of ``capacity_bytes`` and cannot resize. ``eviction`` names the policy that picks which
    unreferenced chunk a full pool drops (:mod:`kvstore.eviction`). ``events`` hears of every chunk
    published (stored) and of every one evicted, discarded or dropped by a shrink (removed).
    """

    def __init__(
        self,
        layout: KVLayout,
        capacity_bytes: int,
        pin_memory: Literal["auto", "always", "never"] = "auto",
        max_bytes: int | None = None,
        eviction: EvictionName | str = DEFAULT_EVICTION,
        events: TierEvents = NO_EVENTS,
    ):
        self.layout = layout
        self.events = events  # told of each chunk published, evicted or discarded (kvstore.events)
        self.slot_bytes = layout.chunk_nbytes
        if capacity_bytes // self.slot_bytes < 1:
            raise ValueError(
                f"dram.capacity ({capacity_bytes} bytes) is smaller than one chunk "
                f"({self.slot_bytes} bytes for {layout.describe()}); raise dram.capacity"
            )
        if max_bytes is not None and max_bytes < capacity_bytes:
            raise ValueError(f"max_bytes must be at least capacity_bytes ({max_bytes} < {capacity_bytes})")
        _refuse_beyond_memory(capacity_bytes, max_bytes)  # before anything is allocated, even the slot lists
        self.max_slots = (capacity_bytes if max_bytes is None else max_bytes) // self.slot_bytes
        # no max_bytes: no resizing asked for, so one segment holds everything (as before segments)
        self.seg_slots = self.max_slots if max_bytes is None else max(1, self.max_slots // SEGMENTS)
        positions = -(-self.max_slots // self.seg_slots)
        self.pinned = _should_pin(pin_memory)
        self._lock = threading.Lock()
        self._resize_lock = threading.Lock()  # one resize at a time; its allocation runs outside _lock
        self._segments: list[torch.Tensor | None] = [None] * positions
        self._usable = 0  # segments [0, _usable) are usable; any allocated above them are retiring
        self._retiring: dict[int, int] = {}  # retiring segment -> how many of its slots are still referenced
        self._tensors: list[torch.Tensor | None] = [None] * self.max_slots  # views, built on first use
        self._bytes: list[memoryview | None] = [None] * self.max_slots
        self._index: dict[ChunkKey, int] = {}  # published slots
        self._policy: EvictionPolicy[ChunkKey] = make_policy(eviction, max(1, self.max_slots))  # their eviction order
        self._key_of: list[ChunkKey | None] = [None] * self.max_slots
        self._refs = [0] * self.max_slots
        self._free: list[int] = []
        self.num_slots = 0
        self.evictions = 0
        self.resize_evictions = 0  # chunks dropped because a shrink retired their segment
        self._grow(self._segments_for(capacity_bytes))
        log.info(
            "DRAM pool: %d slots x %.2f MiB = %.1f MiB (at most %.1f MiB), %s eviction, %s",
            self.num_slots,
            self.slot_bytes / 2**20,
            self.capacity_bytes / 2**20,
            self.max_bytes / 2**20,
            self._policy.name,
            "pinned" if self.pinned else "pageable (no CUDA: pinning skipped)",
        )

    @property
    def capacity_bytes(self) -> int:
        """Bytes of the usable slots (whole segments, so possibly more than asked for)."""
        return self.num_slots * self.slot_bytes

    @property
    def max_bytes(self) -> int:
        """The most the pool may grow to, in whole slots."""
        return self.max_slots * self.slot_bytes

    # -- views -------------------------------------------------------------------------------------

    def tensor(self, slot: int) -> torch.Tensor:
        """The slot as a chunk-shaped tensor (a view: valid while the caller holds a reference)."""
        view = self._tensors[slot]
        return view if view is not None else self._build(slot, self._tensors, self._chunk_view)

    def buffer(self, slot: int) -> memoryview:
        """The slot's bytes (a zero-copy view for secondary tiers)."""
        view = self._bytes[slot]
        return view if view is not None else self._build(slot, self._bytes, tensor_bytes)

    def _chunk_view(self, row: torch.Tensor) -> torch.Tensor:
        return row.view(self.layout.dtype).view(self.layout.chunk_shape)

    def _build(self, slot: int, cache: list[V | None], make: Callable[[torch.Tensor], V]) -> V:
        """A slot's view, cached under the lock so that freeing a segment cannot leave a stale one."""
        with self._lock:
            segment = self._segments[slot // self.seg_slots]
            if segment is None:
                raise IndexError(f"slot {slot} is not in an allocated segment")
            view = cache[slot] = make(segment[slot % self.seg_slots])
            return view

    # -- slots -------------------------------------------------------------------------------------

    @property
    def eviction(self) -> str:
        """The name of the pool's eviction policy."""
        return self._policy.name

    def _held(self, key: ChunkKey) -> bool:
        """Whether a published chunk's slot is referenced (the lock held): the policy steps over it."""
        return self._refs[self._index[key]] > 0

    def reserve(self) -> int | None:
        """A private slot with one reference, evicting an unreferenced chunk the policy picks if none is free.

        None when every slot is referenced: fail fast, never wait.
        """
        with self._lock:
            if self._free:
                slot = self._free.pop()
            else:
                victim = self._policy.evict(self._held)
                if victim is None:
                    return None
                slot = self._index.pop(victim)
                self._key_of[slot] = None
                self.evictions += 1
                self.events.removed(DRAM_MEDIUM, [victim])
            self._refs[slot] = 1
            return slot

    def publish(self, slot: int, key: ChunkKey, *, ranked: bool = True) -> bool:
        """Make a reserved, filled slot findable under ``key``; False if the key was already there.

        A slot whose segment a shrink retired meanwhile is taken (True: the caller goes on, e.g.
        writes it to the next tier) but dropped at once, as if the shrink had come just after.
        ``ranked=False``: the eviction policy is told later, with the rest of a batch (:meth:`rank`);
        until then the chunk is not evicted.
        """
        with self._lock:
            if key in self._index:
                return False
            if slot >= self.num_slots:
                self.resize_evictions += 1
                return True
            self._index[key] = slot
            self._key_of[slot] = key
            if ranked:
                self._policy.insert(key)
            self.events.stored(DRAM_MEDIUM, [key])
            return True

    def rank(self, keys: Sequence[ChunkKey]) -> None:
        """Tell the eviction policy of chunks published unranked, a batch in prefix order: tail first.

        The batch's last chunk is inserted first, so it is the least recent of them and goes first: a
        full pool drops a prefix's tail before its head (a chunk is loaded only after the ones before
        it), as vLLM frees a request's blocks in reverse. Keys gone meanwhile are skipped.
        """
        with self._lock:
            for key in reversed(keys):
                if key in self._index and key not in self._policy:
                    self._policy.insert(key)

    def acquire(self, key: ChunkKey) -> int | None:
        """The key's slot with a reference taken (a hit, told to the eviction policy), or None."""
        return self.acquire_many([key])[0]

    def acquire_many(self, keys: Sequence[ChunkKey]) -> list[int | None]:
        """:meth:`acquire` of each key (a batch in prefix order), the hits told to the eviction policy tail first:
        the batch's first chunk is the most recent of them, so its tail goes before its head (see :meth:`rank`)."""
        with self._lock:
            slots = [self._index.get(key) for key in keys]
            for key, slot in zip(reversed(keys), reversed(slots), strict=True):
                if slot is not None:
                    self._refs[slot] += 1
                    self._policy.touch(key)
            return slots

    def retain(self, slot: int) -> None:
        """One more reference to a slot the caller already holds."""
        with self._lock:
            if self._refs[slot] <= 0:
                raise RuntimeError(f"retain of unreferenced slot {slot}")
            self._refs[slot] += 1

    def release(self, slot: int) -> None:
        """Drop one reference; the last one of a retiring segment frees that segment's memory."""
        freed: list[torch.Tensor] = []
        with self._lock:
            if self._refs[slot] <= 0:
                raise RuntimeError(f"release of unreferenced slot {slot}")
            self._refs[slot] -= 1
            if self._refs[slot] == 0 and self._key_of[slot] is None:
                if slot < self.num_slots:
                    self._free.append(slot)
                else:
                    position = slot // self.seg_slots
                    self._retiring[position] -= 1
                    if self._retiring[position] == 0:
                        freed.append(self._free_segment(position))
        if freed:
            self._give_back(freed)

    def has_spare(self, floor: int) -> bool:
        """Whether more than ``floor`` slots could be reserved now (free, or holding an unreferenced chunk).

        Background work that may wait (DRAM admissions) checks it so as to leave ``floor`` slots to
        the engine's own puts and loads. Stops counting once past ``floor``.
        """
        with self._lock:
            spare = len(self._free)
            if spare > floor:
                return True
            for slot in self._index.values():
                if self._refs[slot] == 0:
                    spare += 1
                    if spare > floor:
                        return True
            return False

    def keys(self) -> list[ChunkKey]:
        """The chunks published now (a snapshot)."""
        with self._lock:
            return list(self._index)

    def contains(self, key: ChunkKey) -> bool:
        with self._lock:
            return key in self._index

    def discard(self, key: ChunkKey) -> bool:
        """Forget a chunk; its slot is reused once the last reference is released."""
        with self._lock:
            slot = self._index.pop(key, None)
            if slot is None:
                return False
            self._policy.remove(key)
            self._key_of[slot] = None
            if self._refs[slot] == 0:
                self._free.append(slot)
            self.events.removed(DRAM_MEDIUM, [key])
            return True

    # -- resizing ----------------------------------------------------------------------------------

    def resize(self, capacity_bytes: int) -> int:
        """Grow or shrink the usable slots to ``capacity_bytes``; returns the new ``num_slots``.

        Rounded up to whole segments, within one segment and ``max_bytes``. Chunks in retired
        segments are dropped (``resize_evictions``); slots held there stay valid until released.
        """
        want = self._segments_for(capacity_bytes)
        with self._resize_lock:
            before = self.num_slots
            if want > self._usable:
                self._grow(want)
            elif want < self._usable:
                self._shrink(want)
            if self.num_slots != before:
                log.info(
                    "DRAM pool resized: %d -> %d slots (%.1f MiB)", before, self.num_slots, self.capacity_bytes / 2**20
                )
            return self.num_slots

    def _segments_for(self, capacity_bytes: int) -> int:
        slots = max(0, capacity_bytes // self.slot_bytes)
        return min(max(1, -(-slots // self.seg_slots)), len(self._segments))

    def _span(self, position: int) -> range:
        start = position * self.seg_slots
        return range(start, min(start + self.seg_slots, self.max_slots))

    def _grow(self, want: int) -> None:
        """Make segments [_usable, want) usable: un-retire those still allocated, allocate the rest."""
        fresh: dict[int, torch.Tensor] = {}
        while True:
            with self._lock:
                # a retiring segment freed while we were allocating needs allocating too: go round again
                missing = [p for p in range(self._usable, want) if self._segments[p] is None and p not in fresh]
                if not missing:
                    for position in range(self._usable, want):
                        if self._segments[position] is None:
                            self._segments[position] = fresh[position]
                        else:
                            del self._retiring[position]
                    # lowest slots on top of the stack: reserve fills the pool from the bottom
                    spans = [self._span(position) for position in reversed(range(self._usable, want))]
                    self._free[:0] = [s for span in spans for s in reversed(span) if self._refs[s] == 0]
                    self._usable = want
                    self.num_slots = self._span(want - 1).stop
                    self._policy.resize(self.num_slots)
                    return
            for position in missing:
                segment = torch.empty(
                    (len(self._span(position)), self.slot_bytes), dtype=torch.uint8, pin_memory=self.pinned
                )
                fresh[position] = segment.zero_()  # pre-touch every page now, not on the first put

    def _shrink(self, want: int) -> None:
        """Retire segments [want, _usable): drop their chunks, free those nobody references now."""
        freed: list[torch.Tensor] = []
        with self._lock:
            dropped: list[ChunkKey] = []
            for position in range(want, self._usable):
                span = self._span(position)
                for slot, key in [(s, self._key_of[s]) for s in span if self._key_of[s] is not None]:
                    del self._index[key]
                    self._policy.remove(key)
                    self._key_of[slot] = None
                    self.resize_evictions += 1
                    dropped.append(key)
                self._retiring[position] = len(span) - self._refs[span.start : span.stop].count(0)
                if self._retiring[position] == 0:
                    freed.append(self._free_segment(position))
            self.events.removed(DRAM_MEDIUM, dropped)
            self._usable = want
            self.num_slots = self._span(want - 1).stop
            self._policy.resize(self.num_slots)
            self._free = [s for s in self._free if s < self.num_slots]
        if freed:
            self._give_back(freed)

    def _free_segment(self, position: int) -> torch.Tensor:
        """Forget a retired segment and its views (under the lock); the caller drops the tensor."""
        span = self._span(position)
        segment = self._segments[position]
        assert segment is not None
        self._segments[position] = None
        del self._retiring[position]
        self._tensors[span.start : span.stop] = [None] * len(span)
        self._bytes[span.start : span.stop] = [None] * len(span)
        return segment

    def _give_back(self, segments: list[torch.Tensor]) -> None:
        """Drop the last references to freed segments (outside the lock), so their memory goes back."""
        segments.clear()
        if self.pinned and hasattr(torch._C, "_host_emptyCache"):
            torch._C._host_emptyCache()  # pinned blocks are cached by torch until emptied
        if _MALLOC_TRIM is not None:
            # glibc raises its mmap threshold (up to 32 MiB) after each munmap, so a segment allocated
            # after an earlier one was freed may sit in its heap, whose free pages stay resident until
            # trimmed: measured, 256 MiB shrunk to 16 MiB gave back 5 MiB without this, 249 MiB with it
            _MALLOC_TRIM(0)

    def stats(self) -> dict[str, int | bool | str]:
        with self._lock:
            return {
                "slots": self.num_slots,
                "slot_bytes": self.slot_bytes,
                "chunks": len(self._index),
                "referenced": self.max_slots - self._refs.count(0),
                "evictions": self.evictions,
                "eviction": self._policy.name,
                "pinned": self.pinned,
                "capacity_bytes": self.capacity_bytes,
                "max_bytes": self.max_bytes,
                "segments": sum(1 for segment in self._segments if segment is not None),
                "resize_evictions": self.resize_evictions,
            }
