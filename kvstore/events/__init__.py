"""KV events for cache-aware routers: vLLM's wire format, from every tier (see the events page).

- :mod:`kvstore.events.wire`: the messages (``KVEventBatch`` of ``BlockStored`` / ``BlockRemoved`` /
  ``AllBlocksCleared``), byte-compatible with ``vllm.distributed.kv_events``;
- :mod:`kvstore.events.publisher`: the ZeroMQ publisher (PUB socket, replay ROUTER socket);
- :mod:`kvstore.events.chunk_events`: what the DRAM pool and the tiers report, turned into events.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvstore.config import EventsConfig
from kvstore.events.chunk_events import (
    DRAM_MEDIUM,
    NO_EVENTS,
    ChunkEvents,
    ChunkIdentity,
    Medium,
    NoEvents,
    TierEvents,
)

if TYPE_CHECKING:
    from kvstore.events.publisher import EventPublisher

__all__ = [
    "DRAM_MEDIUM",
    "NO_EVENTS",
    "ChunkEvents",
    "ChunkIdentity",
    "Medium",
    "NoEvents",
    "TierEvents",
    "open_publisher",
]


def open_publisher(config: EventsConfig, model: str, *, endpoint: str | None = None) -> EventPublisher:
    """A publisher on ``config``'s sockets (``endpoint`` instead of ``config.endpoint`` if given).

    ``model``: the topic's ``{model}`` where ``config.model`` is unset. Raises ConfigError when a
    socket cannot be opened.
    """
    from kvstore.events.publisher import EventPublisher, offset_port

    rank = config.data_parallel_rank
    return EventPublisher(
        offset_port(endpoint or config.endpoint, rank),
        replay_endpoint=offset_port(config.replay_endpoint, rank) if config.replay_endpoint else None,
        topic=config.resolved_topic(model),
        data_parallel_rank=rank,
        buffer_batches=config.buffer_batches,
        flush_interval=config.flush_interval,
    )
