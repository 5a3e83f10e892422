"""The ``kvstore`` command: the typer app, ``version``, and the registration of every other command.

Where a command lives (a new one goes beside its kind, and is registered below):

- :mod:`kvstore.cli.admin`: ``ls``, ``stats``, ``gc``, ``verify`` (what the tiers hold; the work in
  :mod:`kvstore.cli.inventory`);
- :mod:`kvstore.cli.advise`: ``advise`` (DRAM size and write policy from a lookup trace);
- :mod:`kvstore.cli.bench`: ``bench`` (a quick probe of this machine: tier throughput against raw
  baselines; the measuring in :mod:`kvstore.bench`);
- :mod:`kvstore.cli.trying`: ``demo`` and ``dev-servers`` (trying kvstore on one machine; the demo's
  work in :mod:`kvstore.cli.demo`).

What they share (consoles, exit codes, options, parsing, the table builder) is :mod:`kvstore.cli.console`.
"""

from __future__ import annotations

import logging
import sys
import traceback
from collections.abc import Sequence
from typing import Annotated, Any

import typer
from typer.core import TyperGroup

from kvstore import __version__
from kvstore.cli import admin, advise, bench, trying
from kvstore.cli.console import EXIT_CODES, EXIT_ERRORS, fail

# Click's exception classes, found from typer's (recent typer releases carry a copy of click of their own).
_ClickException = next(c for c in typer.BadParameter.__mro__ if c.__name__ == "ClickException")
_UsageError = next(c for c in typer.BadParameter.__mro__ if c.__name__ == "UsageError")


class OneLineErrors(TyperGroup):
    """The command group, whose usage errors read like every other kvstore error: one red line, exit code 2.

    Click and typer would print a boxed panel with the usage above it; kvstore's own errors (a bad
    configuration, an unreachable server) are one line naming the problem and the fix, and a script
    reading stderr should not have to tell two styles apart.
    """

    def main(
        self,
        args: Sequence[str] | None = None,
        prog_name: str | None = None,
        complete_var: str | None = None,
        standalone_mode: bool = True,
        **extra: Any,
    ) -> Any:
        prog_name = "kvstore"  # also under a test runner or `python -m`, errors name the command users type
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        try:
            code = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        except _ClickException as exc:
            if type(exc).__name__ == "NoArgsIsHelpError":  # `kvstore` alone: the help, printed already
                sys.exit(exc.exit_code)
            ctx = getattr(exc, "ctx", None) if isinstance(exc, _UsageError) else None
            where = ctx.command_path if ctx is not None else "kvstore"
            fail(f"{where}: {exc.format_message()} (see {where} --help)", exc.exit_code)
            sys.exit(exc.exit_code)
        except typer.Abort:
            fail("aborted", EXIT_ERRORS)
            sys.exit(EXIT_ERRORS)
        except Exception as exc:  # a defect: still one line, with the way to the traceback
            if logging.getLogger("kvstore").isEnabledFor(logging.INFO):  # --verbose
                traceback.print_exc()
            fail(f"kvstore: unexpected {type(exc).__name__}: {exc} (--verbose shows the traceback)", EXIT_ERRORS)
            sys.exit(EXIT_ERRORS)
        sys.exit(code if isinstance(code, int) else 0)


app = typer.Typer(
    cls=OneLineErrors,
    help=f"kvstore: a tiered KV-cache store for LLM inference engines.\n\n{EXIT_CODES}",
    no_args_is_help=True,
    rich_markup_mode="markdown",
)


def _print_version(given: bool) -> None:
    """``--version``: print the version and stop before any command runs."""
    if given:
        typer.echo(__version__)
        raise typer.Exit()


@app.callback()
def main(
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="log what the store does")] = False,
    show_version: Annotated[
        bool, typer.Option("--version", callback=_print_version, is_eager=True, help="print the version and exit")
    ] = False,
) -> None:
    """Set up logging for every command: warnings only, or with ``--verbose`` what the store does."""
    logging.basicConfig(
        level=logging.INFO if verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s"
    )


def version() -> None:
    """Print the installed version (also ``kvstore --version``)."""
    typer.echo(__version__)


for command in (admin.ls, admin.stats, admin.gc, admin.verify):
    app.command()(command)
app.command("advise")(advise.advise_command)
app.command()(version)
app.command()(trying.demo)
app.command()(bench.bench)
app.command("dev-servers")(trying.dev_servers)
