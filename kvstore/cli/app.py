"""The ``kvstore`` command line: ``demo``, ``bench``, ``dev-servers``, ``version``, and the operator's
tools ``ls``, ``stats``, ``gc`` and ``verify`` (in :mod:`kvstore.cli.admin`), and ``advise``
(in :mod:`kvstore.cli.advise`)."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from kvstore.cli import admin as admin_cli
from kvstore.cli import advise as advise_cli

app = typer.Typer(
    help="kvstore: a tiered KV-cache store for LLM inference engines.",
    no_args_is_help=True,
    rich_markup_mode="markdown",
)
console = Console(width=120)
for tool in (admin_cli.ls, admin_cli.stats, admin_cli.gc, admin_cli.verify):
    app.command()(tool)
app.command("advise")(advise_cli.advise_command)


@app.callback()
def main(verbose: Annotated[bool, typer.Option("--verbose", "-v", help="log what the store does")] = False) -> None:
    logging.basicConfig(
        level=logging.INFO if verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s"
    )


@app.command()
def version() -> None:
    """Print the installed version."""
    from kvstore import __version__

    typer.echo(__version__)


@app.command()
def demo(
    prompts: Annotated[int, typer.Option(help="prompts to prefill")] = 12,
    tokens: Annotated[int, typer.Option(help="tokens per prompt (256 per chunk)")] = 2048,
    dram: Annotated[str, typer.Option(help="DRAM tier size")] = "256MiB",
    directory: Annotated[
        Path | None, typer.Option("--dir", help="disk tier directory (default: a temporary one)")
    ] = None,
) -> None:
    """The full cascade on the embedded default (DRAM + local disk): write, restart, read back."""
    from kvstore.devtools.demo import run_demo

    ok = asyncio.run(run_demo(console, prompts=prompts, tokens=tokens, dram=dram, directory=directory))
    raise typer.Exit(0 if ok else 1)


@app.command()
def bench(
    mib: Annotated[int, typer.Option(help="MiB moved per layout and operation")] = 256,
    repeats: Annotated[int, typer.Option(help="best of this many runs")] = 3,
    directory: Annotated[Path | None, typer.Option("--dir", help="where the disk benchmark writes")] = None,
    fsync: Annotated[bool, typer.Option(help="fsync every file (tier and baseline alike)")] = False,
    codecs: Annotated[bool, typer.Option(help="also measure codecs on the real KV sample")] = True,
    sample: Annotated[Path | None, typer.Option(help="real KV sample (.npy, bf16 bits as uint16)")] = None,
    remote: Annotated[
        str, typer.Option(help="remote tiers to bench on dev servers started here: redis,moto,seaweedfs or all")
    ] = "",
    local: Annotated[bool, typer.Option(help="bench DRAM and disk (--no-local: only the remote tiers)")] = True,
    remote_layout: Annotated[
        list[str] | None, typer.Option(help="layouts for the remote bench (repeatable; default: all)")
    ] = None,
    concurrency: Annotated[
        int, typer.Option(min=1, help="remote requests in flight, kvstore and raw client alike")
    ] = 4,
    prefetch: Annotated[str, typer.Option(help="layer-stream overlap on these tiers: dram,disk,redis,s3 or all")] = "",
) -> None:
    """Tier throughput against memcpy, raw file I/O and raw S3/Redis clients, measured in the same run."""
    names = _remote_names(remote, remote_layout)  # checked before the local bench spends minutes
    if local:
        _bench_local(mib, repeats, directory, fsync, codecs, sample)
    if names:
        _bench_remote(names, mib, repeats, remote_layout, concurrency, sample, codecs)
    if prefetch:
        _bench_prefetch(prefetch, repeats)


def _bench_prefetch(tiers: str, repeats: int) -> None:
    """Time to first layer and overlap efficiency of layer streams against simulated compute."""
    from kvstore.devtools import bench_prefetch as p

    try:
        names = p.parse_tiers(tiers)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None
    rows = p.run_overlap(names, repeats=repeats)
    table = Table(title="layer streams: 8 SmolLM2 chunks (2K tokens), simulated compute c per layer, depth 4")
    for column in ("tier", "fetch f / layer", "compute c / layer", "time to layer 0", "total", "fetch hidden"):
        table.add_column(column, justify="right")
    for row in rows:
        verdict = "met" if row.compute_per_layer < row.fetch_per_layer or row.efficiency >= p.TARGET else "missed"
        table.add_row(
            row.tier,
            f"{row.fetch_per_layer * 1e3:.2f} ms",
            f"{row.compute_per_layer * 1e3:.2f} ms",
            f"{row.ttfl * 1e3:.2f} ms",
            f"{row.total * 1e3:.1f} ms",
            f"{row.efficiency:.0%} ({verdict})",
        )
    console.print(table)


def _bench_local(
    mib: int, repeats: int, directory: Path | None, fsync: bool, codecs: bool, sample: Path | None
) -> None:
    """DRAM and disk against memcpy and raw file I/O, then codecs in one thread."""
    from kvstore.devtools import bench as b

    rows, _ = asyncio.run(b.run(mib, repeats, directory, fsync))
    table = Table(title=f"kvstore bench: {mib} MiB per row, best of {repeats}, fsync={'on' if fsync else 'off'}")
    for column in ("layout", "operation", "kvstore GB/s", "baseline", "baseline GB/s", "ratio", "target"):
        table.add_column(column, justify="right" if "GB/s" in column or column in ("ratio", "target") else "left")
    for row in rows:
        target = row.target
        mark = "" if target is None else (" [green]ok[/]" if row.ratio >= target else " [red]below[/]")
        table.add_row(
            row.layout,
            row.operation,
            f"{row.gbps:.2f}",
            row.baseline,
            f"{row.baseline_gbps:.2f}",
            f"{row.ratio:.2f}x",
            ("" if target is None else f">= {target}x") + mark,
        )
    console.print(table)
    if codecs:
        path = sample or b.default_sample_path()
        if path is None:
            console.print("[yellow]codecs skipped: no real KV sample found; pass --sample PATH[/]")
            return
        results = b.bench_codecs(b.load_kv_sample(path)[:, :, :256].contiguous(), repeats)
        codec_table = Table(title=f"codecs on real KV ({path.name}, 256-token chunk, per-layer segments, 1 thread)")
        for column in ("codec", "lossless", "ratio", "encode MB/s", "decode MB/s", "error"):
            codec_table.add_column(column)
        for result in results:
            codec_table.add_row(
                str(result["codec"]),
                str(result["lossless"]),
                f"{result['ratio']:.3f}",
                f"{result['encode_mbps']:.0f}",
                f"{result['decode_mbps']:.0f}",
                str(result.get("error", "")),
            )
        console.print(codec_table)


def _remote_names(remote: str, layouts: list[str] | None) -> list[str]:
    if not remote:
        return []
    from kvstore.devtools import bench as b
    from kvstore.devtools import bench_remote as r

    try:
        for layout in layouts or []:
            if layout not in b.LAYOUTS:
                raise ValueError(f"unknown layout {layout!r}; choose from {', '.join(b.LAYOUTS)}")
        return r.parse_remotes(remote)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None


def _bench_remote(
    names: list[str],
    mib: int,
    repeats: int,
    layouts: list[str] | None,
    concurrency: int,
    sample: Path | None,
    codecs: bool,
) -> None:
    """The remote tiers on dev servers started for the run; exits 1 when a server cannot start."""
    from kvstore.devtools import bench as b
    from kvstore.devtools import bench_remote as r
    from kvstore.errors import ServerError

    path = (sample or b.default_sample_path()) if codecs else None
    if codecs and path is None:
        console.print("[yellow]remote codec rows skipped: no real KV sample found; pass --sample PATH[/]")
    kv = None if path is None else b.load_kv_sample(path)
    try:
        with r.serve(names, concurrency) as remotes:
            results = asyncio.run(
                r.run_remote(remotes, mib, repeats, layouts or list(b.LAYOUTS), kv, concurrency=concurrency)
            )
    except ServerError as exc:
        console.print(f"[red]could not start a dev server: {exc}[/]")
        raise typer.Exit(1) from None
    for table in r.tables(results, mib, repeats, concurrency):
        console.print(table)


@app.command("dev-servers")
def dev_servers(
    s3: Annotated[str, typer.Option(help="the S3 server to start: moto, seaweedfs or none")] = "moto",
    redis: Annotated[bool, typer.Option(help="start redis-server too")] = True,
    bucket: Annotated[str, typer.Option(help="the bucket kvstore should use")] = "kvstore",
    check: Annotated[bool, typer.Option(help="store a chunk through each server, read it back, then stop")] = False,
) -> None:
    """Real S3 and Redis servers on 127.0.0.1, no Docker: prints the settings for kvstore; Ctrl-C stops them.

    The same servers the tests use (kvstore.devtools.servers): moto or SeaweedFS, and redis-server.
    """
    import os
    import signal
    from contextlib import ExitStack

    from kvstore.devtools.servers import MotoServer, RedisServer, SeaweedFSServer
    from kvstore.errors import ServerError

    if s3 not in ("moto", "seaweedfs", "none"):
        raise typer.BadParameter("use moto, seaweedfs or none", param_hint="--s3")
    settings: dict[str, str] = {}
    with ExitStack() as running:
        try:
            if s3 != "none":
                server = running.enter_context((MotoServer if s3 == "moto" else SeaweedFSServer)())
                settings |= server.credentials_env()
                settings |= {"KVSTORE_S3__ENABLED": "true", "KVSTORE_S3__BUCKET": bucket}
                settings["KVSTORE_S3__CREATE_BUCKET"] = "true"
            if redis:
                settings |= {"REDIS_URL": running.enter_context(RedisServer()).url, "KVSTORE_REDIS__ENABLED": "true"}
        except ServerError as exc:
            console.print(f"[red]{exc}[/red]")
            raise typer.Exit(2) from None
        console.print("# kvstore picks these up from the environment (paste into your shell):", highlight=False)
        for name, value in settings.items():
            typer.echo(f"export {name}={value}")
        if check:
            os.environ.update(settings)
            _check_dev_servers(s3, redis)
            return
        console.print("# running; Ctrl-C stops the servers (their data goes with them)", highlight=False)
        try:
            signal.pause()  # until Ctrl-C (or another signal) arrives
        except KeyboardInterrupt:
            pass


def _check_dev_servers(s3: str, redis: bool) -> None:
    """Put one chunk through every remote tier, then read it back with each tier alone."""
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
            console.print(f"[red]check: the chunk did not come back from {tier}[/red]")
            raise typer.Exit(1)
    console.print(f"check: a chunk was stored and read back exactly through {', '.join(tiers) or 'nothing'}")
