"""Where the disk tier's chunk files are: ``<namespace>/ab/cd/<key>.kvc`` below the tier's root.

The one naming rule that the tier's data path (:mod:`kvstore.backends.disk`), its scan at start
and its operator side (:mod:`kvstore.backends.disk_maintenance`) share. The namespace directory
(:func:`kvstore.keys.namespace_dir`) lets ``kvstore gc`` and ``ls`` work per model, and two levels
of 256 directories keep listings small. A chunk key is 8-128 lowercase hex characters; a file
whose name is not ``<key>.kvc`` (a temporary, anything foreign) is not a chunk.
"""

from __future__ import annotations

import re

SUFFIX = ".kvc"
_CHUNK_KEY = re.compile(r"[0-9a-f]{8,128}")


def relative_path(key: str, namespace: str) -> str:
    """The chunk file's path below the root (its name in the tier's index); ValueError for a malformed key."""
    if not _CHUNK_KEY.fullmatch(key):
        raise ValueError(f"disk keys are 8-128 lowercase hex characters, got {key!r}")
    return f"{namespace}/{key[:2]}/{key[2:4]}/{key}{SUFFIX}"


def chunk_key_of(file_name: str) -> str | None:
    """The chunk key a file name holds (``<key>.kvc``), or None if the file is not a chunk file."""
    if not file_name.endswith(SUFFIX):
        return None
    key = file_name[: -len(SUFFIX)]
    return key if _CHUNK_KEY.fullmatch(key) else None
