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

import re
from collections.abc import Iterable, Mapping
from types import MappingProxyType
from typing import TypeVar, cast

from kvstore.codecs.base import Codec, stage_kind
from kvstore.codecs.byteplanes import BytePlanesCodec
from kvstore.codecs.bytesplit import ByteSplitCodec
from kvstore.codecs.fp8 import Fp8Codec
from kvstore.codecs.hadamard import HadamardCodec
from kvstore.codecs.identity import IdentityCodec
from kvstore.codecs.int4 import Int4Codec
from kvstore.codecs.int8 import Int8Codec
from kvstore.codecs.lz4 import Lz4Codec
from kvstore.codecs.pipeline import CodecPipeline
from kvstore.codecs.zstd import ZstdCodec
from kvstore.util.plugins import PluginCatalogue

ENTRY_POINT_GROUP = "kvstore.codecs"
MAX_CODEC_NAME = 64  # of a whole pipeline name, as chunk headers store it
DEFAULT_REMOTE_CODEC = "byteplanes"  # bytesplit's successor: faster, same ratio (bytesplit chunks still decode)

BUILTIN_CODECS: tuple[type[Codec], ...] = (
    # lossless
    IdentityCodec,
    ZstdCodec,
    Lz4Codec,
    ByteSplitCodec,
    BytePlanesCodec,
    # lossy: e4m3, group-wise integer codes, and a rotation that may come before them
    Fp8Codec,
    Int8Codec,
    Int4Codec,
    HadamardCodec,
)
CODECS: Mapping[str, type[Codec]] = MappingProxyType({codec.name: codec for codec in BUILTIN_CODECS})
"""The built-in stages by name; :func:`available_codecs` lists third-party ones too."""

_NAME = re.compile(r"[a-z][a-z0-9_.-]*")
C = TypeVar("C", bound=type[Codec])


def _qualname(obj: object) -> str:
    return f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', repr(obj))}"


def _check_stage(codec: object) -> None:
    """A stage class with a valid ``name`` (lowercase, no ``+`` or ``:``, as chunk headers store it), else an error."""
    stage_kind(codec)  # type: ignore[arg-type]
    name = getattr(codec, "name", None)
    if not isinstance(name, str) or not _NAME.fullmatch(name) or len(name) > MAX_CODEC_NAME:
        raise ValueError(
            f"{_qualname(codec)}.name must be lowercase ASCII letters, digits, '_', '.' or '-', starting "
            f"with a letter, at most {MAX_CODEC_NAME} characters; got {name!r}"
        )


def _loaded_stage(codec: object, name: str) -> type[Codec]:
    """What the entry point ``name`` loaded, if it is the stage class called ``name``."""
    _check_stage(codec)
    if getattr(codec, "name", None) != name:
        raise ValueError(f"it loads {codec!r}, whose name is {getattr(codec, 'name', None)!r}, not {name!r}")
    return cast(type[Codec], codec)


class CodecRegistry:
    """Stage classes by name, with the entry-point group read lazily, once (a :class:`PluginCatalogue`)."""

    def __init__(self, codecs: Iterable[type[Codec]] = BUILTIN_CODECS) -> None:
        self._catalogue: PluginCatalogue[type[Codec]] = PluginCatalogue(
            ENTRY_POINT_GROUP, "codec", _loaded_stage, describe_item=_qualname
        )
        for codec in codecs:
            self.register(codec)

    def register(self, codec: C) -> C:
        """Add a stage class under its ``name``; a name taken by another class is a ValueError."""
        _check_stage(codec)
        self._catalogue.register(codec.name, codec)
        return codec

    def lookup(self, name: str) -> type[Codec] | None:
        """The stage class called ``name``, its entry point imported on first use; None if there is none."""
        return self._catalogue.lookup(name)

    def names(self) -> list[str]:
        """Every stage name, entry points included (listed without importing them)."""
        return self._catalogue.names()


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
