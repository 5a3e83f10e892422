"""The ``DynamicCache`` of one :class:`~kvstore.connectors.hf.HFConnector` request, and its layers.

Two kinds of transformers cache layer hold per-token attention KV that a chunk can carry:

- ``DynamicLayer`` (full attention) keeps every token;
- ``DynamicSlidingWindowLayer`` (sliding-window attention, and chunked attention, which is the same
  cache with another mask) keeps the last ``sliding_window - 1`` tokens and counts every token it
  has seen in ``cumulative_length``, from which transformers derives positions and mask sizes.

A stored chunk holds every token of every layer, whatever the layer's type. Two consequences:

- **Saving**: a plain sliding-window layer has dropped the KV of all but its last window of tokens
  by the end of a long prefill, so its chunks could not be stored whole. The connector's caches
  therefore use :class:`RecordingSlidingWindowLayer`, which keeps every token of the request (the
  memory of a full-attention layer, for the request's lifetime) while the model still attends to
  its window only. Saving a cache whose sliding layers dropped tokens stops at the first chunk
  some layer no longer holds (counted): a chunk is stored whole or not at all.
- **Loading**: a sliding-window layer is rebuilt as transformers would have left it after computing
  the prefix itself: the prefix's last ``min(prefix, sliding_window - 1)`` tokens, and
  ``cumulative_length`` set to the prefix's length (:class:`StreamedSlidingWindowPrefixLayer`).

Any other layer type (linear-attention and Mamba states, quantized, indexed or KV-sharing layers) is
refused by :func:`check_storable` with the reason and the alternative.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
from transformers import DynamicCache
from transformers.cache_utils import CacheLayerMixin, DynamicLayer, DynamicSlidingWindowLayer

from kvstore.engine.sync import SyncKVStore, SyncLayerStream
from kvstore.errors import PrefetchError
from kvstore.keys import ChunkKey
from kvstore.layout import KVLayout


class RecordingSlidingWindowLayer(DynamicSlidingWindowLayer):
    """A ``DynamicSlidingWindowLayer`` that keeps every token's KV, so its chunks can be saved whole.

    The model sees exactly what the plain layer would give it (the last ``sliding_window - 1``
    tokens before the new ones, then the new ones: transformers' own past-recording mode); the
    tokens before that stay in ``keys``/``values`` until the cache is dropped, or ``crop(0)`` trims
    them (they can no longer be saved after that).
    """

    def __init__(self, sliding_window: int, **kwargs: Any) -> None:
        super().__init__(sliding_window, **kwargs)
        self.record_past = True

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # generate() switches recording off when it hands a cache back (its deferred stop check):
        # ours records for as long as it lives.
        self.record_past = True
        return super().update(key_states, value_states, *args, **kwargs)


STORABLE_LAYERS: tuple[type[CacheLayerMixin], ...] = (DynamicLayer, DynamicSlidingWindowLayer)


def check_storable(cache: DynamicCache, what: str) -> None:
    """Raise ``NotImplementedError`` if ``cache`` has a layer whose state a chunk cannot carry.

    Exact types: a subclass (a quantized layer is a ``DynamicLayer``) may keep its state elsewhere.
    """
    ours = (RecordingSlidingWindowLayer, StreamedPrefixLayer, StreamedSlidingWindowPrefixLayer)
    others: dict[str, list[int]] = {}
    for index, layer in enumerate(cache.layers):
        if type(layer) not in STORABLE_LAYERS + ours:
            others.setdefault(type(layer).__name__, []).append(index)
    if others:
        found = "; ".join(f"{name} at layers {indices}" for name, indices in others.items())
        raise NotImplementedError(
            f"{what} has layers HFConnector cannot store: {found}. It stores per-token attention KV "
            "of full-attention (DynamicLayer) and sliding-window (DynamicSlidingWindowLayer) layers only, not "
            "the recurrent or convolution states of linear-attention and Mamba layers, nor quantized, indexed "
            "or shared KV. Serve this model with model.generate alone (no prefix reuse); to shrink the stored "
            "KV, keep a DynamicCache and give the store's tiers a lossy codec (codec = 'fp8') instead of a "
            "quantized cache."
        )


def first_held_token(layer: DynamicLayer) -> int | None:
    """The position of the first token whose KV ``layer`` still holds (None: it holds nothing)."""
    if not layer.is_initialized or layer.keys is None:
        return None
    return layer.get_seq_length() - layer.keys.shape[-2]


class LoadedPrefix:
    """A request's ``DynamicCache``, whose first ``reused_tokens`` tokens stream in from the store.

    ``chunks`` chunks are loaded (0: nothing was cached, the cache starts empty). Its sliding-window
    layers record every token (:class:`RecordingSlidingWindowLayer`), so the request's chunks can
    be saved. Close it (or use ``with``) if the forward pass never ran: that releases what the
    stream holds. It closes itself once every layer has been handed to the model.
    """

    def __init__(
        self, model: Any, keys: list[ChunkKey], chunks: int = 0, reused_tokens: int = 0, prompt_tokens: int = 0
    ) -> None:
        self.keys, self.chunks, self.reused_tokens = keys, chunks, reused_tokens
        self.prompt_tokens = prompt_tokens
        self.model_dtype, self.model_device = model.dtype, model.device
        self.waited = 0.0  # seconds the forward pass spent waiting for layers
        self.cache = DynamicCache(config=model.config)
        self.cache.layers = [
            RecordingSlidingWindowLayer(layer.sliding_window) if type(layer) is DynamicSlidingWindowLayer else layer
            for layer in self.cache.layers
        ]
        self.buffers: list[torch.Tensor] = []  # per layer [planes, 1, heads, prompt_tokens, dim], if in place
        self._stream: SyncLayerStream | None = None
        self._wait_timeout: float | None = None
        self._pending = 0  # layers still waiting for their part of the prefix (engine thread only)

    def start(self, store: SyncKVStore, wait_timeout: float, on_loaded: Callable[[float], None] | None = None) -> None:
        """Start streaming the prefix; every layer of the cache waits for its own part of it.

        When the model keeps its KV in the stored dtype (on the CPU or a GPU), each layer's prefix is
        written straight into the tensor the model will use (prompt-long, in the model's
        ``[1, heads, tokens, dim]`` order): the tokens after the prefix are added in place, no copy.
        On a GPU the layers cross the bus on the store's copy stream, and the model's stream waits
        for each layer's copies only when the forward pass reaches it.
        """
        layout: KVLayout = store.layout
        shape = (layout.kv_planes, 1, layout.num_kv_heads, self.prompt_tokens, layout.head_dim)
        outs = None
        if layout.dtype == self.model_dtype and self.model_device.type in ("cpu", "cuda"):
            # Plain tensors even under torch.inference_mode(): the store's thread writes them outside it.
            with torch.inference_mode(False):
                self.buffers = [
                    torch.empty(shape, dtype=layout.dtype, device=self.model_device) for _ in range(layout.num_layers)
                ]
            loaded = self.chunks * layout.chunk_tokens  # <= prompt_tokens
            outs = [buffer[:, 0, :, :loaded].permute(0, 2, 1, 3) for buffer in self.buffers]  # canonical order
        started = time.perf_counter()
        self._stream = store.prefetch(self.keys[: self.chunks], depth=layout.num_layers, outs=outs)
        if on_loaded is not None:  # the whole prefix's load time, if every layer arrives (on the store's loop)

            def arrived(error: BaseException | None) -> None:
                if error is None:
                    on_loaded(time.perf_counter() - started)

            self._stream.on_arrival(-1, arrived)
        self._wait_timeout = wait_timeout
        self._pending = len(self.cache.layers)
        self.cache.layers = [
            StreamedSlidingWindowPrefixLayer(self, index, layer.sliding_window)
            if isinstance(layer, DynamicSlidingWindowLayer)
            else StreamedPrefixLayer(self, index)
            for index, layer in enumerate(self.cache.layers)
        ]

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


class _StreamedPrefix(DynamicLayer):
    """A cache layer whose first tokens come from a layer stream, fetched when first needed.

    Before its data is in, it reports the prefix's length (the model computes positions and masks
    from that); its first ``update`` waits for the layer and writes the prefix's kept tokens and the
    new ones into one tensor, a single copy. From then on it is the layer it extends.
    """

    def __init__(self, prefix: LoadedPrefix, index: int, **layer_kwargs: Any) -> None:
        super().__init__(**layer_kwargs)
        self._prefix: LoadedPrefix | None = prefix
        self._index = index

    def _kept(self, tokens: int) -> int:
        """How many of the last tokens this layer holds after computing ``tokens`` tokens."""
        return tokens

    def _set_length(self, tokens: int) -> None:
        """The layer has seen ``tokens`` tokens (for layers that count them apart from what they hold)."""

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

    def _fill(
        self,
        key_states: torch.Tensor | None = None,
        value_states: torch.Tensor | None = None,
        *,
        end: int | None = None,
    ) -> None:
        """Wait for the prefix's layer; the cache becomes what transformers would hold after computing
        its first ``end`` tokens (default: all of it), then ``key_states`` (``[1, heads, new, dim]``)."""
        prefix = self._prefix
        assert prefix is not None
        kv = prefix.layer_kv(self._index)  # [planes, chunks * tokens, heads, dim]
        end = prefix.reused_tokens if end is None else end
        start = end - self._kept(end)  # the first prefix token the layer keeps
        kept = end - start
        new = 0 if key_states is None else key_states.shape[-2]
        if prefix.buffers and end + new == prefix.prompt_tokens:
            # The prefix already sits in the model's tensors; the new tokens go after it.
            planes = [plane[..., start : end + new, :] for plane in prefix.buffers[self._index]]
            for plane, states in zip(planes, (key_states, value_states), strict=True):
                if states is not None:
                    plane[..., kept:, :].copy_(states)
        else:  # another dtype or device, or not the prompt's remaining tokens: one copy (casting, moving)
            dtype = prefix.model_dtype if key_states is None else key_states.dtype
            device = prefix.model_device if key_states is None else key_states.device
            planes = []
            for plane, states in enumerate((key_states, value_states)):
                full = torch.empty((1, kv.shape[2], kept + new, kv.shape[3]), dtype=dtype, device=device)
                full[0, :, :kept].copy_(kv[plane, start:end].transpose(0, 1))
                if states is not None:
                    full[:, :, kept:].copy_(states)
                planes.append(full)
        self.keys, self.values = planes
        self.dtype, self.device, self.is_initialized = self.keys.dtype, self.keys.device, True
        self._set_length(end + new)
        self._prefix = None
        prefix.layer_done(self._index)

    def _materialized(self) -> None:
        if self._prefix is not None:
            self._fill()

    # Everything else that reads or reshapes the tensors needs the prefix first.
    def crop(self, tokens_to_remove: int) -> None:
        if self._prefix is not None and tokens_to_remove < 0:
            # As if the model had computed the shorter prefix: a window layer keeps that one's last tokens.
            self._fill(end=max(self._prefix.reused_tokens + tokens_to_remove, 0))
            return
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


class StreamedPrefixLayer(_StreamedPrefix, DynamicLayer):
    """A full-attention ``DynamicLayer`` whose first tokens (all of the prefix) come from the store."""


class StreamedSlidingWindowPrefixLayer(_StreamedPrefix, RecordingSlidingWindowLayer):
    """A sliding-window layer rebuilt from the store as if it had computed the prefix itself.

    It keeps the prefix's last ``min(prefix, sliding_window - 1)`` tokens and counts the whole
    prefix in ``cumulative_length`` (mask sizes and positions come from it, even before the layer
    has arrived); then it records like :class:`RecordingSlidingWindowLayer`.
    """

    def __init__(self, prefix: LoadedPrefix, index: int, sliding_window: int) -> None:
        super().__init__(prefix, index, sliding_window=sliding_window)
        self.cumulative_length = prefix.reused_tokens

    def _kept(self, tokens: int) -> int:
        return min(tokens, self.sliding_window - 1)

    def _set_length(self, tokens: int) -> None:
        self.cumulative_length = tokens
        self._sliding_window_tensor = self._sliding_window_tensor.to(self.device)
