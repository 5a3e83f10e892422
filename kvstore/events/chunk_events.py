"""What the store tells routers: a chunk stored on a tier, or removed from one.

The DRAM pool and every tier call a :class:`TierEvents` (``stored`` / ``removed``) when a chunk
becomes durable on them or leaves them; :class:`ChunkEvents` turns those calls into vLLM's events
(:mod:`kvstore.events.wire`) and hands them to an :class:`~kvstore.events.publisher.EventPublisher`.
With events off the store holds :data:`NO_EVENTS`, whose calls do nothing.

**What a chunk is called.** A chunk is advertised whole, as one block of ``chunk_tokens``
tokens (``block_size``), because kvstore loads whole chunks only. An engine connector that knows
the engine's own block hashes attributes each chunk (:meth:`ChunkEvents.attribute`) with a
:class:`ChunkIdentity`: the engine's hash of the chunk's last block (which, the hashes being
chained, names the whole prefix up to the chunk's end: the same hash the engine's own GPU
events carry for that block), the previous chunk's, the chunk's tokens, LoRA and extra keys. That
is the shape vLLM itself uses for a block that spans several hash blocks. A chunk nobody
attributed is called by its kvstore key (32 bytes: a SHA-256/BLAKE2 digest of the namespace and
the prefix), with no tokens.

Identities are remembered per key (a bounded map, least recently attributed first out; the
store keeps at least twice its DRAM tier's chunks) so that a later write to a slower tier, an
eviction or a removal names the chunk as its store did. The name is also kept in each chunk's
header (:func:`kvstore.storage.container.header_name`): the disk tier's evictions and ``kvstore
gc`` read it from there, so a chunk long forgotten here is still removed under its engine's name.
"""

from __future__ import annotations

import threading
from array import array
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any, NamedTuple, Protocol

from kvstore.events.wire import (
    LOCAL,
    MEDIUM_CPU,
    MEDIUM_STORAGE,
    REMOTE,
    BlockHash,
    BlockRemoved,
    BlockStored,
    KVEvent,
)
from kvstore.keys import ChunkKey, key_to_bytes

OWNERSHIP = "kvstore"  # BlockStored/BlockRemoved ``ownership``: the secondary tier that published the event


class Medium(NamedTuple):
    """Where a chunk is, as events name it: ``medium`` and ``locality`` (LOCAL or REMOTE)."""

    medium: str
    locality: str

    @classmethod
    def of_tier(cls, name: str, is_local: bool) -> Medium:
        """vLLM's name where it has one (DRAM is ``CPU``, the disk tier ``STORAGE``); else the tier's, upper-case."""
        medium = {"dram": MEDIUM_CPU, "disk": MEDIUM_STORAGE}.get(name, name.upper())
        return cls(medium, LOCAL if is_local else REMOTE)


DRAM_MEDIUM = Medium(MEDIUM_CPU, LOCAL)


@dataclass(frozen=True)
class ChunkIdentity:
    """How the engine names a chunk (see the module docstring); hashes in vLLM's ``ExternalBlockHash`` form."""

    block_hash: BlockHash
    parent_block_hash: BlockHash | None
    token_ids: Sequence[int]
    lora_id: int | None = None
    lora_name: str | None = None
    extra_keys: tuple[Any, ...] | None = None


class TierEvents(Protocol):
    """What the DRAM pool and the tiers call. Never blocks, never raises; safe from any thread."""

    def stored(self, medium: Medium, keys: Sequence[ChunkKey]) -> None:
        """``keys`` are now durable on ``medium`` (written there, or found there already)."""

    def removed(
        self, medium: Medium, keys: Sequence[ChunkKey], names: Sequence[BlockHash | None] | None = None
    ) -> None:
        """``keys`` left ``medium`` (evicted, removed as corrupt, collected, or the tier closed); ``names``:
        the engine's names their headers kept, where read (for chunks whose identity is no longer remembered)."""

    def name_of(self, key: ChunkKey) -> BlockHash | None:
        """The engine's name for ``key``'s chunk, if one attributed it: written into the chunk's header."""


class Publisher(Protocol):
    def publish(self, events: Sequence[KVEvent]) -> None: ...

    def publish_later(self, make: Callable[[], Sequence[KVEvent]], count: int) -> None: ...

    def close(self) -> None: ...


class NoEvents:
    """Events off: every call does nothing."""

    def stored(self, medium: Medium, keys: Sequence[ChunkKey]) -> None:
        pass

    def removed(
        self, medium: Medium, keys: Sequence[ChunkKey], names: Sequence[BlockHash | None] | None = None
    ) -> None:
        pass

    def name_of(self, key: ChunkKey) -> BlockHash | None:
        return None


NO_EVENTS = NoEvents()


class ChunkEvents:
    """The store's events: attributed per chunk, handed to a publisher (see the module docstring)."""

    def __init__(self, chunk_tokens: int, remembered: int = 1 << 14) -> None:
        """``remembered``: how many chunks' identities are kept (each ~1 KB with its 256 tokens).

        Events are published once :meth:`start` has given a publisher; before, and after
        :meth:`close`, they are dropped.
        """
        self.publisher: Publisher | None = None
        self.chunk_tokens = chunk_tokens
        self._remembered = remembered
        self._identities: OrderedDict[ChunkKey, ChunkIdentity] = OrderedDict()
        self._lock = threading.Lock()

    def start(self, publisher: Publisher) -> None:
        self.publisher = publisher

    def close(self) -> None:
        """Send what is queued and close the publisher (see :meth:`EventPublisher.close`)."""
        publisher, self.publisher = self.publisher, None
        if publisher is not None:
            publisher.close()

    def _publish(self, events: list[KVEvent]) -> None:
        publisher = self.publisher
        if publisher is not None and events:
            publisher.publish(events)

    def attribute(self, key: ChunkKey, identity: ChunkIdentity) -> None:
        """Name ``key``'s chunk by the engine's identity in every event from now on."""
        identity = replace(identity, token_ids=array("i", identity.token_ids))  # ~1 KB, not ~9 KB of ints
        with self._lock:
            self._identities[key] = identity
            self._identities.move_to_end(key)
            if len(self._identities) > self._remembered:
                self._identities.popitem(last=False)

    def identity(self, key: ChunkKey) -> ChunkIdentity | None:
        with self._lock:
            return self._identities.get(key)

    def name_of(self, key: ChunkKey) -> BlockHash | None:
        identity = self.identity(key)
        return identity.block_hash if identity is not None else None

    def stored(self, medium: Medium, keys: Sequence[ChunkKey]) -> None:
        publisher = self.publisher
        if publisher is not None and keys:  # the events are made in the publisher's thread, off the engine's path
            chunks = tuple(keys)
            publisher.publish_later(lambda: [self._stored(medium, key) for key in chunks], len(chunks))

    def removed(
        self, medium: Medium, keys: Sequence[ChunkKey], names: Sequence[BlockHash | None] | None = None
    ) -> None:
        if not keys:
            return
        hashes = []
        for i, key in enumerate(keys):
            identity = self.identity(key)
            name = names[i] if names is not None else None
            if identity is not None:
                hashes.append(identity.block_hash)
            else:
                hashes.append(name if name is not None else key_to_bytes(key))
        self.removed_hashes(medium, hashes)

    def removed_hashes(self, medium: Medium, hashes: Sequence[BlockHash]) -> None:
        """Chunks named by their hashes left ``medium`` (what ``kvstore gc`` and ``verify`` know of them)."""
        if hashes:
            self._publish(
                [
                    BlockRemoved(
                        block_hashes=list(hashes),
                        medium=medium.medium,
                        locality=medium.locality,
                        ownership=OWNERSHIP,
                    )
                ]
            )

    def _stored(self, medium: Medium, key: ChunkKey) -> BlockStored:
        identity = self.identity(key)
        if identity is None:
            return BlockStored(
                block_hashes=[key_to_bytes(key)],
                parent_block_hash=None,
                token_ids=[],
                block_size=self.chunk_tokens,
                lora_id=None,
                medium=medium.medium,
                lora_name=None,
                locality=medium.locality,
                ownership=OWNERSHIP,
            )
        return BlockStored(
            block_hashes=[identity.block_hash],
            parent_block_hash=identity.parent_block_hash,
            token_ids=list(identity.token_ids),
            block_size=self.chunk_tokens,
            lora_id=identity.lora_id,
            medium=medium.medium,
            lora_name=identity.lora_name,
            extra_keys=[identity.extra_keys] if identity.extra_keys is not None else None,
            locality=medium.locality,
            ownership=OWNERSHIP,
        )
