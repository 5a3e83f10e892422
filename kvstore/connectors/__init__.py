"""Engine connectors: the glue between an inference engine's KV cache and a kvstore.

Each connector lives in its own module and imports its engine there, so ``import kvstore``
never pulls in transformers, vLLM or SGLang:

- ``kvstore.connectors.hf``: Hugging Face transformers (``DynamicCache``), prefix reuse with
  layer-by-layer loading that overlaps the forward pass.
- ``kvstore.connectors.vllm``: vLLM's KV connector (``KVStoreConnector``) and a secondary tier of
  its native offloading (``KVStoreTier``).
- ``kvstore.connectors.sglang``: a storage backend of SGLang's HiCache (``KVStoreHiCacheStorage``).
"""
