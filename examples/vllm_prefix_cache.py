"""vLLM with KVStoreConnector: time to first token, recomputing a long prompt versus loading it.

Three engines, one per process, on the same model:

- **vLLM alone** computes the prompt, twice (the baseline, and the first token to compare against).
- **vLLM + kvstore** computes it and a second prompt of the same length (saving their chunks: the
  cost of the connector on a miss), then, its own prefix cache reset, answers the first prompt
  again with its prefix from kvstore's DRAM, twice.
- **A fresh vLLM + kvstore** on the same disk answers with the prefix from disk.

Each row is the best of the measurements it has (the machine may be shared and noisy), and
speedups are against the faster of the two recomputes.

The model has SmolLM2-135M's shape (30 layers, 3 KV heads of 64, hidden 576) with random float32
weights, made here once: the time of a forward pass depends on the shape, not on the values.
Run with vLLM's environment (``scripts/vllm_env.sh`` makes ``.venv-vllm``):

    .venv-vllm/bin/python examples/vllm_prefix_cache.py                 # 2K and 8K prompts: ~7.5 min
    .venv-vllm/bin/python examples/vllm_prefix_cache.py --tokens 1024 --layers 4

As written it took 444 s on a 2-core machine (the 8K rows are most of it: each recompute takes
30-45 s); ``--tokens 1024 --layers 2`` (what the tests run) about 140 s. Each row is printed as
it is measured.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")  # GiB for vLLM's own KV cache on the CPU

ROOT = Path(__file__).resolve().parents[1]
VOCAB = 8192
RESULT = "engine result: "  # vLLM prints to stdout as well


def make_model(path: Path, layers: int) -> Path:
    """A Llama of SmolLM2-135M's shape with random weights (made once per layer count)."""
    if (path / "config.json").exists():
        return path
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=576, intermediate_size=1536, num_hidden_layers=layers,
        num_attention_heads=9, num_key_value_heads=3, head_dim=64, max_position_embeddings=16384,
        rope_theta=100000.0, tie_word_embeddings=True, dtype="float32",
    )  # fmt: skip
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(path)
    return path


def prompt(tokens: int, which: str = "A") -> list[int]:
    rng = random.Random(f"{tokens}-{which}")
    return [rng.randrange(10, VOCAB) for _ in range(tokens)]


def engine(model: Path, tokens: int, steps: list[str], extra: dict[str, Any] | None) -> list[dict[str, Any]]:
    """Run ``steps`` in this process: ``A`` or ``B`` (time to the first token of that prompt), or
    ``reset`` (vLLM's own prefix cache)."""
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    transfer = None
    if extra is not None:
        transfer = KVTransferConfig(
            kv_connector="KVStoreConnector",
            kv_connector_module_path="kvstore.connectors.vllm",
            kv_role="kv_both",
            kv_load_failure_policy="recompute",
            kv_connector_extra_config=extra,
        )
    llm = LLM(
        model=str(model), skip_tokenizer_init=True, dtype="float32", max_model_len=tokens + 64,
        max_num_batched_tokens=tokens + 64, enforce_eager=True, seed=0, kv_transfer_config=transfer,
    )  # fmt: skip
    sampling = SamplingParams(temperature=0.0, max_tokens=1, detokenize=False)
    llm.generate([TokensPrompt(prompt_token_ids=prompt(64, "warm-up"))], sampling, use_tqdm=False)
    results = []
    for step in steps:
        if step == "reset":
            llm.reset_prefix_cache()
            continue
        request = TokensPrompt(prompt_token_ids=prompt(tokens, step))
        started = time.perf_counter()
        output = llm.generate([request], sampling, use_tqdm=False)[0]
        results.append(
            {
                "seconds": time.perf_counter() - started,
                "cached": output.num_cached_tokens,
                "token": output.outputs[0].token_ids[0],
            }
        )
    llm.llm_engine.engine_core.shutdown()  # the connector's shutdown flushes kvstore's writes to disk
    return results


def best(runs: list[dict[str, Any]]) -> dict[str, Any]:
    return min(runs, key=lambda run: run["seconds"])


def in_subprocess(model: Path, tokens: int, steps: list[str], extra: dict[str, Any] | None) -> list[dict[str, Any]]:
    """One engine per process: a fresh engine really starts with an empty DRAM tier."""
    return engine_process(__file__, {"model": str(model), "tokens": tokens, "steps": steps, "extra": extra})


def engine_process(script: str, spec: dict[str, Any]) -> Any:
    """Run ``script --engine SPEC`` in a process of its own; the JSON it prints after RESULT."""
    done = subprocess.run(
        [sys.executable, script, "--engine", json.dumps(spec)], capture_output=True, text=True, check=False, cwd=ROOT
    )
    if done.returncode != 0:
        raise SystemExit(f"the engine failed:\n{done.stderr[-4000:]}")
    return json.loads(next(line for line in done.stdout.splitlines() if line.startswith(RESULT))[len(RESULT) :])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", default="2048,8192", help="prompt lengths, comma-separated")
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--engine", help=argparse.SUPPRESS)  # internal: run one engine, print JSON
    args = parser.parse_args()
    if args.engine:
        spec = json.loads(args.engine)
        print(RESULT + json.dumps(engine(Path(spec["model"]), spec["tokens"], spec["steps"], spec["extra"])))
        return

    model = make_model(ROOT / ".kvstore-demo" / f"vllm-llama-135m-shape-{args.layers}l", args.layers)
    print("| prompt | prefix from | tokens vLLM did not compute | time to first token | speedup | same token |")
    print("|---|---|---|---|---|---|")
    for tokens in (int(n) for n in args.tokens.split(",")):
        with tempfile.TemporaryDirectory(prefix="kvstore-vllm-") as disk:
            extra = {"kvstore_config": {"dram": {"capacity": "2GiB"}, "disk": {"path": disk}}}
            alone = best(in_subprocess(model, tokens, ["A", "reset", "A"], None))
            miss_a, miss_b, *dram = in_subprocess(model, tokens, ["A", "B", "reset", "A", "reset", "A"], extra)
            [fresh] = in_subprocess(model, tokens, ["A"], extra)
        miss = {**best([miss_a, miss_b]), "token": miss_a["token"]}
        base = min(alone["seconds"], miss["seconds"])  # speedups against the faster recompute
        rows = [
            ("vLLM alone (recompute)", alone),
            ("kvstore miss (recompute + save)", miss),
            ("kvstore DRAM", best(dram)),
            ("kvstore disk (fresh engine)", fresh),
        ]
        for name, run in rows:
            same = "yes" if run["token"] == alone["token"] else "NO"
            print(
                f"| {tokens} | {name} | {run['cached']} | {run['seconds']:.3f} s | "
                f"{base / run['seconds']:.1f}x | {same} |"
            )


if __name__ == "__main__":
    main()
