"""Test-only: what the engine tests read from kvstore's connector in each vLLM worker.

vLLM mixes this class into its workers (``worker_extension_cls="probe.KVStoreProbe"``, this folder
on ``sys.path``), and ``llm.collective_rpc("kvstore_stats")`` runs a method in every worker, in
vLLM's default mode too, where the workers are processes of their own: the engine tests run the
way users run vLLM. Plain data crosses the process boundary (dicts, lists, strings).
"""

from __future__ import annotations

from typing import Any


def _connector() -> Any:
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    return get_kv_transfer_group()


class KVStoreProbe:
    """Methods added to every vLLM worker (each runs in that worker's process)."""

    def kvstore_stats(self) -> dict[str, Any]:
        """The worker's connector counters, its store's (the first rank's), and the scheduler's as of the last step."""
        return _connector().stats()

    def kvstore_flush(self) -> None:
        """Wait until the worker's kvstore has written everything to every tier (the rank holding a store)."""
        store = _connector().store
        if store is not None:
            store.flush(timeout=60)

    def kvstore_identity(self, prompts: dict[str, list[int]]) -> dict[str, Any]:
        """The namespace, KV cache groups and each prompt's chunk keys (from the rank holding the store)."""
        connector = _connector()
        identity: dict[str, Any] = {
            "namespace": connector.namespace,
            "kv_cache_groups": [{"layers": list(group.layers), "window": group.window} for group in connector.groups],
            "attention": connector.attention,
            "block_size": connector.block_size,
        }
        if connector.store is not None:
            identity["prompt_keys"] = {name: connector.store.chunk_keys(ids) for name, ids in prompts.items()}
        return identity
