"""MkDocs hook: the configuration reference, generated from the pydantic models in ``kvstore/config.py``.

``configuration.md`` holds the line ``<!-- config-reference -->``; at build time it is replaced by
one table per section of :class:`kvstore.StoreConfig` (every key, its environment variable, its
type, its default and its meaning), walked from ``StoreConfig.model_fields``, so the page cannot
drift from the code. A key's meaning is its ``Field(description=...)``; where a field has none,
its attribute docstring or trailing comment in the source, else :data:`FALLBACK`.

``tests/test_docs.py`` imports this module (:func:`reference_rows`) to check that every key is named.
"""

from __future__ import annotations

import ast
import inspect
import textwrap
import types
import typing
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ByteSize, SecretStr
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

PLACEHOLDER = "<!-- config-reference -->"
PAGE = "configuration.md"
ENV_PREFIX = "KVSTORE_"  # kvstore.config.ENV_PREFIX; checked against it in reference_rows

# Meanings for the fields kvstore/config.py gives no description, docstring or comment (a
# description added there takes precedence over these).
FALLBACK = {
    "enabled": "turn this tier on",
}
# Defaults computed when the store starts, shown as the rule rather than this machine's value.
FACTORY_DEFAULTS = {
    "default_cache_dir": "`$XDG_CACHE_HOME/kvstore`, else `~/.cache/kvstore`",
    "default_planner_dir": "`$XDG_STATE_HOME/kvstore/planner`, else `~/.local/state/kvstore/planner`",
}
UNITS = ((1 << 40, "TiB"), (1 << 30, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB"))


@dataclass(frozen=True)
class Row:
    """One leaf key of the configuration."""

    key: str  # dotted: "dram.capacity"
    env: str  # "KVSTORE_DRAM__CAPACITY"
    kind: str  # what values it takes, in words
    default: str  # as markdown
    meaning: str


def env_name(key: str) -> str:
    """The environment variable of a dotted key: sections joined with ``__`` (pydantic-settings' nested delimiter)."""
    return ENV_PREFIX + key.replace(".", "__").upper()


def _is_model(annotation: Any) -> bool:
    return isinstance(annotation, type) and issubclass(annotation, BaseModel)


def _unwrap(annotation: Any, metadata: list[Any]) -> tuple[Any, list[Any]]:
    """The annotation without ``Optional`` and ``Annotated``, and all the metadata found on the way."""
    metadata = list(metadata)
    while True:
        origin = typing.get_origin(annotation)
        if origin is typing.Annotated:
            metadata.extend(annotation.__metadata__)
            annotation = typing.get_args(annotation)[0]
        elif origin in (typing.Union, types.UnionType):
            args = [arg for arg in typing.get_args(annotation) if arg is not type(None)]
            if len(args) != 1:
                return annotation, metadata
            annotation = args[0]
        else:
            return annotation, metadata


def _bounds(metadata: list[Any], size: bool) -> str:
    """Numeric bounds from annotated-types constraints (``ge``, ``gt``, ``le``, ``lt``), in words."""
    parts = []
    for item in metadata:
        for name, symbol in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<")):
            value = getattr(item, name, None)
            if value is not None:
                parts.append(f"{symbol} {_size(value) if size else _number(value)}")
    return ", ".join(parts)


def _number(value: Any) -> str:
    return str(int(value)) if isinstance(value, float) and value.is_integer() else str(value)


def _size(value: int) -> str:
    for factor, unit in UNITS:
        if value and value % factor == 0:
            return f"{value // factor}{unit}"
    return str(value)


def _validator_names(metadata: list[Any]) -> set[str]:
    return {getattr(getattr(item, "func", None), "__name__", "") for item in metadata}


def _kind(annotation: Any, metadata: list[Any]) -> tuple[str, str]:
    """(what the values are, in words; the kind used to format the default)."""
    base, metadata = _unwrap(annotation, metadata)
    validators = _validator_names(metadata)
    if "_duration" in validators:
        kind, fmt = "duration (`30s`, `10m`, `1h30m`, or seconds)", "duration"
    elif validators & {"_size", "_capacity"} or base is ByteSize:
        kind, fmt = "size (`512MiB`, `8GiB`, `1.5TB`, or bytes)", "size"
    elif typing.get_origin(base) is typing.Literal:
        kind, fmt = "one of " + ", ".join(f"`{value}`" for value in typing.get_args(base)), "text"
    elif base is bool:
        kind, fmt = "boolean", "bool"
    elif base is SecretStr:
        kind, fmt = "secret string (never logged)", "text"
    else:
        name = {int: "integer", float: "number", str: "string"}.get(base, getattr(base, "__name__", str(base)))
        kind, fmt = ("path" if name in ("Path", "PosixPath") else name), "text"
    bounds = _bounds(metadata, size=fmt == "size")
    return (f"{kind}, {bounds}" if bounds else kind), fmt


def _default(field: FieldInfo, fmt: str) -> str:
    if field.default_factory is not None:
        name = getattr(field.default_factory, "__name__", "")
        return FACTORY_DEFAULTS.get(name, f"computed at start (`{name}()`)")
    value = field.default
    if value is None or value is PydanticUndefined:
        return "unset"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if fmt == "size":
        return f"`{_size(int(value))}`"
    if fmt == "duration":
        return f"`{_number(float(value))}s`"
    if isinstance(value, float) and not value.is_integer() and (1 / value).is_integer():
        return f"`{value}` (1/{int(1 / value)})"
    if isinstance(value, str):
        return f'`"{value}"`' if value else '`""` (none)'
    return f"`{_number(value)}`"


def _source_notes(model: type[BaseModel]) -> dict[str, str]:
    """Attribute docstrings and trailing comments of the fields defined in ``model``'s own source."""
    notes: dict[str, str] = {}
    for cls in reversed(model.__mro__):
        if not _is_model(cls) or cls.__module__.startswith("pydantic"):
            continue
        try:
            source = textwrap.dedent(inspect.getsource(cls))
        except (OSError, TypeError):
            continue
        lines = source.splitlines()
        body = ast.parse(source).body[0].body  # type: ignore[attr-defined]
        for index, node in enumerate(body):
            if not isinstance(node, ast.AnnAssign) or not isinstance(node.target, ast.Name):
                continue
            following = body[index + 1] if index + 1 < len(body) else None
            if isinstance(following, ast.Expr) and isinstance(getattr(following, "value", None), ast.Constant):
                if isinstance(following.value.value, str):
                    notes[node.target.id] = inspect.cleandoc(following.value.value)
                    continue
            line = lines[node.end_lineno - 1] if node.end_lineno else ""
            if "#" in line:
                notes[node.target.id] = line.split("#", 1)[1].strip()
    return notes


def _meaning(name: str, field: FieldInfo, notes: dict[str, str]) -> str:
    text = field.description or notes.get(name) or FALLBACK.get(name, "")
    return text.replace("|", "\\|").replace("\n", " ")


def reference_rows(model: type[BaseModel] | None = None, prefix: str = "") -> dict[str, list[Row]]:
    """Per section (``""`` for the top level), its leaf keys, in the order the models define them."""
    if model is None:
        from kvstore import config

        assert config.ENV_PREFIX == ENV_PREFIX, "kvstore.config.ENV_PREFIX changed: update docs/hooks"
        model = config.StoreConfig
    sections: dict[str, list[Row]] = {prefix.rstrip("."): []}
    notes = _source_notes(model)
    for name, field in model.model_fields.items():
        key = prefix + name
        if _is_model(field.annotation):
            sections.update(reference_rows(field.annotation, key + "."))
            continue
        kind, fmt = _kind(field.annotation, list(field.metadata))
        row = Row(key, env_name(key), kind, _default(field, fmt), _meaning(name, field, notes))
        sections[prefix.rstrip(".")].append(row)
    return sections


def render() -> str:
    """The reference as markdown: the top-level keys, then one table per section with the section's docstring."""
    from kvstore.config import StoreConfig

    models = {"": StoreConfig}
    models |= {
        name: field.annotation for name, field in StoreConfig.model_fields.items() if _is_model(field.annotation)
    }
    parts = []
    for section, rows in reference_rows().items():
        if not rows:
            continue
        title = f"`[{section}]`" if section else "Top-level keys"
        parts.append(f"### {title}\n")
        doc = models.get(section).__doc__ if section in models else None
        if section and doc:
            parts.append(inspect.cleandoc(doc).split("\n\n")[0].replace("\n", " ") + "\n")
        parts.append("| key | environment variable | values | default | meaning |")
        parts.append("|---|---|---|---|---|")
        for row in rows:
            parts.append(f"| `{row.key}` | `{row.env}` | {row.kind} | {row.default} | {row.meaning} |")
        parts.append("")
    return "\n".join(parts)


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    """MkDocs event: fill the placeholder of the configuration page."""
    if page.file.src_uri != PAGE:
        return markdown
    if PLACEHOLDER not in markdown:
        raise ValueError(f"{PAGE} lacks the placeholder {PLACEHOLDER}")
    return markdown.replace(PLACEHOLDER, render())
