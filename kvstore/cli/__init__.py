"""The ``kvstore`` command line (the console script runs :data:`app`)."""

from kvstore.cli.app import app

__all__ = ["app"]
