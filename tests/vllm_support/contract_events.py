"""kvstore's KV events are vLLM's, byte for byte (run under vLLM's environment by tests/test_vllm_events.py)."""

from __future__ import annotations

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


def batches(module):
    return module.KVEventBatch(
        ts=1764288000.25,
        events=[module.BlockStored(**STORED), module.BlockRemoved(**REMOVED), module.AllBlocksCleared()],
        data_parallel_rank=0,
    )


def test_a_batch_encodes_to_the_same_bytes_as_vllms():
    encoder = msgspec.msgpack.Encoder()
    assert wire.encode_batch(batches(wire)) == encoder.encode(batches(vllm_events))


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
    ours, theirs = getattr(wire, name), getattr(vllm_events, name)
    assert ours.__struct_fields__ == theirs.__struct_fields__
    assert ours.__struct_defaults__ == theirs.__struct_defaults__
    for option in ("array_like", "omit_defaults", "tag", "tag_field"):
        assert getattr(ours.__struct_config__, option) == getattr(theirs.__struct_config__, option), option
