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

The namespace must name the exact weights (and anything else that changes the KV): the layout
fingerprint only tells shapes and dtypes apart, not two models that share them.
:func:`namespace_for_model` derives one from the checkpoint's bytes and the model's config
(:mod:`kvstore.connectors.identity`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

import torch

try:
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        "kvstore.connectors.hf needs Hugging Face transformers >= 5.0: pip install 'kvstore[hf]'"
    ) from exc

from kvstore.connectors.identity import default_namespace
from kvstore.engine.sync import SyncKVStore, SyncLayerStream
from kvstore.errors import PrefetchError
from kvstore.keys import ChunkKey
from kvstore.layout import KVLayout

log = logging.getLogger("kvstore.connectors.hf")


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


class LoadedPrefix:
    """A request's ``DynamicCache``, whose first ``reused_tokens`` tokens stream in from the store.

    ``chunks`` chunks are loaded (0: nothing was cached, the cache starts empty). Close it (or
    use ``with``) if the forward pass never ran: that releases what the stream holds. It closes
    itself once every layer has been handed to the model.
    """

    def __init__(
        self, model: Any, keys: list[ChunkKey], chunks: int = 0, reused_tokens: int = 0, prompt_tokens: int = 0
    ) -> None:
        self.keys, self.chunks, self.reused_tokens = keys, chunks, reused_tokens
        self.prompt_tokens = prompt_tokens
        self.model_dtype, self.model_device = model.dtype, model.device
        self.waited = 0.0  # seconds the forward pass spent waiting for layers
        self.cache = DynamicCache(config=model.config)
        self.buffers: list[torch.Tensor] = []  # per layer [planes, 1, heads, prompt_tokens, dim], if in place
        self._stream: SyncLayerStream | None = None
        self._wait_timeout: float | None = None
        self._pending = 0  # layers still waiting for their part of the prefix (engine thread only)

    def start(self, store: SyncKVStore, wait_timeout: float) -> None:
        """Start streaming the prefix; every layer of the cache waits for its own part of it.

        When the model keeps its KV on the CPU in the stored dtype, each layer's prefix is
        written straight into the tensor the model will use (prompt-long, in the model's
        ``[1, heads, tokens, dim]`` order): the tokens after the prefix are added in place, no copy.
        """
        layout: KVLayout = store.store.layout
        shape = (layout.kv_planes, 1, layout.num_kv_heads, self.prompt_tokens, layout.head_dim)
        outs = None
        if layout.dtype == self.model_dtype and self.model_device.type == "cpu":
            # Plain tensors even under torch.inference_mode(): the store's thread writes them outside it.
            with torch.inference_mode(False):
                self.buffers = [torch.empty(shape, dtype=layout.dtype) for _ in range(layout.num_layers)]
            loaded = self.chunks * layout.chunk_tokens  # <= prompt_tokens
            outs = [buffer[:, 0, :, :loaded].permute(0, 2, 1, 3) for buffer in self.buffers]  # canonical order
        self._stream = store.prefetch(self.keys[: self.chunks], depth=layout.num_layers, outs=outs)
        self._wait_timeout = wait_timeout
        self._pending = len(self.cache.layers)
        self.cache.layers = [StreamedPrefixLayer(self, index) for index in range(len(self.cache.layers))]

    @property
    def complete(self) -> bool:
        """True when every layer of the prefix is in the cache (or there was none to load)."""
        return self._pending == 0

    def layer_kv(self, index: int) -> torch.Tensor:
        """Layer ``index`` of the prefix, ``[planes, chunks * chunk_tokens, heads, head_dim]``.

        Raises :class:`PrefetchError` if it cannot be loaded (or does not arrive in time).
        """
        if self._stream is None:
            raise PrefetchError("the prefix stream is closed")
        started = time.perf_counter()
        try:
            kv = self._stream.wait_layer(index, self._wait_timeout)
        except TimeoutError as exc:
            raise PrefetchError(f"layer {index} of the cached prefix did not arrive: {exc}") from None
        finally:
            self.waited += time.perf_counter() - started
        return kv

    def layer_done(self, index: int) -> None:
        """Layer ``index`` is in the cache; after the last one, the stream is released."""
        self._pending -= 1
        if self._pending == 0:
            self.close()

    def close(self) -> None:
        self.buffers = []  # the layers that took theirs keep them
        stream, self._stream = self._stream, None
        if stream is not None:
            stream.close()

    def __enter__(self) -> LoadedPrefix:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class StreamedPrefixLayer(DynamicLayer):
    """A ``DynamicLayer`` whose first tokens come from a layer stream, fetched when first needed.

    Before its data is in, it reports the prefix's length (the model computes positions and
    masks from that); its first ``update`` waits for the layer and writes prefix and new tokens
    into one tensor, a single copy. From then on it is a plain ``DynamicLayer``.
    """

    def __init__(self, prefix: LoadedPrefix, index: int) -> None:
        super().__init__()
        self._prefix: LoadedPrefix | None = prefix
        self._index = index

    @property
    def pending(self) -> bool:
        return self._prefix is not None

    def get_seq_length(self) -> int:
        return self._prefix.reused_tokens if self._prefix is not None else super().get_seq_length()

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self._prefix is None:
            return super().update(key_states, value_states, *args, **kwargs)
        self._fill(key_states, value_states)
        return self.keys, self.values

    def _fill(self, key_states: torch.Tensor | None = None, value_states: torch.Tensor | None = None) -> None:
        """Wait for the prefix's layer; the cache becomes prefix + ``key_states`` (``[1, heads, new, dim]``)."""
        prefix = self._prefix
        assert prefix is not None
        kv = prefix.layer_kv(self._index)  # [planes, chunks * tokens, heads, dim]
        reused = prefix.reused_tokens
        new = 0 if key_states is None else key_states.shape[-2]
        if prefix.buffers and reused + new == prefix.prompt_tokens:
            # The prefix already sits in the model's tensors; the new tokens go after it.
            planes = [plane[..., : reused + new, :] for plane in prefix.buffers[self._index]]
            for plane, states in zip(planes, (key_states, value_states), strict=True):
                if states is not None:
                    plane[..., reused:, :].copy_(states)
        else:  # another dtype or device, or not the prompt's remaining tokens: one copy (casting, moving)
            dtype = prefix.model_dtype if key_states is None else key_states.dtype
            device = prefix.model_device if key_states is None else key_states.device
            planes = []
            for plane, states in enumerate((key_states, value_states)):
                full = torch.empty((1, kv.shape[2], reused + new, kv.shape[3]), dtype=dtype, device=device)
                full[0, :, :reused].copy_(kv[plane, :reused].transpose(0, 1))
                if states is not None:
                    full[:, :, reused:].copy_(states)
                planes.append(full)
        self.keys, self.values = planes
        self.dtype, self.device, self.is_initialized = self.keys.dtype, self.keys.device, True
        self._prefix = None
        prefix.layer_done(self._index)

    def _materialized(self) -> None:
        if self._prefix is not None:
            self._fill()

    # Everything else that reads or reshapes the tensors needs the prefix first.
    def crop(self, tokens_to_remove: int) -> None:
        self._materialized()
        super().crop(tokens_to_remove)

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._materialized()
        super().batch_repeat_interleave(repeats)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._materialized()
        super().batch_select_indices(indices)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._materialized()
        super().reorder_cache(beam_idx)

    def offload(self) -> None:
        self._materialized()
        super().offload()

    def reset(self) -> None:
        prefix, self._prefix = self._prefix, None
        if prefix is not None:
            prefix.layer_done(self._index)
        super().reset()


class HFConnector:
    """Prefix reuse for one transformers model over a :class:`SyncKVStore` built for its layout.

    Use from one engine thread at a time (the store itself may be shared).
    """

    def __init__(self, model: Any, store: SyncKVStore, *, extra: bytes | None = None) -> None:
        """``extra``: bytes that change the KV for the same tokens (a LoRA adapter's id), folded into keys."""
        layout: KVLayout = store.store.layout
        expected = layout_for_model(model, dtype=layout.dtype, chunk_tokens=layout.chunk_tokens)
        for field in ("num_layers", "num_kv_heads", "head_dim", "kv_planes"):
            if getattr(layout, field) != getattr(expected, field):
                raise ValueError(
                    f"the store's layout has {field}={getattr(layout, field)} but the model has "
                    f"{getattr(expected, field)}: build the store with layout_for_model(model)"
                )
        unsupported = {type(layer).__name__ for layer in DynamicCache(config=model.config).layers}
        unsupported -= {DynamicLayer.__name__}
        if unsupported:
            raise NotImplementedError(
                f"HFConnector supports full-attention layers (DynamicLayer) only; this model's cache "
                f"also has {sorted(unsupported)}"
            )
        self.model, self.store, self.layout, self.extra = model, store, layout, extra
        timeouts = store.store.config.timeouts
        # A layer waits at most for the tiers' header reads plus its own read, each bounded.
        self.wait_timeout = (len(store.store.tiers) + 2) * timeouts.get
        self._staging: torch.Tensor | None = None  # one chunk, reused by every save
        self.counters: dict[str, float] = {
            "requests": 0,
            "prompt_tokens": 0,
            "reused_tokens": 0,
            "loaded_chunks": 0,
            "saved_chunks": 0,
            "save_rejected": 0,
            "fallbacks": 0,
            "load_wait_seconds": 0.0,
        }

    # -- the parts of a request ------------------------------------------------------------------

    def load(self, input_ids: torch.Tensor | Sequence[int]) -> LoadedPrefix:
        """The cache for a request: its longest stored prefix starts streaming in now.

        A prompt that is cached whole reuses all but its last token: the model needs at least
        one input token to produce the next token's logits.
        """
        tokens = _prompt_tokens(input_ids)
        keys = self.store.chunk_keys(tokens, self.extra)
        chunks = self.store.lookup(keys) if keys else 0
        reused = min(chunks * self.layout.chunk_tokens, len(tokens) - 1)
        if reused <= 0:
            return LoadedPrefix(self.model, keys)
        prefix = LoadedPrefix(self.model, keys, chunks, reused, len(tokens))
        prefix.start(self.store, self.wait_timeout)
        return prefix

    def save(
        self, token_ids: torch.Tensor | Sequence[int], cache: DynamicCache, *, start_chunk: int | None = None
    ) -> int:
        """Put the full chunks of ``token_ids`` that ``cache`` holds, from ``start_chunk`` on; how many were put.

        ``start_chunk=None`` asks the store where its stored prefix ends. ``token_ids`` are the
        tokens whose KV the cache holds, in order (the prompt, or prompt and reply for the next turn).
        """
        tokens = _prompt_tokens(token_ids)
        return self._save(self.store.chunk_keys(tokens, self.extra), len(tokens), cache, start_chunk)

    def _save(self, keys: list[ChunkKey], n_tokens: int, cache: DynamicCache, start_chunk: int | None) -> int:
        if any(getattr(layer, "pending", False) for layer in cache.layers):
            raise ValueError("the cache still waits for prefix layers: run the forward pass before saving")
        size = self.layout.chunk_tokens
        held = min(cache.get_seq_length(), n_tokens) // size
        first = self.store.lookup(keys) if start_chunk is None else start_chunk
        if self._staging is None:
            self._staging = torch.empty(self.layout.chunk_shape, dtype=self.layout.dtype)
        staging, saved = self._staging, 0
        for index in range(first, min(held, len(keys))):
            span = slice(index * size, (index + 1) * size)
            for layer_index, layer in enumerate(cache.layers):
                staging[layer_index, 0].copy_(layer.keys[0, :, span].transpose(0, 1))
                staging[layer_index, 1].copy_(layer.values[0, :, span].transpose(0, 1))
            if self.store.put(keys[index], staging):  # copies into DRAM before it returns
                saved += 1
            else:
                self.counters["save_rejected"] += 1
        self.counters["saved_chunks"] += saved
        return saved

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
            output = self.model.generate(input_ids, past_key_values=prefix.cache, **generate_kwargs)
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
        return output

    def stats(self) -> dict[str, Any]:
        """The connector's counters and the store's (per tier)."""
        return {"connector": dict(self.counters), **self.store.stats()}


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
