"""KV <-> DynamicCache helpers (transformers 5.23 API) and KV codecs used by the prototypes.

kvstore canonical chunk layout: [num_layers, 2, tokens, num_kv_heads, head_dim] (bf16 in the store).
transformers DynamicCache layer i: cache.layers[i].keys / .values, each [batch, num_kv_heads, seq, head_dim].
"""
import random

import torch
from transformers import DynamicCache

PARAGRAPH = (
    "The old lighthouse keeper walked along the rocky shore every morning, counting the boats that "
    "had returned from the night's fishing. He wrote their names in a leather notebook, together with "
    "the weather, the height of the tide and the colour of the sky at dawn. Over forty years the notebook "
    "had grown into a shelf of volumes that the village school now used to teach history and arithmetic."
)
WORDS = ("river stone market bridge winter garden silver lantern harbour orchard candle meadow "
         "copper window thunder valley mirror ribbon castle forest").split()


NAMES = "Maria Tomas Aiko Lena Omar Priya Jonas Sofia Mateo Ingrid Kwame Elena Ravi Chloe Dmitri Ana".split()
CITIES = "Lisbon Oslo Nairobi Kyoto Lima Tallinn Porto Hanoi Quebec Dakar Bergen Cusco Seville Tartu Osaka Accra".split()


def _facts_text(rng, i):
    n, c1, c2 = rng.choice(NAMES), rng.choice(CITIES), rng.choice(CITIES)
    year, k = rng.randint(1800, 1990), rng.randint(2, 40)
    trade = rng.choice(["bakery", "bookshop", "pottery studio", "bicycle workshop", "tea house",
                        "clock repair shop", "flower stall", "printing press"])
    thing = {"bakery": "ovens", "bookshop": "shelves", "pottery studio": "kilns", "bicycle workshop": "benches",
             "tea house": "tables", "clock repair shop": "lathes", "flower stall": "buckets",
             "printing press": "typefaces"}[trade]
    return (f"Record {i}: In {year}, {n} moved from {c1} to {c2} and opened a {trade} with {k} {thing}. "
            f"{n} kept the {trade} for {rng.randint(3, 50)} years. ")


def build_prompt_ids(tok, n_tokens: int, seed: int = 0, kind: str = "facts") -> torch.Tensor:
    """Deterministic prompt of exactly n_tokens.

    kind="facts": seeded random records (names, cities, years, counts) + a retrieval question, so the
                  continuation depends on attending to specific earlier tokens (a harder test for lossy KV);
    kind="story": one fixed paragraph repeated with a few seeded words (the model just copies it: easy).
    """
    rng = random.Random(seed)
    parts, i = [], 0
    while True:
        i += 1
        if kind == "facts":
            parts.append(_facts_text(rng, i))
        else:
            extra = " ".join(rng.choice(WORDS) for _ in range(6))
            parts.append(f"Chapter {i}. {PARAGRAPH} Key words: {extra}.\n")
        if i % 8 == 0 or i < 3:
            ids = tok("".join(parts)).input_ids
            if len(ids) >= n_tokens + 64:
                break
    if kind == "facts":
        question = tok("\nQuestion: list where each person from Record 1, Record 2 and Record 3 moved, "
                       "and what they opened.\nAnswer:").input_ids
    else:
        question = tok("\nQuestion: summarise the chapters above in one sentence.\nAnswer:").input_ids
    ids = ids[: n_tokens - len(question)] + question
    assert len(ids) == n_tokens
    return torch.tensor([ids], dtype=torch.long)


# ---- cache <-> canonical tensor ---------------------------------------------------------------

def cache_to_canonical(cache: DynamicCache, n_tokens: int, dtype=torch.bfloat16) -> torch.Tensor:
    """First n_tokens of every layer -> [L, 2, n_tokens, H, D] (batch 0), converted to dtype."""
    L = len(cache.layers)
    k0 = cache.layers[0].keys
    _, H, _, D = k0.shape
    out = torch.empty((L, 2, n_tokens, H, D), dtype=dtype)
    for i, layer in enumerate(cache.layers):
        # [1, H, S, D] -> [S, H, D]; copy_ does the dtype conversion
        out[i, 0].copy_(layer.keys[0, :, :n_tokens].transpose(0, 1))
        out[i, 1].copy_(layer.values[0, :, :n_tokens].transpose(0, 1))
    return out


def layer_from_canonical(kv_layer: torch.Tensor, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """[2, S, H, D] (any dtype) -> (keys, values) each [1, H, S, D] contiguous in the model's dtype."""
    k = kv_layer[0].transpose(0, 1).unsqueeze(0).to(dtype).contiguous()
    v = kv_layer[1].transpose(0, 1).unsqueeze(0).to(dtype).contiguous()
    return k, v


def fill_layer(cache: DynamicCache, i: int, kv_layer: torch.Tensor, dtype) -> None:
    k, v = layer_from_canonical(kv_layer, dtype)
    cache.layers[i].update(k, v)   # lazy-initialises the DynamicLayer, then cat([], k) -> k


def cache_from_canonical(kv: torch.Tensor, config, dtype) -> DynamicCache:
    """[L, 2, S, H, D] -> DynamicCache(config=...) holding exactly those S tokens in every layer."""
    cache = DynamicCache(config=config)
    for i in range(kv.shape[0]):
        fill_layer(cache, i, kv[i], dtype)
    return cache


def cache_from_canonical_ddp(kv: torch.Tensor, dtype) -> DynamicCache:
    """Alternative constructor: DynamicCache(ddp_cache_data=[(k, v), ...]) (the 5.x replacement of from_legacy_cache)."""
    return DynamicCache([layer_from_canonical(kv[i], dtype) for i in range(kv.shape[0])])


# ---- codecs (round trips) ---------------------------------------------------------------------

FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max


def fp8_roundtrip(kv: torch.Tensor, chunk: int = 256, mode: str = "channel") -> torch.Tensor:
    """Quantise [L, 2, S, H, D] to fp8 e4m3 and back (float32), one scale set per 256-token chunk.

    mode="channel": scale per (layer, k/v, head, dim) = amax over the chunk's tokens / 448
    mode="tensor":  one scale per (layer, k/v) per chunk
    """
    x = kv.float()
    out = torch.empty_like(x)
    for s in range(0, x.shape[2], chunk):
        c = x[:, :, s:s + chunk]                                   # [L, 2, T, H, D]
        if mode == "channel":
            amax = c.abs().amax(dim=2, keepdim=True)               # [L, 2, 1, H, D]
        elif mode == "tensor":
            amax = c.abs().amax(dim=(2, 3, 4), keepdim=True)       # [L, 2, 1, 1, 1]
        else:
            raise ValueError(mode)
        scale = (amax / FP8_MAX).clamp_min(1e-12)
        q = (c / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        out[:, :, s:s + chunk] = q.float() * scale
    return out
