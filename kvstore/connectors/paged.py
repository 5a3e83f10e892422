"""Paged KV caches (vLLM's) <-> kvstore chunks: which bytes of a block are K, which are V.

An engine keeps each layer's KV in fixed-size blocks of ``block_size`` tokens; a request's
tokens live in the blocks its block table lists, in order. kvstore stores a chunk in canonical
layout, ``[layers, 2, tokens, kv_heads, head_dim]``, so a chunk does not depend on which
attention backend wrote it. vLLM hands a connector each layer as a ``[blocks, heads, tokens,
content]`` view (RFC #42082); what ``content`` holds depends on the backend:

- ``"kv_split"`` (FlashAttention, Triton, FlashInfer on GPU): ``content`` is K then V of one
  token, ``2 * head_dim`` wide.
- ``"rows"`` (vLLM's CPU backend): per block and head, ``block_size`` rows of K then
  ``block_size`` rows of V, each ``head_dim`` wide (the kernel reads the view as
  ``[blocks, heads, 2 * block_size, head_dim]``).

Only whole blocks are copied: a chunk covers ``chunk_tokens / block_size`` blocks exactly.
"""

from __future__ import annotations

from typing import Literal, TypeAlias

import torch

PagedFormat: TypeAlias = Literal["kv_split", "rows"]

# Attention backends (vLLM's names) whose paged blocks are known to hold K and V in this way.
BACKEND_FORMATS: dict[str, PagedFormat] = {
    "CPU_ATTN": "rows",
    "FLASH_ATTN": "kv_split",
    "TRITON_ATTN": "kv_split",
    "FLASHINFER": "kv_split",
}


class PagedLayer:
    """One layer's paged cache, seen as ``[blocks, 2, block_size, heads, head_dim]`` blocks.

    ``gather`` copies blocks into a chunk layer ``[2, n * block_size, heads, head_dim]`` and
    ``scatter`` copies such a layer back into blocks; both in one indexed copy per call.
    """

    def __init__(self, kv_cache: torch.Tensor, paged_format: PagedFormat, head_dim: int) -> None:
        if kv_cache.dim() != 4:
            raise ValueError(
                f"a paged KV layer must be a [blocks, heads, tokens, content] view, got shape {tuple(kv_cache.shape)}"
            )
        blocks, heads, block_size, content = kv_cache.shape
        if content != 2 * head_dim:
            raise ValueError(
                f"a paged KV layer's content dimension is {content}, expected 2 x head_dim = {2 * head_dim} "
                "(MLA and quantized caches are not supported by this connector yet)"
            )
        self.block_size, self.heads, self.head_dim = block_size, heads, head_dim
        self.format = paged_format
        if paged_format == "rows":
            # [B, H, N, 2D] memory read as [B, H, 2N, D]: rows [0, N) are K, [N, 2N) are V.
            if not kv_cache.is_contiguous():
                raise ValueError("the 'rows' paged format needs a contiguous KV cache tensor")
            blocks_view = kv_cache.view(blocks, heads, 2, block_size, head_dim)
            self._order = (0, 2, 3, 1, 4)  # [B, H, 2, N, D] -> [B, 2, N, H, D]
        elif paged_format == "kv_split":
            blocks_view = kv_cache.unflatten(-1, (2, head_dim))  # [B, H, N, 2, D]
            self._order = (0, 3, 2, 1, 4)
        else:
            raise ValueError(
                f"unknown paged format {paged_format!r}; use one of {sorted(set(BACKEND_FORMATS.values()))}"
            )
        self._blocks = blocks_view
        self.device = kv_cache.device

    def _canonical(self) -> torch.Tensor:
        """The cache as ``[blocks, 2, block_size, heads, head_dim]`` (a strided view, no copy)."""
        return self._blocks.permute(*self._order)

    def gather(self, block_ids: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """Copy blocks ``block_ids`` (in order) into ``out``, a ``[2, n * block_size, heads, head_dim]`` layer."""
        n = len(block_ids)
        picked = self._canonical()[block_ids.to(self.device)]  # [n, 2, N, H, D]
        out.unflatten(1, (n, self.block_size)).copy_(picked.transpose(0, 1))
        return out

    def scatter(self, block_ids: torch.Tensor, layer: torch.Tensor) -> None:
        """Copy ``layer`` (``[2, n * block_size, heads, head_dim]``) into blocks ``block_ids``."""
        n = len(block_ids)
        source = layer.unflatten(1, (n, self.block_size)).transpose(0, 1)
        self._canonical()[block_ids.to(self.device)] = source.to(self.device, non_blocking=True)
