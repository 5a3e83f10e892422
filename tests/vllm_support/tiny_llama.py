"""Build a tiny, deterministic LlamaForCausalLM + locally-trained tokenizer.

The result is a plain HF model directory that vLLM (CPU build) can load fully
offline.  Runs under the vLLM venv (transformers 5.x, tokenizers 0.2x).

Choices forced by the vLLM CPU attention backend (CPU_ATTN):
  * head_dim must be one of 32, 64, 80, ... (16 is NOT supported), so we use
    hidden 128 = 4 heads x head_dim 32, with 2 KV heads (GQA).
  * dtype: weights saved as float32 (the vLLM CPU backend also runs
    bfloat16 and float16; we load with dtype="float32" for bit-stable greedy
    outputs).

Usage:  python tiny_llama.py /path/to/model_dir [--kv-heads 4]

``--kv-heads 4`` (8 attention heads, 4 KV heads, still head_dim 32 and hidden 128) makes a model
that tensor parallelism of 2 can split (each rank keeps 2 KV heads); the default is 2 KV heads.
"""

from __future__ import annotations

import os
from typing import Any

VOCAB_SIZE = 512
MAX_POS = 4096


def _corpus() -> list[str]:
    import random

    rng = random.Random(1234)
    words = (
        "the a one two three four five six seven eight nine ten key value "
        "cache block token layer head store load tier chunk prefix hash "
        "memory disk remote local fast slow red green blue cat dog bird fish "
        "runs jumps sees eats reads writes and or but if then else when while"
    ).split()
    return [" ".join(rng.choice(words) for _ in range(rng.randint(5, 20))) for _ in range(2000)]


def _make_tokenizer(path: str):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=["<unk>", "<s>", "</s>", "<pad>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        model_max_length=MAX_POS,
    )
    fast.save_pretrained(path)
    return fast


def make_tiny_llama(path: str, kv_heads: int = 2) -> str:
    """Create (idempotently) a tiny Llama model dir at ``path``; return path.

    ``kv_heads``: 2 (4 attention heads) or 4 (8 attention heads); head_dim stays 32.
    """
    if kv_heads not in (2, 4):
        raise ValueError(f"kv_heads must be 2 or 4, not {kv_heads}")
    path = os.path.abspath(path)
    if os.path.exists(os.path.join(path, "config.json")):
        return path
    os.makedirs(path, exist_ok=True)

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = _make_tokenizer(path)
    # BPE may stop below VOCAB_SIZE; size the embedding to the real vocab so
    # every id the model can emit is decodable.
    vocab = len(tokenizer)

    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2 * kv_heads,
        num_key_value_heads=kv_heads,
        head_dim=32,
        max_position_embeddings=MAX_POS,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        dtype="float32",
    )
    torch.manual_seed(0)
    return save_random(LlamaForCausalLM(config), path)


def save_random(model: Any, path: str, norm_scale: float | None = None) -> str:
    """Give ``model`` random weights and save it at ``path`` (float32, safetensors); return ``path``.

    Larger than the default init, so that greedy outputs depend on the context (an identical
    output after a KV reload then means something). ``norm_scale``: 1-D weights (norms) random
    too, at that scale (Gemma's norms scale by 1 + w: without it its outputs barely vary).
    """
    import torch

    with torch.no_grad():
        generator = torch.Generator().manual_seed(0)
        for parameter in model.parameters():
            if parameter.dim() >= 2:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.08)
            elif norm_scale is not None:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * norm_scale)
    model.to(torch.float32).save_pretrained(path)
    return path


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description="Make a tiny Llama model directory.")
    parser.add_argument("path")
    parser.add_argument("--kv-heads", type=int, default=2, choices=[2, 4])
    args = parser.parse_args()
    print(make_tiny_llama(args.path, args.kv_heads))
