"""SGLang's host KV pool <-> kvstore chunks: one page of the pool is one chunk, seen in place.

SGLang's HiCache keeps a host (CPU) copy of the KV cache in one tensor, ``kv_buffer``, whose
order depends on ``--hicache-mem-layout``. A page of ``page_size`` tokens starts at a host index
that is a multiple of ``page_size``. kvstore stores a chunk in canonical layout,
``[layers, planes, tokens, heads, head_dim]``; :meth:`HostPages.chunk` gives each page as such a
tensor, a strided view of the pool's memory (nothing copied):

==================== ========================================= ==============================
layout               MHA ``kv_buffer`` (K, V planes)            MLA ``kv_buffer`` (one latent)
==================== ========================================= ==============================
``layer_first``      ``[2, layers, tokens, heads, head_dim]``   ``[layers, tokens, 1, dim]``
``page_first``       ``[2, tokens, layers, heads, head_dim]``   ``[tokens, layers, 1, dim]``
``page_first_direct`` ``[2, pages, layers, page, heads, dim]``   ``[pages, layers, page, 1, dim]``
==================== ========================================= ==============================

(``tokens`` is the pool's size in tokens; for MLA ``dim`` is ``kv_lora_rank + qk_rope_head_dim``.)
The other layouts (``page_head``, ``page_unified``, ``page_first_kv_split``) and pools whose K
and V widths differ are refused with an error naming the layout and the ones supported.
"""

from __future__ import annotations

from typing import Any

import torch

from kvstore.layout import KVLayout, dtype_from_name

SUPPORTED_LAYOUTS = ("layer_first", "page_first", "page_first_direct")


class HostPages:
    """The pages of one SGLang host pool as kvstore chunks (``latent``: an MLA pool, one plane, one head).

    ``host_pool`` is SGLang's ``MHATokenToKVPoolHost`` or ``MLATokenToKVPoolHost`` (read here:
    ``layout``, ``kv_buffer``, ``page_size``, ``layer_num``, ``dtype`` and, for MHA, ``head_num``,
    ``head_dim``, ``v_head_dim``; for MLA, ``kv_cache_dim``). :attr:`layout` is the kvstore layout
    of one page: ``chunk_tokens`` is the page size.
    """

    def __init__(self, host_pool: Any, latent: bool) -> None:
        layout = str(host_pool.layout)
        if layout not in SUPPORTED_LAYOUTS:
            raise ValueError(
                f"kvstore's SGLang storage backend does not support the host KV layout {layout!r}; "
                f"start SGLang with --hicache-mem-layout set to one of {', '.join(SUPPORTED_LAYOUTS)}"
            )
        self.host_layout = layout
        self.latent = latent
        self.page_size = int(host_pool.page_size)
        self.buffer: torch.Tensor = host_pool.kv_buffer
        layers = int(host_pool.layer_num)
        if latent:
            heads, head_dim = 1, int(host_pool.kv_cache_dim)
        else:
            heads, head_dim = int(host_pool.head_num), int(host_pool.head_dim)
            if int(host_pool.v_head_dim) != head_dim:
                raise ValueError(
                    f"kvstore's SGLang storage backend needs K and V of one width; this model's are "
                    f"{head_dim} and {host_pool.v_head_dim}"
                )
        try:
            dtype = dtype_from_name(host_pool.dtype)
        except ValueError as exc:  # e.g. an fp8 cache SGLang stores as uint8: which fp8 is not known here
            raise ValueError(f"kvstore's SGLang storage backend cannot store this host pool's KV: {exc}") from None
        self.layout = KVLayout(
            num_layers=layers,
            num_kv_heads=heads,
            head_dim=head_dim,
            dtype=dtype,
            kv_planes=1 if latent else 2,
            chunk_tokens=self.page_size,
        )
        expected = self._buffer_shape(layers, heads, head_dim)
        if tuple(self.buffer.shape) != expected or self.buffer.dtype != dtype:
            raise ValueError(
                f"the {layout!r} host pool's kv_buffer is {self.buffer.dtype} {tuple(self.buffer.shape)}, "
                f"expected {dtype} {expected} (an SGLang version whose host pools kvstore does not know?)"
            )

    def _buffer_shape(self, layers: int, heads: int, head_dim: int) -> tuple[int, ...]:
        shape = self.buffer.shape
        page = self.page_size
        if self.latent:
            if self.host_layout == "layer_first":
                return (layers, shape[1], 1, head_dim)
            if self.host_layout == "page_first":
                return (shape[0], layers, 1, head_dim)
            return (shape[0], layers, page, 1, head_dim)
        if self.host_layout == "layer_first":
            return (2, layers, shape[2], heads, head_dim)
        if self.host_layout == "page_first":
            return (2, shape[1], layers, heads, head_dim)
        return (2, shape[1], layers, page, heads, head_dim)

    def chunk(self, host_index: int) -> torch.Tensor:
        """The page starting at ``host_index`` as a ``[layers, planes, page_size, heads, head_dim]`` view."""
        page = self.page_size
        if host_index % page:
            raise ValueError(f"host index {host_index} does not start a page of {page} tokens")
        kv = self.buffer
        start, end = host_index, host_index + page
        if self.latent:
            if self.host_layout == "layer_first":
                view = kv[:, start:end]  # [L, P, 1, D]
            elif self.host_layout == "page_first":
                view = kv[start:end].transpose(0, 1)
            else:
                view = kv[host_index // page]
            return view.unsqueeze(1)  # one plane
        if self.host_layout == "layer_first":
            return kv[:, :, start:end].transpose(0, 1)  # [2, L, P, H, D] -> [L, 2, P, H, D]
        if self.host_layout == "page_first":
            return kv[:, start:end].permute(2, 0, 1, 3, 4)  # [2, P, L, H, D] -> [L, 2, P, H, D]
        return kv[:, host_index // page].transpose(0, 1)  # [2, L, P, H, D] -> [L, 2, P, H, D]

    def chunks(self, host_indices: torch.Tensor, pages: int) -> list[torch.Tensor]:
        """The views of ``pages`` pages whose token indices are ``host_indices`` (``pages * page_size`` of them)."""
        if host_indices.numel() != pages * self.page_size:
            raise ValueError(
                f"{pages} pages of {self.page_size} tokens need {pages * self.page_size} host indices, "
                f"got {host_indices.numel()}"
            )
        starts = host_indices[:: self.page_size].tolist()
        return [self.chunk(int(start)) for start in starts]
