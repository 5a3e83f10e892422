"""``kvstore demo`` and ``kvstore dev-servers``: try kvstore on this machine, with nothing else installed.

The demo's work is :func:`kvstore.cli.demo.run_demo` (it returns a report; this module prints
it); the servers are :mod:`kvstore.testing.servers`, the same ones the tests start. Both are
imported inside the commands, so ``kvstore --help`` does not wait for torch.
"""

from __future__ import annotations

import signal
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Literal

import typer

from kvstore.cli.console import EXIT_ERRORS, console, fail, make_table, parse_size, run
from kvstore.util.units import MB

if TYPE_CHECKING:  # imported for real inside the command (see the docstring)
    from kvstore.cli.demo import DemoReport


def demo(
    prompts: Annotated[int, typer.Option(min=1, help="prompts to prefill")] = 12,
    tokens: Annotated[
        int, typer.Option(min=768, help="tokens per prompt (256 per chunk; the first 512 are shared)")
    ] = 2048,
    dram: Annotated[str, typer.Option(help="DRAM tier size")] = "256MiB",
    directory: Annotated[
        Path | None, typer.Option("--dir", help="disk tier directory (default: a temporary one)")
    ] = None,
) -> None:
    """The full cascade on the embedded default (DRAM + local disk): write, restart, read back."""
    from kvstore.cli.demo import run_demo

    parse_size(dram, "--dram")  # a usage error here, not a traceback from the store's configuration
    report = run(lambda: run_demo(prompts=prompts, tokens=tokens, dram=dram, directory=directory))
    print_demo(report)
    raise typer.Exit(0 if report.ok else 1)


def print_demo(report: DemoReport) -> None:
    """The demo's setting, a table of its phases, its notes and the verdict."""
    console.print(f"[bold]kvstore demo[/]: {report.layout}")
    console.print(f"DRAM tier {report.dram}, disk tier {report.directory}\n")
    columns = ("phase", "chunks", "MB", "seconds", "GB/s", "where the chunks came from")
    table = make_table("the cascade, a restart, and the hits that came back", columns, left=(columns[0], columns[-1]))
    for step in report.steps:
        megabytes = "" if step.nbytes is None else f"{step.nbytes / MB:.0f}"
        rate = "" if step.gbps is None else f"{step.gbps:.2f}"
        table.add_row(step.phase, step.chunks, megabytes, f"{step.seconds:.3f}", rate, step.source)
    console.print(table)
    console.print("\n" + report.notes[0])
    for note in report.notes[1:]:
        console.print(note)
    console.print("[green]demo ok[/]" if report.ok else "[red]demo failed: some chunks were missing or wrong[/]")


def dev_servers(
    s3: Annotated[Literal["moto", "seaweedfs", "none"], typer.Option(help="the S3 server to start")] = "moto",
    redis: Annotated[bool, typer.Option(help="start redis-server too")] = True,
    bucket: Annotated[str, typer.Option(help="the bucket kvstore should use")] = "kvstore",
    check: Annotated[bool, typer.Option(help="store a chunk through each server, read it back, then stop")] = False,
) -> None:
    """Real S3 and Redis servers on 127.0.0.1, no Docker: prints the settings for kvstore; Ctrl-C stops them.

    The same servers the tests use (kvstore.testing.servers): moto or SeaweedFS, and redis-server.
    Ctrl-C, SIGTERM (kill, a service manager) and SIGHUP (the terminal closed) stop the servers
    and remove their data directories.
    """
    import os
    from contextlib import ExitStack

    from kvstore.errors import ServerError
    from kvstore.testing.servers import MotoServer, RedisServer, SeaweedFSServer

    settings: dict[str, str] = {}
    try:
        with ExitStack() as running, _signals_stop():
            try:
                if s3 != "none":
                    server = running.enter_context((MotoServer if s3 == "moto" else SeaweedFSServer)())
                    settings |= server.credentials_env()
                    settings |= {"KVSTORE_S3__ENABLED": "true", "KVSTORE_S3__BUCKET": bucket}
                    settings["KVSTORE_S3__CREATE_BUCKET"] = "true"
                if redis:
                    redis_url = running.enter_context(RedisServer()).url
                    settings |= {"REDIS_URL": redis_url, "KVSTORE_REDIS__ENABLED": "true"}
            except ServerError as exc:
                raise fail(str(exc), EXIT_ERRORS) from None
            console.print("# kvstore picks these up from the environment (paste into your shell):", highlight=False)
            for name, value in settings.items():
                typer.echo(f"export {name}={value}")
            if check:
                os.environ.update(settings)
                _check_dev_servers(s3, redis)
                return
            console.print("# running; Ctrl-C or SIGTERM stops the servers (their data goes with them)", highlight=False)
            while True:
                signal.pause()  # until Ctrl-C, SIGTERM or SIGHUP ends it
    except (KeyboardInterrupt, _Stopped):
        pass  # the stack above has stopped every server started and removed its directory
    console.print("# stopped; the servers and their data are gone", highlight=False)


class _Stopped(Exception):
    """SIGTERM or SIGHUP arrived: unwind, so every server started is stopped and its directory removed."""


@contextmanager
def _signals_stop() -> Iterator[None]:
    """Within the block, SIGTERM and SIGHUP raise :class:`_Stopped` (as Ctrl-C raises KeyboardInterrupt)."""

    def stop(signum: int, _frame: object) -> None:
        raise _Stopped(signal.Signals(signum).name)

    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _check_dev_servers(s3: str, redis: bool) -> None:
    """Put one chunk through every remote tier, then read it back with each tier alone; exit 1 if one fails."""
    import torch

    from kvstore import KVLayout, StoreConfig, SyncKVStore

    layout = KVLayout(num_layers=2, num_kv_heads=2, head_dim=64, chunk_tokens=16)
    chunk = torch.randn(layout.chunk_shape).to(layout.dtype)
    base = {"dram": {"capacity": "1MiB"}, "disk": {"enabled": False}}
    with SyncKVStore(StoreConfig(**base), layout, namespace="dev-servers-check") as store:
        key = store.chunk_keys(list(range(16)))[0]
        store.put(key, chunk)
        store.flush(timeout=30)
    tiers = ([f"s3 ({s3})"] if s3 != "none" else []) + (["redis"] if redis else [])
    for tier in tiers:
        only = {"s3": {"enabled": False}} if tier == "redis" else {"redis": {"enabled": False}}
        with SyncKVStore(StoreConfig(**base, **only), layout, namespace="dev-servers-check") as store:
            back = store.get(key)
        if back is None or not torch.equal(back, chunk):
            raise fail(f"check: the chunk did not come back from {tier}", EXIT_ERRORS)
    console.print(f"check: a chunk was stored and read back exactly through {', '.join(tiers) or 'nothing'}")
