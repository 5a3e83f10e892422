"""What every configuration section shares: the value types (sizes, capacities, durations, through
:mod:`kvstore.util.units`), the section base class (validated on assignment; a refused value
changes nothing), and the one-line-per-problem explanation every :class:`~kvstore.errors.ConfigError` carries.
"""

from __future__ import annotations

import difflib
import os
from pathlib import Path
from typing import Annotated, Any

from pydantic import (
    BaseModel,
    BeforeValidator,
    ByteSize,
    ConfigDict,
    ValidationError,
)
from pydantic.fields import FieldInfo

from kvstore.errors import ConfigError
from kvstore.util import units

ENV_PREFIX = "KVSTORE_"
CONFIG_FILE_ENV = "KVSTORE_CONFIG"
# Read by scripts/bootstrap.sh, vllm_env.sh and sglang_env.sh, not by the store: never "unknown" to it.
SCRIPT_VARIABLES = frozenset(
    {"KVSTORE_TORCH_VERSION", "KVSTORE_VLLM_VERSION", "KVSTORE_VLLM_VENV", "KVSTORE_SGLANG_VERSION", "KVSTORE_EXTRAS"}
)


def _size(value: Any) -> Any:
    """Sizes through the one strict parser (kvstore.util.units): pydantic's ByteSize read '12,5GB' as 12 bytes."""
    return value if isinstance(value, ByteSize) else units.parse_size(value)


def _capacity(value: Any) -> Any:
    """A tier's byte budget: positive (0 or less would evict every chunk; the store checks one chunk at open)."""
    if isinstance(value, ByteSize) and value > 0:
        return value
    return units.parse_size(value, minimum=1, why="a capacity must hold at least one chunk of the model's KV")


def _duration(value: Any) -> Any:
    """Durations (seconds) through the one strict parser: 5, 2.5, '500ms', '30s', '10m', '1h30m'."""
    return units.parse_duration(value)


Size = Annotated[ByteSize, BeforeValidator(_size)]
Capacity = Annotated[ByteSize, BeforeValidator(_capacity)]
Duration = Annotated[float, BeforeValidator(_duration)]


def default_cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kvstore"


def default_planner_dir() -> Path:
    """Where the load planner keeps what it measured: ``$XDG_STATE_HOME/kvstore/planner`` (``~/.local/state``)."""
    return Path(os.environ.get("XDG_STATE_HOME") or Path.home() / ".local" / "state") / "kvstore" / "planner"


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    def __setattr__(self, name: str, value: Any) -> None:
        """Assign with validation; a value refused (by a field or a whole-section check) changes nothing."""
        missing = object()
        old = self.__dict__.get(name, missing)
        try:
            super().__setattr__(name, value)
        except ValidationError as exc:
            if old is not missing:  # pydantic has already stored it when a whole-section check refuses it
                self.__dict__[name] = old
            raise ConfigError(explain(exc, type(self))) from None


def known_paths(model: type[BaseModel], prefix: str = "") -> dict[str, type[BaseModel] | None]:
    """Dotted key -> sub-model (for sections) or None (for leaves)."""
    paths: dict[str, type[BaseModel] | None] = {}
    for name, field in model.model_fields.items():
        annotation = field.annotation
        is_section = isinstance(annotation, type) and issubclass(annotation, BaseModel)
        paths[prefix + name] = annotation if is_section else None
        if is_section:
            paths.update(known_paths(annotation, f"{prefix}{name}."))
    return paths


def explain(exc: ValidationError, model: type[BaseModel]) -> str:
    """One line per problem: the dotted key, what was wrong, and what would be valid."""
    paths = known_paths(model)
    lines = ["invalid kvstore configuration:"]
    for error in exc.errors():
        key = units.clip(".".join(str(part) for part in error["loc"]))  # a typo'd key may be huge too
        if error["type"] == "extra_forbidden":
            parent = key.rpartition(".")[0]
            siblings = sorted(p for p in paths if p.rpartition(".")[0] == parent)
            # Compare leaf names only: the shared "section." prefix would make any name look close.
            leaves = {p.rpartition(".")[2]: p for p in siblings}
            hint = difflib.get_close_matches(key.rpartition(".")[2], list(leaves), n=1)
            fix = f"did you mean '{leaves[hint[0]]}'?" if hint else f"valid keys here: {', '.join(siblings)}"
            lines.append(f"  {key}: unknown key; {fix}")
            continue
        message = error["msg"].removeprefix("Value error, ")
        if isinstance(error.get("input"), dict | BaseModel):  # a whole section's check: its message names the keys
            lines.append(f"  {key}: {message}" if key else f"  {message}")
            continue
        field = _field(model, error["loc"])
        description = field.description if field else None
        shown = "'**********'" if field is not None and _is_secret(field) else units.shown(error.get("input"))
        lines.append(f"  {key} = {shown}: {message}" + (f" ({description})" if description else ""))
    return "\n".join(lines)


def _field(model: type[BaseModel], loc: tuple[int | str, ...]) -> FieldInfo | None:
    current: Any = model
    field = None
    for part in loc:
        fields = getattr(current, "model_fields", None)
        if not fields or part not in fields:
            return None
        field = fields[part]
        current = field.annotation
    return field


def _is_secret(field: FieldInfo) -> bool:
    """Keys and URLs with passwords are never echoed back in an error."""
    return not field.repr or "SecretStr" in str(field.annotation)
