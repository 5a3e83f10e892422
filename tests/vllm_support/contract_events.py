"""kvstore's KV events are vLLM's, byte for byte (run under vLLM's environment by tests/test_vllm_events.py)."""

from __future__ import annotations

from types import SimpleNamespace

import msgspec
import pytest
from vllm.distributed import kv_events as vllm_events

from kvstore.events import wire

STORED = dict(
    block_hashes=[bytes(range(32))],
    parent_block_hash=123456789,
    token_ids=list(range(256)),
    block_size=256,
    lora_id=None,
    medium="CPU",
    lora_name="adapter-a",
    extra_keys=[("adapter-a", "salt-b")],
    locality="LOCAL",
    ownership="kvstore",
)
REMOVED = dict(block_hashes=[bytes(32), 2**63 + 5], medium="S3", locality="REMOTE", ownership="kvstore")


class BlockStored033(vllm_events.BlockStored, tag="BlockStored"):
    """vLLM 0.33's ``BlockStored``: 0.32's fields, then ``lookahead_token_ids`` (vllm 0.33.0,
    ``vllm/distributed/kv_events.py``, lines 95-98: its one change to the events' wire format)."""

    lookahead_token_ids: list[list[int]] | None = None


class KVEventBatch033(vllm_events.EventBatch):
    events: list[BlockStored033 | vllm_events.BlockRemoved | vllm_events.AllBlocksCleared]


VLLM_033 = SimpleNamespace(
    KVEventBatch=KVEventBatch033,
    BlockStored=BlockStored033,
    BlockRemoved=vllm_events.BlockRemoved,
    AllBlocksCleared=vllm_events.AllBlocksCleared,
)


def batches(module):
    return module.KVEventBatch(
        ts=1764288000.25,
        events=[module.BlockStored(**STORED), module.BlockRemoved(**REMOVED), module.AllBlocksCleared()],
        data_parallel_rank=0,
    )


def test_a_batch_encodes_to_the_same_bytes_as_vllm_033s():
    """Byte for byte 0.33's encoding. 0.32's differs in one header only (``BlockStored`` has one field less,
    so msgspec writes its map's length in one byte, not three); its decoder reads ours (below)."""
    encoder = msgspec.msgpack.Encoder()
    assert wire.encode_batch(batches(wire)) == encoder.encode(batches(VLLM_033))


def test_vllms_decoder_reads_kvstores_batch_into_vllms_classes():
    decoded = msgspec.msgpack.Decoder(vllm_events.KVEventBatch).decode(wire.encode_batch(batches(wire)))
    stored, removed, cleared = decoded.events
    assert isinstance(stored, vllm_events.BlockStored) and stored == vllm_events.BlockStored(**STORED)
    assert isinstance(removed, vllm_events.BlockRemoved) and removed == vllm_events.BlockRemoved(**REMOVED)
    assert isinstance(cleared, vllm_events.AllBlocksCleared)
    assert decoded.data_parallel_rank == 0


def test_kvstore_reads_vllms_batches():
    payload = msgspec.msgpack.Encoder().encode(batches(vllm_events))
    assert wire.decode_batch(payload) == batches(wire)


@pytest.mark.parametrize("name", ["BlockStored", "BlockRemoved", "AllBlocksCleared", "KVEventBatch", "EventBatch"])
def test_the_structs_have_vllms_fields_defaults_and_options(name):
    """vLLM 0.32's (installed), and 0.33's one more field of ``BlockStored`` (see :class:`BlockStored033`)."""
    ours, theirs = getattr(wire, name), {"BlockStored": BlockStored033}.get(name, getattr(vllm_events, name))
    assert ours.__struct_fields__ == theirs.__struct_fields__
    assert ours.__struct_defaults__ == theirs.__struct_defaults__
    for option in ("array_like", "omit_defaults", "tag", "tag_field"):
        assert getattr(ours.__struct_config__, option) == getattr(theirs.__struct_config__, option), option


def test_a_router_on_vllm_033_reads_kvstores_batches_and_kvstore_reads_its():
    lookahead = [[7, 8, 9]]
    ours = wire.KVEventBatch(ts=1.5, events=[wire.BlockStored(**STORED, lookahead_token_ids=lookahead)])
    decoded = msgspec.msgpack.Decoder(KVEventBatch033).decode(wire.encode_batch(ours))
    assert decoded.events == [BlockStored033(**STORED, lookahead_token_ids=lookahead)]
    theirs = KVEventBatch033(ts=1.5, events=[BlockStored033(**STORED, lookahead_token_ids=lookahead)])
    assert wire.decode_batch(msgspec.msgpack.Encoder().encode(theirs)) == ours
    # vLLM 0.32's decoder skips the field it does not know; without lookahead tokens the bytes are 0.32's.
    old = msgspec.msgpack.Decoder(vllm_events.KVEventBatch).decode(wire.encode_batch(ours))
    assert old.events == [vllm_events.BlockStored(**STORED)]
