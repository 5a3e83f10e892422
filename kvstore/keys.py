"""Chunk keys: a prefix-hash chain, stable across processes, restarts and machines.

key_i = SHA-256(key_{i-1} || tokens of chunk i || extra), seeded by the namespace (model
name), the layout fingerprint and an optional tenant salt. Two prompts share key_i exactly
when they share their first (i+1) chunks of tokens, so a prefix lookup is a walk down the
list. Python's ``hash()`` is never used: it is salted per process.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import struct
from collections.abc import Sequence
from typing import TypeAlias

import numpy as np
import torch

from kvstore.layout import KVLayout

ChunkKey: TypeAlias = str
"""64 lowercase hex characters (a SHA-256 digest)."""

KEY_BYTES = 32
DEFAULT_NAMESPACE = "default"
"""The namespace directory of a backend opened without one (tests, benchmarks)."""
_CHAIN_TAG = b"kvstore-chain-v1\x00"
_HEX_DIGITS = frozenset("0123456789abcdef")


def _token_array(token_ids: Sequence[int] | np.ndarray | torch.Tensor) -> np.ndarray:
    if isinstance(token_ids, torch.Tensor):
        if token_ids.dtype.is_floating_point or token_ids.dtype.is_complex or token_ids.dtype == torch.bool:
            # Checked here: .numpy() itself fails with a TypeError on bfloat16.
            raise ValueError(f"token_ids must be integers, got dtype {token_ids.dtype}")
        token_ids = token_ids.detach().cpu().numpy()
    array = np.asarray(token_ids)
    if array.ndim != 1:
        raise ValueError(f"token_ids must be one-dimensional, got shape {array.shape}")
    if array.size and not np.issubdtype(array.dtype, np.integer):
        raise ValueError(f"token_ids must be integers, got dtype {array.dtype}")
    # One fixed byte order and width, whatever the caller's platform or dtype.
    return array.astype("<i8", copy=False)


def namespace_seed(layout: KVLayout, namespace: str, salt: bytes | str | None = None) -> bytes:
    """The chain's starting value. A secret salt makes one tenant's keys unguessable to another."""
    if isinstance(salt, str):
        salt = salt.encode()
    message = _CHAIN_TAG + namespace.encode() + b"\x00" + layout.fingerprint
    return hmac.new(salt or b"", message, hashlib.sha256).digest()


def chunk_keys(
    token_ids: Sequence[int] | np.ndarray | torch.Tensor,
    layout: KVLayout,
    namespace: str,
    salt: bytes | str | None = None,
    extra: bytes | None = None,
) -> list[ChunkKey]:
    """One key per *full* chunk of ``layout.chunk_tokens`` tokens; a trailing partial chunk has none.

    ``extra`` folds in whatever else changes the KV for the same tokens (a LoRA adapter id,
    an image hash): the same bytes must be given for every lookup of that prefix.
    """
    tokens = _token_array(token_ids)
    size = layout.chunk_tokens
    extra_block = struct.pack("<Q", len(extra)) + extra if extra else b""
    previous = namespace_seed(layout, namespace, salt)
    keys: list[ChunkKey] = []
    for start in range(0, len(tokens) - size + 1, size):
        digest = hashlib.sha256(previous)
        digest.update(tokens[start : start + size].tobytes())
        digest.update(extra_block)
        previous = digest.digest()
        keys.append(previous.hex())
    return keys


def chain_parents(keys: Sequence[ChunkKey], before: ChunkKey | None = None) -> list[ChunkKey | None]:
    """The parent of each of ``keys``, consecutive chunks of one prefix: ``before`` (the key of the chunk
    before ``keys[0]``, None if it is the prefix's first), then ``keys[0]``, ..., ``keys[-2]``.

    For ``put_many(keys, kvs, parents=chain_parents(keys, before))``: with ``all_keys = chunk_keys(...)``
    and a slice ``all_keys[i:j]`` to store, ``before`` is ``all_keys[i - 1]`` (None when ``i`` is 0).
    """
    return [before, *keys[:-1]] if keys else []


def key_to_bytes(key: ChunkKey) -> bytes:
    """Validate a key and return its 32 raw bytes (as stored in chunk headers)."""
    # bytes.fromhex alone would skip whitespace ("00 11..." gives fewer than 32 bytes).
    if not isinstance(key, str) or len(key) != 2 * KEY_BYTES or not set(key) <= _HEX_DIGITS:
        problem = f"a chunk key is {2 * KEY_BYTES} lowercase hex characters (see chunk_keys), got {_shown(key)}"
        raise ValueError(problem)
    return bytes.fromhex(key)


def _shown(value: object, limit: int = 64) -> str:
    """``value``'s repr, cut to about ``limit`` characters with its length: a 1 MB key makes a short message."""
    text = repr(value)
    if len(text) <= limit + 16:
        return text
    size = f"{len(value)} characters" if isinstance(value, str) else f"repr of {len(text)} characters"
    return f"{text[:limit]}... ({size})"


_PLAIN_NAMESPACE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
_NOT_PLAIN = re.compile(r"[^A-Za-z0-9._-]+")


def namespace_dir(namespace: str) -> str:
    """The namespace as it appears in object names: a directory, an S3 prefix, a Redis key part.

    Stored objects carry it so operators can list, bound and delete one model's cache
    (``kvstore ls``, ``kvstore gc --namespace``) without reading any object. A plain name
    (letters, digits, ``._-``, up to 64) is kept as it is; any other is made readable and
    suffixed with ``~`` and 12 hex digits of its SHA-256, so two names never share a directory
    (``~`` never occurs in a plain name). The tenant salt is not part of it: it stays secret.
    """
    if _PLAIN_NAMESPACE.fullmatch(namespace):
        return namespace
    readable = _NOT_PLAIN.sub("-", namespace).strip("-._")[:48] or "ns"
    return f"{readable}~{hashlib.sha256(namespace.encode()).hexdigest()[:12]}"


def is_namespace_dir(name: str) -> bool:
    """Whether ``name`` could be a :func:`namespace_dir` (listings skip anything else)."""
    return bool(_NAMESPACE_DIR.fullmatch(name))


_NAMESPACE_DIR = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}|[A-Za-z0-9][A-Za-z0-9._-]{0,47}~[0-9a-f]{12}")
