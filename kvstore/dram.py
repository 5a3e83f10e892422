"""The DRAM primary tier: a pre-allocated slab of chunk-sized slots with LRU and ref-counts.

All memory is allocated and touched once at start: allocating per chunk would pay the
first-touch page faults (0.2-2.5 GB/s here) on every put. With CUDA present the slab is pinned
so copies to and from the GPU run at full PCIe speed. A slot referenced by an in-flight
transfer is never evicted; when every slot is referenced, ``reserve`` returns None at once
(the caller counts a rejected put) instead of waiting for memory.

Thread-safe: the sync facade and worker threads touch it, so state sits behind one lock.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from typing import Literal

import torch

from kvstore.buffers import tensor_bytes
from kvstore.keys import ChunkKey
from kvstore.layout import KVLayout

log = logging.getLogger("kvstore.dram")


def _should_pin(pin_memory: Literal["auto", "always", "never"]) -> bool:
    if pin_memory == "never":
        return False
    available = torch.cuda.is_available()
    if pin_memory == "always" and not available:
        raise RuntimeError("dram.pin_memory = 'always' needs CUDA, and torch.cuda.is_available() is False")
    return available


class SlabPool:
    """Fixed slots of ``layout.chunk_nbytes`` each; a key maps to at most one published slot."""

    def __init__(self, layout: KVLayout, capacity_bytes: int, pin_memory: Literal["auto", "always", "never"] = "auto"):
        self.layout = layout
        slot_bytes = layout.chunk_nbytes
        self.num_slots = capacity_bytes // slot_bytes
        if self.num_slots < 1:
            raise ValueError(
                f"dram.capacity ({capacity_bytes} bytes) is smaller than one chunk "
                f"({slot_bytes} bytes for {layout.describe()}); raise dram.capacity"
            )
        self.pinned = _should_pin(pin_memory)
        self._slab = torch.empty((self.num_slots, slot_bytes), dtype=torch.uint8, pin_memory=self.pinned)
        self._slab.zero_()  # pre-touch every page now, not on the first put
        self._tensors = [self._slab[i].view(layout.dtype).view(layout.chunk_shape) for i in range(self.num_slots)]
        self._bytes = [tensor_bytes(self._slab[i]) for i in range(self.num_slots)]
        self._lock = threading.Lock()
        self._index: OrderedDict[ChunkKey, int] = OrderedDict()  # published slots, least recent first
        self._key_of: list[ChunkKey | None] = [None] * self.num_slots
        self._refs = [0] * self.num_slots
        self._free = list(range(self.num_slots - 1, -1, -1))
        self.evictions = 0
        log.info(
            "DRAM pool: %d slots x %.2f MiB = %.1f MiB, %s",
            self.num_slots,
            slot_bytes / 2**20,
            self.num_slots * slot_bytes / 2**20,
            "pinned" if self.pinned else "pageable (no CUDA: pinning skipped)",
        )

    def tensor(self, slot: int) -> torch.Tensor:
        """The slot as a chunk-shaped tensor (a view: valid while the caller holds a reference)."""
        return self._tensors[slot]

    def buffer(self, slot: int) -> memoryview:
        """The slot's bytes (a zero-copy view for secondary tiers)."""
        return self._bytes[slot]

    def reserve(self) -> int | None:
        """A private slot with one reference, evicting the least recently used unreferenced chunk.

        None when every slot is referenced: fail fast, never wait.
        """
        with self._lock:
            if self._free:
                slot = self._free.pop()
            else:
                evictable = next((s for s in self._index.values() if self._refs[s] == 0), None)
                if evictable is None:
                    return None
                slot = evictable
                victim = self._key_of[slot]
                assert victim is not None
                del self._index[victim]
                self._key_of[slot] = None
                self.evictions += 1
            self._refs[slot] = 1
            return slot

    def publish(self, slot: int, key: ChunkKey) -> bool:
        """Make a reserved, filled slot findable under ``key``; False if the key was already there."""
        with self._lock:
            if key in self._index:
                return False
            self._index[key] = slot
            self._key_of[slot] = key
            return True

    def acquire(self, key: ChunkKey) -> int | None:
        """The key's slot with a reference taken (and marked recently used), or None."""
        with self._lock:
            slot = self._index.get(key)
            if slot is not None:
                self._refs[slot] += 1
                self._index.move_to_end(key)
            return slot

    def retain(self, slot: int) -> None:
        """One more reference to a slot the caller already holds."""
        with self._lock:
            if self._refs[slot] <= 0:
                raise RuntimeError(f"retain of unreferenced slot {slot}")
            self._refs[slot] += 1

    def release(self, slot: int) -> None:
        with self._lock:
            if self._refs[slot] <= 0:
                raise RuntimeError(f"release of unreferenced slot {slot}")
            self._refs[slot] -= 1
            if self._refs[slot] == 0 and self._key_of[slot] is None:
                self._free.append(slot)

    def contains(self, key: ChunkKey) -> bool:
        with self._lock:
            return key in self._index

    def discard(self, key: ChunkKey) -> bool:
        """Forget a chunk; its slot is reused once the last reference is released."""
        with self._lock:
            slot = self._index.pop(key, None)
            if slot is None:
                return False
            self._key_of[slot] = None
            if self._refs[slot] == 0:
                self._free.append(slot)
            return True

    def stats(self) -> dict[str, int | bool]:
        with self._lock:
            return {
                "slots": self.num_slots,
                "slot_bytes": self.layout.chunk_nbytes,
                "chunks": len(self._index),
                "referenced": sum(1 for r in self._refs if r > 0),
                "evictions": self.evictions,
                "pinned": self.pinned,
            }
