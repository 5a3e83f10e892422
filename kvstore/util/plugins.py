"""Named plugins: registered in code, or declared by installed distributions in an entry-point group.

A :class:`PluginCatalogue` maps names to objects (a backend's declaration, say). The entry-point
group is read the first time a name is asked for that is not registered, and an entry point is
imported only when its own name is asked for: a plugin whose import fails breaks only the
configurations that name it, with an error naming the entry point and its distribution.
"""

from __future__ import annotations

import importlib.metadata
import threading
import warnings
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


def describe(entry: importlib.metadata.EntryPoint) -> str:
    """``'name = module:attr' (from dist version)``: how an error names an entry point."""
    dist = f" (from {entry.dist.name} {entry.dist.version})" if entry.dist is not None else ""
    return f"'{entry.name} = {entry.value}'{dist}"


class PluginCatalogue(Generic[T]):
    """Objects by name, registered in code or loaded from the entry points of ``group``.

    ``check(obj, name)`` turns what an entry point loads into a ``T`` (or raises, saying what is
    wrong with it); ``kind`` names the plugins in messages ("backend", "codec"), ``describe_item``
    an item. An entry point that names the very object registered under its name is no clash.
    """

    def __init__(
        self, group: str, kind: str, check: Callable[[object, str], T], describe_item: Callable[[T], str] = repr
    ) -> None:
        self.group, self.kind = group, kind
        self._check, self._describe_item = check, describe_item
        self._items: dict[str, T] = {}
        self._loaded: set[str] = set()  # names whose item came from an entry point
        self._entry_points: dict[str, list[importlib.metadata.EntryPoint]] | None = None  # not read yet
        self._lock = threading.RLock()  # a plugin's module may register things while it is imported

    def register(self, name: str, item: T) -> T:
        """Add ``item`` under ``name``; a name held by another item is a ValueError (an entry point of
        that name, not loaded yet, is ignored from now on, with a warning)."""
        with self._lock:
            taken = self._items.get(name)
            if taken is not None and taken is not item:
                raise ValueError(
                    f"{self.kind} name {name!r} is taken by {self._describe_item(taken)}: "
                    f"give {self._describe_item(item)} another"
                )
            self._items[name] = item
            shadowed = (self._entry_points or {}).pop(name, [])
        for entry in shadowed:
            if not _names(entry, item):
                warnings.warn(self._ignored(entry), stacklevel=2)
        return item

    def lookup(self, name: str) -> T | None:
        """The item called ``name``, its entry point imported on first use; None if there is none.

        A ValueError naming the entry point if it cannot be loaded or loads something unfit.
        """
        with self._lock:
            item = self._items.get(name)
            if item is None and name in self._discovered():
                item = self._load(name)
            return item

    def names(self) -> list[str]:
        """Every name, registered or declared by an entry point (listed without importing it)."""
        with self._lock:
            return sorted(self._items.keys() | self._discovered().keys())

    def loaded_names(self) -> list[str]:
        """The names registered or loaded from entry points so far (no entry point is imported)."""
        with self._lock:
            return sorted(self._items)

    def rescan(self) -> None:
        """Read the entry-point group again on next use, forgetting what was loaded from it before.

        For a distribution installed (or removed) while the process runs; items registered in code stay.
        """
        with self._lock:
            for name in self._loaded:
                self._items.pop(name, None)
            self._loaded.clear()
            self._entry_points = None

    def _ignored(self, entry: importlib.metadata.EntryPoint) -> str:
        return f"entry point {describe(entry)} in group {self.group!r} is ignored: {self.kind} {entry.name!r} is taken"

    def _discovered(self) -> dict[str, list[importlib.metadata.EntryPoint]]:
        if self._entry_points is None:
            found: dict[str, list[importlib.metadata.EntryPoint]] = {}
            seen: set[tuple[str, str]] = set()  # a distribution found twice on sys.path declares it once
            for entry in importlib.metadata.entry_points(group=self.group):
                if (entry.name, entry.value) in seen:
                    continue
                seen.add((entry.name, entry.value))
                if entry.name in self._items:
                    if not _names(entry, self._items[entry.name]):
                        warnings.warn(self._ignored(entry), stacklevel=3)
                else:
                    found.setdefault(entry.name, []).append(entry)
            self._entry_points = found
        return self._entry_points

    def _load(self, name: str) -> T:
        entries = self._discovered()[name]
        where = f"{', '.join(describe(entry) for entry in entries)} in group {self.group!r}"
        if len(entries) > 1:
            raise ValueError(f"{self.kind} {name!r} is declared by several entry points, {where}: keep one of them")
        try:
            item = self._check(entries[0].load(), name)
        except Exception as exc:  # third-party code: whatever it raises, say which entry point it was
            raise ValueError(
                f"{self.kind} {name!r} could not be loaded from the entry point {where}: {type(exc).__name__}: {exc}"
            ) from exc
        self._discovered().pop(name)
        self._items[name] = item
        self._loaded.add(name)
        return item


def _names(entry: importlib.metadata.EntryPoint, item: object) -> bool:
    """Whether ``entry`` points at ``item`` itself (``module:qualname``): the same plugin, declared twice."""
    return entry.value == f"{getattr(item, '__module__', None)}:{getattr(item, '__qualname__', None)}"
