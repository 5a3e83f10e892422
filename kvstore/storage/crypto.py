"""Encryption at rest: AES-GCM per layer segment, so a layer stays readable (and checkable) alone.

Each segment is stored as ``nonce (12 bytes) || ciphertext || tag (16 bytes)``. The associated
data binds it to its chunk key, layer index and model layout, so a segment moved to another
chunk or layer fails authentication instead of decoding. The header carries a key id (not the
key): a chunk written under another key is recognised as foreign and left alone, not deleted.
Nonces are random; NIST's bound for random 96-bit nonces (2^32 encryptions per key) is about
130 million Llama-sized chunks: rotate keys well before that.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import struct

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from kvstore.errors import DecryptionError
from kvstore.util.buffers import Buffer

NONCE_BYTES = 12
TAG_BYTES = 16
OVERHEAD = NONCE_BYTES + TAG_BYTES
KEY_ID_BYTES = 8


class ChunkCipher:
    """Seals and opens layer segments under one key."""

    def __init__(self, key: bytes) -> None:
        self._aead = AESGCM(key)
        self.key_id = hmac.new(key, b"kvstore key id v1", hashlib.sha256).digest()[:KEY_ID_BYTES]

    def __repr__(self) -> str:
        return f"ChunkCipher(key_id={self.key_id.hex()})"

    def seal(self, plaintext: Buffer, associated: bytes) -> bytes:
        nonce = os.urandom(NONCE_BYTES)
        return nonce + self._aead.encrypt(nonce, plaintext, associated)

    def open(self, stored: Buffer, associated: bytes) -> bytes:
        view = memoryview(stored).cast("B")
        if len(view) < OVERHEAD:
            raise DecryptionError("segment shorter than a nonce and tag")
        try:
            return self._aead.decrypt(view[:NONCE_BYTES], view[NONCE_BYTES:], associated)
        except InvalidTag:
            raise DecryptionError("segment failed authentication (tampered, or another key)") from None


def associated_data(key_bytes: bytes, layer: int, fingerprint: bytes) -> bytes:
    """What a segment is bound to: its chunk, its layer, its model layout."""
    return key_bytes + struct.pack("<I", layer) + fingerprint
