"""Build every tiny test model in one process (``python tiny_models.py DIR``): one interpreter start
with torch and transformers instead of one per model. Prints one JSON line: name -> directory.

Runs under the vLLM environment; the models are those of tiny_llama.py, tiny_mla.py and tiny_gemma.py.
"""

from __future__ import annotations

import json
import os
import sys

from tiny_gemma import make_tiny_gemma
from tiny_llama import make_tiny_llama
from tiny_mla import make_tiny_mla

MODELS = {
    "llama": lambda path: make_tiny_llama(path),
    "llama_4kv": lambda path: make_tiny_llama(path, 4),
    "mla": make_tiny_mla,
    "gemma": make_tiny_gemma,
    "gemma_sliding": lambda path: make_tiny_gemma(path, all_sliding=True),
}

if __name__ == "__main__":
    if len(sys.argv) != 2:
        print("usage: tiny_models.py DIR", file=sys.stderr)
        sys.exit(2)
    print(json.dumps({name: make(os.path.join(sys.argv[1], name)) for name, make in MODELS.items()}))
