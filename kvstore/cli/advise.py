"""``kvstore advise TRACE``: replay a recorded chunk-lookup trace and say what DRAM size and write policy pay.

The trace (``[adaptive] trace = ...`` records one) is fed in order to the same reuse-time sampler the
store runs online, so the offline answer is the one auto mode would reach; ``--exact`` times every reuse
instead, for a curve without sampling error on traces small enough to afford it. Costs are in seconds
per chunk from the sizes and bandwidths given (defaults: the store config and this machine's measured
baselines), so every saving is a fraction of prefill compute (see :mod:`kvstore.sizing.advice`).

The write policies weighed are the admission policies of :mod:`kvstore.admission` (``adaptive.policy``).
The curves give the hit rates of LRU tiers (see :data:`kvstore.sizing.mrc.MODELLED_EVICTION`); the
output says so, and names the tiers the config has evict by another policy.

Exit codes as in :mod:`kvstore.cli.console`: 0 done; 2 bad usage, configuration or trace file.
"""

from __future__ import annotations

import importlib.util
import json
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal, get_args

import numpy as np
import typer
from rich.table import Table

from kvstore.cli.console import ConfigOption, console, fail, load_config, make_table, parse_size
from kvstore.errors import TraceFormatError
from kvstore.sizing.advice import DEFAULT_BANDWIDTH, Advice, CostModel, Policy, TierRates, advise, cost_model
from kvstore.sizing.mrc import MODELLED_EVICTION, ReuseProfile, ReuseSampler
from kvstore.sizing.traces import Trace, flatten, read_trace, write_trace
from kvstore.sizing.workloads import all_unique, multi_turn, phase_change, rag, zipf_prefixes
from kvstore.util.units import GB, human_bytes, short_bytes

if TYPE_CHECKING:
    from kvstore.config import StoreConfig

DRAM_GBPS, DISK_READ_GBPS, DISK_WRITE_GBPS, REMOTE_GBPS = (
    DEFAULT_BANDWIDTH[name] / GB for name in ("dram_copy", "disk_read", "disk_write", "remote")
)
SyntheticChoice = Literal["zipf", "multi-turn", "rag", "unique", "phase"]
SYNTHETIC: tuple[str, ...] = get_args(SyntheticChoice)
# SmolLM2-135M: 30 layers x K,V x 3 heads x 64 dims x 2 bytes x 256 tokens, bf16 (1,966,080 bytes).
SYNTHETIC_META = {"chunk_tokens": 256, "chunk_bytes": 1_966_080, "writer": "kvstore advise --synthetic"}
CURVE_POINTS = 64
# KV bytes per token that a real model has: SmolLM2-135M holds 15 KiB at bf16, Llama-3.1-405B 504 KiB.
# A chunk size from the command line with the trace's tokens per chunk (or the other way round)
# outside this range is two different models mixed up, and would give confidently wrong advice.
PLAUSIBLE_BYTES_PER_TOKEN = (1024, 1024 * 1024)


def synthetic_trace(name: str, requests: int) -> Trace:
    """A workload from :mod:`kvstore.sizing.workloads`, as if read from a file: for demos and the docs."""
    if name not in SYNTHETIC:
        raise fail(f"unknown synthetic workload {name!r}; choose from {', '.join(SYNTHETIC)} (--synthetic)")
    if name == "zipf":
        chains = zipf_prefixes(requests)
    elif name == "multi-turn":
        chains = multi_turn(sessions=max(1, requests // 5))
    elif name == "rag":
        chains = rag(requests)
    elif name == "unique":
        chains = all_unique(requests)
    else:
        chains = phase_change(zipf_prefixes(requests // 2, seed=1), rag(requests - requests // 2, seed=2))
    ids = flatten(chains)
    numbers = np.repeat(np.arange(len(chains)), [len(chain) for chain in chains])
    meta = {**SYNTHETIC_META, "namespace": f"synthetic:{name}"}
    return Trace(meta, numbers.astype(np.float64), numbers.astype(np.uint32), ids, path=f"synthetic:{name}")


def load_trace(path: Path) -> Trace:
    """Read a trace file; a missing, unreadable or foreign file ends the command with exit 2."""
    try:
        return read_trace(path)
    except TraceFormatError as exc:
        raise fail(str(exc)) from None
    except OSError as exc:
        raise fail(f"{path}: {exc.strerror or exc}") from None


def measure(ids: np.ndarray, exact: bool) -> ReuseProfile:
    """The reuse profile of ``ids`` in order: sampled like the store does online, or every reuse timed."""
    if exact:
        sampler = ReuseSampler(rate=1.0, max_watches=max(16, len(ids)), seed=0)
    else:
        sampler = ReuseSampler(seed=0)  # the store's default rate; seeded, so a trace always gives the same advice
    for start in range(0, len(ids), 1 << 16):
        sampler.record(ids[start : start + (1 << 16)])
    return sampler.profile()


def meta_number(trace: Trace, key: str, given: int | None, option: str) -> int:
    """An option, else the trace's metadata field; neither ends the command naming the option."""
    if given is not None:
        return given
    value = trace.meta.get(key)
    if isinstance(value, int | float) and not isinstance(value, bool) and value > 0:
        return int(value)
    raise fail(f"{trace.path}: the trace's metadata has no {key}; pass {option}")


def check_chunk_mix(chunk: int, tokens: int, from_trace: str) -> None:
    """Refuse one chunk option mixed with the trace's other figure when they imply no real model's KV per token.

    ``--chunk-bytes 32MiB`` on a trace recorded with 16-token chunks would mean 2 MiB of KV a token:
    the advice would compare loading 32 MiB with recomputing 16 tokens, and call every hit a loss.
    """
    low, high = PLAUSIBLE_BYTES_PER_TOKEN
    per_token = chunk / tokens
    if low <= per_token <= high:
        return
    given = "--chunk-tokens" if from_trace == "--chunk-bytes" else "--chunk-bytes"
    figure = f"{human_bytes(chunk)}" if from_trace == "--chunk-bytes" else f"{tokens} tokens"
    raise fail(
        f"{given} with the trace's chunk of {figure} means {human_bytes(per_token)} of KV per token, which no model "
        f"has ({human_bytes(low)} to {human_bytes(high)}): give both --chunk-bytes and --chunk-tokens "
        f"(e.g. --chunk-bytes 32MiB --chunk-tokens 256 for Llama-3-8B's 256-token chunks)"
    )


def eviction_note(settings: StoreConfig, disk_bytes: int) -> str:
    """Which eviction the curves model (LRU), and which tiers the config has evict otherwise."""
    configured = {"dram": settings.dram.eviction}
    if disk_bytes:
        configured["disk"] = settings.disk.eviction
    differing = [f"{tier}.eviction = '{name}'" for tier, name in configured.items() if name != MODELLED_EVICTION]
    note = f"hit rates assume {MODELLED_EVICTION.upper()} eviction (the curves come from LRU reuse times)"
    if differing:
        note += (
            f"; the config sets {', '.join(differing)}, whose hit rates differ (see the eviction page: "
            "python -m benchmarks.eviction, from a clone, measures them)"
        )
    return note


def curve(profile: ReuseProfile, cost: CostModel, result: Advice, disk_bytes: int) -> list[dict[str, float]]:
    """Hit rates on a log grid of DRAM sizes spanning the table's rows and the disk size."""
    chunk = cost.chunk_bytes
    low = max(chunk, min(row.dram_bytes for row in result.rows) // 2)
    high = max(max(row.dram_bytes for row in result.rows), disk_bytes) * 2
    sizes = sorted({max(chunk, int(size) // chunk * chunk) for size in np.geomspace(low, high, CURVE_POINTS)})
    policy = result.recommended_policy
    return [
        {
            "dram_bytes": size,
            "dram_hit_rate": profile.hit_rate(size / chunk),
            "hit_rate": cost.hit_rate(profile, size / chunk, policy),
        }
        for size in sizes
    ]


def size_table(result: Advice, chunk: int) -> Table:
    """One row per DRAM size shown: hit rates and net saving; the current and recommended sizes marked."""
    current = result.dram_bytes // chunk * chunk
    columns = ("DRAM", "DRAM hit rate", "hit rate (all tiers)", "net saving (of prefill)", "")
    table = make_table(f"DRAM size (net saving under policy '{result.recommended_policy}')", columns, left=("",))
    for row in result.rows:
        marks = [m for m, on in (("current", row.dram_bytes == current), ("recommended", _is_rec(row, result))) if on]
        table.add_row(
            human_bytes(row.dram_bytes),
            f"{row.dram_hit_rate:.1%}",
            f"{row.hit_rate:.1%}",
            f"{row.net_saving:+.1%}",
            " + ".join(marks),
            style="bold green" if _is_rec(row, result) else None,
        )
    return table


def _is_rec(row: Any, result: Advice) -> bool:
    """Whether ``row`` is the recommended DRAM size."""
    return bool(row.dram_bytes == result.recommended_dram_bytes)


def disk_table(result: Advice, disk_bytes: int) -> Table:
    """One row per disk size shown: the hit rate of DRAM and disk together; current and recommended marked."""
    title = f"disk size (hit rate of DRAM + disk, with {human_bytes(result.dram_bytes)} DRAM)"
    table = make_table(title, ("disk", "hit rate", ""))
    for size, rate in result.disk_rows:
        marks = ["current"] * (size == disk_bytes) + ["recommended"] * (size == result.recommended_disk_bytes)
        table.add_row(human_bytes(size), f"{rate:.1%}", ", ".join(marks))
    return table


def plot_curve(path: Path, points: list[dict[str, float]], result: Advice, disk_bytes: int, title: str) -> None:
    """The miss-ratio curve as a PNG; matplotlib (the ``plot`` extra) is imported only here."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import FuncFormatter, LogLocator, NullLocator, PercentFormatter

    sizes = [p["dram_bytes"] for p in points]
    figure = Figure(figsize=(8, 5), dpi=120)
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    label = "all tiers" if disk_bytes or result.disk_rows else "total"
    axes.plot(sizes, [100 * p["hit_rate"] for p in points], label=f"{label} ({result.recommended_policy})")
    axes.plot(sizes, [100 * p["dram_hit_rate"] for p in points], label="DRAM only", linestyle="--")
    lines = [(result.dram_bytes, "current", "grey", ":"), (result.recommended_dram_bytes, "recommended", "green", "-")]
    if disk_bytes:
        lines.append((disk_bytes, "disk", "tab:purple", "-."))
    for x, name, colour, style in lines:
        axes.axvline(x, color=colour, linestyle=style, linewidth=1, label=f"{name}: {human_bytes(x)}")
    axes.set_xscale("log")
    axes.xaxis.set_major_locator(LogLocator(base=2, numticks=10))
    axes.xaxis.set_minor_locator(NullLocator())
    axes.xaxis.set_major_formatter(FuncFormatter(lambda x, _: short_bytes(x)))
    axes.yaxis.set_major_formatter(PercentFormatter())
    axes.set_ylim(0, 100)
    axes.set_xlabel("DRAM size (bytes, binary units)")
    axes.set_ylabel("hit rate (of chunk lookups)")
    axes.set_title(title)
    axes.grid(True, alpha=0.3)
    axes.legend(loc="best", fontsize="small")
    figure.tight_layout()
    figure.savefig(path, format="png")


def advise_command(
    trace: Annotated[Path | None, typer.Argument(help="trace file ([adaptive] trace = ... records one)")] = None,
    dram: Annotated[str | None, typer.Option(help="DRAM size now (default: the config's dram.capacity)")] = None,
    disk: Annotated[
        str | None, typer.Option(help="disk tier size; 0: none (default: the config's, if enabled)")
    ] = None,
    remote: Annotated[bool, typer.Option("--remote", help="a Redis/S3 tier below disk (unbounded)")] = False,
    chunk_bytes: Annotated[str | None, typer.Option(help="bytes per chunk (default: the trace's)")] = None,
    chunk_tokens: Annotated[int | None, typer.Option(min=1, help="tokens per chunk (default: the trace's)")] = None,
    prefill_rate: Annotated[
        float | None, typer.Option(min=1e-9, help="engine prefill, tokens/s (default: the config's)")
    ] = None,
    policy: Annotated[
        Policy | None, typer.Option(help="write (admission) policy now (default: the config's adaptive.policy)")
    ] = None,
    dram_gbps: Annotated[float, typer.Option(min=1e-9, help="DRAM copy bandwidth, GB/s")] = DRAM_GBPS,
    disk_read_gbps: Annotated[float, typer.Option(min=1e-9, help="disk read bandwidth, GB/s")] = DISK_READ_GBPS,
    disk_write_gbps: Annotated[float, typer.Option(min=1e-9, help="disk write bandwidth, GB/s")] = DISK_WRITE_GBPS,
    remote_gbps: Annotated[float, typer.Option(min=1e-9, help="remote tier bandwidth, GB/s")] = REMOTE_GBPS,
    exact: Annotated[
        bool, typer.Option("--exact", help="time every reuse, not a sample: no sampling error, more time")
    ] = False,
    as_json: Annotated[bool, typer.Option("--json", help="print the advice and the curve as JSON")] = False,
    plot: Annotated[Path | None, typer.Option(help="write the hit-rate curve to this PNG")] = None,
    synthetic: Annotated[SyntheticChoice | None, typer.Option(help="a generated workload instead of a trace")] = None,
    requests: Annotated[int, typer.Option(min=1, help="requests in a --synthetic workload", hidden=True)] = 20_000,
    write_trace_to: Annotated[
        Path | None, typer.Option("--write-trace", help="with --synthetic: write the trace here and stop")
    ] = None,
    config: ConfigOption = None,
) -> None:
    """What DRAM size and write policy pay for the traffic in a trace: hit rate and net saving per size."""
    if (trace is None) == (synthetic is None):
        raise fail("give a TRACE file or --synthetic NAME (one of them)")
    if write_trace_to is not None and synthetic is None:
        raise fail("--write-trace writes a --synthetic workload; pass --synthetic NAME")
    if plot is not None and importlib.util.find_spec("matplotlib") is None:
        raise fail("--plot needs matplotlib: pip install 'kvstore-tiered[plot]'")
    data = synthetic_trace(synthetic, requests) if synthetic is not None else load_trace(trace)  # type: ignore[arg-type]
    if write_trace_to is not None:
        write_trace(write_trace_to, data.requests_as_chains(), data.meta)
        console.print(f"wrote {len(data):,} chunk lookups ({synthetic}) to {write_trace_to}", highlight=False)
        return
    if not len(data):
        raise fail(f"{data.path}: no lookups recorded")
    settings = load_config(config)
    given = None if chunk_bytes is None else parse_size(chunk_bytes, "--chunk-bytes")
    chunk = meta_number(data, "chunk_bytes", given, "--chunk-bytes")
    tokens = meta_number(data, "chunk_tokens", chunk_tokens, "--chunk-tokens")
    if (given is None) != (chunk_tokens is None):
        check_chunk_mix(chunk, tokens, from_trace="--chunk-tokens" if given is not None else "--chunk-bytes")
    current: Policy = settings.adaptive.policy if policy is None else policy
    dram_bytes = int(settings.dram.capacity) if dram is None else parse_size(dram, "--dram")
    if disk is not None:
        disk_bytes = parse_size(disk, "--disk")
    else:
        disk_bytes = int(settings.disk.capacity) if settings.disk.enabled else 0
    if dram_bytes < chunk:
        raise fail(f"--dram {human_bytes(dram_bytes)} holds no chunk of {human_bytes(chunk)}")
    rate = settings.adaptive.prefill_tokens_per_s if prefill_rate is None else prefill_rate
    lower = [TierRates("disk", disk_bytes, disk_read_gbps * GB, disk_write_gbps * GB)] if disk_bytes else []
    if remote:
        lower.append(TierRates("remote", None, remote_gbps * GB, remote_gbps * GB))
    cost = cost_model(chunk, tokens, rate, dram_gbps * GB, lower)

    profile = measure(data.ids, exact)
    result = advise(profile, cost, dram_bytes, current, knee=settings.adaptive.knee)
    points = curve(profile, cost, result, disk_bytes)
    name = Path(data.path).name if synthetic is None else data.path
    if plot is not None:
        title = f"{name}: {len(data):,} chunk lookups" + ("" if exact else f" (sampled at {profile.sample_rate:.2%})")
        try:
            plot_curve(plot, points, result, disk_bytes, title)
        except OSError as exc:
            raise fail(f"{plot}: {exc.strerror or exc}") from None
    if as_json:
        document = {
            **result.as_dict(),
            "trace": name,
            "lookups": len(data),
            "cost": asdict(cost),
            "curve": points,
            "curve_eviction": MODELLED_EVICTION,
            "configured_eviction": {"dram": settings.dram.eviction, "disk": settings.disk.eviction},
        }
        typer.echo(json.dumps(document, indent=1))
        return
    tiers = " -> ".join(
        ["DRAM"] + [f"{t.name} ({human_bytes(disk_bytes)})" if t.name == "disk" else t.name for t in lower]
    )
    console.print(
        f"{name}: {len(data):,} chunk lookups of {human_bytes(chunk)} ({tokens} tokens); tiers {tiers}; "
        f"prefill {rate:,.0f} tokens/s; sampled at {profile.sample_rate:.2%}",
        highlight=False,
    )
    console.print(f"{eviction_note(settings, disk_bytes)}", highlight=False)
    console.print(size_table(result, chunk))
    if result.disk_rows:
        console.print(disk_table(result, disk_bytes))
    for sentence in result.verdict:
        console.print(f"- {sentence}", highlight=False)
    console.print(
        f"[bold]recommendation: DRAM {human_bytes(result.recommended_dram_bytes)}"
        + (f", disk {human_bytes(result.recommended_disk_bytes)}" if result.recommended_disk_bytes else "")
        + f", policy '{result.recommended_policy}'[/bold] (now {human_bytes(dram_bytes)}"
        + (f", disk {human_bytes(disk_bytes)}" if result.recommended_disk_bytes else "")
        + f", '{current}')",
        highlight=False,
    )
    if plot is not None:
        console.print(f"curve written to {plot}", highlight=False)
