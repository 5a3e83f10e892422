# ---------------------------------------------------------------------------------------------
# Real KV sample for codec and container tests (test_codecs.py, test_format.py).
# ---------------------------------------------------------------------------------------------
from pathlib import Path as _Path

import numpy as _np
import pytest as _pytest
import torch as _torch

REAL_KV_PATH = _Path(__file__).resolve().parents[1].parent / "shared" / "kv_smollm2_512tok_bf16bits.npy"
REAL_KV_SHAPE = (30, 2, 512, 3, 64)  # [layer, k_or_v, token, kv_head, head_dim] of SmolLM2-135M


@_pytest.fixture(scope="session")
def real_kv() -> _torch.Tensor:
    """512 tokens of real SmolLM2-135M KV, bf16, shape [30, 2, 512, 3, 64]. Missing file = failure."""
    if not REAL_KV_PATH.is_file():
        _pytest.fail(
            f"the real KV sample {REAL_KV_PATH} is missing: codec and format tests need it "
            "(it lives in the shared/ folder beside the repository; see DESIGN.md)",
            pytrace=False,
        )
    bits = _np.load(REAL_KV_PATH)  # allow_pickle stays False: the file is plain data
    assert bits.dtype == _np.uint16 and bits.shape == REAL_KV_SHAPE, (bits.dtype, bits.shape)
    return _torch.from_numpy(bits).view(_torch.bfloat16)
