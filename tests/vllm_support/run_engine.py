"""Run real vLLM (CPU) with a kvstore integration and report what happened, as JSON.

Run by the engine tests (tests/test_vllm*.py) under the vLLM virtual environment (.venv-vllm),
one engine per process so that "a fresh engine" really starts with an empty kvstore DRAM tier:

    python run_engine.py --model DIR --mode connector --extra '{"kvstore_config": {...}}' \
        --steps gen,reset,gen --out result.json

Steps: ``gen`` generates greedily for the prompt (recording output tokens and how many prompt
tokens vLLM did not compute), ``reset`` empties vLLM's own prefix cache, ``other``, ``third`` and
``fourth`` generate for other prompts, ``pair`` for the ``third`` prompt twice in one batch (two
requests saving the same chunks in one step), ``salted`` for the same prompt under another
tenant's ``cache_salt``,
``flush`` waits until kvstore's writes reached every tier, ``freeze`` sends SIGSTOP to
process ``--freeze-pid`` (a server that stops answering), ``handshake`` writes ``<--handshake>.ready``
and waits (at most 5 minutes) for the test to write ``<--handshake>.go`` (a subscriber catching up).
``overlap`` (the engine core in this process: ``--processes workers`` or ``one``) steps vLLM by hand:
request R (the ``other`` prompt, 400 tokens) decodes, then request P (the ``gen`` prompt, whose
prefix the test holds in a tier off the machine) comes; once P waits for its prefix
(``WAITING_FOR_REMOTE_KVS``) and R has produced ``OVERLAP_TOKENS`` more while P has none, it writes
``<--handshake>.ready`` (the test then lets the load go on) and steps until P is done (at most 5
minutes). It records P's run as ``gen`` does, plus R's tokens meanwhile and whether ``.ready`` was written.
``--kv-events PUB,REPLAY`` turns vLLM's own KV events on, published there.

``--processes`` lays the engine out:

- ``default``: vLLM's default multiprocessing, as users run it: the engine core (scheduler) in a
  process of its own and each worker in another (on vLLM's CPU build even at TP=1);
- ``workers``: the engine core in this process, each worker in a process of its own (vLLM's
  multiprocessing executor): for kvstore the same split as the default (scheduler and workers
  apart; nothing of kvstore runs in vLLM's front-end process), ~7 s less to start and stop;
- ``one``: the engine core and, at TP=1, the worker in this process.

TP=2 pins one worker per core (``VLLM_CPU_OMP_THREADS_BIND="0|1"``). The connector's counters are
read in the workers (``worker_extension_cls``: tests/vllm_support/probe.py); the scheduler's come
to them with each step's metadata. The tier's counters live in vLLM's scheduler: a tier engine
whose counters are read runs its engine core in this process (``workers`` or ``one``).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time
from typing import Any

from prompts import prompt

SUPPORT = os.path.dirname(os.path.abspath(__file__))
# vLLM's processes import probe.py and cpu_offload_spec.py from here.
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [SUPPORT, os.environ.get("PYTHONPATH")]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
# The engine tests check what is loaded and what it yields; whether a hit is worth loading is the
# load-or-recompute planner's call, made from measured timings (tests/test_planner.py tests it).
# Its prefill rate is pinned at 1 token/s here (a chunk "recomputes" in minutes: every hit is
# loaded), so a busy machine never turns an expected load into a recompute; a test's own
# kvstore_config may pin another.
os.environ.setdefault("KVSTORE_PLANNER__PREFILL_TOKENS_PER_S", "1")
# Likewise a minute for a read (5 s by default): at TP=2 on a 2-core machine, where vLLM's workers are
# pinned one per core, kvstore's loop was seen to wait ~30 s for the CPU. A timeout is a correct miss,
# but not what a test of loads looks for; a test of timeouts sets its own (kwargs win over the env).
os.environ.setdefault("KVSTORE_TIMEOUTS__GET", "60")


OVERLAP_TOKENS = 8  # R's tokens while P's prefix loads, before the overlap step writes .ready


def overlap(llm: Any, other: Any, gen: Any, sampling: Any, handshake: str) -> dict[str, Any]:
    """The ``overlap`` step (see the module docstring): P's run, and what R produced while P waited."""
    from vllm import SamplingParams
    from vllm.v1.request import RequestStatus

    engine, scheduler = llm.llm_engine, llm.llm_engine.engine_core.engine_core.scheduler
    tokens: dict[str, list[int]] = {"R": [], "P": []}
    cached, finished = None, False

    def step() -> None:
        nonlocal cached, finished
        for output in engine.step():
            tokens[output.request_id] = list(output.outputs[0].token_ids)
            if output.request_id == "P":
                cached, finished = output.num_cached_tokens, output.finished

    engine.add_request("R", other, SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True))
    while not tokens["R"]:
        step()
    begin = time.perf_counter()
    p_id = engine.add_request("P", gen, sampling)
    added, waiting_from, ready = len(tokens["R"]), None, False
    r_after_p_added = r_while_p_waited = 0
    while not finished and time.perf_counter() - begin < 300:  # a guard against a hang
        step()
        request = scheduler.requests.get(p_id)
        if waiting_from is None and request is not None and request.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
            waiting_from = len(tokens["R"])
        if ready or tokens["P"]:  # counted until .ready, or until P's first output (then no .ready)
            continue
        r_after_p_added = len(tokens["R"]) - added
        r_while_p_waited = 0 if waiting_from is None else len(tokens["R"]) - waiting_from
        if r_while_p_waited >= OVERLAP_TOKENS:
            with open(handshake + ".ready", "w"):
                pass
            ready = True
    engine.abort_request(["R"] if finished else ["R", "P"])  # nothing left running for later steps
    return {
        "step": "overlap",
        "tokens": tokens["P"],
        "cached_tokens": cached,
        "seconds": time.perf_counter() - begin,
        "finished": finished,
        "waited_for_remote_kvs": waiting_from is not None,
        "r_tokens_after_p_added": r_after_p_added,
        "r_tokens_while_p_waited": r_while_p_waited,
        "ready_while_p_had_none": ready,
    }


def is_mla(model: str) -> bool:
    """Whether the model at ``model`` is a DeepSeek-style MLA model (its config has a latent rank)."""
    with open(os.path.join(model, "config.json")) as f:
        return bool(json.load(f).get("kv_lora_rank"))


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
        transfer = KVTransferConfig(
            kv_connector="OffloadingConnector", kv_role="kv_both", kv_connector_extra_config=extra
        )
    backend = {"attention_backend": args.attention_backend} if args.attention_backend else {}
    executor = {"distributed_executor_backend": "mp"} if args.processes == "workers" else {}
    probe = {"worker_extension_cls": "probe.KVStoreProbe"} if args.mode == "connector" else {}
    events: dict[str, Any] = {}
    if args.kv_events:
        from vllm.config import KVEventsConfig

        endpoint, replay = args.kv_events.split(",")
        events["kv_events_config"] = KVEventsConfig(
            enable_kv_cache_events=True, publisher="zmq", endpoint=endpoint, replay_endpoint=replay
        )
    return LLM(
        model=args.model,
        dtype=args.dtype,
        max_model_len=4096,
        block_size=args.block_size,
        kv_cache_dtype=args.kv_cache_dtype,
        enforce_eager=True,
        seed=0,
        tensor_parallel_size=args.tensor_parallel_size,
        pipeline_parallel_size=args.pipeline_parallel_size,
        max_num_batched_tokens=args.max_batched_tokens,
        kv_transfer_config=transfer,
        **backend,
        **executor,
        **probe,
        **events,
    )


def scheduler_connector(llm: Any) -> Any:
    return llm.llm_engine.engine_core.engine_core.scheduler.connector


def kvstore_tier(llm: Any) -> Any:
    """The KVStoreTier among the secondary tiers of vLLM's tiering manager (scheduler side)."""
    manager = scheduler_connector(llm).connector_scheduler.manager
    return next(tier for tier in manager.secondary_tiers if type(tier).__name__ == "KVStoreTier")


def report_stats(llm: Any, mode: str, in_process: bool) -> dict[str, Any]:
    """kvstore's counters: the first worker's (its store's, the scheduler's), every rank's; the tier's in-process."""
    if mode == "tier":
        return kvstore_tier(llm).stats() if in_process else {}
    ranks = llm.collective_rpc("kvstore_stats")
    stats = dict(ranks[0])  # the first rank holds the store; the others report their own counters
    stats["ranks"] = [rank["connector"] for rank in ranks]
    return stats


def flush(llm: Any, mode: str, in_process: bool) -> None:
    """Wait until kvstore's writes have reached every tier (the tier: once vLLM has cascaded to it)."""
    if mode == "connector":
        llm.collective_rpc("kvstore_flush")
    elif in_process:
        tier = kvstore_tier(llm)
        tier.drain_jobs()
        tier.store.flush(timeout=60)
    else:
        raise SystemExit("flush in tier mode needs the engine core here (--processes workers or one)")


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
    parser.add_argument("--max-batched-tokens", type=int, default=None, help="tokens per step (prefill in steps)")
    parser.add_argument("--kv-cache-dtype", default="auto")
    parser.add_argument("--freeze-pid", type=int, default=0)
    # Workers in processes of their own; on vLLM's CPU build pin them: VLLM_CPU_OMP_THREADS_BIND="0|1".
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    parser.add_argument("--pipeline-parallel-size", type=int, default=1)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--attention-backend", default=None, help="e.g. CPU_MLA: vLLM's portable MLA kernels")
    parser.add_argument("--processes", choices=["default", "workers", "one"], default="default")
    parser.add_argument("--kv-events", default="", help="PUB,REPLAY endpoints: vLLM's own KV events on")
    parser.add_argument("--handshake", default="", help="the handshake step's files: PATH.ready, PATH.go")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    in_process = args.processes != "default"  # the engine core (vLLM's scheduler) in this process
    if in_process:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    if os.environ.get("TEST_VLLM_CPU_KERNELS") == "portable" and not args.attention_backend and is_mla(args.model):
        args.attention_backend = "CPU_MLA"  # what vLLM runs on a CPU without AMX

    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    started = time.perf_counter()
    llm = build_llm(args)
    report: dict[str, Any] = {"startup_s": time.perf_counter() - started, "runs": []}
    sampling = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    prompts = {
        "gen": TokensPrompt(prompt_token_ids=prompt(args.prompt_seed, args.prompt_tokens)),
        "other": TokensPrompt(prompt_token_ids=prompt(args.prompt_seed + 1000, 1000)),
        "third": TokensPrompt(prompt_token_ids=prompt(args.prompt_seed + 2000, 1000)),
        "fourth": TokensPrompt(prompt_token_ids=prompt(args.prompt_seed + 3000, 1000)),
        "salted": TokensPrompt(prompt_token_ids=prompt(args.prompt_seed, args.prompt_tokens), cache_salt="tenant-b"),
    }
    for step in args.steps.split(","):
        if step == "reset":
            assert llm.reset_prefix_cache(), "vLLM refused to reset its prefix cache"
        elif step == "flush":
            flush(llm, args.mode, in_process)
        elif step == "handshake":
            with open(args.handshake + ".ready", "w"):
                pass
            waited = time.monotonic()
            while not os.path.exists(args.handshake + ".go") and time.monotonic() - waited < 300:
                time.sleep(0.05)
        elif step == "overlap":
            report["runs"].append(overlap(llm, prompts["other"], prompts["gen"], sampling, args.handshake))
        elif step == "freeze":
            os.kill(args.freeze_pid, signal.SIGSTOP)
        elif step in prompts or step == "pair":
            begin = time.perf_counter()
            batch = [prompts["third"]] * 2 if step == "pair" else [prompts[step]]  # pair: one prompt twice, one step
            outputs = llm.generate(batch, sampling, use_tqdm=False)
            report["runs"].append(
                {
                    "step": step,
                    "tokens": list(outputs[0].outputs[0].token_ids),
                    "cached_tokens": outputs[0].num_cached_tokens,
                    "seconds": time.perf_counter() - begin,
                    "batch_tokens": [list(output.outputs[0].token_ids) for output in outputs],
                }
            )
        else:
            raise SystemExit(f"unknown step {step!r}")
    report["stats"] = report_stats(llm, args.mode, in_process)
    if args.mode == "connector":  # where the prompts' chunks are, from the first worker
        unsalted = {step: list(p["prompt_token_ids"]) for step, p in prompts.items() if step != "salted"}
        identity = llm.collective_rpc("kvstore_identity", args=(unsalted,))[0]
        report.update(identity)
        report["keys"] = identity["prompt_keys"]["gen"]
    with open(args.out, "w") as f:
        json.dump(report, f, default=str)
    llm.llm_engine.engine_core.shutdown() if hasattr(llm.llm_engine.engine_core, "shutdown") else None


if __name__ == "__main__":  # vLLM starts its TP workers with spawn: they import this module
    main()
