"""What kvstore's vLLM connector makes of a model's configuration, without starting an engine.

Run under vLLM's environment by tests/test_vllm_shapes.py (``python layout_check.py MODEL_DIR DTYPE
[ATTENTION_BACKEND]``, from the repository root so that this checkout's kvstore is imported);
prints one JSON line: the layout (layers, planes, heads, head_dim), the paged format, the
attention backend vLLM's platform picks and its block size, and the refusals for pipeline and
context parallelism, for a sparse MLA model (DeepSeek-V3.2's ``index_topk`` set), and for fp8
KV (an MLA model's; any model's on a CPU without AVX-512 or AMX, simulated by hiding both).
"""

from __future__ import annotations

import json
import os
import sys

import torch
from vllm.config import VllmConfig
from vllm.engine.arg_utils import EngineArgs

from kvstore.connectors.vllm._common import kv_values_dtype
from kvstore.connectors.vllm.engine_config import expected_paged_format, layout_for_vllm
from kvstore.errors import ConfigError


def refusal(config: VllmConfig) -> str | None:
    try:
        layout_for_vllm(config, 256)
    except ConfigError as exc:
        return str(exc)
    return None


def values_dtype(cache_dtype: str) -> str:
    """What the connector stores for a K/V model with this KV cache dtype, or its refusal."""
    try:
        return str(kv_values_dtype("kvstore's KVStoreConnector", cache_dtype, "float32"))
    except ConfigError as exc:
        return str(exc)


def backend_name(config: VllmConfig) -> str:
    """The attention backend vLLM's platform picks for this config (as its engine would)."""
    from vllm.platforms import current_platform
    from vllm.v1.attention.selector import AttentionSelectorConfig

    model = config.model_config
    selector = AttentionSelectorConfig(
        head_size=model.get_head_size(),
        dtype=model.dtype,
        kv_cache_dtype=config.cache_config.cache_dtype,
        block_size=config.cache_config.block_size,
        use_mla=model.use_mla,
    )
    path = current_platform.get_attn_backend_cls(config.attention_config.backend, selector)
    return path.rsplit(".", 1)[-1]


def main(model: str, dtype: str, backend: str | None) -> None:
    if os.environ.get("TEST_VLLM_CPU_KERNELS") == "portable" and backend is None:
        backend = "CPU_MLA"  # what vLLM runs on a CPU without AMX (this model is an MLA model)
    args = EngineArgs(model=model, dtype=dtype, max_model_len=4096, attention_backend=backend)
    config = args.create_engine_config()
    layout = layout_for_vllm(config, 256)
    report = {
        "layout": [layout.num_layers, layout.kv_planes, layout.num_kv_heads, layout.head_dim],
        "format": expected_paged_format(config)[0],
        "backend": backend_name(config),
        "block_size": config.cache_config.block_size,
    }
    parallel = config.parallel_config
    parallel.pipeline_parallel_size = 2
    report["pipeline"] = refusal(config)
    parallel.pipeline_parallel_size = 1
    parallel.decode_context_parallel_size = 2
    report["context"] = refusal(config)
    parallel.decode_context_parallel_size = 1
    config.cache_config.cache_dtype = "fp8"
    report["fp8_mla"] = refusal(config)
    config.cache_config.cache_dtype = "auto"
    # A model with K and V: fp8 is stored where the CPU has vLLM's fp8 kernels, refused elsewhere.
    report["fp8"] = values_dtype("fp8")
    report["int8"] = values_dtype("int8_per_token_head")
    torch.cpu._is_avx512_supported = torch.cpu._is_amx_tile_supported = lambda: False  # a CPU without either
    report["fp8_without_avx512"] = values_dtype("fp8")
    config.model_config.hf_text_config.index_topk = 2048  # what makes DeepSeek-V3.2's MLA sparse
    report["sparse"] = refusal(config)
    print(json.dumps(report))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3] if len(sys.argv) > 3 else None)
