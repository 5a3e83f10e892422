"""What the connector reads from vLLM's configuration, layers and requests: layout, paged format, keys' extras.

Apart from :mod:`kvstore.connectors.vllm.connector` (the connector's own state lives there and in
:mod:`~kvstore.connectors.vllm.scheduler`) so that each stays short; both sides of the connector
call these at start.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch

from kvstore.connectors.attention_groups import AttentionGroup
from kvstore.connectors.paged import PagedFormat, PagedLayer, paged_format
from kvstore.connectors.vllm._common import kv_values_dtype, refuse_split_layers_or_tokens
from kvstore.errors import ConfigError
from kvstore.layout import KVLayout

log = logging.getLogger("kvstore.connectors.vllm")

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request


def layout_for_vllm(vllm_config: VllmConfig, chunk_tokens: int) -> KVLayout:
    """The :class:`KVLayout` of the served model's KV cache; refuses what this connector cannot store.

    A key-value model's chunk holds K and V of all its KV heads (``kv_planes=2``). An MLA model's
    holds one latent per token (``kv_planes=1``, one head, ``head_dim`` = vLLM's MLA head size,
    ``kv_lora_rank + qk_rope_head_dim``): what vLLM's MLA cache holds, stored once. The dtype is
    the cache's: the model's, or an fp8 one whose bytes are stored as the engine keeps them.
    """
    model, parallel, cache = vllm_config.model_config, vllm_config.parallel_config, vllm_config.cache_config
    who = "kvstore's KVStoreConnector"
    refuse_split_layers_or_tokens(
        who,
        parallel.pipeline_parallel_size,
        getattr(parallel, "prefill_context_parallel_size", 1),
        getattr(parallel, "decode_context_parallel_size", 1),
    )
    skipped = getattr(cache, "kv_cache_dtype_skip_layers", ())
    dtype = kv_values_dtype(who, cache.cache_dtype, model.dtype, mla=model.use_mla, skipped_layers=skipped)
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
            dtype=dtype,
            kv_planes=1,
            chunk_tokens=chunk_tokens,
        )
    return KVLayout(
        num_layers=model.get_num_layers(parallel),
        num_kv_heads=model.get_total_num_kv_heads(),
        head_dim=model.get_head_size(),
        dtype=dtype,
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


def engine_layer(
    name: str, attention: Any, kv: torch.Tensor, layout: KVLayout, expected: PagedFormat, kernels: str
) -> tuple[PagedLayer, str]:
    """One registered layer's paged cache, read as the scheduler expects, and its kernels' name.

    ``attention`` is the layer's attention module (its backend and, on CPU, its kernel set):
    its blocks must be in the ``expected`` format (and, for opaque blocks, from the same
    ``kernels``), its values of the layout's dtype (fp8 caches, which vLLM keeps as bytes, are
    viewed as their fp8 dtype); else a ConfigError. The name is ``BACKEND`` or ``BACKEND/isa``.
    """
    backend, isa = attention.attn_backend.get_name(), getattr(attention, "isa", None)
    fmt = paged_format(backend, isa)
    if fmt != expected or (fmt == "opaque" and f"{backend}/{isa}" != kernels):
        raise ConfigError(
            f"layer {name} uses attention backend {backend} (kernels {isa}), whose blocks kvstore reads as "
            f"{fmt!r}; the scheduler expected {expected!r} ({kernels}). Please report this "
            "with your vLLM version and --attention-backend"
        )
    if kv.dtype == torch.uint8 and layout.dtype.itemsize == 1:  # vLLM keeps fp8 values as bytes
        kv = kv.view(layout.dtype)
    if kv.dtype != layout.dtype:
        raise ConfigError(f"layer {name}'s KV cache is {kv.dtype}, expected {layout.dtype}")
    return PagedLayer(kv, fmt, layout.head_dim), backend + (f"/{isa}" if isa else "")


def warn_of_another_compute_path(kernels: str, dtype: torch.dtype) -> None:
    """Log once where a loaded prefix is exact but the engine computes on from it another way.

    vLLM's portable CPU MLA kernels (``CPU_MLA``) run with prefix caching and chunked prefill
    off: vLLM itself never computes a prompt's rest from cached latents there. A prefix kvstore
    loads (byte for byte) is continued through vLLM's prefill-with-context path, whose rounding
    in 16-bit dtypes differs from one whole prefill: greedy tokens can differ from a recompute's
    (seen in bfloat16 on a tiny model; float32 gave identical tokens).
    """
    if kernels == "CPU_MLA" and dtype.itemsize < 4:
        log.warning(
            "kvstore: vLLM's CPU_MLA kernels in %s: loaded prefixes are exact, but vLLM continues them through "
            "a prefill-with-context path it never uses itself here (its prefix cache is off on CPU MLA), whose "
            "%s rounding differs from one whole prefill: outputs can differ from a recompute's. float32 (or the "
            "AMX kernels, AMX_MLA, on a CPU with AMX) continues them as a recompute would",
            dtype,
            dtype,
        )


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
