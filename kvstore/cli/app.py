"""The ``kvstore`` command: the typer app, ``version``, and the registration of every other command.

Where a command lives (a new one goes beside its kind, and is registered below):

- :mod:`kvstore.cli.admin`: ``ls``, ``stats``, ``gc``, ``verify`` (what the tiers hold; the work in
  :mod:`kvstore.cli.inventory`);
- :mod:`kvstore.cli.advise`: ``advise`` (DRAM size and write policy from a lookup trace);
- :mod:`kvstore.cli.bench`: ``bench`` (tier throughput against raw baselines);
- :mod:`kvstore.cli.devtools`: ``demo`` and ``dev-servers`` (trying kvstore on one machine).

What they share (consoles, exit codes, options, parsing, the table builder) is :mod:`kvstore.cli.console`.
"""

from __future__ import annotations

import logging
from typing import Annotated

import typer

from kvstore.cli import admin, advise, bench, devtools
from kvstore.cli.console import EXIT_CODES

app = typer.Typer(
    help=f"kvstore: a tiered KV-cache store for LLM inference engines.\n\n{EXIT_CODES}",
    no_args_is_help=True,
    rich_markup_mode="markdown",
)


@app.callback()
def main(verbose: Annotated[bool, typer.Option("--verbose", "-v", help="log what the store does")] = False) -> None:
    """Set up logging for every command: warnings only, or with ``--verbose`` what the store does."""
    logging.basicConfig(
        level=logging.INFO if verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s"
    )


def version() -> None:
    """Print the installed version."""
    from kvstore import __version__

    typer.echo(__version__)


for command in (admin.ls, admin.stats, admin.gc, admin.verify):
    app.command()(command)
app.command("advise")(advise.advise_command)
app.command()(version)
app.command()(devtools.demo)
app.command()(bench.bench)
app.command("dev-servers")(devtools.dev_servers)
