"""What every ``kvstore`` command shares: the consoles, exit codes, option types, argument parsing and tables.

Why one module: each command prints tables, reads a configuration, parses sizes and durations
and ends with an exit code; written once here, they look and behave alike in every command.
A new command imports from here and from the library below (devtools, sizing, engine), never
from another command's module.

Exit codes (also in the README): 0 done; 1 some objects could not be listed, read or deleted (or a
dev server would not start); 2 bad usage or configuration; 3 ``verify`` found damaged objects and
left them in place; 4 the deletion was not confirmed.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Collection, Coroutine, Sequence
from pathlib import Path
from typing import Annotated, Any, TypeVar

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table

from kvstore.config import StoreConfig
from kvstore.errors import ConfigError
from kvstore.util import units

EXIT_OK, EXIT_ERRORS, EXIT_USAGE, EXIT_DAMAGED, EXIT_DECLINED = 0, 1, 2, 3, 4
T = TypeVar("T")
console = Console(width=140)  # results (stdout); wide enough that the tables do not wrap
errors = Console(stderr=True, width=140)  # errors and progress bars (stderr), so stdout stays parseable

ConfigOption = Annotated[
    Path | None,
    typer.Option("--config", "-c", help="kvstore TOML file (default: $KVSTORE_CONFIG); KVSTORE_* variables apply too"),
]
TierOption = Annotated[
    list[str] | None,
    typer.Option("--tier", "-t", help="disk, redis or s3 (repeatable or comma-separated; default: every enabled tier)"),
]
NamespaceOption = Annotated[
    list[str] | None,
    typer.Option("--namespace", "-n", help="a namespace as engines name it, or a glob on stored names (repeatable)"),
]


def make_table(title: str, columns: Sequence[str], left: Collection[str] = ()) -> Table:
    """A titled table with ``columns`` in order: right-aligned (figures) except those named in ``left`` (text)."""
    table = Table(title=title)
    for column in columns:
        table.add_column(column, justify="left" if column in left else "right")
    return table


def fail(message: str, code: int = EXIT_USAGE) -> typer.Exit:
    """Print ``message`` in red on stderr; the caller raises the returned exit (default: usage error, code 2)."""
    errors.print(f"[red]{message}[/red]", highlight=False)
    return typer.Exit(code)


def parse_size(text: str, option: str) -> int:
    """Bytes in a size option ('500GiB', '12.5GB', '1048576'); anything else is a usage error naming ``option``."""
    try:
        return units.parse_size(text)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint=f"'{option}'") from None


def parse_duration(text: str, option: str) -> float:
    """Seconds in a duration option ('90s', '10m', '12h', '7d', '1h30m'); anything else is a usage error naming it."""
    try:
        return units.parse_duration(text)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint=f"'{option}'") from None


def load_config(path: Path | None) -> StoreConfig:
    """The store configuration (``path``, else $KVSTORE_CONFIG, plus KVSTORE_* variables); a bad one exits 2."""
    try:
        return StoreConfig.load(path)
    except ConfigError as exc:
        raise fail(str(exc)) from None


def run(main: Callable[[], Coroutine[Any, Any, T]]) -> T:
    """Run a tool; configuration problems and unreachable servers end it with a message, not a trace."""
    try:
        return asyncio.run(main())
    except ConfigError as exc:
        raise fail(str(exc)) from None
    except (OSError, RuntimeError) as exc:
        raise fail(f"{type(exc).__name__}: {exc}", EXIT_ERRORS) from None


def progress_bar() -> Progress:
    """A transient progress display on stderr (spinner, bar, done/total, elapsed) for long listings and checks."""
    return Progress(
        SpinnerColumn(),
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=errors,
        transient=True,
    )
