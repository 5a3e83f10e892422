"""End-to-end sketch of kvstore/connectors/hf.py on the real kvstore (a snapshot of main's HEAD in ./snap).

  cd /tmp/hfproto && PYTHONPATH=snap venv/bin/python hf_connector_proto.py --tokens 2048 --layout-dtype bfloat16
  ... --tokens 8192 --gen 4

Flow (per request):
  keys = chunk_keys(prompt)            one key per full 256-token chunk
  n = store.lookup(keys)               longest cached prefix, in chunks
  P = min(n*256, N-1)                  a fully cached prompt is cropped by one token: the model needs
                                       at least one input token to produce the first logits
  stream = store.prefetch(keys[:n])    layer-by-layer; each cache layer is a LazyLoadedLayer that
                                       blocks in update() until its layer arrived (overlaps load & compute)
  model(prompt[P:], past_key_values=cache) -> first token; then greedy decode
  after the request: put every full chunk of the prompt that the store did not have
"""
import argparse
import os
import shutil
import tempfile
import time

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from kvstore import KVLayout, StoreConfig, SyncKVStore, chunk_keys
from kvutil import build_prompt_ids
from smol import load


class LazyLoadedLayer(DynamicLayer):
    """DynamicLayer whose first `promised` tokens come from a kvstore layer stream."""

    def __init__(self, stream, idx, promised, dtype):
        super().__init__()
        self._stream, self._idx, self._promised, self._dtype = stream, idx, promised, dtype
        self.wait_s = 0.0

    def _materialize(self):
        if self._stream is None:
            return
        t0 = time.perf_counter()
        kv = self._stream.wait_layer(self._idx, timeout=60)        # [2, n*256, H, D] in layout dtype
        self.wait_s = time.perf_counter() - t0
        kv = kv[:, : self._promised]
        k = kv[0].transpose(0, 1).unsqueeze(0).to(self._dtype).contiguous()   # [1, H, P, D]
        v = kv[1].transpose(0, 1).unsqueeze(0).to(self._dtype).contiguous()
        self._stream = None
        super().update(k, v)

    def update(self, key_states, value_states, *args, **kwargs):
        self._materialize()
        return super().update(key_states, value_states, *args, **kwargs)

    def get_seq_length(self):
        return self._promised if self._stream is not None else super().get_seq_length()


class HFConnector:
    def __init__(self, model, store: SyncKVStore, layout: KVLayout, namespace: str):
        self.model, self.store, self.layout, self.ns = model, store, layout, namespace
        self.dtype = model.dtype

    def prepare(self, ids: torch.Tensor):
        """(cache, P, stream, n_chunks) for prompt ids [1, N]."""
        N = ids.shape[1]
        keys = chunk_keys(ids[0], self.layout, namespace=self.ns)
        n = self.store.lookup(keys) if keys else 0
        if n == 0:
            return DynamicCache(config=self.model.config), 0, None, keys, 0
        P = min(n * self.layout.chunk_tokens, N - 1)
        stream = self.store.prefetch(keys[:n], depth=self.layout.num_layers)
        cache = DynamicCache(config=self.model.config)
        cache.layers = [LazyLoadedLayer(stream, i, P, self.dtype) for i in range(self.layout.num_layers)]
        return cache, P, stream, keys, n

    def save(self, cache: DynamicCache, keys, n_have: int):
        """put the prompt's full chunks the store did not have (canonical [L, 2, 256, H, D], layout dtype)."""
        T = self.layout.chunk_tokens
        put = 0
        for c in range(n_have, len(keys)):
            kv = torch.empty(self.layout.chunk_shape, dtype=self.layout.dtype)
            for i, layer in enumerate(cache.layers):
                kv[i, 0].copy_(layer.keys[0, :, c * T:(c + 1) * T].transpose(0, 1))
                kv[i, 1].copy_(layer.values[0, :, c * T:(c + 1) * T].transpose(0, 1))
            put += bool(self.store.put(keys[c], kv))
        return put

    @torch.inference_mode()
    def run(self, ids: torch.Tensor, gen: int):
        """One request: returns dict(tokens, logits, ttft, P, waits)."""
        t0 = time.perf_counter()
        cache, P, stream, keys, n = self.prepare(ids)
        out = self.model(input_ids=ids[:, P:], past_key_values=cache, use_cache=True, logits_to_keep=1)
        first = out.logits[0, -1].float()
        ttft = time.perf_counter() - t0
        waits = sum(getattr(layer, "wait_s", 0.0) for layer in cache.layers)
        if stream is not None:
            stream.close()
        toks, logits = [int(first.argmax())], [first]
        for _ in range(gen - 1):
            out = self.model(input_ids=torch.tensor([[toks[-1]]]), past_key_values=cache, use_cache=True,
                             logits_to_keep=1)
            logits.append(out.logits[0, -1].float())
            toks.append(int(logits[-1].argmax()))
        saved = self.save(cache, keys, n)
        return dict(tokens=toks, logits=torch.stack(logits), ttft=ttft, P=P, waits=waits, saved=saved)


def report(name, ref, r):
    same = [a == b for a, b in zip(ref["tokens"], r["tokens"])]
    fd = same.index(False) if False in same else len(same)
    d = (r["logits"][: max(fd, 1)] - ref["logits"][: max(fd, 1)]).abs().max().item()
    print(f"  {name:<24} P={r['P']:5d} TTFT {r['ttft']:.3f}s (waited for KV {r['waits']:.3f}s)  "
          f"speedup {ref['ttft'] / r['ttft']:5.1f}x  tokens equal {sum(same)}/{len(same)}  "
          f"max|dlogit| {d:.3e}  bit-identical step0 {torch.equal(r['logits'][0], ref['logits'][0])}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--gen", type=int, default=32)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--layout-dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--prompt", default="facts", choices=["facts", "story"])
    a = ap.parse_args()
    tok, model, _ = load(dtype=getattr(torch, a.dtype))
    cfg = model.config
    layout = KVLayout(num_layers=cfg.num_hidden_layers, num_kv_heads=cfg.num_key_value_heads,
                      head_dim=cfg.head_dim, dtype=getattr(torch, a.layout_dtype))
    ids = build_prompt_ids(tok, a.tokens, kind=a.prompt)
    with torch.inference_mode():
        model(input_ids=ids[:, :16], logits_to_keep=1)
    tmp = tempfile.mkdtemp(prefix="hfproto-store-", dir="/tmp/hfproto")
    config = StoreConfig(dram={"capacity": "1GiB"}, disk={"path": tmp})
    print(f"model {a.dtype}, store layout {a.layout_dtype}, N={a.tokens}, gen {a.gen}, store {tmp}")
    try:
        with SyncKVStore(config, layout, namespace="smollm2") as store:
            conn = HFConnector(model, store, layout, "smollm2")
            ref = conn.run(ids, a.gen)                       # miss: full recompute, then chunks are put
            print(f"  {'full recompute (miss)':<24} P={ref['P']:5d} TTFT {ref['ttft']:.3f}s, "
                  f"put {ref['saved']} chunks; text {tok.decode(ref['tokens'][:24])!r}")
            store.flush()
            report("hit from DRAM", ref, conn.run(ids, a.gen))
        # a new store on the same directory: DRAM empty, the disk tier has the chunks (as after a restart)
        for label in ("hit from disk (warm)", "hit from disk (cold)"):
            if "cold" in label:
                for root, _, files in os.walk(tmp):
                    for f in files:
                        fd = os.open(os.path.join(root, f), os.O_RDONLY)
                        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                        os.close(fd)
            with SyncKVStore(config, layout, namespace="smollm2") as store:
                conn = HFConnector(model, store, layout, "smollm2")
                report(label, ref, conn.run(ids, a.gen))
                st = store.stats()
                print(f"    stats: dram {dict((k, st['dram'][k]) for k in list(st['dram'])[:6])}")
        # a longer prompt sharing the prefix: 300 extra tokens; the cached chunks cover only part of it
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
