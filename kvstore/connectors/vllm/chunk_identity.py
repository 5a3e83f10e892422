"""The engine's names for kvstore's chunks, for KV events a router can join with vLLM's own.

vLLM hashes a request's tokens block by block (``request.block_hashes``, chained: each hash
covers every token before it, with the engine's hash function and seed, LoRA, multimodal
inputs and cache salt folded in) and publishes those hashes in its GPU events. kvstore keeps
chunks of ``chunk_tokens`` tokens and advertises each as one block of that size
(:mod:`kvstore.events.chunk_events`), named by the engine's hash of the chunk's last hash block:
the same hash, for the same prefix, as the engine's GPU event for that block. This is how vLLM
itself publishes a block that spans several hash blocks.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvstore.events import ChunkIdentity

if TYPE_CHECKING:
    from vllm.v1.request import Request


def chunk_identity(request: Request, chunk: int, chunk_tokens: int, hash_block_size: int) -> ChunkIdentity | None:
    """How the engine names chunk ``chunk`` of ``request``; None where vLLM has not hashed all its blocks."""
    from vllm.v1.core.kv_cache_utils import (
        generate_block_hash_extra_keys,
        maybe_convert_block_hash,
        to_event_extra_keys,
    )

    if chunk_tokens % hash_block_size:
        return None
    per_chunk = chunk_tokens // hash_block_size
    hashes = request.block_hashes
    last = (chunk + 1) * per_chunk - 1
    if last >= len(hashes):
        return None
    start, end = chunk * chunk_tokens, (chunk + 1) * chunk_tokens
    extra, _ = generate_block_hash_extra_keys(request, start, end, 0)
    event_extra = to_event_extra_keys([extra])
    lora = request.lora_request
    return ChunkIdentity(
        block_hash=maybe_convert_block_hash(hashes[last]),
        parent_block_hash=maybe_convert_block_hash(hashes[chunk * per_chunk - 1]) if chunk else None,
        token_ids=tuple(request.all_token_ids[start:end]),
        lora_id=lora.adapter_id if lora is not None else None,
        lora_name=lora.name if lora is not None else None,
        extra_keys=event_extra[0] if event_extra else None,
    )
