"""vLLM's KV-event wire format, byte for byte: msgpack ``KVEventBatch`` messages of tagged events.

These structs mirror ``vllm.distributed.kv_events`` of vLLM 0.33 (0.32's, and ``BlockStored``'s
``lookahead_token_ids``): the same field names, order, defaults and msgspec options, so a batch
encoded here decodes with vLLM's own ``msgspec.msgpack.Decoder(KVEventBatch)`` into vLLM's
classes, and consumers of vLLM's events (llm-d's kv-cache-manager, Dynamo's router) read
kvstore's without a change. A batch is byte for byte 0.33's; 0.32's decoder reads it into the same
events (fields at their default are left out of the map, and the one 0.32 lacks is skipped where
set). The test suite checks both directions against the installed vLLM (0.32) and 0.33's structs.

A batch is an array ``[ts, events, data_parallel_rank]``; each event a map whose ``type`` is
its class name (``BlockStored``, ``BlockRemoved``, ``AllBlocksCleared``), fields at their
default left out. A block hash is ``bytes`` or ``int`` (vLLM's ``ExternalBlockHash``).
"""

from __future__ import annotations

from typing import Any

import msgspec

BlockHash = bytes | int  # vLLM's ExternalBlockHash

# Media: vLLM's names where one exists (GPU, CPU, STORAGE); kvstore's remote tiers name themselves.
MEDIUM_CPU = "CPU"
MEDIUM_STORAGE = "STORAGE"
LOCAL = "LOCAL"
REMOTE = "REMOTE"


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):  # type: ignore[call-arg]
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):  # type: ignore[call-arg]
    """Base class of the events (tagged: each is a map with ``type`` = its class name)."""


class BlockStored(KVCacheEvent):
    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: list[list[int]] | None = None  # vLLM 0.33: tokens past each block used in its hash


class BlockRemoved(KVCacheEvent):
    block_hashes: list[BlockHash]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared
_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(KVEventBatch)


def encode_batch(batch: KVEventBatch) -> bytes:
    return _encoder.encode(batch)


def decode_batch(payload: bytes) -> KVEventBatch:
    """A batch from its payload (msgspec.ValidationError or DecodeError for anything else)."""
    return _decoder.decode(payload)
