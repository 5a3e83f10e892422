"""A stall benchmark: does a prefix loading from a slow tier (Redis) freeze the other requests in ``vllm serve``?

A real ``redis-server`` sits behind :class:`~kvstore.testing.slow_proxy.SlowProxy`, which caps
what it sends back at 25 MB/s in total (one congested link, however many connections kvstore
opens). First a server with kvstore's connector computes a few long prefixes (3 of 4,100 tokens:
16 chunks of 256, 4.7 MB a chunk for a 12-layer Llama of SmolLM2-135M's shape in float32, about
4.1 MB in Redis after its codec) and kvstore writes them to Redis; then every measured
configuration starts a fresh server, so the prefixes are only in Redis. Against it run, at once:

- **the others**: decode-heavy traffic from vLLM's own client (``vllm bench serve``, random
  32-token prompts, 150 output tokens with ``--ignore-eos``, 4 in flight), whose per-token
  timestamps (``--save-result --save-detailed``) give every inter-token gap;
- **the loads**: the prefix prompts (token ids), sent by a streaming client here once the others
  all run (2 s after, then one every 4 s), which times their first token (TTFT).

The configurations, vLLM's prefix cache off in all (``--no-enable-prefix-caching``: the only
cache is kvstore): ``vllm`` (vLLM alone: the prefixes are recomputed), ``forward-pass`` (kvstore,
``kvstore_max_stall_ms: null``: every load streams inside the forward pass) and ``background``
(kvstore's defaults: a Redis load runs outside the forward pass). kvstore's load planner is off
(``--planner`` turns it on): every hit loads, since what a load costs the others is the question.
The target figure is the others' largest inter-token gap while the loads run (first sent to last
first token) divided by their median gap: near 1 when nothing freezes them; beside it, the same
outside the loads (what the machine does anyway). Both clients stamp ``time.perf_counter()``
(CLOCK_MONOTONIC, one clock for all processes), so the gaps line up with the loads.

Run with vLLM's environment, from the repository root (about 6 minutes a round on 2 cores)::

    .venv-vllm/bin/python -m benchmarks.stall --out stall.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy

from benchmarks import serving  # the model, vLLM's commands, the server's process group, /health, /metrics
from kvstore.bench.machine import describe_machine
from kvstore.testing.servers import RedisServer
from kvstore.testing.slow_proxy import SlowProxy

CONFIGURATIONS = ("vllm", "forward-pass", "background")
CHUNK_TOKENS = 256  # kvstore's chunk (kvstore_chunk_tokens' default)
COUNTED = ("vllm:external_prefix_cache_hits", serving.BY_SOURCE)  # besides every vllm:kvstore_* counter


@dataclass(frozen=True)
class Setup:
    """The model, the traffic and the slow link."""

    layers: int = 12
    prefixes: int = 3
    prefix_tokens: int = 4100  # 16 chunks of 256, and 4 tokens vLLM computes
    decode_requests: int = 32
    decode_concurrency: int = 4
    decode_input: int = 32
    decode_output: int = 150
    lead_s: float = 2.0  # the first load this long after the others all run
    interval_s: float = 4.0  # between loads
    link_bytes_per_s: float = 25e6  # Redis -> kvstore, all connections together
    engine_kv_bytes: int = 384 * serving.MiB
    dram_bytes: int = 512 * serving.MiB
    planner: bool = False  # kvstore's load planner (it may recompute a prefix rather than load it)
    seed: int = 0

    def chunks(self) -> int:
        return self.prefixes * (self.prefix_tokens // CHUNK_TOKENS)


@dataclass(frozen=True)
class Bench:
    """What every server and client of a run shares."""

    setup: Setup
    model: Path
    prompts: list[list[int]]
    port: int
    limit: float  # seconds per server, all included
    python: Path = Path(sys.executable)

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"


@dataclass
class Run:
    """One configuration in one round; ``error`` set when it could not run. Times in seconds."""

    name: str
    round: int
    load_ttfts_s: list[float] = field(default_factory=list)
    gaps_s: list[float] = field(default_factory=list)  # every inter-token gap of the others
    load_gaps_s: list[float] = field(default_factory=list)  # those overlapping the loads (first sent..last TTFT)
    loads_at_s: list[tuple[float, float]] = field(default_factory=list)  # (sent, first token) from the first sent
    worst_gap_at_s: tuple[float, float] = (0.0, 0.0)  # the largest of load_gaps_s: (start, end), likewise
    quiet_max_s: float = 0.0  # the others' largest gap outside the loads: what the machine does anyway
    covered: bool = False  # the others still ran when the last load got its first token
    decode_completed: int = 0
    metrics: dict[str, float] = field(default_factory=dict)
    seconds: float = 0.0
    error: str | None = None


@dataclass
class Load:
    """One loading request: when it was sent and got its first token (``perf_counter``)."""

    sent: float = 0.0
    first: float | None = None
    error: str | None = None


# -- the prompts, the servers and the clients -----------------------------------------------------


def prefix_prompts(setup: Setup, vocab: int) -> list[list[int]]:
    """``setup.prefixes`` prompts of random token ids (special tokens 0-3 avoided), the same every run."""
    rng = random.Random(setup.seed)
    return [[rng.randrange(4, vocab) for _ in range(setup.prefix_tokens)] for _ in range(setup.prefixes)]


def transfer_config(name: str, setup: Setup, redis_url: str, workdir: Path) -> dict[str, Any] | None:
    """``--kv-transfer-config``: kvstore with DRAM and Redis (no disk); ``forward-pass`` never loads aside.

    The planner keeps what it measures in ``workdir``: a run inherits nothing from the user's state.
    """
    if name == "vllm":
        return None
    sections = {
        "dram": {"capacity": f"{setup.dram_bytes // serving.MiB}MiB"},
        "disk": {"enabled": False},
        "redis": {"enabled": True, "url": redis_url},
        "planner": {"enabled": setup.planner, "state_dir": str(workdir / "planner")},
    }
    extra: dict[str, Any] = {"kvstore_config": sections}
    if name == "forward-pass":
        extra["kvstore_max_stall_ms"] = None
    return {
        "kv_connector": "KVStoreConnector", "kv_connector_module_path": "kvstore.connectors.vllm",
        "kv_role": "kv_both", "kv_load_failure_policy": "recompute", "kv_connector_extra_config": extra,
    }  # fmt: skip


def serve_command(bench: Bench, name: str, redis_url: str, workdir: Path) -> list[str]:
    """``vllm serve`` with benchmarks.serving's CPU flags, vLLM's prefix cache off, room for the prefixes."""
    setup = bench.setup
    command = [
        str(bench.python), *serving.SERVE, str(bench.model), "--port", str(bench.port), "--host", "127.0.0.1",
        "--served-model-name", "bench", "--dtype", "float32", "--max-model-len", str(setup.prefix_tokens + 256),
        "--block-size", "128", "--kv-cache-memory-bytes", str(setup.engine_kv_bytes), "--no-enable-prefix-caching",
        "--enforce-eager", "--seed", "0", "--disable-uvicorn-access-log",
    ]  # fmt: skip
    transfer = transfer_config(name, setup, redis_url, workdir)
    return command if transfer is None else [*command, "--kv-transfer-config", json.dumps(transfer)]


def decode_command(bench: Bench, result: Path) -> list[str]:
    """``vllm bench serve`` of the others: short random prompts, long outputs, per-request token times saved."""
    setup = bench.setup
    return [
        str(bench.python), *serving.BENCH_SERVE, "--backend", "vllm", "--base-url", bench.url(""),
        "--model", "bench", "--tokenizer", str(bench.model), "--dataset-name", "random",
        "--random-input-len", str(setup.decode_input), "--random-output-len", str(setup.decode_output),
        "--num-prompts", str(setup.decode_requests), "--max-concurrency", str(setup.decode_concurrency),
        "--request-rate", "inf", "--ignore-eos", "--seed", str(setup.seed), "--disable-tqdm",
        "--percentile-metrics", "ttft,itl", "--metric-percentiles", "50,99",
        "--save-result", "--save-detailed", "--result-dir", str(result.parent), "--result-filename", result.name,
    ]  # fmt: skip


def environment() -> dict[str, str]:
    """benchmarks.serving's: this clone importable, offline, vLLM's engine in a process of its own."""
    path = os.pathsep.join([str(serving.ROOT), os.environ.get("PYTHONPATH", "")])
    multiprocessing = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    offline = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": multiprocessing}
    return {**os.environ, "PYTHONPATH": path, **offline}


def send_load(url: str, prompt: list[int], load: Load, timeout: float) -> None:
    """Stream one completion of ``prompt`` (token ids) and stamp its first token."""
    body = {"model": "bench", "prompt": prompt, "max_tokens": 2, "stream": True, "ignore_eos": True}
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    load.sent = time.perf_counter()
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:  # noqa: S310 (localhost only)
            for line in response:
                if load.first is None and line.startswith(b"data: {") and b'"choices"' in line:
                    load.first = time.perf_counter()
    except OSError as error:
        load.error = repr(error)


def running(bench: Bench) -> float:
    """``vllm:num_requests_running`` now (summed over engines)."""
    lines = serving._get(bench.url("/metrics")).splitlines()
    return sum(float(line.rpartition(" ")[2]) for line in lines if line.startswith("vllm:num_requests_running"))


def counters(text: str) -> dict[str, float]:
    """Every ``vllm:kvstore_*`` counter and :data:`COUNTED`, as ``name:tier`` or ``name:source`` where labelled."""
    found: dict[str, float] = {}
    for line in text.splitlines():
        metric, _, value = line.rpartition(" ")
        base, _, labels = metric.partition("{")
        base = base.removesuffix("_total")
        wanted = base.startswith("vllm:kvstore_") or base in COUNTED
        if wanted and not line.startswith("#") and not base.endswith("_created"):
            label = serving._labels(labels)
            key = ":".join([base, *(label[name] for name in ("tier", "source") if name in label)])
            found[key] = found.get(key, 0.0) + float(value)
    return found


def redis_chunks(url: str) -> int:
    """Chunks Redis holds: its keys but the records beside them (``<chunk>~parent``)."""
    import redis  # kvstore's own dependency

    client = redis.Redis.from_url(url)
    try:
        return sum(1 for key in client.scan_iter(count=1000) if b"~" not in key.rpartition(b":")[2])
    finally:
        client.close()


# -- the two phases -------------------------------------------------------------------------------


def write_prefixes(bench: Bench, redis_url: str, workdir: Path) -> float:
    """Phase 1: a server computes the prefixes and kvstore writes them to Redis; the seconds it took."""
    started = time.monotonic()
    deadline, log, chunks = started + bench.limit, workdir / "write-server.log", bench.setup.chunks()
    with serving.server(serve_command(bench, "write", redis_url, workdir / "write"), environment(), log) as process:
        serving.wait_healthy(process, bench.port, deadline, log)
        for prompt in bench.prompts:
            body = {"model": "bench", "prompt": prompt, "max_tokens": 1}
            serving._post(bench.url("/v1/completions"), body, timeout=max(1.0, deadline - time.monotonic()))
        while redis_chunks(redis_url) < chunks:  # kvstore writes behind: wait until Redis holds them all
            if time.monotonic() > deadline:
                raise TimeoutError(f"Redis holds {redis_chunks(redis_url)} of the {chunks} chunks in time")
            time.sleep(0.5)
    return time.monotonic() - started


def measure(bench: Bench, name: str, round_: int, redis_url: str, workdir: Path) -> Run:
    """Phase 2 for one configuration: a fresh server, the others and the loads at once; its :class:`Run`."""
    started, run, loads = time.monotonic(), Run(name, round_), [Load() for _ in bench.prompts]
    deadline, confdir = started + bench.limit, workdir / f"{round_}-{name}"
    confdir.mkdir(parents=True, exist_ok=True)
    log, phase = confdir / "server.log", "vllm serve start"
    try:
        with serving.server(serve_command(bench, name, redis_url, confdir), environment(), log) as process:
            serving.wait_healthy(process, bench.port, deadline, log)
            phase = "warm-up"
            warm = {"model": "bench", "prompt": "warm up " * 20, "max_tokens": 4}
            serving._post(bench.url("/v1/completions"), warm, timeout=max(1.0, deadline - time.monotonic()))
            phase = "the others and the loads"
            drive(bench, confdir, loads, deadline)
            phase = "metrics scrape"
            run.metrics = counters(serving._get(bench.url("/metrics")))
        failed = [load.error or "no first token" for load in loads if load.first is None]
        if failed:
            raise RuntimeError(f"a load failed: {failed[0]}")
        score(run, loads, json.loads((confdir / "decode.json").read_text()))
    except subprocess.TimeoutExpired:
        run.error = f"{phase} ran past the {bench.limit:.0f} s limit of the configuration"
    except (OSError, RuntimeError, ValueError, KeyError) as error:
        run.error = f"{phase}: {error}".replace("|", "/")[:400]
    run.seconds = time.monotonic() - started
    return run


def drive(bench: Bench, confdir: Path, loads: list[Load], deadline: float) -> None:
    """The others (``vllm bench serve``, a process group of its own) and, once they all run, the loads."""
    setup, log = bench.setup, confdir / "client.log"
    with log.open("w") as out:
        command = decode_command(bench, confdir / "decode.json")
        client = subprocess.Popen(command, env=environment(), stdout=out, stderr=out, start_new_session=True)
        try:
            while running(bench) < setup.decode_concurrency:
                if client.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the others never ran {setup.decode_concurrency} at once")
                time.sleep(0.2)
            time.sleep(setup.lead_s)
            threads = []
            for i, (prompt, load) in enumerate(zip(bench.prompts, loads, strict=True)):
                time.sleep(setup.interval_s if i else 0.0)
                args = (bench.url("/v1/completions"), prompt, load, max(1.0, deadline - time.monotonic()))
                threads.append(threading.Thread(target=send_load, args=args, daemon=True))
                threads[-1].start()
            for thread in threads:
                thread.join()
            client.wait(max(1.0, deadline - time.monotonic()))
        finally:
            if client.poll() is None:
                os.killpg(client.pid, signal.SIGKILL)
    if client.returncode != 0:
        raise RuntimeError(f"vllm bench serve failed ({client.returncode}): {serving.error_line(log)}")


def score(run: Run, loads: list[Load], bench: dict[str, Any]) -> None:
    """Fill ``run`` from the loads' stamps and the others' token times (``vllm bench serve``'s detailed JSON)."""
    firsts = [load.first or 0.0 for load in loads]
    window = (min(load.sent for load in loads), max(firsts))
    run.load_ttfts_s = [first - load.sent for load, first in zip(loads, firsts, strict=True)]
    run.loads_at_s = [(load.sent - window[0], first - window[0]) for load, first in zip(loads, firsts, strict=True)]
    run.decode_completed = bench["completed"]
    last_token = 0.0
    for start, ttft, itls in zip(bench["start_times"], bench["ttfts"], bench["itls"], strict=True):
        at = start + (ttft or 0.0)
        for gap in itls if ttft else ():  # a failed request has no tokens
            run.gaps_s.append(gap)
            if at + gap > window[0] and at < window[1]:
                if gap > max(run.load_gaps_s, default=-1.0):
                    run.worst_gap_at_s = (at - window[0], at + gap - window[0])
                run.load_gaps_s.append(gap)
            else:
                run.quiet_max_s = max(run.quiet_max_s, gap)
            at += gap
        last_token = max(last_token, at)
    run.covered = last_token >= window[1]


# -- the report -----------------------------------------------------------------------------------


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile, linear between the nearest ranks (NaN when empty)."""
    return float(numpy.percentile(values, q)) if len(values) else math.nan


def tiers(metrics: dict[str, float]) -> str:
    """Tokens loaded per tier: kvstore's chunk reads per tier below DRAM, DRAM the rest of its reads and
    streams (x256 each); then vLLM's ``prompt_tokens_cached_by_source``."""
    below = {k.rpartition(":")[2]: v for k, v in sorted(metrics.items()) if k.startswith("vllm:kvstore_tier_hits:")}
    read = metrics.get("vllm:kvstore_chunks_streamed", 0) + metrics.get("vllm:kvstore_chunk_hits", 0)
    dram = read - sum(below.values())
    parts = [f"{tier} {chunks * CHUNK_TOKENS:.0f}" for tier, chunks in {**below, "dram": dram}.items() if chunks > 0]
    by_source = serving.BY_SOURCE + ":"
    sources = [f"{k.removeprefix(by_source)} {v:.0f}" for k, v in metrics.items() if k.startswith(by_source) and v]
    return (", ".join(parts) or "-") + (f" (vLLM: {', '.join(sources)})" if sources else "")


def markdown_table(runs: Sequence[Run]) -> str:
    """One row per configuration, over all its rounds (loads and gaps pooled, counters summed)."""
    lines = [
        "| configuration | loading TTFT p50 s | p99 s | others' ITL p50 ms | p99 ms | max ms "
        "| max gap during loads ÷ median gap | outside the loads | tokens loaded per tier |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for name in dict.fromkeys(run.name for run in runs):
        done = [run for run in runs if run.name == name and run.error is None]
        if not done:
            lines.append(f"| {name} | failed: {next(run.error for run in runs if run.name == name)} | | | | | | | |")
            continue
        ttfts = [t for run in done for t in run.load_ttfts_s]
        gaps, median = [g for run in done for g in run.gaps_s], percentile([g for run in done for g in run.gaps_s], 50)
        worst = max(g for run in done for g in [*run.load_gaps_s, 0.0])
        quiet = max(run.quiet_max_s for run in done)
        metrics: dict[str, float] = {}
        for run in done:
            for key, value in run.metrics.items():
                metrics[key] = metrics.get(key, 0.0) + value
        note = "" if all(run.covered for run in done) else " (the others ended before the loads)"
        lines.append(
            f"| {name} | {percentile(ttfts, 50):.2f} | {percentile(ttfts, 99):.2f} | {median * 1e3:.0f} "
            f"| {percentile(gaps, 99) * 1e3:.0f} | {max(gaps) * 1e3:.0f} | {worst / median:.1f}{note} "
            f"| {quiet / median:.1f} | {tiers(metrics)} |"
        )
    return "\n".join(lines)


# -- the command ----------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    s = Setup()
    parser = argparse.ArgumentParser(prog="python -m benchmarks.stall", description=__doc__.split("\n")[0])
    add = parser.add_argument
    add("--configs", default=",".join(CONFIGURATIONS), help=f"comma-separated of {CONFIGURATIONS}")
    add("--rounds", type=int, default=1, help="each configuration once a round, who goes first alternating")
    add("--quick", action="store_true", help="one round of 2 loads among 16 others")
    add("--layers", type=int, default=s.layers, help="model layers (SmolLM2-135M has 30)")
    add("--prefixes", type=int, default=s.prefixes, help="prefix prompts, one loaded every --interval s")
    add("--prefix-tokens", type=int, default=s.prefix_tokens)
    add("--decode-requests", type=int, default=s.decode_requests, help="the others, in all")
    add("--decode-concurrency", type=int, default=s.decode_concurrency)
    add("--decode-output", type=int, default=s.decode_output, help="tokens each of the others makes")
    add("--interval", type=float, default=s.interval_s, help="seconds between loads")
    add("--link-mb-s", type=float, default=s.link_bytes_per_s / 1e6, help="Redis link, MB/s in all")
    add("--planner", action="store_true", help="kvstore's load planner on (default off: every hit loads)")
    add("--limit", type=float, default=360.0, help="seconds per server, all included")
    add("--port", type=int, default=8766)
    add("--model-dir", type=Path, default=serving.ROOT / ".kvstore-demo", help="where the model is made")
    add("--workdir", type=Path, help="logs and results (default: a temporary folder)")
    add("--out", type=Path, help="also write the runs as JSON here")
    args = parser.parse_args(argv)
    unknown = sorted(set(args.configs.split(",")) - set(CONFIGURATIONS))
    if unknown:
        parser.error(f"unknown configuration(s) {unknown}: choose from {CONFIGURATIONS}")
    if args.quick:
        args.rounds, args.prefixes, args.decode_requests = 1, 2, 16
    return args


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))  # unwind: stop the servers
    setup = Setup(
        layers=args.layers, prefixes=args.prefixes, prefix_tokens=args.prefix_tokens,
        decode_requests=args.decode_requests, decode_concurrency=args.decode_concurrency,
        decode_output=args.decode_output, interval_s=args.interval, link_bytes_per_s=args.link_mb_s * 1e6,
        planner=args.planner,
    )  # fmt: skip
    command = shlex.join(["python", "-m", "benchmarks.stall", *(sys.argv[1:] if argv is None else argv)])
    model = serving.make_model(args.model_dir / f"serving-llama-135m-shape-{setup.layers}l", setup.layers)
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    bench = Bench(setup, model, prefix_prompts(setup, vocab), args.port, args.limit)
    prefix_mb = setup.prefix_tokens // CHUNK_TOKENS * CHUNK_TOKENS * setup.layers * 2 * 3 * 64 * 4 / 1e6  # K, V f32
    print(f"machine: {describe_machine()}\ncommand: {command}", flush=True)
    print(
        f"model {model.name}; {setup.prefixes} prefixes of {setup.prefix_tokens} tokens, each "
        f"{setup.prefix_tokens // CHUNK_TOKENS} chunks = {prefix_mb:.0f} MB of KV (less in Redis, after its codec); "
        f"Redis link {setup.link_bytes_per_s / 1e6:g} MB/s",
        flush=True,
    )
    runs: list[Run] = []
    names = args.configs.split(",")
    with (
        tempfile.TemporaryDirectory(prefix="kvstore-stall-") as temporary,
        RedisServer() as redis,
        SlowProxy("127.0.0.1", redis.port, total_bytes_per_s=setup.link_bytes_per_s) as proxy,
    ):
        workdir = args.workdir or Path(temporary)
        workdir.mkdir(parents=True, exist_ok=True)
        seconds = write_prefixes(bench, redis.url, workdir)
        print(f"write: Redis holds {redis_chunks(redis.url)} chunks after {seconds:.0f} s", flush=True)
        for round_ in range(args.rounds):
            for name in names[round_ % len(names) :] + names[: round_ % len(names)]:
                run = measure(bench, name, round_, f"redis://127.0.0.1:{proxy.port}/0", workdir)
                status = run.error or (
                    f"loading TTFT max {max(run.load_ttfts_s):.2f} s; the others' largest gap during the loads "
                    f"{max(run.load_gaps_s, default=0) * 1e3:.0f} ms"
                )
                print(f"round {round_ + 1} {name}: {run.seconds:.0f} s; {status}", flush=True)
                runs.append(run)
    print()
    print(markdown_table(runs))
    if args.out:
        report = {
            "machine": describe_machine(),
            "command": command,
            "setup": asdict(setup),
            "runs": [asdict(r) for r in runs],
        }
        args.out.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
