"""Backends by name: built in (disk, Redis, S3), registered in code, or found through an entry point.

A backend is one module that declares a :class:`BackendSpec`: its name, where its tier goes
among the others, its configuration section, how to build it, and what the circuit breaker and
the operator's tools need to know of it. A third-party package adds one without touching kvstore
by declaring the spec in the ``kvstore.backends`` entry-point group under the backend's name::

    [project.entry-points."kvstore.backends"]
    gcs = "kvstore_gcs:SPEC"

Its section is then read from ``[gcs]`` in TOML, ``KVSTORE_GCS__BUCKET=...`` in the environment
or ``StoreConfig(gcs={...})``, and a store whose configuration enables it gets its tier, in rank
order. The group is read once, the first time a name is asked for that is not registered, and an
entry point is imported only when its own name is asked for: a broken plugin fails the
configurations that name it, with an error naming the entry point, and no others. Code can also
call :func:`register_backend`. (The catalogue itself lives in :mod:`kvstore.config`, below this
package, so that the configuration can validate a plugin's section; this module is its interface.)

Importing this module and the built-in specs loads neither redis nor aiobotocore: a spec's
``make`` imports its backend's module (:mod:`kvstore.backends.builtin`).
"""

from __future__ import annotations

import pkgutil
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar, cast

from pydantic import BaseModel

from kvstore.backends.base import Backend
from kvstore.config import (
    BACKEND_ENTRY_POINTS,
    BackendSection,
    StoreConfig,
    TimeoutConfig,
    backend_catalogue,
    check_backend_declaration,
)

S = TypeVar("S", bound=BaseModel)

# Error class names that say "not reachable" (refused, reset, timed out) from any client: Python's
# own, and clients' classes named alike (redis-py's ConnectionError and TimeoutError). Each backend
# adds its client's own in its spec.
GENERIC_UNREACHABLE = frozenset({"ConnectionError", "TimeoutError"})
GENERIC_TIMEOUT = frozenset({"TimeoutError"})

__all__ = [
    "BACKEND_ENTRY_POINTS",
    "GENERIC_TIMEOUT",
    "GENERIC_UNREACHABLE",
    "BackendSection",
    "BackendSpec",
    "SectionSettings",
    "available_backends",
    "backend_sections",
    "default_endpoint",
    "lookup_backend",
    "register_backend",
    "rescan_backends",
    "spec_for_section",
    "timeout_error_names",
    "unreachable_error_names",
]


class SectionSettings(Protocol):
    """What every backend's section has: :class:`~kvstore.config.BackendSection`'s fields (the built-in ones' too)."""

    enabled: bool
    codec: str
    allow_lossy: bool


def default_endpoint(backend: Backend) -> str:
    """Where a backend keeps its objects, for the tools' messages: its ``root`` or ``url`` attribute, else its name."""
    for attribute in ("root", "url"):
        value = getattr(backend, attribute, None)
        if value is not None:
            return str(value)
    return backend.name


@dataclass(frozen=True)
class BackendSpec(Generic[S]):
    """What a backend module declares so that configurations, the store, the breaker and the tools know it.

    - ``name``: the backend's configuration section (``[name]``, ``KVSTORE_NAME__KEY``) and its tier's
      name (stats, metrics, ``kvstore ls``); lowercase letters, digits and single ``_``.
    - ``rank``: where its tier goes, fastest first: disk is 100, Redis 200, S3 300 (ties: by name).
    - ``section``: its configuration section class, a :class:`~kvstore.config.BackendSection`
      subclass (``enabled``, ``codec``, ``allow_lossy``, and the backend's own settings) whose
      ``section`` class variable is ``name``.
    - ``make(section, timeouts, namespace, executor)``: the backend, not opened yet, storing under the
      namespace directory ``namespace``; ``timeouts`` (:class:`~kvstore.config.TimeoutConfig`) bound
      its requests, ``executor`` (None: the loop's) runs blocking calls. Import heavy client libraries
      here, not at the top of the spec's module: configurations import the spec.
    - ``unreachable_errors`` / ``timeout_errors``: class names of the client's errors that mean the
      server could not be reached / a request ran out of time (the circuit breaker opens on these,
      not on a request the server refused); a timeout also counts as unreachable.

    For ``kvstore ls``, ``stats``, ``gc`` and ``verify`` (the backend implements
    :class:`~kvstore.backends.maintenance.Maintenance`):

    - ``endpoint(backend)``: where the tools read, for their messages, without secrets (default:
      :func:`default_endpoint`);
    - ``secrets(section)``: texts never to print (passwords, keys), blotted out of the errors the
      tools show;
    - ``tools_section(section)``: the section as the tools use it (S3: never create a bucket);
    - ``tools_open``: whether the tools open the backend (the disk's open rebuilds its index and
      evicts: an engine's business, not a listing's);
    - ``tools_check(section)``: checks before the tools read (a ConfigError naming the fix).

    ``dev_server``: ``"module:attribute"`` of a server factory for local tests (a
    :class:`kvstore.testing.servers.DevServer`), or None.
    """

    name: str
    rank: int
    section: type[S]
    make: Callable[[S, TimeoutConfig, str, Executor | None], Backend]
    unreachable_errors: frozenset[str] = field(default_factory=frozenset)
    timeout_errors: frozenset[str] = field(default_factory=frozenset)
    endpoint: Callable[[Any], str] = default_endpoint
    secrets: Callable[[S], Sequence[str]] | None = None
    tools_section: Callable[[S], S] | None = None
    tools_open: bool = True
    tools_check: Callable[[S], None] | None = None
    dev_server: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.unreachable_errors, str) or isinstance(self.timeout_errors, str):
            raise ValueError(f"backend {self.name!r}: error names are a set of class names, not one string")
        object.__setattr__(self, "unreachable_errors", frozenset(self.unreachable_errors))
        object.__setattr__(self, "timeout_errors", frozenset(self.timeout_errors))
        if not isinstance(self.rank, int) or isinstance(self.rank, bool):
            raise ValueError(f"backend {self.name!r}: rank must be an integer (disk 100, redis 200, s3 300)")
        if not callable(self.make):
            raise ValueError(f"backend {self.name!r}: make must be callable (section, timeouts, namespace, executor)")
        check_backend_declaration(self, self.name)

    def dev_server_factory(self) -> Callable[[], Any] | None:
        """The factory ``dev_server`` names, imported now; None if the backend names none."""
        return None if self.dev_server is None else cast(Callable[[], Any], pkgutil.resolve_name(self.dev_server))


def _spec(declaration: object, name: str) -> BackendSpec[Any]:
    if not isinstance(declaration, BackendSpec):  # an entry point's object with the right attributes, another class
        raise ValueError(f"backend {name!r} is declared by {declaration!r}, not by a BackendSpec")
    return declaration


def register_backend(spec: BackendSpec[S]) -> BackendSpec[S]:
    """Register ``spec`` under its name (a name taken by another spec is a ValueError); returns it."""
    _spec(spec, spec.name)
    backend_catalogue.register(spec.name, spec)
    return spec


def lookup_backend(name: str) -> BackendSpec[Any] | None:
    """The spec of backend ``name``, its entry point imported on first use; None if there is none.

    A ValueError naming the entry point if its plugin cannot be loaded.
    """
    declaration = backend_catalogue.lookup(name)
    return None if declaration is None else _spec(declaration, name)


def available_backends() -> list[str]:
    """Every backend name: built in, registered, and declared by entry points (listed without importing them)."""
    return backend_catalogue.names()


def rescan_backends() -> None:
    """Read the entry-point group again on next use (after installing a backend's package in a running process)."""
    backend_catalogue.rescan()


def backend_sections(config: StoreConfig) -> list[tuple[BackendSpec[Any], SectionSettings]]:
    """Every backend ``config`` has a section of, with that section, fastest first (by rank, then name).

    The built-in backends always (their sections are StoreConfig fields, enabled or not), others
    where the configuration gives their section. Callers keep the enabled ones.
    """
    found: list[tuple[BackendSpec[Any], SectionSettings]] = []
    for name, section in config.backend_sections().items():
        spec = lookup_backend(name)
        if spec is None:
            raise RuntimeError(f"backend {name!r} has a section in the configuration but no spec registered")
        found.append((spec, cast(SectionSettings, section)))
    return sorted(found, key=lambda pair: (pair[0].rank, pair[0].name))


def spec_for_section(section: object) -> BackendSpec[Any]:
    """The spec whose section class ``section`` is an instance of (its own class first); a ValueError if none."""
    specs = _loaded_specs()
    for spec in specs:
        if type(section) is spec.section:
            return spec
    for spec in specs:
        if isinstance(section, spec.section):
            return spec
    raise ValueError(f"{type(section).__qualname__} is the section of no registered backend; register its BackendSpec")


def unreachable_error_names() -> frozenset[str]:
    """Class names of errors that mean a tier could not be reached: the generic ones and every loaded backend's
    (its timeouts included). A backend not loaded yet has no tier, so none of its errors can arise."""
    return GENERIC_UNREACHABLE.union(*(spec.unreachable_errors | spec.timeout_errors for spec in _loaded_specs()))


def timeout_error_names() -> frozenset[str]:
    """Class names of errors that mean a request ran out of time: the generic ones and every loaded backend's."""
    return GENERIC_TIMEOUT.union(*(spec.timeout_errors for spec in _loaded_specs()))


def _loaded_specs() -> list[BackendSpec[Any]]:
    """The specs registered or loaded from entry points so far (none is imported here)."""
    return [_spec(backend_catalogue.lookup(name), name) for name in backend_catalogue.loaded_names()]
