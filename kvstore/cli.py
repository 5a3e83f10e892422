"""The ``kvstore`` command line."""
from __future__ import annotations

import typer

app = typer.Typer(help="kvstore: a tiered KV-cache store for LLM inference engines.", no_args_is_help=True)


@app.command()
def version() -> None:
    """Print the installed version."""
    from kvstore import __version__

    typer.echo(__version__)
