"""Second sighting: a chunk goes below DRAM only once its prefix has been looked up before.

At a put, a key the store's lookups saw before (a hashed sighting count, :mod:`kvstore.sizing.mrc`)
is written to every tier below; a first sighting stays in DRAM only, held back, and is written
below at its next DRAM hit (a second sighting that came back while it was still in DRAM). One-off
prompts then cost a DRAM copy and nothing else; what this gives up is the lower tiers' hits on
chunks whose second sighting came after DRAM dropped them (``kvstore advise`` weighs the two).

A store that has seen no lookup at all cannot judge (a vLLM worker process, whose lookups run in
the scheduler's): ``seen_before`` then says True, and the policy writes through.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvstore.admission.base import AdmissionPolicy, T

if TYPE_CHECKING:
    from kvstore.keys import ChunkKey


class SecondSighting(AdmissionPolicy[T]):
    """Every tier for a key seen before, none (held back until a DRAM hit) for a first sighting."""

    name = "second-sighting"
    uses_sightings = True

    def admit(self, key: ChunkKey, below: Sequence[T]) -> Sequence[T]:
        if not below or self.seen_before(key):
            return below
        return below[:0]
