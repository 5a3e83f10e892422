"""chunk_keys: a prefix-hash chain that names chunks the same way in every process and machine."""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore import KVLayout, chunk_keys
from kvstore.keys import KEY_BYTES, key_to_bytes, namespace_seed

REPO = Path(__file__).resolve().parents[1]
HEX_KEY = re.compile(r"[0-9a-f]{64}")

LAYOUT = KVLayout(num_layers=30, num_kv_heads=3, head_dim=64, dtype=torch.bfloat16)  # SmolLM2, 256 tokens
SMALL = KVLayout(num_layers=2, num_kv_heads=1, head_dim=4, chunk_tokens=4)


def tokens(n: int, seed: int = 0) -> list[int]:
    return np.random.default_rng(seed).integers(0, 50_000, size=n).tolist()


# ---------------------------------------------------------------------------------------------
# How many keys, and what they look like
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", [LAYOUT, SMALL], ids=["chunk256", "chunk4"])
@pytest.mark.parametrize("chunks, extra_tokens", [(0, 0), (0, 1), (1, -1), (1, 0), (1, 1), (2, 0), (3, -1), (5, 3)])
def test_one_key_per_full_chunk_and_none_for_the_partial_tail(layout, chunks, extra_tokens):
    n = max(0, chunks * layout.chunk_tokens + extra_tokens)
    keys = chunk_keys(tokens(n), layout, namespace="m")
    assert len(keys) == n // layout.chunk_tokens
    assert len(set(keys)) == len(keys)


def test_default_chunk_is_256_tokens():
    assert LAYOUT.chunk_tokens == 256
    assert len(chunk_keys(tokens(255), LAYOUT, "m")) == 0
    assert len(chunk_keys(tokens(256), LAYOUT, "m")) == 1
    assert len(chunk_keys(tokens(767), LAYOUT, "m")) == 2


def test_empty_prompt_has_no_keys():
    assert chunk_keys([], LAYOUT, "m") == []
    assert chunk_keys(np.array([], dtype=np.int64), LAYOUT, "m") == []
    assert chunk_keys(torch.tensor([], dtype=torch.long), LAYOUT, "m") == []


def test_keys_are_64_lowercase_hex_and_round_trip_through_bytes():
    keys = chunk_keys(tokens(4 * 256), LAYOUT, "m", salt="s", extra=b"x")
    assert len(keys) == 4
    for key in keys:
        assert isinstance(key, str)
        assert HEX_KEY.fullmatch(key), key
        raw = key_to_bytes(key)
        assert len(raw) == KEY_BYTES == 32
        assert raw.hex() == key


def test_the_tail_never_changes_the_keys_of_full_chunks():
    base = tokens(2 * 256 + 100)
    other_tail = base[:512] + tokens(100, seed=9)
    assert chunk_keys(base, LAYOUT, "m") == chunk_keys(other_tail, LAYOUT, "m") == chunk_keys(base[:512], LAYOUT, "m")


def test_identical_chunks_at_different_positions_get_different_keys():
    """It is a chain: the same 256 tokens after another prefix are another chunk."""
    keys = chunk_keys([7] * (4 * 256), LAYOUT, "m")
    assert len(set(keys)) == 4


# ---------------------------------------------------------------------------------------------
# The prefix property
# ---------------------------------------------------------------------------------------------


def test_keys_of_a_prefix_are_a_prefix_of_the_keys():
    full = tokens(6 * 256 + 17)
    all_keys = chunk_keys(full, LAYOUT, "m")
    assert len(all_keys) == 6
    for cut in (0, 1, 255, 256, 257, 511, 512, 1000, 1536, len(full)):
        assert chunk_keys(full[:cut], LAYOUT, "m") == all_keys[: cut // 256]


@settings(max_examples=60, deadline=None, database=None)
@given(
    prompt=st.lists(st.integers(0, 2**31 - 1), max_size=40),
    cut=st.integers(0, 40),
)
def test_prefix_property_holds_for_any_prompt(prompt, cut):
    all_keys = chunk_keys(prompt, SMALL, "m")
    assert len(all_keys) == len(prompt) // 4
    assert chunk_keys(prompt[:cut], SMALL, "m") == all_keys[: min(cut, len(prompt)) // 4]


@pytest.mark.parametrize("layout", [LAYOUT, SMALL], ids=["chunk256", "chunk4"])
@pytest.mark.parametrize("position", ["first", "middle", "last"])
def test_changing_a_token_in_chunk_i_changes_keys_from_i_on_only(layout, position):
    size, n_chunks = layout.chunk_tokens, 5
    base = tokens(n_chunks * size)
    before = chunk_keys(base, layout, "m")
    for i in range(n_chunks):
        offset = {"first": 0, "middle": size // 2, "last": size - 1}[position]
        changed = list(base)
        changed[i * size + offset] += 1
        after = chunk_keys(changed, layout, "m")
        assert after[:i] == before[:i], f"keys before chunk {i} must not change"
        for j in range(i, n_chunks):
            assert after[j] != before[j], f"key {j} must change when chunk {i} changes"


def test_chain_definition():
    """key_i = SHA-256(key_{i-1} || chunk i's tokens as little-endian int64 || len(extra) || extra)."""
    prompt = tokens(3 * 4)
    extra = b"lora-7"
    previous = namespace_seed(SMALL, "ns", "tenant")
    expected = []
    for start in range(0, len(prompt), 4):
        h = hashlib.sha256(previous)
        h.update(np.array(prompt[start : start + 4], dtype="<i8").tobytes())
        h.update(len(extra).to_bytes(8, "little") + extra)
        previous = h.digest()
        expected.append(previous.hex())
    assert chunk_keys(prompt, SMALL, "ns", salt="tenant", extra=extra) == expected


def test_golden_keys_never_change():
    """Persisted caches (disk, S3, Redis) are found by these keys: changing the derivation orphans
    every stored chunk, so it needs a new chain tag and a deliberate update of these values."""
    assert chunk_keys(list(range(512)), LAYOUT, "smollm2") == [
        "14ef3e26dbbe6ef97609cbaf959de40f5700057a65ea3586c07fca8fe4ffd99a",
        "a61daa3c78e92b821ff15a31fa0480175f6fbff9cf52b5ad9d98745cdf4d4c78",
    ]
    assert chunk_keys(list(range(8)), SMALL, "ns", salt="tenant", extra=b"lora-7") == [
        "27fc2be2886b3d520aba387b57ae9506e1b30aee00c567c1e9f5785006ce274b",
        "6d4a6ef6343be7c5d3bc6fb9881e81392ebe567e87016cf83e04ab43dace1d73",
    ]


# ---------------------------------------------------------------------------------------------
# What else goes into a key
# ---------------------------------------------------------------------------------------------

PROMPT = tokens(3 * 256)


def _all_differ(a: list[str], b: list[str]) -> bool:
    return len(a) == len(b) > 0 and all(x != y for x, y in zip(a, b, strict=False))


def test_namespace_changes_every_key():
    assert _all_differ(chunk_keys(PROMPT, LAYOUT, "model-a"), chunk_keys(PROMPT, LAYOUT, "model-b"))
    assert _all_differ(chunk_keys(PROMPT, LAYOUT, "m"), chunk_keys(PROMPT, LAYOUT, "m2"))
    assert _all_differ(chunk_keys(PROMPT, LAYOUT, ""), chunk_keys(PROMPT, LAYOUT, "m"))


def test_salt_changes_every_key_and_str_equals_its_utf8_bytes():
    plain = chunk_keys(PROMPT, LAYOUT, "m")
    tenant_a = chunk_keys(PROMPT, LAYOUT, "m", salt="tenant-a")
    tenant_b = chunk_keys(PROMPT, LAYOUT, "m", salt=b"tenant-b")
    assert _all_differ(plain, tenant_a)
    assert _all_differ(plain, tenant_b)
    assert _all_differ(tenant_a, tenant_b)
    assert chunk_keys(PROMPT, LAYOUT, "m", salt=b"tenant-a") == tenant_a
    assert chunk_keys(PROMPT, LAYOUT, "m", salt="tenant-a") == tenant_a  # deterministic


def test_extra_changes_every_key():
    plain = chunk_keys(PROMPT, LAYOUT, "m")
    lora1 = chunk_keys(PROMPT, LAYOUT, "m", extra=b"lora-1")
    lora2 = chunk_keys(PROMPT, LAYOUT, "m", extra=b"lora-2")
    assert _all_differ(plain, lora1)
    assert _all_differ(lora1, lora2)
    assert chunk_keys(PROMPT, LAYOUT, "m", extra=b"lora-1") == lora1


@pytest.mark.parametrize(
    "other",
    [
        KVLayout(num_layers=30, num_kv_heads=3, head_dim=64, dtype=torch.float16),
        KVLayout(num_layers=30, num_kv_heads=3, head_dim=64, dtype=torch.float32),
        KVLayout(num_layers=30, num_kv_heads=4, head_dim=64),
        KVLayout(num_layers=30, num_kv_heads=3, head_dim=128),
        KVLayout(num_layers=31, num_kv_heads=3, head_dim=64),
        KVLayout(num_layers=30, num_kv_heads=3, head_dim=64, kv_planes=1),
    ],
    ids=["fp16", "fp32", "heads", "head_dim", "layers", "mla"],
)
def test_another_layout_gives_other_keys(other):
    assert other.chunk_tokens == LAYOUT.chunk_tokens
    assert other.fingerprint != LAYOUT.fingerprint
    assert _all_differ(chunk_keys(PROMPT, LAYOUT, "m"), chunk_keys(PROMPT, other, "m"))


def test_equal_layouts_spelled_differently_give_the_same_keys():
    spelled = KVLayout(num_layers=30, num_kv_heads=3, head_dim=64, dtype="bfloat16")
    prefixed = KVLayout(num_layers=30, num_kv_heads=3, head_dim=64, dtype="torch.bfloat16")
    assert spelled.fingerprint == prefixed.fingerprint == LAYOUT.fingerprint
    assert chunk_keys(PROMPT, spelled, "m") == chunk_keys(PROMPT, prefixed, "m") == chunk_keys(PROMPT, LAYOUT, "m")


# ---------------------------------------------------------------------------------------------
# Input types
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "convert",
    [
        list,
        tuple,
        lambda t: np.array(t, dtype=np.int32),
        lambda t: np.array(t, dtype=np.int64),
        lambda t: np.array(t, dtype=np.uint32),
        lambda t: np.array(t, dtype=">i8"),  # big-endian
        lambda t: np.repeat(np.array(t, dtype=np.int64), 2)[::2],  # non-contiguous view
        lambda t: torch.tensor(t, dtype=torch.int32),
        lambda t: torch.tensor(t, dtype=torch.int64),
        lambda t: torch.tensor(t, dtype=torch.int64).repeat_interleave(2)[::2],  # non-contiguous tensor
        lambda t: [np.int64(x) for x in t],
    ],
    ids=[
        "list",
        "tuple",
        "np.int32",
        "np.int64",
        "np.uint32",
        "np.>i8",
        "np.strided",
        "torch.int32",
        "torch.int64",
        "torch.strided",
        "np.scalars",
    ],
)
def test_list_numpy_and_torch_inputs_give_identical_keys(convert):
    prompt = tokens(2 * 256 + 5)
    expected = chunk_keys(prompt, LAYOUT, "m")
    converted = convert(prompt)
    assert len(converted) == len(prompt)
    assert chunk_keys(converted, LAYOUT, "m") == expected


@pytest.mark.parametrize(
    "bad",
    [
        np.zeros((2, 256), dtype=np.int64),
        torch.zeros((1, 512), dtype=torch.long),
        [[1, 2, 3, 4], [5, 6, 7, 8]],
        np.int64(5),  # 0-d
    ],
    ids=["np-2d", "torch-2d", "nested-list", "scalar"],
)
def test_rejects_input_that_is_not_one_dimensional(bad):
    with pytest.raises(ValueError, match="one-dimensional"):
        chunk_keys(bad, SMALL, "m")


@pytest.mark.parametrize(
    "bad",
    [
        np.arange(512, dtype=np.float32),
        np.arange(512, dtype=np.float64),
        torch.arange(512, dtype=torch.float32),
        torch.arange(512, dtype=torch.bfloat16),
        [1.0, 2.0, 3.0, 4.0],
        [1, 2, 3, 4.5],
        np.ones(8, dtype=bool),
        torch.ones(8, dtype=torch.bool),
        ["1", "2", "3", "4"],
    ],
    ids=[
        "np.float32",
        "np.float64",
        "torch.float32",
        "torch.bfloat16",
        "float-list",
        "mixed-list",
        "np.bool",
        "torch.bool",
        "str",
    ],
)
def test_rejects_non_integer_input(bad):
    with pytest.raises(ValueError, match="integers"):
        chunk_keys(bad, SMALL, "m")


# ---------------------------------------------------------------------------------------------
# key_to_bytes
# ---------------------------------------------------------------------------------------------

GOOD_KEY = "0123456789abcdef" * 4


@pytest.mark.parametrize(
    "bad",
    [
        GOOD_KEY[:-1],  # 63 characters
        GOOD_KEY + "0",  # 65
        "",
        GOOD_KEY.upper(),
        "A" + GOOD_KEY[1:],
        "g" + GOOD_KEY[1:],
        "00" * 30 + "  " + "00",  # bytes.fromhex would skip the spaces and give 31 bytes
        "00" * 31 + " 0",
        "00" * 31 + "\n0",
        "0x" + GOOD_KEY[2:],
        "\u0660" + GOOD_KEY[1:],  # ARABIC-INDIC DIGIT ZERO
        GOOD_KEY.encode(),  # bytes, not str
        None,
        12345,
    ],
)
def test_key_to_bytes_rejects_malformed_keys(bad):
    with pytest.raises(ValueError, match="64 lowercase hex"):
        key_to_bytes(bad)


def test_key_to_bytes_accepts_every_hex_digit():
    assert key_to_bytes(GOOD_KEY) == bytes.fromhex(GOOD_KEY)
    assert key_to_bytes("f" * 64) == b"\xff" * 32


# ---------------------------------------------------------------------------------------------
# The same keys in every process
# ---------------------------------------------------------------------------------------------

_SUBPROCESS_SCRIPT = """
import json, sys
import numpy as np, torch
from kvstore import KVLayout, chunk_keys
spec = json.loads(sys.argv[1])
layout = KVLayout(num_layers=30, num_kv_heads=3, head_dim=64, dtype=torch.bfloat16)
out = {
    "list": chunk_keys(spec["tokens"], layout, "smollm2"),
    "numpy": chunk_keys(np.array(spec["tokens"], dtype=np.int32), layout, "smollm2", salt="tenant"),
    "torch": chunk_keys(torch.tensor(spec["tokens"]), layout, "smollm2", extra=b"lora"),
}
print(json.dumps(out))
"""


def test_keys_are_identical_across_processes_and_hash_seeds():
    prompt = tokens(3 * 256 + 10, seed=42)
    expected = {
        "list": chunk_keys(prompt, LAYOUT, "smollm2"),
        "numpy": chunk_keys(prompt, LAYOUT, "smollm2", salt="tenant"),
        "torch": chunk_keys(prompt, LAYOUT, "smollm2", extra=b"lora"),
    }
    assert all(len(keys) == 3 for keys in expected.values())
    runs = []
    for hash_seed in ("0", "12345", "random"):
        env = {k: v for k, v in os.environ.items() if not k.upper().startswith("KVSTORE_")}
        env["PYTHONHASHSEED"] = hash_seed
        runs.append(
            subprocess.Popen(
                [sys.executable, "-c", _SUBPROCESS_SCRIPT, json.dumps({"tokens": prompt})],
                cwd=REPO,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    try:
        for run in runs:
            stdout, stderr = run.communicate(timeout=120)
            assert run.returncode == 0, stderr
            assert json.loads(stdout) == expected
    finally:
        for run in runs:
            if run.poll() is None:
                run.kill()
                run.wait()
