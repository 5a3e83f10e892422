"""SyncKVStore: the store for engine threads, with its event loop in one background thread.

Each method submits the async method to that loop and waits for its result: a thin wrapper,
so behaviour and errors are the async core's. ``put`` waits only for the DRAM copy; the writes
to slower tiers continue on the loop thread while the engine goes on.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine, Sequence
from typing import Any, TypeVar

import torch

from kvstore.config import StoreConfig
from kvstore.keys import ChunkKey
from kvstore.layout import KVLayout
from kvstore.store import KVStore, StoreClosedError

T = TypeVar("T")


class SyncKVStore:
    def __init__(self, config: StoreConfig, layout: KVLayout, namespace: str, **kwargs: Any) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="kvstore-loop", daemon=True)
        self._thread.start()
        try:
            self.store = self._call(self._create(config, layout, namespace, kwargs))
        except BaseException:
            self._stop_loop()
            raise

    @staticmethod
    async def _create(config: StoreConfig, layout: KVLayout, namespace: str, kwargs: dict[str, Any]) -> KVStore:
        return await KVStore(config, layout, namespace, **kwargs).open()

    def _call(self, coroutine: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        if self._loop.is_closed() or not self._thread.is_alive():
            coroutine.close()
            raise StoreClosedError("the SyncKVStore is closed")
        if threading.current_thread() is self._thread:
            coroutine.close()
            raise RuntimeError("SyncKVStore methods cannot be called from its own event-loop thread")
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result(timeout)

    def chunk_keys(self, token_ids: Sequence[int], extra: bytes | None = None) -> list[ChunkKey]:
        return self.store.chunk_keys(token_ids, extra)

    def put(self, key: ChunkKey, kv: torch.Tensor) -> bool:
        return self._call(self.store.put(key, kv))

    def lookup(self, keys: Sequence[ChunkKey]) -> int:
        return self._call(self.store.lookup(keys))

    def get(self, key: ChunkKey, out: torch.Tensor | None = None) -> torch.Tensor | None:
        return self._call(self.store.get(key, out))

    def flush(self, timeout: float | None = None) -> None:
        self._call(self.store.flush(), timeout)

    def stats(self) -> dict[str, dict[str, Any]]:
        return self._call(_as_coroutine(self.store.stats))

    def close(self) -> None:
        if not self._thread.is_alive():
            return
        try:
            # close() bounds itself by timeouts.close; the margin covers the tiers' own close.
            self._call(self.store.close(), timeout=2 * self.store.config.timeouts.close + 5)
        finally:
            self._stop_loop()

    def _stop_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)
        if not self._thread.is_alive():
            self._loop.close()

    def __enter__(self) -> SyncKVStore:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


async def _as_coroutine(fn: Any) -> Any:
    """Run a plain method on the loop thread, where the store's state lives."""
    return fn()
