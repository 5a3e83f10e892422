"""What kvstore's vLLM connector makes of a model's configuration, without starting an engine.

Run under vLLM's environment by tests/test_vllm_shapes.py (``python layout_check.py MODEL_DIR``, from
the repository root so that this checkout's kvstore is imported); prints one JSON line: the
layout (layers, planes, heads, head_dim), the paged format, vLLM's block size, and the refusals
for pipeline parallelism and for a sparse MLA model (DeepSeek-V3.2's ``index_topk`` set).
"""

from __future__ import annotations

import json
import sys

from vllm.config import VllmConfig
from vllm.engine.arg_utils import EngineArgs

from kvstore.connectors.vllm.engine_config import expected_paged_format, layout_for_vllm
from kvstore.errors import ConfigError


def refusal(config: VllmConfig) -> str | None:
    try:
        layout_for_vllm(config, 256)
    except ConfigError as exc:
        return str(exc)
    return None


def main(model: str) -> None:
    config = EngineArgs(model=model, dtype="float32", max_model_len=4096).create_engine_config()
    layout = layout_for_vllm(config, 256)
    report = {
        "layout": [layout.num_layers, layout.kv_planes, layout.num_kv_heads, layout.head_dim],
        "format": expected_paged_format(config)[0],
        "block_size": config.cache_config.block_size,
    }
    config.parallel_config.pipeline_parallel_size = 2
    report["pipeline"] = refusal(config)
    config.parallel_config.pipeline_parallel_size = 1
    config.model_config.hf_text_config.index_topk = 2048  # what makes DeepSeek-V3.2's MLA sparse
    report["sparse"] = refusal(config)
    print(json.dumps(report))


if __name__ == "__main__":
    main(sys.argv[1])
