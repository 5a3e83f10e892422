"""Paged blocks <-> canonical chunk layers (kvstore.connectors.paged), on synthetic caches.

Each cache is built from known per-token K and V in the kernel's own block layout, so a
gather must give back exactly those K and V, in token order. (The CPU format is also checked
end to end against transformers' KV in tests/test_vllm.py.)
"""

import pytest
import torch

from kvstore.connectors.paged import PagedLayer, paged_format

BLOCKS, HEADS, BLOCK, DIM = 9, 3, 16, 8


def kernel_cache(fmt: str, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """``k`` and ``v`` ([blocks, heads, block, dim]) packed as kernel ``fmt`` packs them."""
    if fmt == "kv_split":
        return torch.cat([k, v], dim=-1)
    first = k.transpose(2, 3) if fmt == "cpu_vec" else k
    regions = torch.stack([first.reshape(BLOCKS, HEADS, -1), v.reshape(BLOCKS, HEADS, -1)], dim=2)
    return regions.reshape(BLOCKS, HEADS, BLOCK, 2 * DIM)


def canonical(x: torch.Tensor, blocks: list[int]) -> torch.Tensor:
    """[blocks, heads, block, dim] -> [tokens, heads, dim] for ``blocks`` in order."""
    return x[blocks].transpose(1, 2).reshape(-1, HEADS, DIM)


@pytest.mark.parametrize("fmt", ["kv_split", "cpu_vec", "opaque"])
def test_gather_gives_each_tokens_k_and_v_in_order(fmt):
    k, v = torch.randn(BLOCKS, HEADS, BLOCK, DIM), torch.randn(BLOCKS, HEADS, BLOCK, DIM)
    layer = PagedLayer(kernel_cache(fmt, k, v), fmt, DIM)
    blocks = [7, 2, 5]
    out = torch.empty(2, len(blocks) * BLOCK, HEADS, DIM)
    layer.gather(torch.tensor(blocks), out)
    assert torch.equal(out[0], canonical(k, blocks))
    assert torch.equal(out[1], canonical(v, blocks))


@pytest.mark.parametrize("fmt", ["kv_split", "cpu_vec", "opaque"])
def test_scatter_writes_only_the_given_blocks_and_round_trips(fmt):
    k, v = torch.randn(BLOCKS, HEADS, BLOCK, DIM), torch.randn(BLOCKS, HEADS, BLOCK, DIM)
    source = PagedLayer(kernel_cache(fmt, k, v), fmt, DIM)
    chunk = torch.empty(2, 4 * BLOCK, HEADS, DIM)
    source.gather(torch.tensor([1, 3]), chunk[:, BLOCK : 3 * BLOCK])  # into a strided slice
    target_cache = torch.zeros(BLOCKS, HEADS, BLOCK, 2 * DIM)
    PagedLayer(target_cache, fmt, DIM).scatter(torch.tensor([6, 0]), chunk[:, BLOCK : 3 * BLOCK])
    original = kernel_cache(fmt, k, v)
    assert torch.equal(target_cache[6], original[1]) and torch.equal(target_cache[0], original[3])
    untouched = [b for b in range(BLOCKS) if b not in (6, 0)]
    assert target_cache[untouched].abs().sum() == 0


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_fp8_blocks_move_bit_exactly(dtype):
    """What an engine with an fp8 KV cache holds moves unchanged, byte for byte (the connector
    still refuses fp8 caches: no engine here runs them; see engine_config.layout_for_vllm)."""
    k, v = torch.randn(BLOCKS, HEADS, BLOCK, DIM).to(dtype), torch.randn(BLOCKS, HEADS, BLOCK, DIM).to(dtype)
    cache = kernel_cache("cpu_vec", k.view(torch.uint8), v.view(torch.uint8)).view(dtype)
    chunk = torch.empty(2, 2 * BLOCK, HEADS, DIM, dtype=dtype)
    PagedLayer(cache, "cpu_vec", DIM).gather(torch.tensor([5, 2]), chunk)
    target = torch.zeros_like(cache)
    PagedLayer(target, "cpu_vec", DIM).scatter(torch.tensor([0, 1]), chunk)
    assert torch.equal(target[:2].view(torch.uint8), cache[[5, 2]].view(torch.uint8))


def test_cpu_vec_differs_from_opaque_so_the_formats_cannot_be_confused():
    k, v = torch.randn(BLOCKS, HEADS, BLOCK, DIM), torch.randn(BLOCKS, HEADS, BLOCK, DIM)
    cache = kernel_cache("cpu_vec", k, v)
    out_vec, out_opaque = torch.empty(2, BLOCK, HEADS, DIM), torch.empty(2, BLOCK, HEADS, DIM)
    PagedLayer(cache, "cpu_vec", DIM).gather(torch.tensor([0]), out_vec)
    PagedLayer(cache, "opaque", DIM).gather(torch.tensor([0]), out_opaque)
    assert torch.equal(out_vec[1], out_opaque[1]) and not torch.equal(out_vec[0], out_opaque[0])


@pytest.mark.parametrize("heads_dim", [True, False], ids=["4d", "3d"])
def test_mla_latents_gather_and_scatter_as_one_plane_of_one_head(heads_dim):
    """vLLM's MLA cache, [blocks, block_size, latent] (or with a heads dimension of 1), is one plane."""
    latent = 2 * DIM + 4  # e.g. kv_lora_rank + qk_rope_head_dim; not 2 x anything the layout names
    tokens = torch.randn(BLOCKS, BLOCK, latent)
    cache = tokens.unsqueeze(1) if heads_dim else tokens
    layer = PagedLayer(cache, "mla_latent", latent)
    assert (layer.planes, layer.heads, layer.block_size) == (1, 1, BLOCK)
    blocks = [4, 0, 8]
    out = torch.empty(1, len(blocks) * BLOCK, 1, latent)
    layer.gather(torch.tensor(blocks), out)
    assert torch.equal(out[0, :, 0], tokens[blocks].reshape(-1, latent))
    target = torch.zeros_like(cache)
    PagedLayer(target, "mla_latent", latent).scatter(torch.tensor([1, 2, 3]), out)
    assert torch.equal(target.view(BLOCKS, BLOCK, latent)[1:4], tokens[blocks])
    assert target.view(BLOCKS, BLOCK, latent)[[0, *range(4, BLOCKS)]].abs().sum() == 0


def test_mla_layers_that_are_not_one_latent_per_token_are_refused():
    with pytest.raises(ValueError, match="one latent of 576 per token"):
        PagedLayer(torch.zeros(4, 16, 656, dtype=torch.uint8), "mla_latent", 576)  # fp8_ds_mla packing
    with pytest.raises(ValueError, match="one latent of 576 per token"):
        PagedLayer(torch.zeros(4, 2, 16, 576), "mla_latent", 576)  # two heads: not a latent cache


def test_formats_of_vllm_backends():
    assert paged_format("CPU_MLA") == paged_format("AMX_MLA") == paged_format("FLASHMLA") == "mla_latent"
    assert paged_format("FLASHMLA_SPARSE") == "opaque"  # DeepSeek-V3.2's fp8 packing: not a plain latent
    assert paged_format("CPU_ATTN", "vec") == "cpu_vec"
    assert paged_format("CPU_ATTN", "amx") == "opaque"  # packed for AMX tiles: moved, not interpreted
    assert paged_format("FLASH_ATTN") == "kv_split"
    assert paged_format("SOMETHING_NEW") == "opaque"


def test_shapes_kvstore_cannot_read_are_refused_with_the_reason():
    with pytest.raises(ValueError, match="2 x head_dim"):
        PagedLayer(torch.zeros(4, 2, 16, 24), "kv_split", DIM)  # an MLA latent read as K and V
    with pytest.raises(ValueError, match=r"\[blocks, heads, tokens, content\]"):
        PagedLayer(torch.zeros(2, 4, 2, 16, 16), "kv_split", DIM)
    with pytest.raises(ValueError, match="contiguous"):
        PagedLayer(torch.zeros(4, 16, 2, 16).transpose(1, 2), "cpu_vec", DIM)
