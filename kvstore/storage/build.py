"""Tiers from a config: the one place configuration becomes the tiers below DRAM.

The engine is given its tiers (as zarr's arrays are given a store): :class:`kvstore.KVStore`
calls :func:`build_tiers` when it is not handed tiers of its own, and never names a backend.
Each backend the config enables (built-in or registered, :mod:`kvstore.backends.registry`)
becomes a :class:`~kvstore.storage.tier.ChunkTier` with its section's codec, the config's
encryption key and circuit breaker, fastest first.
"""

from __future__ import annotations

from concurrent.futures import Executor

from kvstore.backends import make_backend
from kvstore.backends.registry import backend_sections
from kvstore.codecs import make_codec
from kvstore.config import StoreConfig
from kvstore.keys import namespace_dir
from kvstore.layout import KVLayout
from kvstore.storage.crypto import ChunkCipher
from kvstore.storage.tier import ChunkTier


def build_tiers(config: StoreConfig, layout: KVLayout, namespace: str, executor: Executor) -> list[ChunkTier]:
    """Each backend ``config`` enables, fastest first: disk, Redis, S3, and registered ones by their rank.

    Not opened yet. Objects are stored per namespace (a directory name: see ``kvstore gc``);
    ``executor`` runs the tiers' blocking work (encoding, checks, file I/O) and stays the caller's
    to shut down.
    """
    directory = namespace_dir(namespace)
    key = config.encryption.resolve_key()
    cipher = ChunkCipher(key) if key is not None else None
    return [
        ChunkTier(
            make_backend(section, config.timeouts, directory, executor=executor),
            make_codec(section.codec),
            layout,
            executor,
            cipher=cipher,
            breaker=config.breaker,
        )
        for _, section in backend_sections(config)
        if section.enabled
    ]
