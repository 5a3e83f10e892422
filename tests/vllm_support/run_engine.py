"""Run real vLLM (CPU) with a kvstore integration and report what happened, as JSON.

Run by tests/test_vllm.py under the vLLM virtual environment (.venv-vllm), one engine per
process so that "a fresh engine" really starts with an empty kvstore DRAM tier:

    python run_engine.py --model DIR --mode connector --extra '{"kvstore_config": {...}}' \
        --steps gen,reset,gen --out result.json

Steps: ``gen`` generates greedily for the prompt (recording output tokens and how many prompt
tokens vLLM did not compute), ``reset`` empties vLLM's own prefix cache, ``other`` generates for
a different prompt, ``flush`` waits until kvstore's writes reached every tier. The engine runs
in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0), so the connectors' counters can be read.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from typing import Any

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

VOCAB = 400  # the tiny Llama's tokenizer has a few more; stay below


def prompt(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(4, VOCAB) for _ in range(length)]


def build_llm(args: argparse.Namespace) -> Any:
    from vllm import LLM
    from vllm.config import KVTransferConfig

    extra = json.loads(args.extra)
    if args.mode == "connector":
        transfer = KVTransferConfig(
            kv_connector="KVStoreConnector",
            kv_connector_module_path="kvstore.connectors.vllm",
            kv_role="kv_both",
            kv_load_failure_policy="recompute",
            kv_connector_extra_config=extra,
        )
    else:
        sys.path.insert(0, os.path.dirname(__file__))
        transfer = KVTransferConfig(
            kv_connector="OffloadingConnector", kv_role="kv_both", kv_connector_extra_config=extra
        )
    return LLM(
        model=args.model,
        dtype="float32",
        max_model_len=4096,
        block_size=args.block_size,
        enforce_eager=True,
        seed=0,
        kv_transfer_config=transfer,
    )


def connector_stats(llm: Any) -> dict[str, Any]:
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    worker = get_kv_transfer_group()
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler.connector
    stats = worker.stats()
    stats["scheduler"] = dict(scheduler.counters)
    return stats


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--mode", choices=["connector", "tier"], default="connector")
    parser.add_argument("--extra", default="{}")
    parser.add_argument("--steps", default="gen,reset,gen")
    parser.add_argument("--prompt-seed", type=int, default=0)
    parser.add_argument("--prompt-tokens", type=int, default=1000)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--block-size", type=int, default=128)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    started = time.perf_counter()
    llm = build_llm(args)
    report: dict[str, Any] = {"startup_s": time.perf_counter() - started, "runs": []}
    sampling = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    prompts = {"gen": prompt(args.prompt_seed, args.prompt_tokens), "other": prompt(args.prompt_seed + 1000, 700)}
    for step in args.steps.split(","):
        if step == "reset":
            assert llm.reset_prefix_cache(), "vLLM refused to reset its prefix cache"
        elif step == "flush":
            from vllm.distributed.kv_transfer import get_kv_transfer_group

            get_kv_transfer_group().store.flush(timeout=60)
        elif step in prompts:
            begin = time.perf_counter()
            output = llm.generate([TokensPrompt(prompt_token_ids=prompts[step])], sampling, use_tqdm=False)[0]
            report["runs"].append(
                {
                    "step": step,
                    "tokens": list(output.outputs[0].token_ids),
                    "cached_tokens": output.num_cached_tokens,
                    "seconds": time.perf_counter() - begin,
                }
            )
        else:
            raise SystemExit(f"unknown step {step!r}")
    report["stats"] = connector_stats(llm) if args.mode == "connector" else {}
    with open(args.out, "w") as f:
        json.dump(report, f, default=str)
    llm.llm_engine.engine_core.shutdown() if hasattr(llm.llm_engine.engine_core, "shutdown") else None


if __name__ == "__main__":
    main()
