"""The errors kvstore defines, under one root: ``except kvstore.KVStoreError`` catches every one of them.

Each also derives from the built-in kind that says what happened, where one fits, so code written
against the built-ins keeps working: bad input is a ``ValueError``, a wait that ran out is a
``TimeoutError``, something that cannot be used now is a ``RuntimeError``. (A programming error,
such as opening a store twice or passing a tensor of the wrong shape, raises the built-in kind.)

Most errors about stored objects never reach an engine: the tier (:mod:`kvstore.storage.tier`)
turns a corrupt, foreign or undecodable object into a counted miss. They are public so that
tools (``kvstore verify``) and third-party backends and codecs can raise and catch them.
"""

from __future__ import annotations


class KVStoreError(Exception):
    """The root of every error kvstore raises on purpose."""


# -- using the store ------------------------------------------------------------------------------


class ConfigError(KVStoreError, ValueError):
    """A configuration value is missing, unknown or invalid; the message says which and how to fix it."""


class StoreClosedError(KVStoreError, RuntimeError):
    """The store was used before ``open()`` or after ``close()``."""


class PrefetchError(KVStoreError, RuntimeError):
    """A layer of a layer stream could not be loaded (and nor can any later one): recompute the prefix.

    ``chunk``: the index (in the stream's keys) of the first chunk that failed, when known; the
    chunks before it were sound, so an engine may keep them and recompute from there. ``layer``:
    the layer that failed, when known.
    """

    def __init__(self, *args: object, chunk: int | None = None, layer: int | None = None) -> None:
        super().__init__(*args)
        self.chunk, self.layer = chunk, layer


class LayerTimeout(PrefetchError, TimeoutError):
    """A layer did not arrive within the time an engine thread allowed it (``SyncLayerStream.wait_layer``)."""


class TierTimeout(KVStoreError, TimeoutError):
    """A tier operation ran past its configured timeout (counted; the caller treats it as a miss)."""


class TierSkipped(TierTimeout):
    """A tier operation was not attempted: the tier's circuit breaker is open (counted; a miss, as after a timeout).

    A :class:`TierTimeout` because the caller's answer is the same: the tier did not answer in time.
    """


# -- stored objects (a tier turns these into counted misses) --------------------------------------


class ChunkFormatError(KVStoreError):
    """A stored object is not a valid chunk for this key and layout. Callers treat it as a miss."""


class ForeignChunkError(ChunkFormatError):
    """A valid chunk this store cannot open (another encryption key, or encryption on one side only).

    A miss like any other, but the object is someone else's, not damaged: it is left in place.
    """


class CodecError(KVStoreError, ValueError):
    """Encoded bytes that a codec cannot decode (the container turns it into a miss)."""


class DecryptionError(KVStoreError):
    """A segment failed authentication: tampered, or sealed under another key or for another place."""


# -- servers and files ----------------------------------------------------------------------------


class S3BackendError(KVStoreError, RuntimeError):
    """The bucket cannot be used (absent, forbidden, unreachable); the message names bucket and endpoint."""


class BucketMissing(S3BackendError):
    """The bucket does not exist, and this backend was not allowed to create it."""


class TraceFormatError(KVStoreError, ValueError):
    """A file is not a readable kvstore trace."""


class ServerError(KVStoreError, RuntimeError):
    """A dev server could not be found or started; the message says what to install."""
