"""Loads of whole chunks in the background, finished or failed per request.

How hybrid models load, and how any model loads a prefix that needs a tier off this machine (Redis,
S3: the scheduler's choice, :class:`~kvstore.connectors.vllm.scheduler.ConnectorScheduler`): a
layer-by-layer load of such a prefix inside the forward pass would hold every request in the batch
for the whole transfer; in the background, vLLM runs the others meanwhile.

With more than one KV cache group (a hybrid model: sliding-window and full-attention layers),
vLLM cannot take a load failure block by block (a block id names a block of one group only, so
vLLM 0.32 stops the engine if a connector reports one). It takes them per request instead, for
asynchronous loads: the request waits (``WAITING_FOR_REMOTE_KVS``) until the connector reports it
in ``finished_recving``, and is recomputed whole if it is also in ``failed_recving``. So a hybrid
prefix hit is loaded whole or not at all: every group gets what it needs, or the request is a miss.

The reading rank (the TP group's first) reads every chunk of a load into staging buffers on
kvstore's event loop (``get_many``: one bounded call per tier); at the end of each step
(:meth:`WholeChunkLoads.poll`) the ranks agree on which loads are done, and each done one is
copied into the engine's blocks, each rank its own heads, layer by layer. Nothing is written
into the engine's blocks until every chunk of the load has come and passed its checks.
"""

from __future__ import annotations

import concurrent.futures
import logging
from dataclasses import dataclass, field

import torch

from kvstore.connectors.vllm.step_metadata import BlockRun, LoadSpec
from kvstore.connectors.vllm.worker_context import WorkerContext

log = logging.getLogger("kvstore.connectors.vllm")
PENDING, LOADED, FAILED = 0, 1, 2


@dataclass
class _WholeLoad:
    req_id: str
    runs: list[BlockRun]
    chunks: int
    tokens: int  # tokens the request gets from the load (what vLLM was told)
    future: concurrent.futures.Future[list[torch.Tensor | None]] | None = None  # the reading rank's reads
    staging: torch.Tensor | None = None  # [chunks, layers, planes, tokens, heads, head_dim] (reading rank)
    error: str = ""
    block_tensors: list[torch.Tensor] = field(default_factory=list)


class WholeChunkLoads:
    """Background loads of whole chunks for a hybrid model, reported per request (see the module docstring).

    ``layer_groups[i]`` is the position (in ``runs``) of the group of chunk layer ``i``.
    Methods run on the worker's thread; :meth:`start` does not block (the reads run on kvstore's
    loop), :meth:`poll` copies the loads that are done and does not wait for the others. With
    tensor parallelism both are called on every rank in the same order (the step's metadata).
    """

    def __init__(self, worker: WorkerContext) -> None:
        self.layout, self.ranks, self.store, self.counters = worker.layout, worker.ranks, worker.store, worker.counters
        self._layers, self._layer_groups = worker.layers, worker.layer_groups  # filled by register_kv_caches
        self._loads: list[_WholeLoad] = []

    def start(self, spec: LoadSpec) -> None:
        """Begin reading the chunks of ``spec`` (on the reading rank); reported by a later :meth:`poll`."""
        keys, runs = spec.keys, spec.runs
        load = _WholeLoad(spec.req_id, runs, len(keys), spec.tokens)
        load.block_tensors = [torch.tensor(run.block_ids, dtype=torch.long) for run in runs]
        self._loads.append(load)
        if self.store is None:
            return
        try:
            with torch.inference_mode(False):  # vLLM's step runs in inference mode; kvstore's loop writes into it
                load.staging = torch.empty((len(keys), *self.layout.chunk_shape), dtype=self.layout.dtype)
            load.future = self.store.get_many_future(keys, list(load.staging))
        except Exception as exc:  # noqa: BLE001 - a closed store, no memory: the load fails at the next poll
            load.error = f"the reads did not start: {exc!r}"

    def poll(self) -> tuple[set[str], set[str]]:
        """Copy every load that is done into the engine's blocks: (requests finished, those of them failed)."""
        if not self._loads:
            return set(), set()
        mine = [self._state(load) for load in self._loads] if self.store is not None else None
        states = self.ranks.agree_states(mine, len(self._loads))
        finished: set[str] = set()
        failed: set[str] = set()
        keep: list[_WholeLoad] = []
        for load, state in zip(self._loads, states, strict=True):
            if state == PENDING:
                keep.append(load)
                continue
            finished.add(load.req_id)
            if state == FAILED:
                failed.add(load.req_id)
                self.counters["load_failures"] += 1
                log.warning(
                    "kvstore: request %s's cached prefix failed to load (%s); vLLM recomputes it",
                    load.req_id, load.error or "a chunk failed on the reading rank",
                )  # fmt: skip
                continue
            self._copy_into_blocks(load)
            self.counters["loaded_chunks"] += load.chunks
            self.counters["loaded_tokens"] += load.tokens
        self._loads = keep
        return finished, failed

    def _state(self, load: _WholeLoad) -> int:
        """The reading rank's view of ``load``: PENDING, LOADED or FAILED (``load.error`` says why)."""
        if not load.chunks:
            load.error = "the load did not match the engine's blocks"
            return FAILED
        if load.future is None:
            return FAILED
        if not load.future.done():
            return PENDING
        try:
            results = load.future.result()
        except Exception as exc:  # noqa: BLE001 - any failure of the reads is this load's failure
            load.error = repr(exc)
            return FAILED
        if not all(result is not None for result in results):
            load.error = f"{sum(result is None for result in results)} of {load.chunks} chunks did not load"
            return FAILED
        return LOADED

    def _copy_into_blocks(self, load: _WholeLoad) -> None:
        """Each layer of the staged chunks into its group's blocks (every rank its heads)."""
        chunk = self.layout.chunk_tokens
        for index, layer in enumerate(self._layers):
            group = self._layer_groups[index]
            run, blocks = load.runs[group], load.block_tensors[group]
            if not run.block_ids:
                continue
            tokens = len(run.block_ids) * layer.block_size
            rows = None
            if load.staging is not None:
                # Only the chunks holding the group's rows (a sliding window's are the last few):
                # [chunks, planes, C, heads, dim] -> [planes, their tokens, heads, dim].
                first, last = run.first_row // chunk, -(-(run.first_row + tokens) // chunk)
                held = load.staging[first:last, index].transpose(0, 1).flatten(1, 2)
                start = run.first_row - first * chunk
                rows = held[:, start : start + tokens]
            layer.scatter(blocks, self.ranks.scatter_heads(rows, self.layout, tokens))

    def close(self) -> None:
        """Forget every load (the engine is shutting down); reads in flight finish on kvstore's loop."""
        self._loads.clear()
