"""Paged KV caches (vLLM's) <-> kvstore chunks: which bytes of a block are which token's K and V.

An engine keeps each layer's KV in fixed-size blocks of ``block_size`` tokens; a request's
tokens live in the blocks its block table lists, in order. kvstore stores a chunk in canonical
layout, ``[layers, planes, tokens, kv_heads, head_dim]``, so that a chunk does not depend on
which attention kernel wrote it. vLLM hands a connector each layer as a ``[blocks, heads,
block_size, content]`` tensor (RFC #42082); what ``content`` holds depends on the kernel:

- ``"kv_split"`` (FlashAttention, Triton, FlashInfer on GPU): ``content`` is K then V of one
  token, ``2 * head_dim`` wide.
- ``"cpu_vec"`` (vLLM's CPU backend with its portable ``vec`` kernels): per block and head, K
  transposed (``[head_dim, block_size]``), then V (``[block_size, head_dim]``).
- ``"mla_latent"`` (multi-head latent attention: DeepSeek-V2/V3 style models, every dense MLA
  backend, ``CPU_MLA`` and ``AMX_MLA`` on CPU included): one plane, one head. A token's
  ``content`` is its latent, ``kv_lora_rank`` compressed dimensions then ``qk_rope_head_dim``
  rotary ones (576 for DeepSeek), token after token in a block. Such a layer may also come as a
  3-D ``[blocks, block_size, latent]`` tensor (what the MLA kernels themselves are given); both
  are accepted. The chunk layer is ``[1, tokens, 1, latent]``. Every tensor-parallel rank holds
  the whole latent (it is replicated, not split by heads): one rank's copy is the chunk.
- ``"opaque"``: a layout this module does not know (e.g. the CPU backend's AMX packing). Each
  block's bytes are still moved exactly, as if they were ``[2, block_size, head_dim]`` per
  head, so a chunk round-trips through the same engine unchanged; but it is not canonical,
  and the connector keeps such chunks apart (their keys carry the format's name).

Only whole blocks are copied: a chunk covers ``chunk_tokens / block_size`` blocks exactly.
An fp8 cache is read like any other, its values one byte each (the connector views vLLM's uint8
cache as the fp8 dtype); caches with per-token scales packed into ``content`` are not: a layer
whose ``content`` is not what its format says is refused.
"""

from __future__ import annotations

from typing import Literal, TypeAlias

import torch

PagedFormat: TypeAlias = Literal["kv_split", "cpu_vec", "mla_latent", "opaque"]
CANONICAL_FORMATS: frozenset[str] = frozenset({"kv_split", "cpu_vec", "mla_latent"})
# vLLM 0.32's dense MLA backends (``get_name()``): a token's latent, unpadded, in every block.
# The sparse ones (DeepSeek-V3.2/V4: an indexer cache beside, fp8 packing) are not among them.
MLA_BACKENDS: frozenset[str] = frozenset(
    {
        "CPU_MLA",
        "AMX_MLA",
        "TRITON_MLA",
        "FLASHMLA",
        "FLASH_ATTN_MLA",
        "FLASHINFER_MLA",
        "CUTLASS_MLA",
        "ROCM_AITER_MLA",
        "AITER_TRITON_MLA",
        "TOKENSPEED_MLA",
    }
)


def paged_format(backend: str, cpu_isa: str | None = None) -> PagedFormat:
    """The format of a vLLM attention backend's blocks (``cpu_isa``: the CPU backend's kernel set)."""
    if backend == "CPU_ATTN":
        return "cpu_vec" if cpu_isa == "vec" else "opaque"
    if backend in ("FLASH_ATTN", "TRITON_ATTN", "FLASHINFER"):
        return "kv_split"
    if backend in MLA_BACKENDS:
        return "mla_latent"
    return "opaque"


class PagedLayer:
    """One layer's paged cache, each plane seen as ``[blocks, block_size, heads, head_dim]``.

    ``planes`` is 2 (K and V) for the key-value formats and 1 (the latent) for ``"mla_latent"``,
    matching :attr:`kvstore.layout.KVLayout.kv_planes`. ``gather`` copies blocks into a chunk
    layer ``[planes, n * block_size, heads, head_dim]``; ``scatter`` copies such a layer back
    into blocks. Both are one indexed copy per plane, on strided views of the engine's memory.
    """

    def __init__(self, kv_cache: torch.Tensor, fmt: PagedFormat, head_dim: int) -> None:
        if fmt == "mla_latent" and kv_cache.dim() == 3:
            kv_cache = kv_cache.unsqueeze(1)  # [blocks, block_size, latent] -> one head
        if kv_cache.dim() != 4:
            raise ValueError(
                f"a paged KV layer must be a [blocks, heads, tokens, content] tensor, got shape {tuple(kv_cache.shape)}"
            )
        blocks, heads, block_size, content = kv_cache.shape
        self.block_size, self.heads, self.head_dim, self.format = block_size, heads, head_dim, fmt
        self.device = kv_cache.device
        if fmt == "mla_latent":
            if heads != 1 or content != head_dim:
                raise ValueError(
                    f"an MLA layer must hold one latent of {head_dim} per token ([blocks, 1, tokens, {head_dim}] "
                    f"or [blocks, tokens, {head_dim}]), got shape {tuple(kv_cache.shape)} "
                    "(quantized MLA caches are not supported by this connector)"
                )
            self._planes: tuple[torch.Tensor, ...] = (kv_cache.transpose(1, 2),)  # [B, N, 1, D]
            return
        if content != 2 * head_dim:
            raise ValueError(
                f"a paged KV layer's content dimension is {content}, expected 2 x head_dim = {2 * head_dim} "
                "(quantized caches are not supported by this connector)"
            )
        if fmt == "kv_split":
            planes = kv_cache.unflatten(-1, (2, head_dim))  # [B, H, N, 2, D]
            k, v = planes[:, :, :, 0], planes[:, :, :, 1]
        elif fmt in ("cpu_vec", "opaque"):
            if not kv_cache.is_contiguous():
                raise ValueError(f"the {fmt!r} paged format needs a contiguous KV cache tensor")
            regions = kv_cache.view(blocks, heads, 2, block_size * head_dim)
            if fmt == "cpu_vec":
                k = regions[:, :, 0].unflatten(-1, (head_dim, block_size)).transpose(2, 3)
            else:
                k = regions[:, :, 0].unflatten(-1, (block_size, head_dim))
            v = regions[:, :, 1].unflatten(-1, (block_size, head_dim))
        else:
            raise ValueError(f"unknown paged format {fmt!r}; use kv_split, cpu_vec, mla_latent or opaque")
        # [B, H, N, D] -> [B, N, H, D]: strided views of the engine's memory, nothing copied.
        self._planes = (k.transpose(1, 2), v.transpose(1, 2))

    @property
    def planes(self) -> int:
        """Planes of a chunk layer: 2 (K, V) or 1 (an MLA latent)."""
        return len(self._planes)

    def gather(self, block_ids: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """Copy blocks ``block_ids`` (in order) into ``out``, a ``[planes, n * block_size, heads, head_dim]`` layer."""
        index = block_ids.to(self.device)
        for plane, source in enumerate(self._planes):
            out[plane].unflatten(0, (len(block_ids), self.block_size)).copy_(source[index])
        return out

    def scatter(self, block_ids: torch.Tensor, layer: torch.Tensor) -> None:
        """Copy ``layer`` (``[planes, n * block_size, heads, head_dim]``) into blocks ``block_ids``."""
        index = block_ids.to(self.device)
        for plane, target in enumerate(self._planes):
            target[index] = layer[plane].unflatten(0, (len(block_ids), self.block_size)).to(self.device)
