"""An MLA model's compressed KV, computed from its checkpoint alone (no engine, no transformers).

Shared by tests/test_vllm_shapes.py (kvstore's environment): the first ``kv_lora_rank`` values of a
token's latent in layer 0 are ``kv_a_layernorm(kv_a_proj_with_mqa(input_layernorm(embedding)))``;
the rest (``k_pe``) is rotated by position and is not computed here.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file


def layer0_compressed_kv(model: Path, token_ids: list[int]) -> torch.Tensor:
    """``[tokens, kv_lora_rank]``: layer 0's normalized compressed KV of ``token_ids`` (float32)."""
    config = json.loads((model / "config.json").read_text())
    weights = load_file(model / "model.safetensors")
    eps, rank = config["rms_norm_eps"], config["kv_lora_rank"]

    def rms_norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight

    attn = "model.layers.0.self_attn."
    hidden = rms_norm(
        weights["model.embed_tokens.weight"][torch.tensor(token_ids)], weights["model.layers.0.input_layernorm.weight"]
    )
    compressed = (hidden @ weights[attn + "kv_a_proj_with_mqa.weight"].T)[:, :rank]
    return rms_norm(compressed, weights[attn + "kv_a_layernorm.weight"])
