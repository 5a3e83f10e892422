"""Prototype of tests/test_connector_hf.py: real SmolLM2-135M, real kvstore tiers (DRAM, disk, Redis).

  cd /tmp/hfproto && HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONPATH=snap venv/bin/python -m pytest -q -s test_hf_proto.py

float32 model. Lossless: KVLayout dtype float32 (the model's own KV, bit-exact in the store) -> tokens
identical to full recompute. bf16 layout and the fp8 codec are lossy: agreement and logit diff are printed.
"""
import shutil
import tempfile
import time

import pytest
import torch
from transformers import DynamicCache

from hf_connector_proto import HFConnector
from kvstore import KVLayout, StoreConfig, SyncKVStore, chunk_keys
from kvutil import build_prompt_ids
from smol import load

GEN = 32
N = 2048


@pytest.fixture(scope="module")
def model_tok():
    torch.manual_seed(0)
    tok, model, (tt, tm) = load(dtype=torch.float32)
    print(f"\n[load] tokenizer {tt:.1f}s model {tm:.1f}s")
    return model, tok


@pytest.fixture(scope="module")
def reference(model_tok):
    """Full recompute of the 2K prompt and of the same prompt + 100 tokens; greedy 32 each."""
    model, tok = model_tok
    ids = build_prompt_ids(tok, N)
    ext = torch.cat([ids[:, :-64], build_prompt_ids(tok, 164, seed=1)], dim=1)  # shares the first 1984 tokens
    refs = {}
    for name, x in (("same", ids), ("extended", ext)):
        cache = DynamicCache(config=model.config)
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = model(input_ids=x, past_key_values=cache, use_cache=True, logits_to_keep=1)
        ttft = time.perf_counter() - t0
        toks, logits = [], []
        with torch.inference_mode():
            for _ in range(GEN):
                lg = out.logits[0, -1].float()
                toks.append(int(lg.argmax()))
                logits.append(lg)
                out = model(input_ids=torch.tensor([[toks[-1]]]), past_key_values=cache, use_cache=True,
                            logits_to_keep=1)
        refs[name] = dict(ids=x, cache=cache, tokens=toks, logits=torch.stack(logits), ttft=ttft)
    print(f"[reference] full prefill {N} tokens: {refs['same']['ttft']:.2f}s")
    return refs


def layout_for(model, dtype):
    c = model.config
    return KVLayout(num_layers=c.num_hidden_layers, num_kv_heads=c.num_key_value_heads, head_dim=c.head_dim,
                    dtype=dtype)


def tier_config(tier, tmp, codec, redis_url=None):
    if tier == "dram":
        return StoreConfig(dram={"capacity": "128MiB"}, disk={"enabled": False})
    if tier == "disk":
        return StoreConfig(dram={"capacity": "128MiB"}, disk={"path": tmp, "codec": codec})
    if tier == "redis":
        return StoreConfig(dram={"capacity": "128MiB"}, disk={"enabled": False},
                           redis={"enabled": True, "url": redis_url, "codec": codec})
    raise ValueError(tier)


@pytest.fixture(scope="module")
def redis_url():
    from kvstore.devservers import RedisServer
    with RedisServer() as r:
        yield r.url


def run_case(model, ref_all, tier, layout_dtype, codec, redis_url, which="same"):
    """Populate `tier` from the 'same' reference's KV (as the first request would), then serve `which`."""
    ref_same, ref = ref_all["same"], ref_all[which]
    layout = layout_for(model, layout_dtype)
    tmp = tempfile.mkdtemp(prefix="hfproto-t-", dir="/tmp/hfproto")
    try:
        config = tier_config(tier, tmp, codec, redis_url)
        with SyncKVStore(config, layout, namespace="t") as store:
            conn = HFConnector(model, store, layout, "t")
            keys = chunk_keys(ref_same["ids"][0], layout, namespace="t")
            assert conn.save(ref_same["cache"], keys, 0) == len(keys)
            store.flush()
            if tier == "dram":
                r = conn.run(ref["ids"], GEN)
        if tier != "dram":  # a fresh store: DRAM empty, the chunks come from the tier
            with SyncKVStore(config, layout, namespace="t") as store:
                r = HFConnector(model, store, layout, "t").run(ref["ids"], GEN)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    same = [a == b for a, b in zip(r["tokens"], ref["tokens"])]
    fd = same.index(False) if False in same else GEN
    d0 = (r["logits"][0] - ref["logits"][0]).abs().max().item()
    dmax = (r["logits"][: max(fd, 1)] - ref["logits"][: max(fd, 1)]).abs().max().item()
    print(f"\n[{tier} {str(layout_dtype)[6:]} {codec} {which}] P={r['P']} TTFT {r['ttft']:.3f}s "
          f"(recompute {ref['ttft']:.2f}s) tokens {sum(same)}/{GEN} first divergence "
          f"{'none' if fd == GEN else fd}, max|dlogit| step0 {d0:.2e} until divergence {dmax:.2e}")
    return r, sum(same), d0, dmax


@pytest.mark.parametrize("tier,codec", [("dram", "identity"), ("disk", "identity"), ("disk", "bytesplit"),
                                        ("redis", "bytesplit")])
@pytest.mark.parametrize("which", ["same", "extended"])
def test_lossless_identical(model_tok, reference, redis_url, tier, codec, which):
    model, _ = model_tok
    r, agree, d0, dmax = run_case(model, reference, tier, torch.float32, codec, redis_url, which)
    assert r["P"] == (N - 1 if which == "same" else 1792)
    assert agree == GEN
    assert dmax < 1e-3


@pytest.mark.parametrize("tier,codec,layout_dtype", [
    ("disk", "identity", torch.bfloat16),
    ("disk", "fp8", torch.bfloat16),
    ("redis", "fp8+zstd", torch.bfloat16),
    ("disk", "fp8", torch.float32),
])
def test_lossy_report(model_tok, reference, redis_url, tier, codec, layout_dtype):
    model, _ = model_tok
    r, agree, d0, dmax = run_case(model, reference, tier, layout_dtype, codec, redis_url)
    assert r["P"] == N - 1
    assert r["tokens"][0] == reference["same"]["tokens"][0]  # weak: the first token survives
