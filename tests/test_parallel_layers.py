"""One chunk's layers encoded and decoded over the tier's idle I/O threads.

The parallel path must give the same bytes as the serial one, decode bit-exact, report a corrupt
layer as before, and never deadlock however small or busy the pool it shares with its caller.
No test here depends on timing: where a helper thread has to run, the test waits for it on an
event (a failure, if it never runs, after a generous bound), never on a clock.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from kvstore import ChunkFormatError, KVLayout, chunk_keys
from kvstore.codecs import make_codec
from kvstore.storage import container
from kvstore.storage.container import PARALLEL_MIN_BYTES, decode_chunk, encode_chunk, parse_header
from kvstore.storage.crypto import ChunkCipher
from kvstore.util.buffers import tensor_bytes
from kvstore.util.threads import map_with_helpers, usable_cores

SMOLLM2 = KVLayout(num_layers=30, num_kv_heads=3, head_dim=64, dtype=torch.bfloat16)  # 5.9 MB chunks
KEY = chunk_keys(list(range(256)), SMOLLM2, "parallel-layers")[0]
BOUND = 120  # seconds: only reached if a thread that must run never does (a hang, reported as a failure)


@pytest.fixture(scope="module")
def chunk(real_kv: torch.Tensor) -> torch.Tensor:
    """The first 256 tokens of the real SmolLM2 KV sample: one chunk of SMOLLM2."""
    return real_kv[:, :, :256].contiguous()


@pytest.fixture
def pool():
    with ThreadPoolExecutor(4, thread_name_prefix="test-io") as executor:
        yield executor


def joined(parts) -> bytes:
    return b"".join(bytes(part) for part in parts)


def test_the_real_layout_is_big_enough_to_go_parallel():
    assert SMOLLM2.chunk_nbytes >= PARALLEL_MIN_BYTES


@pytest.mark.parametrize("codec", ["byteplanes", "bytesplit+lz4", "zstd", "fp8+zstd", "int8+zstd", "int4", "identity"])
def test_parallel_encode_gives_the_serial_bytes_and_decodes_the_same(chunk, pool, codec, monkeypatch):
    pipeline = make_codec(codec)
    serial = joined(encode_chunk(SMOLLM2, KEY, tensor_bytes(chunk), pipeline))
    spread: list[int] = []  # chunks whose layers went through map_with_helpers with the pool

    def spy(fn, count, executor, helpers):
        spread.append(count)
        assert executor is pool
        return map_with_helpers(fn, count, executor, helpers)

    monkeypatch.setattr(container, "map_with_helpers", spy)
    parallel = joined(pool.submit(encode_chunk, SMOLLM2, KEY, tensor_bytes(chunk), pipeline, None, pool).result(BOUND))
    assert parallel == serial
    serial_out, parallel_out = torch.empty_like(chunk), torch.empty_like(chunk)
    decode_chunk(serial, SMOLLM2, KEY, tensor_bytes(serial_out))
    pool.submit(decode_chunk, parallel, SMOLLM2, KEY, tensor_bytes(parallel_out), None, pool).result(BOUND)
    assert torch.equal(parallel_out.view(torch.int16), serial_out.view(torch.int16))
    if pipeline.lossless:
        assert torch.equal(parallel_out.view(torch.int16), chunk.view(torch.int16))
    # identity stays zero-copy and serial (its layers are views of the chunk); every other codec
    # spreads one run of layers per usable core (one run alone is not spread)
    runs = min(SMOLLM2.num_layers, usable_cores())
    assert spread == ([] if pipeline.is_identity or runs == 1 else [runs, runs])


def test_parallel_encode_with_encryption_decodes_bit_exact(chunk, pool):
    cipher = ChunkCipher(os.urandom(32))
    parts = pool.submit(encode_chunk, SMOLLM2, KEY, tensor_bytes(chunk), make_codec("byteplanes"), cipher, pool)
    data = joined(parts.result(BOUND))
    out = torch.empty_like(chunk)
    pool.submit(decode_chunk, data, SMOLLM2, KEY, tensor_bytes(out), cipher, pool).result(BOUND)
    assert torch.equal(out.view(torch.int16), chunk.view(torch.int16))


@pytest.mark.parametrize("layer", [0, 17, 29])
def test_a_corrupt_layer_is_a_format_error_in_parallel_too(chunk, pool, layer):
    data = bytearray(joined(encode_chunk(SMOLLM2, KEY, tensor_bytes(chunk), make_codec("byteplanes"))))
    header = parse_header(data, SMOLLM2, KEY)
    data[header.header_len + header.segments[layer].offset + 5] ^= 0x40
    future = pool.submit(decode_chunk, bytes(data), SMOLLM2, KEY, tensor_bytes(torch.empty_like(chunk)), None, pool)
    with pytest.raises(ChunkFormatError, match=f"layer {layer} failed its checksum"):
        future.result(BOUND)


def test_no_deadlock_when_the_caller_holds_the_only_worker(chunk):
    """A pool of one: the helpers queue behind the caller itself, which then encodes every layer alone."""
    pipeline = make_codec("byteplanes")
    serial = joined(encode_chunk(SMOLLM2, KEY, tensor_bytes(chunk), pipeline))
    with ThreadPoolExecutor(1) as single:
        parts = single.submit(encode_chunk, SMOLLM2, KEY, tensor_bytes(chunk), pipeline, None, single).result(BOUND)
        assert joined(parts) == serial
        out = torch.empty_like(chunk)
        single.submit(decode_chunk, serial, SMOLLM2, KEY, tensor_bytes(out), None, single).result(BOUND)
    assert torch.equal(out.view(torch.int16), chunk.view(torch.int16))


def test_no_deadlock_when_every_worker_decodes_a_chunk_at_once(chunk):
    data = joined(encode_chunk(SMOLLM2, KEY, tensor_bytes(chunk), make_codec("byteplanes")))
    outs = [torch.empty_like(chunk) for _ in range(6)]
    with ThreadPoolExecutor(2) as small:
        futures = [small.submit(decode_chunk, data, SMOLLM2, KEY, tensor_bytes(out), None, small) for out in outs]
        for future in futures:
            future.result(BOUND)
    for out in outs:
        assert torch.equal(out.view(torch.int16), chunk.view(torch.int16))


# -- map_with_helpers itself -------------------------------------------------------------------


def test_map_with_helpers_runs_each_item_once_in_order(pool):
    calls: list[int] = []
    lock = threading.Lock()

    def square(item: int) -> int:
        with lock:
            calls.append(item)
        return item * item

    assert map_with_helpers(square, 50, pool, 3) == [i * i for i in range(50)]
    assert sorted(calls) == list(range(50))
    assert map_with_helpers(square, 1, pool, 3) == [0]
    assert map_with_helpers(square, 0, pool, 3) == []


def test_a_free_worker_really_helps(pool):
    """The caller's first item waits until another thread has run an item: only a helper can."""
    caller = threading.get_ident()
    helped = threading.Event()
    threads: dict[int, int] = {}

    def item(index: int) -> None:
        threads[index] = threading.get_ident()
        if threading.get_ident() != caller:
            helped.set()
        else:
            assert helped.wait(BOUND), "no helper ever ran, with 4 idle workers"

    map_with_helpers(item, 8, pool, 1)
    assert sorted(threads) == list(range(8))
    assert set(threads.values()) - {caller}, "every item ran in the calling thread"


def test_the_caller_does_everything_when_no_worker_is_free():
    caller_threads: set[int] = set()

    def caller_task() -> list[int]:
        me = threading.get_ident()

        def item(index: int) -> int:
            caller_threads.add(threading.get_ident())
            return index

        result = map_with_helpers(item, 10, single, 4)
        assert caller_threads == {me}
        return result

    with ThreadPoolExecutor(1) as single:
        assert single.submit(caller_task).result(BOUND) == list(range(10))


def test_an_error_is_raised_once_no_item_is_running(pool):
    running = 0
    lock = threading.Lock()

    def item(index: int) -> None:
        nonlocal running
        with lock:
            running += 1
        try:
            if index == 3:
                raise ValueError("item 3 is bad")
        finally:
            with lock:
                running -= 1

    with pytest.raises(ValueError, match="item 3 is bad"):
        map_with_helpers(item, 40, pool, 3)
    assert running == 0


def test_a_shut_down_executor_leaves_the_caller_to_do_it_alone():
    executor = ThreadPoolExecutor(2)
    executor.shutdown()
    assert map_with_helpers(lambda item: item + 1, 5, executor, 3) == [1, 2, 3, 4, 5]
