"""``kvstore bench``: a quick probe of this machine; runs the measurements in :mod:`kvstore.bench` and prints tables.

The measuring lives in ``kvstore.bench.local`` (DRAM and disk), ``remote`` (Redis and S3 on dev
servers started for the run), ``prefetch`` (layer streams against simulated compute), ``device``
and ``ttft`` (an engine's memory, time to first token) and ``accuracy`` (codecs' effect on a real
model's answers); each returns rows, and this module only chooses what to run and renders the
results. Those modules are imported inside the command: they pull in torch and the servers, which
``kvstore --help`` should not wait for. The research benchmarks (eviction, auto mode, serving...)
are not here: they run from a clone (``benchmarks/``, docs/benchmarks.md).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.table import Table

from kvstore.cli.console import EXIT_ERRORS, console, fail, make_table
from kvstore.util.units import GB, MB, MiB, per_second

if TYPE_CHECKING:  # kvstore.bench sits below the CLI; imported for real inside the command (see the docstring)
    from kvstore.bench.disk_parts import Part
    from kvstore.bench.local import CodecRow, Row
    from kvstore.bench.prefetch import OverlapRow
    from kvstore.bench.ttft import TTFTRow

RATE_UNITS = {"GB/s": (GB, 2), "MB/s": (MB, 0)}  # unit: (bytes per unit, decimals shown)


def bench(
    mib: Annotated[int, typer.Option(min=1, help="MiB moved per layout and operation")] = 256,
    repeats: Annotated[int, typer.Option(min=1, help="best of this many runs")] = 3,
    directory: Annotated[
        Path | None,
        typer.Option(
            "--dir",
            exists=True,
            file_okay=False,
            writable=True,
            help="an existing directory the disk benchmark writes in",
        ),
    ] = None,
    fsync: Annotated[bool, typer.Option(help="fsync every file (tier and baseline alike)")] = False,
    codecs: Annotated[bool, typer.Option(help="also measure codecs on the real KV sample")] = True,
    disk_parts: Annotated[
        bool, typer.Option(help="also time each stage of a disk put + flush alone (where its time goes)")
    ] = False,
    sample: Annotated[
        Path | None, typer.Option(exists=True, dir_okay=False, help="real KV sample (.npy, bf16 bits as uint16)")
    ] = None,
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
    accuracy: Annotated[
        str,
        typer.Option(help="what each codec does to a real model's answers: smollm2 (minutes; --no-local to run alone)"),
    ] = "",
    prompts: Annotated[int, typer.Option(min=1, help="prompts of real text for --accuracy")] = 20,
    device: Annotated[
        str,
        typer.Option(
            help="the paths into an engine's memory on this device (cpu or cuda): put, get_many and layer streams "
            "against raw copies; on cuda also HFConnector's time to first token (random-weight Llama 1B and 8B)"
        ),
    ] = "",
    gpu: Annotated[bool, typer.Option("--gpu", help="the same as --device cuda")] = False,
    ttft_cases: Annotated[
        str, typer.Option(help="with --device: model:prompt pairs for the TTFT table, e.g. 8B:8192,8B:32768")
    ] = "",
    accuracy_codecs: Annotated[
        str,
        typer.Option(help="comma-separated codecs for --accuracy (default: every built-in and lossy codec registered)"),
    ] = "",
    torch_threads: Annotated[
        int | None,
        typer.Option(
            min=1,
            help="torch's intra-op threads for the run, kvstore and baselines alike (default: torch's own; "
            "vLLM's GPU workers serve with 1)",
        ),
    ] = None,
) -> None:
    """Tier throughput against memcpy, raw file I/O and raw S3/Redis clients, measured in the same run."""
    names = _remote_names(remote, remote_layout)  # checked before the local bench spends minutes
    accuracy_names = _accuracy_codecs(accuracy, accuracy_codecs)
    from kvstore.bench.machine import describe_machine, torch_threads_set

    with torch_threads_set(torch_threads):
        console.print(f"machine: {describe_machine()}", markup=False, highlight=False, soft_wrap=True)
        if local:
            _bench_local(mib, repeats, directory, fsync, codecs, sample, disk_parts)
        if names:
            _bench_remote(names, mib, repeats, remote_layout, concurrency, sample, codecs)
        if prefetch:
            _bench_prefetch(prefetch, repeats)
        if accuracy:
            _bench_accuracy(prompts, accuracy_names)
        if gpu or device:
            _bench_device("cuda" if gpu else device, repeats, directory, ttft_cases)


# -- tables -------------------------------------------------------------------------------------


def ratio_table(title: str, rows: Sequence[Row], unit: str) -> Table:
    """kvstore beside its baseline, one row per layout and operation; throughputs in ``unit`` (GB/s or MB/s)."""
    scale, decimals = RATE_UNITS[unit]
    columns = ("layout", "operation", f"kvstore {unit}", "baseline", f"baseline {unit}", "ratio", "target")
    table = make_table(title, columns, left=("layout", "operation", "baseline"))
    for row in rows:
        target = row.target
        mark = "" if target is None else (" [green]ok[/]" if row.ratio >= target else " [red]below[/]")
        table.add_row(
            row.layout,
            row.operation,
            f"{per_second(row.nbytes, row.seconds, scale):.{decimals}f}",
            row.baseline,
            f"{per_second(row.nbytes, row.baseline_seconds, scale):.{decimals}f}",
            f"{row.ratio:.2f}x",
            ("" if target is None else f">= {target}x") + mark,
        )
    return table


def codec_table(title: str, rows: Sequence[CodecRow], remote: bool) -> Table:
    """One row per codec (and server, for ``remote`` rows): ratio and MB/s each way; in memory, also the error.

    Remote rows also give each get's speed as a share of the same server's identity get (raw KV), same run.
    """
    if remote:
        columns = ["server", "codec", "lossless", "ratio", "put MB/s of KV", "get MB/s of KV", "get vs identity"]
    else:
        columns = ["codec", "lossless", "ratio", "encode MB/s", "decode MB/s", "error"]
    table = make_table(title, columns, left=("server", "codec", "lossless", "error"))
    identity_get = {row.server: row.get_mbps for row in rows if row.codec == "identity"}
    for row in rows:
        figures = [row.codec, "yes" if row.lossless else "no", f"{row.ratio:.3f}", f"{row.put_mbps:.0f}"]
        figures.append(f"{row.get_mbps:.0f}")
        if remote:
            base = identity_get.get(row.server)
            table.add_row(row.server, *figures, f"{row.get_mbps / base:.2f}x" if base else "")
        else:
            table.add_row(*figures, row.error)
    return table


def overlap_table(rows: Sequence[OverlapRow], target: float) -> Table:
    """Layer streams: fetch and compute per layer, time to layer 0, and how much fetch the compute hid."""
    title = "layer streams: 8 SmolLM2 chunks (2K tokens), simulated compute c per layer, depth 4"
    columns = (
        "tier",
        "fetch f / layer",
        "compute c / layer",
        "time to layer 0",
        "total",
        "fetch hidden",
        "after layer 0",
    )
    table = make_table(title, columns)
    for row in rows:
        verdict = "met" if row.compute_per_layer < row.fetch_per_layer or row.efficiency >= target else "missed"
        table.add_row(
            row.tier,
            f"{row.fetch_per_layer * 1e3:.2f} ms",
            f"{row.compute_per_layer * 1e3:.2f} ms",
            f"{row.ttfl * 1e3:.2f} ms",
            f"{row.total * 1e3:.1f} ms",
            f"{row.efficiency:.0%} ({verdict})",
            f"{row.efficiency_after_first:.0%}",
        )
    return table


def parts_table(title: str, parts: Sequence[Part]) -> Table:
    """Each stage's milliseconds and GB/s: a stage's share of the path through the API (put + flush), or the path's
    speed as a ratio of a baseline's."""
    table = make_table(title, ("layout", "stage", "ms", "GB/s", "share, or ratio"), left=("layout", "stage"))
    whole: dict[str, float] = {}
    for part in parts:
        whole.setdefault(part.layout, part.seconds)  # each layout's first part is the whole path
        speed = "" if part.kind == "rest" else f"{per_second(part.nbytes, part.seconds, GB):.2f}"
        if part.kind == "baseline":
            share = f"put + flush at {part.seconds / whole[part.layout]:.2f}x"
        else:
            share = f"{part.seconds / whole[part.layout]:.0%}" + (" (not added)" if part.kind == "detail" else "")
        table.add_row(part.layout, part.stage, f"{part.seconds * 1e3:.1f}", speed, share)
    return table


# -- the parts of a run -------------------------------------------------------------------------


def _bench_local(
    mib: int, repeats: int, directory: Path | None, fsync: bool, codecs: bool, sample: Path | None, parts: bool
) -> None:
    """DRAM and disk against memcpy and raw file I/O, the stages of a disk put if asked, then codecs in one thread."""
    from kvstore.bench import local as b

    rows, _ = asyncio.run(b.run(mib, repeats, directory, fsync))
    title = f"kvstore bench: {mib} MiB per row, best of {repeats}, fsync={'on' if fsync else 'off'}"
    console.print(ratio_table(title, rows, "GB/s"))
    if parts:
        from kvstore.bench.disk_parts import run_disk_parts

        title = (
            f"where a disk put + flush spends its time: {mib} MiB, best of {repeats}, fsync={'on' if fsync else 'off'}"
        )
        console.print(parts_table(title, asyncio.run(run_disk_parts(mib, repeats, directory, fsync))))
    if codecs:
        path = sample or b.default_sample_path()
        if path is None:
            console.print("[yellow]codecs skipped: no real KV sample found; pass --sample PATH[/]")
            return
        with b.one_torch_thread():
            results = b.bench_codecs(b.load_kv_sample(path)[:, :, :256].contiguous(), repeats)
        title = f"codecs on real KV ({path.name}, 256-token chunk, per-layer segments, 1 thread)"
        console.print(codec_table(title, results, remote=False))


def _remote_names(remote: str, layouts: list[str] | None) -> list[str]:
    """The --remote servers, checked with the --remote-layout names; an unknown one is a usage error."""
    if not remote:
        return []
    from kvstore.bench import local as b
    from kvstore.bench import remote_servers as servers

    try:
        for layout in layouts or []:
            if layout not in b.LAYOUTS:
                raise ValueError(f"unknown layout {layout!r}; choose from {', '.join(b.LAYOUTS)}")
        return servers.parse_remotes(remote)
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
    from kvstore.bench import local as b
    from kvstore.bench import remote as r
    from kvstore.bench import remote_servers as servers
    from kvstore.errors import ServerError

    path = (sample or b.default_sample_path()) if codecs else None
    if codecs and path is None:
        console.print("[yellow]remote codec rows skipped: no real KV sample found; pass --sample PATH[/]")
    kv = None if path is None else b.load_kv_sample(path)
    try:
        with servers.serve(names, concurrency) as remotes:
            results = asyncio.run(
                r.run_remote(remotes, mib, repeats, layouts or list(b.LAYOUTS), kv, concurrency=concurrency)
            )
    except ServerError as exc:
        raise fail(f"could not start a dev server: {exc}", EXIT_ERRORS) from None
    title = f"kvstore bench, remote tiers: {mib} MiB per row, {concurrency} in flight, best of {repeats}"
    console.print(ratio_table(title, results.rows, "MB/s"))
    if results.codec_rows:
        size = results.codec_rows[0].nbytes / MiB
        title = f"codecs through the remote tiers on real KV: SmolLM2 sample, {size:.0f} MiB per row (uncompressed)"
        console.print(codec_table(title, results.codec_rows, remote=True))


def _bench_prefetch(tiers: str, repeats: int) -> None:
    """Time to first layer and overlap efficiency of layer streams against simulated compute."""
    from kvstore.bench import prefetch as p

    try:
        names = p.parse_tiers(tiers)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None
    console.print(overlap_table(p.run_overlap(names, repeats=repeats), p.TARGET))


def _bench_device(device: str, repeats: int, directory: Path | None, cases: str) -> None:
    """Loads and saves between the store and ``device`` memory; on a GPU (or with ``cases``) the TTFT table too."""
    import torch

    from kvstore.bench import device as d
    from kvstore.bench import ttft as t

    if device not in ("cpu", "cuda"):
        raise typer.BadParameter(f"--device {device!r}: choose cpu or cuda")
    if device == "cuda" and not torch.cuda.is_available():
        raise fail("--device cuda: torch.cuda.is_available() is False here (no GPU, or a CPU-only torch)", EXIT_ERRORS)
    try:
        chosen = t.parse_cases(cases) if cases else (t.CASES if device == "cuda" else ())
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None
    card = torch.cuda.get_device_name() if device == "cuda" else "CPU"
    rows = asyncio.run(d.bench_paths(device, repeats=repeats, directory=directory))
    title = (
        f"kvstore bench --device {device} ({card}): 16 Llama-3-8B chunks (512 MiB) per row, best of {repeats}; "
        f"streams {d.ENGINE_DEPTH} layers ahead"
    )
    console.print(ratio_table(title, rows, "GB/s"))
    if device == "cpu":
        from kvstore.util.copy_kernels import CHOICE

        console.print(f"copy kernels this process chose: {CHOICE.describe()}", markup=False, highlight=False)
    if chosen:
        console.print(ttft_table(t.bench_ttft(chosen, device, repeats, directory), card))


def ttft_table(rows: Sequence[TTFTRow], card: str) -> Table:
    """HFConnector's time to first token beside recompute and a hit in a cache already on the device."""
    columns = ("model", "prompt", "recompute", "GPU cache hit", "kvstore DRAM", "kvstore disk", "first + save")
    table = make_table(f"HFConnector time to first token on {card} (random-weight Llama, bf16, SDPA)", columns)
    for row in rows:

        def ms(seconds: float) -> str:
            return f"{seconds * 1e3:.0f} ms"

        table.add_row(
            row.model,
            f"{row.prompt // 1024}K",
            ms(row.recompute),
            ms(row.gpu_hit),
            f"{ms(row.dram)} ({row.recompute / row.dram:.1f}x; {row.loaded_dram}/{row.chunks} loaded)",
            f"{ms(row.disk)} ({row.recompute / row.disk:.1f}x; {row.loaded_disk}/{row.chunks} loaded)",
            f"{ms(row.first_with_save)} ({row.first_with_save / row.recompute:.2f}x recompute)",
        )
    return table


def _accuracy_codecs(model: str, codecs: str) -> list[str]:
    """The --accuracy-codecs names, checked (an unknown one is a usage error before any work); [] without --accuracy."""
    if not model:
        if codecs:
            raise typer.BadParameter("--accuracy-codecs needs --accuracy smollm2")
        return []
    from kvstore.bench import accuracy as a

    if model not in a.MODELS:
        raise typer.BadParameter(f"unknown model {model!r} for --accuracy; choose from {', '.join(a.MODELS)}")
    if codecs:
        try:
            return a.parse_codecs(codecs)
        except ValueError as exc:
            raise typer.BadParameter(str(exc)) from None
    names, missing = a.default_codecs()
    if missing:
        console.print(f"[yellow]not registered here, left out: {', '.join(missing)}[/]")
    return names


def _bench_accuracy(prompts: int, codecs: list[str]) -> None:
    """Codecs on SmolLM2's answers: a markdown table (the one in docs/codecs.md), progress per prompt as it goes."""
    from kvstore.bench import accuracy as a

    start = time.perf_counter()
    rows, used = a.run_smollm2(prompts, codecs, lambda line: console.print(line, markup=False, highlight=False))
    console.print(a.describe(used, time.perf_counter() - start), markup=False, highlight=False, soft_wrap=True)
    console.print(a.markdown_table(rows), markup=False, highlight=False, soft_wrap=True)
