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
    """The :class:`KVLayout` of the served model's KV cache; refuses what this connector cannot store."""
    model, parallel = vllm_config.model_config, vllm_config.parallel_config
    if parallel.pipeline_parallel_size > 1:
        raise ConfigError(
            "kvstore's vLLM integrations do not support pipeline parallelism (pipeline_parallel_size "
            f"{parallel.pipeline_parallel_size}): each stage would hold a part of the layers of a chunk; "
            "use tensor parallelism instead (tensor_parallel_size, supported), or run without kvstore"
        )
    if model.use_mla:
        raise ConfigError("kvstore's vLLM integrations do not support MLA models yet")
    if vllm_config.cache_config.cache_dtype != "auto":
        raise ConfigError(
            f"kv_cache_dtype {vllm_config.cache_config.cache_dtype!r} is not supported by kvstore's vLLM "
            "connector; use --kv-cache-dtype auto (kvstore's fp8 codecs can still compress what it stores)"
        )
    block_size = vllm_config.cache_config.block_size
    if block_size and chunk_tokens % block_size:
        raise ConfigError(
            f"kvstore_chunk_tokens ({chunk_tokens}) must be a multiple of vLLM's block size ({block_size}); "
            "change one of them (e.g. --block-size 16, or kvstore_chunk_tokens 256)"
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

    groups = [group for group in kv_cache_config.kv_cache_groups if getattr(group, "enable_kv_transfer", True)]
    names = sorted((name for group in groups for name in group.layer_names), key=extract_layer_index)
    position = {name: index for index, name in enumerate(names)}
    result: list[AttentionGroup] = []
    for index, group in enumerate(kv_cache_config.kv_cache_groups):
        if group not in groups:
            continue
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
