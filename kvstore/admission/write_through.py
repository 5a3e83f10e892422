"""Write-through: every chunk put is written to every tier below DRAM at once (the default).

Tiers stay inclusive (each holds what the faster ones hold), and a chunk's second sighting finds it
on disk even after DRAM dropped it. The price: one-off prompts cost their writes below too.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvstore.admission.base import AdmissionPolicy, T

if TYPE_CHECKING:
    from kvstore.keys import ChunkKey


class WriteThrough(AdmissionPolicy[T]):
    """Every tier, now."""

    name = "write-through"
    uses_sightings = False

    def admit(self, key: ChunkKey, below: Sequence[T]) -> Sequence[T]:
        return below
