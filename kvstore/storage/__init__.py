"""From chunks to stored objects: the chunk container, encryption at rest, the tier that checks every byte,
and :func:`build_tiers`, which makes a config's tiers (the engine is given them)."""

from kvstore.storage.build import build_tiers

__all__ = ["build_tiers"]
