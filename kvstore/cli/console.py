"""What every ``kvstore`` command shares: the consoles, exit codes, option types, argument parsing and tables.

Why one module: each command prints tables, reads a configuration, parses sizes and durations
and ends with an exit code; written once here, they look and behave alike in every command.
A new command imports from here and from the library below (bench, sizing, engine), never
from another command's module.

Exit codes (also in docs/operations.md and ``kvstore --help``): 0 done; 1 some objects could not be listed,
read or deleted (or a dev server would not start); 2 bad usage or configuration; 3 ``verify`` found
damaged objects and left them in place; 4 the deletion was not confirmed; 5 a tier's server could
not be reached or refused the credentials (one line on stderr names the tier, its endpoint and the
cause, never a password or secret key; ``--verbose`` adds the traceback).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Collection, Coroutine, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, TypeVar

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table

from kvstore.errors import ConfigError
from kvstore.util import units

if TYPE_CHECKING:
    from kvstore.config import StoreConfig

EXIT_OK, EXIT_ERRORS, EXIT_USAGE, EXIT_DAMAGED, EXIT_DECLINED, EXIT_UNREACHABLE = 0, 1, 2, 3, 4, 5
EXIT_CODES = (
    "Exit codes: 0 done; 1 some objects could not be listed, read or deleted; 2 bad usage or configuration; "
    "3 verify found damaged objects and left them; 4 deletion not confirmed; 5 a tier's server could not be "
    "reached or refused the credentials."
)
T = TypeVar("T")
log = logging.getLogger("kvstore.cli")
console = Console(width=140)  # results (stdout); wide enough that the tables do not wrap
errors = Console(stderr=True, width=140)  # errors and progress bars (stderr), so stdout stays parseable

ConfigOption = Annotated[
    Path | None,
    typer.Option("--config", "-c", help="kvstore TOML file (default: $KVSTORE_CONFIG); KVSTORE_* variables apply too"),
]
TierOption = Annotated[
    list[str] | None,
    typer.Option(
        "--tier",
        "-t",
        help="disk, redis, s3 or an installed backend's tier (repeatable or comma-separated; default: every enabled)",
    ),
]
NamespaceOption = Annotated[
    list[str] | None,
    typer.Option("--namespace", "-n", help="a namespace as engines name it, or a glob on stored names (repeatable)"),
]


class TierUnreachable(RuntimeError):
    """A tier's server could not be used (down, unreachable, wrong password or keys): exit code 5, one line.

    The message names the tier, its endpoint (host:port, endpoint URL and bucket, or directory;
    never a password or secret key) and the cause.
    """

    def __init__(self, tier: str, endpoint: str, cause: str) -> None:
        super().__init__(f"the {tier} tier ({endpoint}) cannot be used: {cause}")
        self.tier, self.endpoint, self.cause = tier, endpoint, cause


def make_table(title: str, columns: Sequence[str], left: Collection[str] = ()) -> Table:
    """A titled table with ``columns`` in order: right-aligned (figures) except those named in ``left`` (text)."""
    table = Table(title=title)
    for column in columns:
        table.add_column(column, justify="left" if column in left else "right")
    return table


def fail(message: str, code: int = EXIT_USAGE) -> typer.Exit:
    """Print ``message`` in red on stderr; the caller raises the returned exit (default: usage error, code 2).

    Printed as written (no markup read in it), on one line and never wrapped: a message of several
    lines (a configuration with several problems) has them joined with "; ", so every error is one line.
    """
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    head, problems = (lines[0], lines[1:]) if lines and lines[0].endswith(":") else ("", lines)
    message = " ".join(filter(None, [head, "; ".join(problems)]))
    errors.print(f"[red]{escape(message)}[/red]", highlight=False, soft_wrap=True)
    return typer.Exit(code)


def parse_size(text: str, option: str) -> int:
    """Bytes in a size option ('500GiB', '12.5GB', '1048576'); anything else is a usage error naming ``option``."""
    try:
        return units.parse_size(text)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint=f"'{option}'") from None


def parse_duration(text: str, option: str) -> float:
    """Seconds in a duration option ('90s', '10m', '12h', '7d', '1h30m'); anything else is a usage error naming it.

    A bare number is refused: ``--max-age 7`` read as seconds would delete a whole cache meant to keep a week.
    """
    try:
        return units.parse_duration(text, unit_required=True)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint=f"'{option}'") from None


def load_config(path: Path | None) -> StoreConfig:
    """The store configuration (``path``, else $KVSTORE_CONFIG, plus KVSTORE_* variables); a bad one exits 2."""
    from kvstore.config import StoreConfig  # imported when a command runs: `kvstore --help` stays quick

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
    except TierUnreachable as exc:
        log.info("%s", exc, exc_info=exc.__cause__)  # the whole story with --verbose
        raise fail(str(exc), EXIT_UNREACHABLE) from None
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
        disable=not errors.is_terminal,  # no terminal (a script, a log): no progress lines, only the results
    )
