"""The two ways kvstore copies CPU memory keep every bit, and the one chosen per block size is the measured faster."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvstore.util import copy_kernels
from kvstore.util.buffers import copy_between
from kvstore.util.copy_kernels import (
    MEMMOVE,
    SMALLEST_MEASURED,
    TRIAL_COPIES,
    VECTOR,
    KernelChoice,
    contiguous_block,
    copy_array,
    copy_memmove,
    copy_vector_loop,
)

RANDOM = np.random.default_rng(7)


def random_bits(shape: tuple[int, ...], dtype: str) -> np.ndarray:
    """Every bit pattern of ``dtype`` equally likely (negative values, and for bf16 NaNs with payloads too)."""
    return RANDOM.integers(0, 256, size=(*shape, np.dtype(dtype).itemsize), dtype=np.uint8).view(dtype)[..., 0]


@pytest.mark.parametrize("kernel", [copy_memmove, copy_vector_loop])
@pytest.mark.parametrize("dtype", ["u1", "i2", "i4", "i8"])
def test_each_kernel_copies_every_bit_contiguous_or_into_a_strided_place(kernel, dtype) -> None:
    source = random_bits((4, 2, 96, 8), dtype)
    target = np.zeros_like(source)
    kernel(target, source)
    assert np.array_equal(target.view(np.uint8), source.view(np.uint8))
    wide = np.zeros((2, 3 * 96, 8), dtype=dtype)  # a layer output: this chunk's tokens in the middle
    place = wide[:, 96:192]
    kernel(place, source[1])
    assert np.array_equal(place.view(np.uint8), source[1].view(np.uint8))
    assert not wide[:, :96].any() and not wide[:, 192:].any()  # nothing written outside the place


def test_a_block_is_the_run_contiguous_in_both_arrays() -> None:
    chunk = np.zeros((32, 2, 256, 8, 128), dtype="i2")
    assert contiguous_block(chunk, chunk) == chunk.nbytes
    wide = np.zeros((2, 16 * 256, 8, 128), dtype="i2")
    place = wide[:, 256:512]
    assert contiguous_block(place, chunk[0]) == 256 * 8 * 128 * 2  # one plane of one chunk's layer
    assert contiguous_block(chunk[:1], chunk[:1]) == chunk.nbytes // 32  # a dimension of 1 breaks nothing


def test_the_vector_loop_is_kept_only_where_its_trials_were_clearly_faster() -> None:
    choice = KernelChoice()
    tried: dict[int, list[str]] = {0: [], 1: []}
    for _ in range(2 * TRIAL_COPIES):
        for size_class, vector_time in ((0, 0.85), (1, 0.95)):  # seconds per byte, memmove's being 1.0
            kernel = choice.next_trial(size_class)
            tried[size_class].append(kernel)
            choice.record(size_class, kernel, 1.0 if kernel == MEMMOVE else vector_time)
    assert tried[0] == tried[1] == [MEMMOVE, VECTOR] * TRIAL_COPIES  # in turn, memmove first
    assert choice.chosen == {0: VECTOR, 1: MEMMOVE}  # 15% faster is kept; 5% is within the margin
    choice.record(1, VECTOR, 0.01)
    assert choice.chosen[1] == MEMMOVE  # a choice, once made, stays
    assert choice.describe() == "vector for blocks of 64.0 KiB to 256.0 KiB; memmove for blocks of 256.0 KiB to 1.0 MiB"


def test_copies_stay_exact_while_a_size_class_is_tried_and_after_it_is_chosen(monkeypatch) -> None:
    choice = KernelChoice()
    monkeypatch.setattr(copy_kernels, "CHOICE", choice)
    small = random_bits((SMALLEST_MEASURED // 2 - 1,), "i2")  # under the smallest measured block: memmove, untimed
    copy_array(np.empty_like(small), small)
    assert choice.chosen == {} and choice.next_trial(0) == MEMMOVE
    for _ in range(2 * TRIAL_COPIES + 2):
        source = random_bits((SMALLEST_MEASURED,), "i2")  # 128 KiB: the first size class
        target = np.empty_like(source)
        copy_array(target, source)
        assert np.array_equal(target, source)
    assert set(choice.chosen) == {0}


def test_copy_between_copies_bf16_chunks_bit_for_bit_through_the_chosen_kernels() -> None:
    source = torch.from_numpy(random_bits((4, 2, 256, 8, 128), "i2")).view(torch.bfloat16)
    target = torch.empty_like(source)
    for _ in range(2 * TRIAL_COPIES + 1):
        target.zero_()
        copy_between(target, source)
        assert torch.equal(target.view(torch.int16), source.view(torch.int16))
