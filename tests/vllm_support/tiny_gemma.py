"""Build a tiny Gemma-3-style hybrid model: sliding-window and full-attention layers alternating.

Random float32 weights and the tokenizer of tiny_llama.py, made locally (no downloads), for
vLLM's hybrid KV cache manager: 4 layers (sliding, full, sliding, full), a window of 256 tokens,
2 KV heads of 32. Gemma-3 rather than Gemma-2: vLLM's Gemma-2 always ties the output head to the
embeddings, and a tied random Gemma repeats one token whatever its context; untied weights and
random norm weights (Gemma's norms scale by 1 + w) give greedy outputs that depend on the prompt.

Usage:  python tiny_gemma.py PATH [--all-sliding]
"""

from __future__ import annotations

import os
import sys

from tiny_llama import MAX_POS, _make_tokenizer, save_random

SLIDING_WINDOW = 256


def make_tiny_gemma(path: str, all_sliding: bool = False) -> str:
    """Create (idempotently) the model directory at ``path``; return it.

    ``all_sliding``: every layer attends to the sliding window (Mistral-7B-v0.1 style): one KV
    cache group, of sliding-window layers.
    """
    path = os.path.abspath(path)
    if os.path.exists(os.path.join(path, "config.json")):
        return path
    os.makedirs(path, exist_ok=True)
    import torch
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    tokenizer = _make_tokenizer(path)
    config = Gemma3TextConfig(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=MAX_POS,
        sliding_window=SLIDING_WINDOW,
        layer_types=["sliding_attention"] * 4 if all_sliding else ["sliding_attention", "full_attention"] * 2,
        query_pre_attn_scalar=32,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        dtype="float32",
    )
    torch.manual_seed(0)
    return save_random(Gemma3ForCausalLM(config), path, norm_scale=0.5)


if __name__ == "__main__":
    if len(sys.argv) not in (2, 3) or sys.argv[2:] not in ([], ["--all-sliding"]):
        print("usage: tiny_gemma.py PATH [--all-sliding]", file=sys.stderr)
        sys.exit(2)
    print(make_tiny_gemma(sys.argv[1], all_sliding=len(sys.argv) == 3))
