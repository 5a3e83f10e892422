"""StoreConfig: every section, read from keyword arguments > ``KVSTORE_*`` environment > TOML file > defaults.

Also the sections of backends from other packages: ``[gcs]`` in TOML, ``KVSTORE_GCS__BUCKET`` in
the environment, ``gcs={...}`` as a keyword, each validated by its backend's own section class.
The backends are found in :data:`backend_catalogue` (the ``kvstore.backends`` entry points, read
lazily, a broken plugin failing only the names it serves); a key that names no backend stays an
unknown key, refused as ever.
"""

from __future__ import annotations

import difflib
import json
import os
import re
import tomllib
from contextvars import ContextVar
from pathlib import Path
from typing import Any, Protocol, cast

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    SerializationInfo,
    SerializerFunctionWrapHandler,
    ValidationError,
    create_model,
    model_serializer,
    model_validator,
)
from pydantic.fields import FieldInfo
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    SettingsError,
    TomlConfigSettingsSource,
)

from kvstore.config.backend_sections import (
    BACKEND_ENTRY_POINTS,
    BACKEND_NAME,
    BUILTIN_BACKENDS,
    DiskConfig,
    RedisConfig,
    S3Config,
)
from kvstore.config.base import CONFIG_FILE_ENV, ENV_PREFIX, SCRIPT_VARIABLES, explain, known_paths
from kvstore.config.sections import (
    AdaptiveConfig,
    BreakerConfig,
    DramConfig,
    EncryptionConfig,
    EventsConfig,
    MetricsConfig,
    PlannerConfig,
    TimeoutConfig,
)
from kvstore.errors import ConfigError
from kvstore.util import units
from kvstore.util.plugins import PluginCatalogue

_toml_file: ContextVar[Path | None] = ContextVar("kvstore_toml_file", default=None)
_environment_off: ContextVar[bool] = ContextVar("kvstore_environment_off", default=False)  # isolated()


class StoreConfig(BaseSettings):
    """Everything a :class:`kvstore.KVStore` needs besides the model layout."""

    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX, env_nested_delimiter="__", extra="forbid", validate_assignment=True
    )

    dram: DramConfig = Field(default_factory=DramConfig)
    disk: DiskConfig = Field(default_factory=DiskConfig)
    s3: S3Config = Field(default_factory=S3Config)
    redis: RedisConfig = Field(default_factory=RedisConfig)
    encryption: EncryptionConfig = Field(default_factory=EncryptionConfig)
    timeouts: TimeoutConfig = Field(default_factory=TimeoutConfig)
    breaker: BreakerConfig = Field(default_factory=BreakerConfig)
    metrics: MetricsConfig = Field(default_factory=MetricsConfig)
    events: EventsConfig = Field(default_factory=EventsConfig)
    adaptive: AdaptiveConfig = Field(default_factory=AdaptiveConfig)
    planner: PlannerConfig = Field(default_factory=PlannerConfig)
    queue_depth: int = Field(64, ge=1, description="pending writes per secondary tier; a full queue drops the write")
    tier_workers: int = Field(2, ge=1, le=64, description="concurrent writes per secondary tier")
    io_threads: int = Field(4, ge=1, le=256, description="threads for file I/O and codecs")
    # The sections of backends from other packages ([gcs] for a backend named gcs), validated by their
    # own section classes (see backend_section and kvstore.backends.registry).
    _plugin_sections: dict[str, BaseModel] = PrivateAttr(default_factory=dict)

    @model_validator(mode="wrap")
    @classmethod
    def _backend_sections(cls, data: Any, handler: Any) -> StoreConfig:
        """Take the sections of backends from other packages out of ``data``, validate each by its own class.

        A key that is neither StoreConfig's own nor a backend's stays in ``data``, so it is refused
        as an unknown key, as ever; the problems of both kinds are reported together.
        """
        if not isinstance(data, dict):
            return cast(StoreConfig, handler(data))
        given = {key: data[key] for key in data if isinstance(key, str) and key not in cls.model_fields}
        raw = {key: value for key, value in given.items() if backend_named(key)}
        if not raw:
            return cast(StoreConfig, handler(data))
        sections, problems = validate_plugin_sections(cls, raw)
        try:
            config = cast(StoreConfig, handler({key: value for key, value in data.items() if key not in raw}))
        except ValidationError as exc:
            problems = explain(exc, cls).splitlines()[1:] + problems
            config = None
        if problems:
            raise ValueError("\n".join(problems).strip())
        assert config is not None
        config._plugin_sections = sections
        return config

    @model_serializer(mode="wrap")
    def _with_plugin_sections(self, handler: SerializerFunctionWrapHandler, info: SerializationInfo) -> Any:
        """Dumps show the sections of backends from other packages too (so a dump validates back to an equal config)."""
        data = handler(self)
        if isinstance(data, dict):
            mode = "json" if info.mode_is_json() else "python"
            for name, section in self._plugin_sections.items():
                data[name] = section.model_dump(mode=mode, exclude_unset=info.exclude_unset)
        return data

    def backend_section(self, name: str) -> BaseModel | None:
        """The section of backend ``name``: a built-in one (``disk``, ``redis``, ``s3``, always there), or
        that of a backend from another package, if this configuration gives it; else None."""
        if name in BUILTIN_BACKENDS:
            return cast(BaseModel, getattr(self, name))
        return self._plugin_sections.get(name)

    def plugin_sections(self) -> dict[str, BaseModel]:
        """The sections this configuration gives of backends from other packages, by backend name."""
        return dict(self._plugin_sections)

    def backend_sections(self) -> dict[str, BaseModel]:
        """Every backend section, enabled or not, by backend name: the built-in ones, then other packages'."""
        return {name: cast(BaseModel, getattr(self, name)) for name in BUILTIN_BACKENDS} | self._plugin_sections

    def enabled_backends(self) -> list[str]:
        """The names of the backends this configuration turns on (the tiers below DRAM), in section order."""
        return [name for name, section in self.backend_sections().items() if getattr(section, "enabled", False)]

    @model_validator(mode="after")
    def _auto_bounds(self) -> StoreConfig:
        low, high = self.dram_bounds()
        if not low <= int(self.dram.capacity) <= high:
            raise ValueError(
                f"dram.capacity ({int(self.dram.capacity)} bytes) must lie within adaptive.dram_min ({low}) and "
                f"adaptive.dram_max ({high}); widen the bounds or change dram.capacity"
            )
        return self

    def dram_bounds(self) -> tuple[int, int]:
        """The DRAM sizes auto mode may choose between (bytes)."""
        capacity, adaptive = int(self.dram.capacity), self.adaptive
        low = int(adaptive.dram_min) if adaptive.dram_min is not None else capacity // 8
        high = int(adaptive.dram_max) if adaptive.dram_max is not None else capacity
        return low, high

    def __init__(self, **values: Any) -> None:
        environment = not _environment_off.get()
        if environment and _toml_file.get() is None and os.environ.get(CONFIG_FILE_ENV):
            token = _toml_file.set(_toml_path(None))  # StoreConfig() honours $KVSTORE_CONFIG too
            try:
                self.__init__(**values)  # type: ignore[misc]
            finally:
                _toml_file.reset(token)
            return
        if environment:
            _reject_unknown_env()
        try:
            super().__init__(**values)
        except ValidationError as exc:
            raise ConfigError(explain(exc, type(self))) from None
        except SettingsError as exc:  # e.g. KVSTORE_DRAM='not json'
            field = re.search(r'field "([^"]+)"', str(exc))
            name = f"{ENV_PREFIX}{field[1].upper()}" if field else f"a {ENV_PREFIX}* variable"
            raise ConfigError(
                f"invalid kvstore configuration: {exc}; {name} must be a JSON object "
                f'(e.g. \'{{"capacity": "4GiB"}}\'), or set one key with {ENV_PREFIX}SECTION__KEY'
            ) from None
        except (tomllib.TOMLDecodeError, UnicodeDecodeError, OSError) as exc:
            raise ConfigError(f"config file {_toml_file.get()} cannot be read as TOML: {exc}; fix the file") from None

    def __setattr__(self, name: str, value: Any) -> None:
        try:
            super().__setattr__(name, value)
        except ValidationError as exc:
            raise ConfigError(explain(exc, type(self))) from None

    @classmethod
    def load(cls, path: str | os.PathLike[str] | None = None, **overrides: Any) -> StoreConfig:
        """Read a TOML file (``path`` or ``$KVSTORE_CONFIG``), then the environment, then ``overrides``."""
        token = _toml_file.set(_toml_path(path))
        try:
            return cls(**overrides)
        finally:
            _toml_file.reset(token)

    @classmethod
    def isolated(cls, **values: Any) -> StoreConfig:
        """A configuration of ``values`` and the defaults alone: no ``KVSTORE_*`` variable, no ``$KVSTORE_CONFIG``.

        For a store that must not touch what the shell points at (``kvstore demo``): with the
        defaults, that is DRAM and the local disk, never Redis or S3.
        """
        token = _environment_off.set(True)
        try:
            return cls(**values)
        finally:
            _environment_off.reset(token)

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        if _environment_off.get():
            return (init_settings,)
        toml_path = _toml_file.get()
        sources: list[PydanticBaseSettingsSource] = [init_settings, env_settings, PluginEnvironment(settings_cls)]
        if toml_path is not None:
            sources.append(TomlConfigSettingsSource(settings_cls, toml_file=toml_path))
        return tuple(sources)


def _toml_path(path: str | os.PathLike[str] | None) -> Path | None:
    """The TOML file to read: ``path``, else ``$KVSTORE_CONFIG``, else none; it must exist."""
    file = path if path is not None else os.environ.get(CONFIG_FILE_ENV)
    toml_path = Path(file).expanduser() if file else None
    if toml_path is None:
        return None
    source, fix = (
        ("the path given", "pass the path of an existing TOML file")
        if path is not None
        else (CONFIG_FILE_ENV, f"set {CONFIG_FILE_ENV} to an existing TOML file, or unset it")
    )
    denied = f"config file {toml_path} (from {source}) cannot be read (permission denied); run as a user who can"
    try:
        is_file = toml_path.is_file()
    except PermissionError:  # a directory on its way that this user may not enter
        raise ConfigError(denied) from None
    if not is_file:
        raise ConfigError(f"config file {toml_path} (from {source}) does not exist or is not a file; {fix}")
    if not os.access(toml_path, os.R_OK):
        raise ConfigError(denied)
    return toml_path


def _reject_unknown_env() -> None:
    """pydantic-settings ignores unknown ``KVSTORE_*`` variables; a typo there should not pass silently."""
    known = {path.replace(".", "__").upper() for path in known_paths(StoreConfig)} | plugin_env_names()
    for name in os.environ:
        # pydantic-settings matches names case-insensitively (kvstore_io_threads is read), so check them
        # all; KVSTORE_CONFIG is only read spelled exactly so.
        if name != CONFIG_FILE_ENV and name not in SCRIPT_VARIABLES and name.upper().startswith(ENV_PREFIX):
            rest = name[len(ENV_PREFIX) :].upper()
            if rest not in known:
                choices = sorted(known | {CONFIG_FILE_ENV.removeprefix(ENV_PREFIX)})
                hint = difflib.get_close_matches(rest, choices, n=1)
                fix = f"did you mean {ENV_PREFIX}{hint[0]}?" if hint else f"valid: {sorted(known)}"
                raise ConfigError(f"unknown environment variable {units.clip(name)}: {fix}")


# -- the sections of backends from other packages ------------------------------------------------


class BackendDeclaration(Protocol):
    """What the configuration needs of a backend (:class:`kvstore.backends.registry.BackendSpec` has it)."""

    @property
    def name(self) -> str: ...

    @property
    def section(self) -> type[BaseModel]: ...


def check_backend_declaration(declaration: object, name: str) -> BackendDeclaration:
    """``declaration``, if it can declare the backend ``name`` to the configuration; else a ValueError saying why.

    Its ``name`` is ``name``: a lowercase identifier (letters, digits, single ``_``), and not one of
    StoreConfig's own sections unless it is a built-in backend's. Its ``section`` is a pydantic
    model class with the fields ``enabled``, ``codec`` and ``allow_lossy`` (:class:`BackendSection`
    gives them), whose ``section`` class variable, where set, is ``name`` too.
    """
    shown = f"{type(declaration).__module__}.{type(declaration).__qualname__}"
    for attribute in ("name", "rank", "section", "make"):
        if not hasattr(declaration, attribute):
            raise ValueError(f"{shown} has no {attribute!r}: declare it with kvstore.backends.registry.BackendSpec")
    own, section = cast(BackendDeclaration, declaration).name, cast(BackendDeclaration, declaration).section
    if own != name:
        raise ValueError(f"it declares the backend {own!r}, not {name!r}")
    if not isinstance(name, str) or not BACKEND_NAME.fullmatch(name):
        raise ValueError(
            f"backend name {name!r} must be lowercase ASCII letters and digits, with single '_' between them, "
            f"starting with a letter (it is a TOML table and part of KVSTORE_<NAME>__<KEY> variables)"
        )
    field = StoreConfig.model_fields.get(name)
    if field is not None and (name not in BUILTIN_BACKENDS or field.annotation is not section):
        raise ValueError(f"backend name {name!r} is a section of kvstore's own configuration: choose another")
    if not (isinstance(section, type) and issubclass(section, BaseModel)):
        raise ValueError(f"the section of backend {name!r} must be a pydantic model class (e.g. a BackendSection)")
    missing = [key for key in ("enabled", "codec", "allow_lossy") if key not in section.model_fields]
    if missing:
        raise ValueError(f"section {section.__qualname__} of backend {name!r} lacks {missing}: subclass BackendSection")
    declared = getattr(section, "section", name) or name
    if declared != name:
        raise ValueError(f"the section {section.__qualname__} is for {declared!r}, not the backend {name!r}")
    return cast(BackendDeclaration, declaration)


backend_catalogue: PluginCatalogue[BackendDeclaration] = PluginCatalogue(
    BACKEND_ENTRY_POINTS, "backend", check_backend_declaration
)
"""Every backend by name, the built-in ones registered by :mod:`kvstore.backends.registry` (which is the
interface to use), others in code or through the ``kvstore.backends`` entry-point group."""


def _plugin_backend(name: str) -> BackendDeclaration | None:
    """The declaration of backend ``name`` if it is one whose section StoreConfig lacks; None if it is no backend.

    A ValueError naming the entry point if its plugin cannot be loaded.
    """
    if name in StoreConfig.model_fields or not BACKEND_NAME.fullmatch(name):
        return None
    if name not in backend_catalogue.names():  # listed without importing any plugin
        return None
    return backend_catalogue.lookup(name)


def validate_plugin_sections(model: type[StoreConfig], raw: dict[str, Any]) -> tuple[dict[str, BaseModel], list[str]]:
    """Each of ``raw`` (backend name -> its section as given) validated by its backend's section class.

    Also the problems, one ``  key: ...`` line each, as :func:`explain` words them (dotted keys
    under the backend's name, secrets not echoed).
    """
    sections: dict[str, BaseModel] = {}
    lines: list[str] = []
    fields: dict[str, Any] = {}
    for name in raw:
        try:
            declaration = _plugin_backend(name)
        except ValueError as exc:
            lines.append(f"  {name}: {exc}")
            continue
        assert declaration is not None
        fields[name] = (declaration.section, ...)
    if not fields:
        return sections, lines
    holder = create_model(model.__name__, __config__=ConfigDict(extra="forbid"), **fields)
    try:
        validated = holder.model_validate({name: raw[name] for name in fields})
    except ValidationError as exc:
        return sections, lines + explain(exc, holder).splitlines()[1:]
    return {name: getattr(validated, name) for name in fields}, lines


def plugin_env_names() -> set[str]:
    """The ``KVSTORE_*`` names (upper case, prefix off) of the backends from other packages that the
    environment sets a variable of: their sections' keys, which :func:`_reject_unknown_env` then accepts."""
    names: set[str] = set()
    for variable in os.environ:
        head = variable.upper().removeprefix(ENV_PREFIX).partition("__")[0]
        if not variable.upper().startswith(ENV_PREFIX) or head in names or variable.upper() in _NOT_SECTIONS:
            continue
        try:
            declaration = _plugin_backend(head.lower())
        except ValueError as exc:
            raise ConfigError(f"environment variable {units.clip(variable)}: {exc}") from None
        if declaration is not None:
            names.add(head)
            names.update(f"{head}__{path.replace('.', '__').upper()}" for path in known_paths(declaration.section))
    return names


_NOT_SECTIONS = frozenset({CONFIG_FILE_ENV, *SCRIPT_VARIABLES})  # KVSTORE_* variables that name no section


class PluginEnvironment(PydanticBaseSettingsSource):
    """``KVSTORE_<NAME>__<KEY>`` (and ``KVSTORE_<NAME>``, a JSON object) of the backends from other packages.

    pydantic-settings reads only StoreConfig's own fields from the environment; this reads the
    sections of the other backends, by the same rules (names in any case, ``__`` nesting).
    """

    def get_field_value(self, field: FieldInfo, field_name: str) -> tuple[Any, str, bool]:
        return None, field_name, False  # StoreConfig's own fields are the environment source's

    def __call__(self) -> dict[str, Any]:
        found: dict[str, Any] = {}
        for variable, value in os.environ.items():
            if not variable.upper().startswith(ENV_PREFIX) or variable.upper() in _NOT_SECTIONS:
                continue
            head, _, rest = variable.upper().removeprefix(ENV_PREFIX).partition("__")
            name = head.lower()
            if _plugin_backend(name) is None:
                continue
            if not rest:
                try:
                    whole = json.loads(value)
                except json.JSONDecodeError:
                    whole = None
                if not isinstance(whole, dict):
                    raise ConfigError(
                        f"{units.clip(variable)} must be a JSON object (e.g. '{{\"enabled\": true}}'), "
                        f"or set one key with {ENV_PREFIX}{head}__KEY"
                    )
                found[name] = {**whole, **found.get(name, {})}  # single keys win over the whole object
                continue
            node = found.setdefault(name, {})
            *parents, leaf = rest.lower().split("__")
            for part in parents:
                node = node.setdefault(part, {})
            node[leaf] = value
        return found


def backend_named(key: str) -> bool:
    """Whether ``key`` (not a StoreConfig field) names a backend from another package (loaded or not)."""
    return bool(BACKEND_NAME.fullmatch(key)) and key in backend_catalogue.names()
