"""Hugging Face transformers connector: a prompt prefix computed once is loaded, not recomputed.

    from kvstore import StoreConfig, SyncKVStore
    from kvstore.connectors.hf import HFConnector, layout_for_model

    layout = layout_for_model(model)         # the model's KV shape; its dtype, so reuse is lossless
    namespace = namespace_for_model(model)   # the exact weights: hf:<path>#id=<weights and settings>
    with SyncKVStore(StoreConfig.load("kvstore.toml"), layout, namespace=namespace) as store:
        connector = HFConnector(model, store)
        out = connector.generate(input_ids, max_new_tokens=32)   # model.generate, with prefix reuse

Per request (batch size 1): the prompt's chunk keys are looked up; the longest cached prefix is
streamed layer by layer into a ``DynamicCache`` whose layer i waits for its KV only when the
forward pass reaches layer i, so layers i+1, i+2, ... keep arriving while layer i computes;
transformers then prefills only the tokens after the prefix. After the request, the prompt's
full chunks the store lacked are put (the store cascades them to disk, Redis, S3). A prefix
that fails to load (a chunk corrupt or gone, a tier timing out) is recomputed instead: counted,
never wrong KV.

Sliding-window models (Gemma 2 and 3, Mistral, ...; transformers' ``DynamicSlidingWindowLayer``)
are served too, with the same chunks: a chunk holds every token of every layer, whatever the
layer's type, so it means the same to any request that reaches it. The cache :meth:`HFConnector.load`
makes keeps every token of its sliding-window layers for the request's lifetime (by the end of a
long prefill transformers would have dropped all but the window, and such a chunk could not be
stored whole); on load, a sliding-window layer gets only what transformers itself would hold after
computing the prefix: its last ``sliding_window - 1`` tokens, and the prefix's length as
``cumulative_length``. A cache whose layers no longer hold a chunk's tokens saves no chunk from
there on (counted in ``save_incomplete``): never a chunk with holes. A model whose cache has
layers that are not per-token attention KV (linear-attention and Mamba states, shared KV) is
refused when the connector is built, a quantized cache when it is saved, each with the reason and
the alternative. See :mod:`kvstore.connectors.hf_cache`.

The namespace must name the exact weights (and anything else that changes the KV): the layout
fingerprint only tells shapes and dtypes apart, not two models that share them.
:func:`namespace_for_model` derives one from the checkpoint's bytes and the model's config
(:mod:`kvstore.connectors.identity`).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

try:
    from transformers import DynamicCache
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        "kvstore.connectors.hf needs Hugging Face transformers >= 5.20: pip install 'kvstore-tiered[hf]'"
    ) from exc

from kvstore.connectors.hf_cache import (
    LoadedPrefix,
    StreamedPrefixLayer,
    StreamedSlidingWindowPrefixLayer,
    check_storable,
    first_held_token,
)
from kvstore.connectors.identity import default_namespace
from kvstore.engine.planner import LoadPlan
from kvstore.engine.sync import SyncKVStore
from kvstore.errors import PrefetchError
from kvstore.keys import ChunkKey, chain_parents
from kvstore.layout import KVLayout

__all__ = [
    "HFConnector",
    "LoadedPrefix",
    "StreamedPrefixLayer",
    "StreamedSlidingWindowPrefixLayer",
    "layout_for_model",
    "namespace_for_model",
]

log = logging.getLogger("kvstore.connectors.hf")
SAVE_GROUP_BYTES = 256 * 2**20  # a GPU model's save assembles its chunks on the device this many bytes at a time


def layout_for_model(model: Any, *, dtype: torch.dtype | None = None, chunk_tokens: int = 256) -> KVLayout:
    """The :class:`KVLayout` of a transformers decoder's KV cache (dtype: the model's, unless given).

    Storing the model's own dtype makes reuse lossless; a narrower one (bf16 KV of an fp32 model)
    halves the bytes at a measurable cost in accuracy.
    """
    config = model.config.get_text_config(decoder=True)
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return KVLayout(
        num_layers=config.num_hidden_layers,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        dtype=dtype or model.dtype,
        chunk_tokens=chunk_tokens,
    )


def namespace_for_model(model: Any, *, revision: str | None = None) -> str:
    """``hf:<name_or_path>#id=<identity>``: a namespace that changes whenever the model's KV would.

    The identity hashes the checkpoint the model was loaded from (every weight byte, its
    config.json; see :mod:`kvstore.connectors.identity` for the cost and its cache) and what
    else changes the KV: the dtype the model runs in, its quantization, rope scaling and the
    config it was loaded with (``from_pretrained`` overrides included). Pass the ``revision``
    you loaded for a hub model.
    """
    config = model.config
    name = getattr(model, "name_or_path", None) or config.name_or_path
    if not name:
        raise ValueError("the model has no name_or_path (not loaded by from_pretrained): pass the store a namespace")
    settings = {
        "dtype": str(model.dtype),
        "config": config.to_diff_dict() if hasattr(config, "to_diff_dict") else config.to_dict(),
    }
    return default_namespace("hf", str(name), settings, revision)


class HFConnector:
    """Prefix reuse for one transformers model over a :class:`SyncKVStore` built for its layout.

    Use from one engine thread at a time (the store itself may be shared).
    """

    def __init__(self, model: Any, store: SyncKVStore, *, extra: bytes | None = None) -> None:
        """``extra``: bytes that change the KV for the same tokens (a LoRA adapter's id), folded into keys."""
        check_storable(DynamicCache(config=model.config), f"the cache of {type(model).__name__}")
        layout: KVLayout = store.layout
        expected = layout_for_model(model, dtype=layout.dtype, chunk_tokens=layout.chunk_tokens)
        for field in ("num_layers", "num_kv_heads", "head_dim", "kv_planes"):
            if getattr(layout, field) != getattr(expected, field):
                raise ValueError(
                    f"the store's layout has {field}={getattr(layout, field)} but the model has "
                    f"{getattr(expected, field)}: build the store with layout_for_model(model)"
                )
        self.model, self.store, self.layout, self.extra = model, store, layout, extra
        self.wait_timeout = store.layer_wait_timeout  # the longest a layer can take while the store keeps its bounds
        self._staging: torch.Tensor | None = None  # a CPU model's saves: one chunk, reused by every save
        self.counters: dict[str, float] = {
            "requests": 0,
            "prompt_tokens": 0,
            "reused_tokens": 0,
            "loaded_chunks": 0,
            "saved_chunks": 0,
            "save_rejected": 0,
            "save_incomplete": 0,  # chunks not saved: a sliding-window layer had dropped some of their tokens
            "fallbacks": 0,
            "recomputed_chunks": 0,  # stored chunks the load planner found faster to compute than to load
            "load_wait_seconds": 0.0,
        }
        self.last_plan: LoadPlan | None = None  # the plan of the latest request's prefix
        self._prefills: list[_ForwardTiming] = []  # prefills timed, not yet given to the planner

    # -- the parts of a request ------------------------------------------------------------------

    def load(self, input_ids: torch.Tensor | Sequence[int]) -> LoadedPrefix:
        """The cache for a request: its longest stored prefix starts streaming in now.

        A prompt that is cached whole reuses all but its last token: the model needs at least
        one input token to produce the next token's logits.

        Of the stored prefix, only the leading chunks the store's load planner finds faster to load
        than to compute are loaded (``self.last_plan``; :mod:`kvstore.engine.planner`); the rest are
        recomputed, and saved again after the request (so a chunk only a slow tier holds gets into
        DRAM and the disk).
        """
        tokens = _prompt_tokens(input_ids)
        self._observe_prefills()  # a GPU's last prefill, timed by now
        keys = self.store.chunk_keys(tokens, self.extra)
        plan = self.store.plan(keys) if keys else LoadPlan((), 0, 0.0, 0.0)
        self.last_plan = plan
        self.counters["recomputed_chunks"] += plan.recomputed
        reused = min(plan.load * self.layout.chunk_tokens, len(tokens) - 1)
        if reused <= 0:
            return LoadedPrefix(self.model, keys)
        prefix = LoadedPrefix(self.model, keys, plan.load, reused, len(tokens))
        prefix.start(self.store, self.wait_timeout, lambda seconds: self.store.observe_load(plan, seconds))
        return prefix

    def save(
        self, token_ids: torch.Tensor | Sequence[int], cache: DynamicCache, *, start_chunk: int | None = None
    ) -> int:
        """Put the full chunks of ``token_ids`` that ``cache`` holds, from ``start_chunk`` on; how many were put.

        ``start_chunk=None`` asks the store where its stored prefix ends. ``token_ids`` are the
        tokens whose KV the cache holds, in order (the prompt, or prompt and reply for the next turn).
        A chunk is stored whole (every token, every layer) or not at all: saving stops at the first
        chunk whose tokens some layer no longer holds (a plain ``DynamicSlidingWindowLayer`` keeps
        only its window; the caches :meth:`load` makes keep every token), counted in
        ``counters["save_incomplete"]``.
        """
        tokens = _prompt_tokens(token_ids)
        return self._save(self.store.chunk_keys(tokens, self.extra), len(tokens), cache, start_chunk)

    def _save(self, keys: list[ChunkKey], n_tokens: int, cache: DynamicCache, start_chunk: int | None) -> int:
        if any(getattr(layer, "pending", False) for layer in cache.layers):
            raise ValueError("the cache still waits for prefix layers: run the forward pass before saving")
        check_storable(cache, "the cache to save")
        size = self.layout.chunk_tokens
        held = min(cache.get_seq_length(), n_tokens) // size
        first = self.store.lookup(keys) if start_chunk is None else start_chunk
        last = min(held, len(keys))  # one past the last chunk to save
        starts = [first_held_token(layer) for layer in cache.layers]
        if first < last and any(start is None or start > first * size for start in starts):
            # A layer lacks the first chunk's tokens (it holds a suffix of the tokens). The chunks after
            # it are not saved either: the stored prefix would still end here, so they would never be found.
            self.counters["save_incomplete"] += last - first
            last = first
        saved = 0
        group = self._save_group()
        for begin in range(first, last, group):
            end = min(begin + group, last)
            chunks = self._chunks(cache, starts, begin, end)
            parents = chain_parents(keys[begin:end], keys[begin - 1] if begin else None)
            accepted = sum(self.store.put_many(keys[begin:end], list(chunks), parents=parents))
            saved += accepted
            self.counters["save_rejected"] += end - begin - accepted
        self.counters["saved_chunks"] += saved
        return saved

    def _save_group(self) -> int:
        """Chunks assembled at once for a save: one on the CPU (a reused staging chunk: the store copies it
        before ``put`` returns), up to SAVE_GROUP_BYTES on a GPU (copied out asynchronously)."""
        if self.model.device.type == "cpu":
            return 1
        return max(1, SAVE_GROUP_BYTES // self.layout.chunk_nbytes)

    def _chunks(self, cache: DynamicCache, starts: list[int | None], begin: int, end: int) -> torch.Tensor:
        """Chunks ``begin`` to ``end - 1`` of the cache in canonical order, ``[n, layers, 2, tokens, heads, dim]``.

        One copy per layer and plane for all of them, on the model's device (on a GPU, a kernel on its
        stream: the store's download stream waits for it, then copies each chunk to its DRAM slot).
        """
        count, size = end - begin, self.layout.chunk_tokens
        if self.model.device.type == "cpu":
            if self._staging is None:
                self._staging = torch.empty((1, *self.layout.chunk_shape), dtype=self.layout.dtype)
            chunks = self._staging
        else:
            chunks = torch.empty((count, *self.layout.chunk_shape), dtype=self.layout.dtype, device=self.model.device)
        for layer_index, (layer, held_from) in enumerate(zip(cache.layers, starts, strict=True)):
            assert held_from is not None
            span = slice(begin * size - held_from, end * size - held_from)
            for plane, states in enumerate((layer.keys, layer.values)):  # [1, heads, tokens, dim]
                chunks[:count, layer_index, plane].copy_(
                    states[0, :, span].unflatten(1, (count, size)).permute(1, 2, 0, 3)
                )
        return chunks[:count]

    # -- a whole request ---------------------------------------------------------------------------

    def generate(self, input_ids: torch.Tensor, *, save: bool = True, **generate_kwargs: Any) -> Any:
        """``model.generate(input_ids, **generate_kwargs)``, prefilling only what the store lacks.

        If the cached prefix cannot be loaded the request is recomputed from scratch (counted in
        ``counters["fallbacks"]``). With ``save``, the prompt's new full chunks are stored after.
        """
        tokens = _prompt_tokens(input_ids)
        prefix = self.load(tokens)
        start_chunk: int | None = prefix.chunks
        try:
            with _first_forward(self.model) as prefill:
                output = self.model.generate(input_ids, past_key_values=prefix.cache, **generate_kwargs)
            if prefill.tokens >= self.layout.chunk_tokens:  # a real prefill, not a token or two
                prefill.waited = prefix.waited
                self._prefills.append(prefill)
        except PrefetchError as exc:
            log.warning("cached prefix of %d tokens failed to load (%s); recomputing", prefix.reused_tokens, exc)
            self.counters["fallbacks"] += 1
            prefix.close()
            prefix = LoadedPrefix(self.model, prefix.keys)
            start_chunk = None  # the store's prefix may have shrunk: a corrupt chunk was removed
            output = self.model.generate(input_ids, past_key_values=prefix.cache, **generate_kwargs)
        finally:
            prefix.close()
        self.counters["requests"] += 1
        self.counters["prompt_tokens"] += len(tokens)
        self.counters["reused_tokens"] += prefix.reused_tokens
        self.counters["loaded_chunks"] += prefix.chunks
        self.counters["load_wait_seconds"] += prefix.waited
        if save:
            self._save(prefix.keys, len(tokens), prefix.cache, start_chunk)  # keys hashed once per request
        self._observe_prefills()
        return output

    def _observe_prefills(self) -> None:
        """Give the planner the prefills timed so far whose time is known (a GPU's once its events completed).

        The forward's time, less what the host waited for loaded layers: the engine's prefill rate.
        """
        waiting = []
        for prefill in self._prefills:
            seconds = prefill.seconds()
            if seconds is None:
                waiting.append(prefill)
            else:
                self.store.observe_prefill(prefill.tokens, seconds - prefill.waited)
        self._prefills = waiting

    def stats(self) -> dict[str, Any]:
        """The connector's counters and the store's (per tier)."""
        return {"connector": dict(self.counters), **self.store.stats()}


@dataclass
class _ForwardTiming:
    """The model's first forward call in a block: its input tokens and how long it ran.

    On a GPU the call returns once its kernels are queued, so it is timed by two CUDA events on the
    model's stream (``seconds()`` is None until the second has completed: read it later, no host
    synchronize); on the CPU by the clock.
    """

    tokens: int = 0  # input tokens of the model's first forward call
    waited: float = 0.0  # seconds the host spent waiting for loaded layers during it
    started: float | None = None
    ended: float | None = None
    events: tuple[torch.cuda.Event, torch.cuda.Event] | None = None

    def seconds(self) -> float | None:
        if self.events is not None:
            start, end = self.events
            return start.elapsed_time(end) / 1000 if end.query() else None
        if self.started is None or self.ended is None:
            return None
        return self.ended - self.started


@contextlib.contextmanager
def _first_forward(model: Any) -> Iterator[_ForwardTiming]:
    """Time the model's first forward call in the block (``generate``'s prefill) and count its tokens."""
    timing = _ForwardTiming()
    on_gpu = model.device.type == "cuda"

    def before(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if timing.started is None:
            inputs = kwargs.get("input_ids", args[0] if args else None)
            inputs = inputs if inputs is not None else kwargs.get("inputs_embeds")
            timing.tokens = int(inputs.shape[1]) if inputs is not None and inputs.dim() >= 2 else 0
            timing.started = time.perf_counter()
            if on_gpu:
                timing.events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                timing.events[0].record()

    def after(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
        if timing.started is not None and timing.ended is None:
            timing.ended = time.perf_counter()
            if timing.events is not None:
                timing.events[1].record()

    hooks = [
        model.register_forward_pre_hook(before, with_kwargs=True),
        model.register_forward_hook(after, with_kwargs=True),
    ]
    try:
        yield timing
    finally:
        for hook in hooks:
            hook.remove()


def _prompt_tokens(input_ids: torch.Tensor | Sequence[int]) -> list[int]:
    """The token ids of a single prompt (``[1, N]`` or ``[N]``)."""
    if isinstance(input_ids, torch.Tensor):
        if input_ids.dim() == 2:
            if input_ids.shape[0] != 1:
                raise ValueError(f"HFConnector serves one prompt at a time, got a batch of {input_ids.shape[0]}")
            input_ids = input_ids[0]
        if input_ids.dim() != 1:
            raise ValueError(f"input_ids must be [1, tokens] or [tokens], got shape {tuple(input_ids.shape)}")
        return input_ids.tolist()
    return list(input_ids)
