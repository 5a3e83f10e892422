"""A layer stream's outputs: their kind is decided once from what the caller gave, and a chunk's share of a
layer is the same memory whether it is written as a tensor or read into as bytes."""

from __future__ import annotations

import torch

from kvstore import KVLayout
from kvstore.engine.streams.outputs import LayerOutputs, OutputKind, output_kind
from kvstore.engine.transfer import DeviceTransfers

LAYOUT = KVLayout(num_layers=4, num_kv_heads=2, head_dim=8, chunk_tokens=4, dtype=torch.bfloat16)
CHUNKS = 3
SHAPE = (LAYOUT.kv_planes, CHUNKS * LAYOUT.chunk_tokens, LAYOUT.num_kv_heads, LAYOUT.head_dim)


def test_the_kind_of_outputs_follows_what_the_caller_gave() -> None:
    contiguous = [torch.zeros(SHAPE, dtype=LAYOUT.dtype) for _ in range(2)]
    strided = [torch.zeros(SHAPE[1], SHAPE[0], *SHAPE[2:], dtype=LAYOUT.dtype).transpose(0, 1) for _ in range(2)]
    transfers = DeviceTransfers()
    assert output_kind(None, transfers) is OutputKind.HOST  # the stream's own tensors: staged and promoted
    assert output_kind(contiguous, transfers) is OutputKind.HOST_IN_PLACE
    assert output_kind(strided, transfers) is OutputKind.HOST
    assert output_kind([contiguous[0], strided[1]], transfers) is OutputKind.HOST, "every output must allow it"
    assert output_kind(contiguous, DeviceTransfers(host_as_device=True)) is OutputKind.DEVICE


def test_a_chunks_planes_as_bytes_are_its_share_of_the_layer() -> None:
    outs = [torch.zeros(SHAPE, dtype=LAYOUT.dtype) for _ in range(2)]  # a ring of two
    outputs = LayerOutputs(outs, SHAPE, LAYOUT, DeviceTransfers(), None)
    assert outputs.kind is OutputKind.HOST_IN_PLACE and outputs.ring == 2
    run = outputs.run(1, 2, CHUNKS)
    assert run.layers[0] is outs[1] and run.layers[1] is outs[0]  # layer i in outs[i % ring]
    for j in range(run.count):
        for chunk in range(CHUNKS):
            value = torch.full((), 10 * j + chunk + 1, dtype=LAYOUT.dtype)
            for plane in run.planes(chunk, j):
                plane[:] = value.view(torch.int16).numpy().tobytes() * (len(plane) // 2)
            assert bool((run.share(chunk, j) == value).all()), (j, chunk)
    assert run.complete_before(2) == [outs[1]]
