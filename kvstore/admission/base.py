"""The admission policy interface: which chunk is written to which tier below DRAM, and when.

Every chunk put lands in DRAM; its admission policy decides where else it goes. The store asks
and tells its policy:

- :meth:`AdmissionPolicy.admit` as a chunk is put (before its copy into DRAM): which of the tiers
  below DRAM (fastest first) get its write now. The rest are *held back*.
- :meth:`AdmissionPolicy.hold` once a chunk with tiers held back is in DRAM (a put of a key
  already there, or one that loses a race, holds nothing back): remembered in :class:`HeldBack`.
- :meth:`AdmissionPolicy.sighted` on each DRAM hit (``get_many``, a layer stream opening its
  chunks): a hit is a second sighting, so a held-back chunk is due, and the store writes it to the
  tiers it was held back from.

Eviction (:mod:`kvstore.eviction`) decides what leaves a tier; admission decides what enters one.
A policy reads lookups' sightings through ``seen_before`` (the store's access tracker, see
:mod:`kvstore.sizing.adaptive`), never the store. The held-back chunks and the counters live in
:class:`HeldBack`, which a policy is given: auto mode switches policies as traffic changes, and the
new policy takes over the old one's held-back chunks (so each still goes below at its next hit).

Threading: everything runs on the store's event loop; every method is short, never blocks and
does no I/O.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, ClassVar, Generic, TypeVar

if TYPE_CHECKING:  # kvstore.keys imports torch; `kvstore --help` reads the policies' names without it
    from kvstore.keys import ChunkKey

T = TypeVar("T")
"""A tier below DRAM (the engine's :class:`~kvstore.storage.tier.ChunkTier`); a policy only passes tiers on."""

SeenBefore = Callable[["ChunkKey"], bool]
"""Whether a key was looked up before the lookup that led to its put (True when that cannot be judged)."""


def _always_seen(key: ChunkKey) -> bool:
    return True


class HeldBack(Generic[T]):
    """Chunks in DRAM but not yet in some tiers below it, each with the tiers it was held back from.

    Bounded: the oldest entries go first (uncounted); by then their chunk has usually left DRAM anyway.
    Counts what was held back and what was released, for ``stats()["adaptive"]``.
    """

    def __init__(self, limit: int) -> None:
        self.limit = max(16, limit)
        self._keys: OrderedDict[ChunkKey, tuple[T, ...]] = OrderedDict()
        self.held_back = 0  # chunks kept out of some lower tier when put
        self.released = 0  # of which, sent on later (a second sighting hit them in DRAM)

    def add(self, key: ChunkKey, tiers: Sequence[T]) -> None:
        self._keys[key] = tuple(tiers)
        self.held_back += 1
        if len(self._keys) > self.limit:
            self._keys.popitem(last=False)

    def take(self, key: ChunkKey) -> tuple[T, ...]:
        """The tiers ``key`` was held back from (once; counted as released), or () if it was not held back."""
        tiers = self._keys.pop(key, ())
        self.released += bool(tiers)
        return tiers

    def counters(self) -> dict[str, int]:
        return {"held_back": self.held_back, "released": self.released}

    def __len__(self) -> int:
        return len(self._keys)


class AdmissionPolicy(ABC, Generic[T]):
    """Decides which tiers below DRAM a chunk put is written to now (see the module docstring for the contract).

    ``seen_before`` tells lookups' sightings (default: every key counts as seen); ``held_back`` is
    the store's memory of held-back chunks, handed on from policy to policy.
    """

    name: ClassVar[str]
    """The registry name, as the ``adaptive.policy`` config key takes it."""
    uses_sightings: ClassVar[bool]
    """Whether it reads ``seen_before``: the store then tracks its lookups."""

    def __init__(self, held_back: HeldBack[T], seen_before: SeenBefore = _always_seen) -> None:
        self.held_back = held_back
        self.seen_before = seen_before

    @abstractmethod
    def admit(self, key: ChunkKey, below: Sequence[T]) -> Sequence[T]:
        """Which of ``below`` (the tiers below DRAM, fastest first) get ``key``'s write now; the others are held back.

        Returns ``below`` itself, or a subsequence of it (in its order).
        """

    def hold(self, key: ChunkKey, tiers: Sequence[T]) -> None:
        """``key`` is in DRAM now, and not in ``tiers`` (held back by :meth:`admit`): its next DRAM hit sends it."""
        self.held_back.add(key, tiers)

    def sighted(self, key: ChunkKey) -> tuple[T, ...]:
        """A DRAM hit on ``key``: the tiers it was held back from, to be written now (() if none)."""
        return self.held_back.take(key) if len(self.held_back) else ()

    @property
    def holding(self) -> bool:
        """Whether any chunk is held back now (the store skips :meth:`sighted` when none is)."""
        return len(self.held_back) > 0

    def counters(self) -> dict[str, int]:
        """``held_back`` (chunks kept out of some lower tier when put) and ``released`` (sent on later), so far."""
        return self.held_back.counters()
