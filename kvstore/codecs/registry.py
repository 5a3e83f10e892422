"""Codec stages by name: built in, registered in code, or found through an entry point.

A third-party package adds a stage without touching kvstore: it subclasses one of the stage
kinds in :mod:`kvstore.codecs.base` and declares the class in the ``kvstore.codecs`` entry-point
group under the codec's own name::

    [project.entry-points."kvstore.codecs"]
    delta = "kvstore_delta:DeltaCodec"

The group is read once, the first time a name is asked for that is not registered yet, and an
entry point is imported only when its own name is asked for: a broken plugin fails the
pipelines that name it, with an error naming the entry point, and no others. Code can also call
:func:`register_codec` directly.

A name is what chunk headers store (the pipeline id, ``"fp8+zstd:3"``), so it is lowercase
ASCII without ``+`` or ``:``, and once chunks are written under it, it must keep meaning the
same codec: a name cannot be registered twice.
"""

from __future__ import annotations

import importlib.metadata
import re
import threading
import warnings
from collections.abc import Iterable, Mapping
from types import MappingProxyType
from typing import TypeVar

from kvstore.codecs.base import Codec, stage_kind
from kvstore.codecs.bytesplit import ByteSplitCodec
from kvstore.codecs.fp8 import Fp8Codec
from kvstore.codecs.hadamard import HadamardCodec
from kvstore.codecs.identity import IdentityCodec
from kvstore.codecs.int4 import Int4Codec
from kvstore.codecs.int8 import Int8Codec
from kvstore.codecs.lz4 import Lz4Codec
from kvstore.codecs.pipeline import CodecPipeline
from kvstore.codecs.zstd import ZstdCodec

ENTRY_POINT_GROUP = "kvstore.codecs"
MAX_CODEC_NAME = 64  # of a whole pipeline name, as chunk headers store it
DEFAULT_REMOTE_CODEC = "bytesplit"

BUILTIN_CODECS: tuple[type[Codec], ...] = (IdentityCodec, ZstdCodec, Lz4Codec, ByteSplitCodec, Fp8Codec)
BUILTIN_CODECS += (Int8Codec, Int4Codec, HadamardCodec)  # lossy: group-wise integer codes, a rotation before them
CODECS: Mapping[str, type[Codec]] = MappingProxyType({codec.name: codec for codec in BUILTIN_CODECS})
"""The built-in stages by name; :func:`available_codecs` lists third-party ones too."""

_NAME = re.compile(r"[a-z][a-z0-9_.-]*")
C = TypeVar("C", bound=type[Codec])


def _qualname(obj: object) -> str:
    return f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', repr(obj))}"


def _describe(entry: importlib.metadata.EntryPoint) -> str:
    dist = f" (from {entry.dist.name} {entry.dist.version})" if entry.dist is not None else ""
    return f"'{entry.name} = {entry.value}'{dist}"


class CodecRegistry:
    """Stage classes by name, with the entry-point group read lazily, once."""

    def __init__(self, codecs: Iterable[type[Codec]] = BUILTIN_CODECS) -> None:
        self._codecs: dict[str, type[Codec]] = {}
        self._entry_points: dict[str, list[importlib.metadata.EntryPoint]] | None = None  # not read yet
        self._lock = threading.RLock()  # an entry point's module may call register_codec as it is imported
        for codec in codecs:
            self.register(codec)

    def register(self, codec: C) -> C:
        """Add a stage class under its ``name``; a name taken by another class is a ValueError."""
        stage_kind(codec)
        name = getattr(codec, "name", None)
        if not isinstance(name, str) or not _NAME.fullmatch(name) or len(name) > MAX_CODEC_NAME:
            raise ValueError(
                f"{_qualname(codec)}.name must be lowercase ASCII letters, digits, '_', '.' or '-', starting "
                f"with a letter, at most {MAX_CODEC_NAME} characters; got {name!r}"
            )
        with self._lock:
            taken = self._codecs.get(name)
            if taken is not None and taken is not codec:
                raise ValueError(f"codec name {name!r} is taken by {_qualname(taken)}: give {_qualname(codec)} another")
            self._codecs[name] = codec
        return codec

    def lookup(self, name: str) -> type[Codec] | None:
        """The stage class called ``name``, its entry point imported on first use; None if there is none."""
        with self._lock:
            codec = self._codecs.get(name)
            if codec is None and name in self._discovered():
                codec = self._load(name)
            return codec

    def names(self) -> list[str]:
        """Every stage name, entry points included (listed without importing them)."""
        with self._lock:
            return sorted(self._codecs.keys() | self._discovered().keys())

    def _discovered(self) -> dict[str, list[importlib.metadata.EntryPoint]]:
        if self._entry_points is None:
            found: dict[str, list[importlib.metadata.EntryPoint]] = {}
            for entry in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
                taken = self._codecs.get(entry.name)
                if taken is None:
                    found.setdefault(entry.name, []).append(entry)
                elif entry.value != f"{taken.__module__}:{taken.__qualname__}":
                    warnings.warn(
                        f"entry point {_describe(entry)} in group {ENTRY_POINT_GROUP!r} is ignored: "
                        f"codec {entry.name!r} is {_qualname(taken)}",
                        stacklevel=2,
                    )
            self._entry_points = found
        return self._entry_points

    def _load(self, name: str) -> type[Codec]:
        entries = self._discovered()[name]
        where = f"{', '.join(_describe(entry) for entry in entries)} in group {ENTRY_POINT_GROUP!r}"
        if len(entries) > 1:
            raise ValueError(f"codec {name!r} is declared by several entry points, {where}: uninstall all but one")
        try:
            codec = entries[0].load()
            stage_kind(codec)
            if getattr(codec, "name", None) != name:
                raise ValueError(f"it loads {codec!r}, whose name is {getattr(codec, 'name', None)!r}, not {name!r}")
            self.register(codec)
        except Exception as exc:  # third-party code: whatever it raises, say which entry point it was
            raise ValueError(
                f"codec {name!r} could not be loaded from the entry point {where}: {type(exc).__name__}: {exc}"
            ) from exc
        self._discovered().pop(name)
        return codec


default_registry = CodecRegistry()


def register_codec(codec: C) -> C:
    """Register a stage class under its ``name`` (usable as a class decorator); a taken name is a ValueError."""
    return default_registry.register(codec)


def available_codecs() -> list[str]:
    """Every stage name that :func:`make_codec` accepts: built-in, registered and from entry points."""
    return default_registry.names()


def make_codec(name: str) -> CodecPipeline:
    """Parse ``"stage[:level]+stage[:level]..."``; unknown names fail with the valid ones listed."""
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"codec must be a name like 'bytesplit' or 'fp8+zstd:3'; valid stages: {available_codecs()}")
    if len(name) > MAX_CODEC_NAME:
        raise ValueError(f"codec name is longer than {MAX_CODEC_NAME} characters: {name!r}")
    stages: list[Codec] = []
    for part in name.strip().split("+"):
        stage_name, _, level_text = part.strip().partition(":")
        codec = default_registry.lookup(stage_name)
        if codec is None:
            raise ValueError(f"unknown codec {stage_name!r} in {name!r}; valid stages: {available_codecs()}")
        try:
            level = int(level_text) if level_text else None
        except ValueError:
            raise ValueError(f"codec level must be an integer, got {level_text!r} in {name!r}") from None
        stages.append(codec(level))
    return CodecPipeline(stages)
