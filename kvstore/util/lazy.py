"""Modules imported on first use, so a command's ``--help`` does not wait for torch."""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any


class Deferred:
    """Stands for the module ``name`` and imports it (an ordinary import) when an attribute is first read.

    Not placed in ``sys.modules``: nothing that walks the imported modules (``inspect.getmodule``,
    which torch runs while it imports) can set off the import halfway through another one.
    """

    def __init__(self, name: str) -> None:
        self._name = name
        self._module: ModuleType | None = None

    def __getattr__(self, attribute: str) -> Any:
        if self._module is None:
            self._module = importlib.import_module(self._name)
        return getattr(self._module, attribute)

    def __repr__(self) -> str:
        return f"<deferred module {self._name!r}>"
