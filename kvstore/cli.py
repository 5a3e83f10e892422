"""The ``kvstore`` command line: ``demo``, ``bench``, ``version``."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

app = typer.Typer(help="kvstore: a tiered KV-cache store for LLM inference engines.", no_args_is_help=True)
console = Console(width=120)


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
    from kvstore.demo import run_demo

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
) -> None:
    """Tier throughput against memcpy and raw file I/O, measured in the same run."""
    from kvstore import bench as b

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
