"""``kvstore bench --device cuda``'s second table: time to first token through :class:`HFConnector`.

A random-weight Llama of a real model's shapes is built on the device (nothing is downloaded: the
timings depend on the shapes, not the weights), in bf16 with SDPA attention. Per model and prompt
length, best of ``repeats`` (each a ``generate(..., max_new_tokens=1)``, synchronized before the
clock is read):

- **recompute**: ``model.generate`` on a fresh cache;
- **GPU cache hit** (the floor): ``model.generate`` on a cache that already holds the prompt's first
  ``n - 1`` tokens on the device, as an engine's own prefix cache would;
- **kvstore DRAM** and **kvstore disk** (DRAM emptied first, files in the page cache): ``HFConnector.generate``
  with the prompt's chunks stored; the load planner may choose to recompute (the row says how many
  chunks it loaded);
- **first request + save**: ``HFConnector.generate`` of a prompt the store has not seen, with its save.

Each loaded prefix is checked bit for bit, per layer, against the cache it was saved from.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvstore.config import StoreConfig
from kvstore.util.progress import Progress

SHAPES: dict[str, dict[str, int]] = {  # Llama-3.2-1B and Llama-3-8B; "tiny" for a CPU run of the code
    "1B": {"hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32,
           "num_key_value_heads": 8, "head_dim": 64, "vocab_size": 128256},
    "8B": {"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
           "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 128256},
    "tiny": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
             "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 1000},
}  # fmt: skip
CASES = (("1B", 8192), ("8B", 8192), ("8B", 32768))


@dataclass
class TTFTRow:
    """One model and prompt length: seconds to the first token by each path (best of the repeats)."""

    model: str
    prompt: int
    recompute: float
    gpu_hit: float
    dram: float
    disk: float
    first_with_save: float
    loaded_dram: int  # chunks the planner loaded (the rest were recomputed)
    loaded_disk: int
    chunks: int
    kv_bytes: int  # of the prompt's stored chunks


def parse_cases(text: str) -> tuple[tuple[str, int], ...]:
    """``"8B:8192,8B:32768"`` as cases; a model not in SHAPES, or a prompt not a whole number of chunks, is refused."""
    cases = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, _, length = item.partition(":")
        if name not in SHAPES or not length.isdigit() or int(length) < 512 or int(length) % 256:
            raise ValueError(
                f"--ttft-cases {item!r}: use MODEL:TOKENS with MODEL one of {', '.join(SHAPES)} and TOKENS a multiple "
                "of 256, at least 512 (e.g. 8B:8192)"
            )
        cases.append((name, int(length)))
    return tuple(cases)


def build_model(shape: str, device: str, dtype: torch.dtype = torch.bfloat16) -> Any:
    """A random-weight LlamaForCausalLM of ``shape`` on ``device`` (SDPA attention)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**SHAPES[shape], max_position_embeddings=131072, attn_implementation="sdpa")
    config.name_or_path = f"random-llama-{shape}"
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    return model.eval()


def _timed(device: torch.device, work: Callable[[], object]) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    work()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


def bench_ttft(
    cases: tuple[tuple[str, int], ...] = CASES, device: str = "cuda", repeats: int = 3, directory: Path | None = None
) -> list[TTFTRow]:
    """The TTFT table's rows (see the module docstring); raises if any loaded KV differs from what was saved."""
    where = torch.device(device)
    rows: list[TTFTRow] = []
    generator = torch.Generator().manual_seed(0)
    with Progress("TTFT", total=len(cases), keep=False) as progress:  # a step after each case's row
        for shape in dict.fromkeys(name for name, _ in cases):
            progress.doing(f"building {shape}")
            rows += _bench_shape(
                shape,
                [length for name, length in cases if name == shape],
                where,
                repeats,
                directory,
                generator,
                progress,
            )
            if where.type == "cuda":
                torch.cuda.empty_cache()
    return rows


def _bench_shape(
    shape: str,
    lengths: list[int],
    where: torch.device,
    repeats: int,
    directory: Path | None,
    generator: torch.Generator,
    progress: Progress,
) -> list[TTFTRow]:
    """The rows of one model shape (its model built once), one per prompt length."""
    from transformers import DynamicCache

    from kvstore.connectors.hf import HFConnector, layout_for_model
    from kvstore.engine.sync import SyncKVStore

    rows: list[TTFTRow] = []
    model = build_model(shape, where.type)
    layout = layout_for_model(model)
    longest = max(lengths)
    chunk_bytes = layout.chunk_nbytes
    capacity = (2 * (longest // layout.chunk_tokens) + 4) * chunk_bytes  # the prompt, and its staging share
    with tempfile.TemporaryDirectory(prefix="kvstore-ttft-", dir=directory) as scratch:
        config = StoreConfig(dram={"capacity": capacity}, disk={"path": Path(scratch), "capacity": 1 << 50})
        with torch.inference_mode(), SyncKVStore(config, layout, namespace=f"bench-ttft-{shape}") as store:
            connector = HFConnector(model, store)

            def prompt(length: int) -> torch.Tensor:
                return torch.randint(0, model.config.vocab_size, (1, length), generator=generator).to(where)

            def generate(ids: torch.Tensor, **kwargs: Any) -> Any:
                return model.generate(ids, max_new_tokens=1, do_sample=False, **kwargs)

            def empty_dram(ids: torch.Tensor) -> None:
                store.flush()
                for key in store.chunk_keys(ids[0].tolist()):  # behind the contract: no engine empties DRAM
                    store._store.pool.discard(key)

            for length in lengths:
                progress.doing(f"{shape}, {length} tokens")
                generate(prompt(length))  # warm-up: kernels, allocator
                ids = prompt(length)
                reference = DynamicCache(config=model.config)
                model(ids, past_key_values=reference, use_cache=True)  # the KV of the whole prompt
                connector.save(ids, reference)
                store.flush()
                floor_cache = DynamicCache(config=model.config)
                model(ids[:, :-1], past_key_values=floor_cache, use_cache=True)

                def gpu_hit(cache: DynamicCache = floor_cache, ids: torch.Tensor = ids) -> float:
                    copy = DynamicCache(config=model.config)
                    for index, layer in enumerate(cache.layers):
                        copy.update(layer.keys.clone(), layer.values.clone(), index)
                    return _timed(where, lambda: generate(ids, past_key_values=copy))

                def kvstore(
                    disk: bool, ids: torch.Tensor = ids, reference: DynamicCache = reference
                ) -> tuple[float, int]:
                    if disk:
                        empty_dram(ids)
                    prefix: list[Any] = []

                    def run() -> None:
                        loaded = connector.load(ids)
                        prefix.append(loaded)
                        try:
                            generate(ids, past_key_values=loaded.cache)
                        finally:
                            loaded.close()

                    seconds = _timed(where, run)
                    _check(prefix[0], reference)
                    return seconds, prefix[0].chunks

                def first_with_save(length: int = length) -> float:
                    fresh = prompt(length)
                    seconds = _timed(where, lambda: connector.generate(fresh, max_new_tokens=1, do_sample=False))
                    store.flush()
                    return seconds

                recompute = min(_timed(where, lambda ids=ids: generate(ids)) for _ in range(repeats))
                for _ in range(repeats):  # the planner's prefill rate, measured as the connector runs
                    connector.generate(prompt(length), max_new_tokens=1, do_sample=False, save=False)
                hit = min(gpu_hit() for _ in range(repeats))
                dram = [kvstore(False) for _ in range(repeats)]
                disk = [kvstore(True) for _ in range(repeats)]
                saved = min(first_with_save() for _ in range(repeats))
                chunks = length // layout.chunk_tokens
                rows.append(
                    TTFTRow(
                        shape,
                        length,
                        recompute,
                        hit,
                        min(s for s, _ in dram),
                        min(s for s, _ in disk),
                        saved,
                        min(n for _, n in dram),
                        min(n for _, n in disk),
                        chunks,
                        chunks * chunk_bytes,
                    )  # fmt: skip
                )
                del reference, floor_cache
                progress.step(f"{shape}, {length} tokens: done")
    return rows


def _check(prefix: Any, reference: Any) -> None:
    """Every loaded token of every layer equals the cache the chunks were saved from, bit for bit."""
    tokens = prefix.reused_tokens
    for index, (layer, saved) in enumerate(zip(prefix.cache.layers, reference.layers, strict=True)):
        for name in ("keys", "values"):
            got, want = getattr(layer, name)[..., :tokens, :], getattr(saved, name)[..., :tokens, :]
            if not torch.equal(got.view(torch.int16), want.view(torch.int16)):
                raise RuntimeError(f"layer {index} {name}: the loaded KV differs from the saved KV")
