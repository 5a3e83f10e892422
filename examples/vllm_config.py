"""Configure vLLM to keep prompt KV in kvstore: a kvstore TOML file, the KV transfer config, ``vllm serve``.

Writes a kvstore TOML (DRAM and a disk tier; ``--redis URL`` or ``--s3-bucket NAME`` add a
remote tier), prints the ``--kv-transfer-config`` that loads ``KVStoreConnector`` with it, then
runs it: two fresh vLLM engines, one process each, answer the same 1000-token prompt, and the
second loads the prompt's prefix from kvstore's disk instead of computing it. The model is a
Llama of SmolLM2-135M's shape with random weights and few layers, made here (no download).
About 75 s on a 2-core machine (70-82 s measured).
Run with vLLM's environment (``scripts/vllm_env.sh`` makes ``.venv-vllm``):

    .venv-vllm/bin/python examples/vllm_config.py
    .venv-vllm/bin/python examples/vllm_config.py --redis redis://127.0.0.1:6379/0
"""

from __future__ import annotations

import argparse
import json
import shlex
import tempfile
from pathlib import Path
from typing import Any

from vllm_prefix_cache import RESULT, ROOT, engine_process, make_model, prompt  # shared with the other vLLM example

PROMPT_TOKENS = 1000  # 3 full chunks of 256 tokens can be reused; vLLM computes the other 232


def kvstore_toml(chunks: Path, redis: str | None, s3_bucket: str | None) -> str:
    """The file KVStoreConnector reads: any StoreConfig section, as in every kvstore config."""
    text = f"""\
[dram]                  # kvstore's own CPU tier (pinned when CUDA is present), below vLLM's GPU blocks
capacity = "1GiB"

[disk]                  # survives restarts: a fresh engine finds the prefixes computed before it
path = "{chunks}"
capacity = "20GiB"
"""
    if redis:  # shared by engines on several hosts; credentials may stay in $REDIS_URL instead
        text += f'\n[redis]\nenabled = true\nurl = "{redis}"\ncodec = "byteplanes"\n'
    if s3_bucket:  # endpoint and credentials from the AWS chain (AWS_ENDPOINT_URL_S3, AWS_ACCESS_KEY_ID, ...)
        text += f'\n[s3]\nenabled = true\nbucket = "{s3_bucket}"\ncodec = "byteplanes"\n'
    return text


def transfer_config(toml: Path) -> dict[str, Any]:
    """vLLM's KVTransferConfig, as the dict ``--kv-transfer-config`` takes (and ``KVTransferConfig(**it)``)."""
    return {
        "kv_connector": "KVStoreConnector",
        "kv_connector_module_path": "kvstore.connectors.vllm",  # vLLM imports the connector from here
        "kv_role": "kv_both",  # save what this engine computes, load what others computed
        "kv_load_failure_policy": "recompute",  # a chunk that fails its checks is computed, never an error
        "kv_connector_extra_config": {
            "kvstore_config_file": str(toml),
            # The model's identity in chunk keys: engines that share it share chunks, so it must name
            # the exact weights (default: "vllm:<model>").
            "kvstore_namespace": "example-llama-135m-shape",
        },
    }


def engine(model: str, transfer: dict[str, Any]) -> dict[str, Any]:
    """One vLLM engine with kvstore (run in a process of its own): the prompt's output and cached tokens."""
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    llm = LLM(
        model=model, skip_tokenizer_init=True, dtype="float32", max_model_len=2048, enforce_eager=True, seed=0,
        kv_transfer_config=KVTransferConfig(**transfer),
    )  # fmt: skip
    sampling = SamplingParams(temperature=0.0, max_tokens=16, detokenize=False)
    output = llm.generate([TokensPrompt(prompt_token_ids=prompt(PROMPT_TOKENS))], sampling, use_tqdm=False)[0]
    llm.llm_engine.engine_core.shutdown()  # the connector's shutdown finishes kvstore's writes to disk
    return {"cached": output.num_cached_tokens, "tokens": list(output.outputs[0].token_ids)}


def in_subprocess(model: Path, transfer: dict[str, Any]) -> dict[str, Any]:
    """A fresh engine per process: its kvstore DRAM starts empty, as after a restart."""
    return engine_process(__file__, {"model": str(model), "transfer": transfer})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=4, help="model layers (SmolLM2-135M has 30)")
    parser.add_argument("--redis", metavar="URL", help="add a Redis tier below disk")
    parser.add_argument("--s3-bucket", metavar="NAME", help="add an S3 tier: an existing bucket (endpoint: AWS env)")
    parser.add_argument("--engine", help=argparse.SUPPRESS)  # internal: run one engine, print JSON
    args = parser.parse_args()
    if args.engine:
        spec = json.loads(args.engine)
        print(RESULT + json.dumps(engine(spec["model"], spec["transfer"])))
        return

    model = make_model(ROOT / ".kvstore-demo" / f"vllm-llama-135m-shape-{args.layers}l", args.layers)
    with tempfile.TemporaryDirectory(prefix="kvstore-vllm-") as workdir:
        toml = Path(workdir) / "kvstore.toml"
        toml.write_text(kvstore_toml(Path(workdir) / "chunks", args.redis, args.s3_bucket))
        transfer = transfer_config(toml)
        print(f"# {toml} (removed when this script ends: copy it to keep it)\n{toml.read_text()}")
        print("# the same engine as a server on vLLM's CPU build (`vllm serve` on a GPU build). This model has no")
        print("# tokenizer: prompts are token ids. A real model to serve: docs/vllm-first-hit.md")
        server = [
            "python", "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--skip-tokenizer-init",
            "--dtype", "float32", "--enforce-eager", "--kv-cache-memory-bytes", "1073741824",
            "--kv-transfer-config", json.dumps(transfer),
        ]  # fmt: skip
        print(shlex.join(server) + "\n")

        first = in_subprocess(model, transfer)
        files = len(list((Path(workdir) / "chunks").rglob("*.kvc")))
        print(f"engine 1: computed the {PROMPT_TOKENS}-token prompt ({first['cached']} tokens from kvstore); ", end="")
        print(f"kvstore saved {files} chunk files to disk")
        second = in_subprocess(model, transfer)
        same = "same" if second["tokens"] == first["tokens"] else "DIFFERENT"
        print(
            f"engine 2 (a fresh process): {second['cached']} of {PROMPT_TOKENS} prompt tokens loaded from kvstore, "
            f"not computed; {same} {len(second['tokens'])} output tokens as engine 1"
        )


if __name__ == "__main__":
    main()
