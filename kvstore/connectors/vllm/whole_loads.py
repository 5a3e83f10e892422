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

The reading rank (the TP group's first) reads every chunk of a load into a staging buffer on
kvstore's event loop; at the end of each step (:meth:`WholeChunkLoads.poll`) the ranks agree on
which loads are done, and each done one is copied into the engine's blocks, each rank its own
heads, layer by layer. Nothing is written into the engine's blocks until every chunk of the load
has come and passed its checks.

What such a load costs the requests vLLM runs meanwhile is CPU beside their steps: reading and
decoding a chunk (about 30 ms of CPU for 4.7 MB from Redis in byteplanes, half of it the decode),
then copying it into the blocks. So the work is spread out rather than done at once:

- The chunks are read a few at a time (:data:`READS_IN_FLIGHT`), one ``get_many`` each, the
  next started as one ends, the first ones :data:`STAGGER_S` apart. Reads started together share
  the link and end together: a 16-chunk prefix read in one call arrived whole at the end of the
  transfer, and its 16 decodes then ran at once beside vLLM's steps (on 2 cores,
  ``benchmarks/stall.py``: the others' steps went from 31 ms to a median of 60 ms, up to 260 ms,
  for the ~0.8 s it lasted, and the loading request waited for all of it after the last byte).
  Read a few at a time, each chunk is decoded while the next ones are on the wire.
- Each read has the store's ``timeouts.get`` for itself, so a prefix that takes longer than that
  on a slow link still loads (read in one call, the whole prefix had one timeout); the first chunk
  that misses or fails fails the load, and no more of its chunks are read.
- The copy into the blocks (75 MB: 25-40 ms on the worker's thread, in one step) is split over at
  most :data:`COPY_STEPS` steps, whole layers, :data:`COPY_BYTES_PER_STEP` a step where that takes
  no more steps; the request is reported finished once the last layer is in. Every rank copies
  the same layers in the same step (the count depends only on the load's size and the layout).
"""

from __future__ import annotations

import concurrent.futures
import functools
import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from kvstore.connectors.vllm.step_metadata import BlockRun, LoadSpec
from kvstore.connectors.vllm.worker_context import WorkerContext
from kvstore.engine.sync import SyncKVStore
from kvstore.keys import ChunkKey

log = logging.getLogger("kvstore.connectors.vllm")
PENDING, LOADED, FAILED = 0, 1, 2
READS_IN_FLIGHT = 3
"""Chunk reads of one load in flight at once, once all have started (see :data:`STAGGER_S`)."""
STAGGER_S = 0.03
"""The reads of a load start one at a time, at least this many seconds apart (at the end of a step): reads
started together share the link and end together, and so would the decoding of their chunks."""
COPY_BYTES_PER_STEP = 24 << 20
"""What one step copies of a load into the engine's blocks (whole layers, at least one a step) ..."""
COPY_STEPS = 4
"""... unless the load would then take more steps than this: then its bytes over this many steps."""


class _ChunkReads:
    """The reading rank's reads of one load: chunk ``i`` into ``outs[i]``, one ``get_many`` each, at most
    :data:`READS_IN_FLIGHT` at once, the next started as one ends (see the module docstring).

    :meth:`start` starts one read; :meth:`widen`, called at the end of each step, lets one more run
    at once, :data:`STAGGER_S` after the one before, up to :data:`READS_IN_FLIGHT`. Started and
    widened on the worker's thread; each read's end starts the next on kvstore's loop (the calls'
    callbacks), and :meth:`state` is read on the worker's thread: the counts are kept under a lock.
    """

    def __init__(self, store: SyncKVStore, keys: Sequence[ChunkKey], outs: Sequence[torch.Tensor]) -> None:
        self.store, self._keys, self._outs = store, list(keys), list(outs)
        self._lock = threading.Lock()
        self._allowed = 1  # reads that may run at once now (widened to READS_IN_FLIGHT)
        self._widened_at = time.monotonic()
        self._next = 0  # the next chunk to read
        self._running = 0  # reads started and not ended
        self._read = 0  # chunks read
        self._starting = False  # a thread is in _more
        self.error = ""  # the first failure (then no more reads start)

    def start(self) -> None:
        """Start the first read (non-blocking)."""
        self._more()

    def widen(self, now: float) -> None:
        """Let one more read run at once, if :data:`STAGGER_S` has passed since the last one was let (non-blocking)."""
        with self._lock:
            if self._allowed == READS_IN_FLIGHT or now - self._widened_at < STAGGER_S:
                return
            self._allowed, self._widened_at = self._allowed + 1, now
        self._more()

    def stop(self) -> None:
        """Start no more reads; those in flight end on kvstore's loop."""
        with self._lock:
            self.error = self.error or "stopped"

    def state(self) -> int:
        """PENDING while a read runs or remains, then LOADED, or FAILED (:attr:`error` says why)."""
        with self._lock:
            if self._running:
                return PENDING
            if self.error:
                return FAILED
            return LOADED if self._read == len(self._keys) else PENDING

    def _more(self) -> None:
        """Start reads until as many run as are let, none remains, or one has failed.

        Called on the worker's thread (start, widen) and on kvstore's loop (a read's end); one
        thread at a time starts reads (``_starting``), and a read that ends while they start (its
        callback then runs at once, on the same thread) is counted, not recursed into: the loop
        here sees its slot free.
        """
        with self._lock:
            if self._starting:
                return  # the thread starting reads checks again before it stops
            self._starting = True
        while True:
            with self._lock:
                if self.error or self._next == len(self._keys) or self._running >= self._allowed:
                    self._starting = False  # under the same lock as the check: no end is missed
                    return
                index, self._next, self._running = self._next, self._next + 1, self._running + 1
            try:
                call = self.store.get_many_future([self._keys[index]], [self._outs[index]])
            except Exception as exc:  # noqa: BLE001 - a closed store: the load fails
                self._ended(f"the read of chunk {index} did not start: {exc!r}")
                continue  # (the loop stops: the error is set)
            call.add_done_callback(functools.partial(self._on_end, index))

    def _on_end(self, index: int, call: concurrent.futures.Future[list[torch.Tensor | None]]) -> None:
        """Read ``index`` ended (on kvstore's loop, or at once where it had already): count it, start the next."""
        try:
            error = "" if call.result()[0] is not None else f"chunk {index} of {len(self._keys)} did not load"
        except Exception as exc:  # noqa: BLE001 - any failure of a read is this load's failure
            error = f"chunk {index} of {len(self._keys)}: {exc!r}"
        self._ended(error)
        self._more()

    def _ended(self, error: str) -> None:
        with self._lock:
            self._running -= 1
            if error:
                self.error = self.error or error
            else:
                self._read += 1


@dataclass
class _WholeLoad:
    req_id: str
    runs: list[BlockRun]
    chunks: int
    tokens: int  # tokens the request gets from the load (what vLLM was told)
    reads: _ChunkReads | None = None  # the reading rank's
    staging: torch.Tensor | None = None  # [chunks, layers, planes, tokens, heads, head_dim] (reading rank)
    error: str = ""
    block_tensors: list[torch.Tensor] = field(default_factory=list)
    copied: int = 0  # layers copied into the engine's blocks so far (once every chunk is in)


class WholeChunkLoads:
    """Background loads of whole chunks for a hybrid model, reported per request (see the module docstring).

    ``layer_groups[i]`` is the position (in ``runs``) of the group of chunk layer ``i``.
    Methods run on the worker's thread; :meth:`start` does not block (the reads run on kvstore's
    loop, a few chunks at a time), :meth:`poll` copies the loads that are done and does not wait for the others. With
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
                load.reads = _ChunkReads(self.store, keys, list(load.staging))
            load.reads.start()
        except Exception as exc:  # noqa: BLE001 - a closed store, no memory: the load fails at the next poll
            load.error = f"the reads did not start: {exc!r}"

    def poll(self) -> tuple[set[str], set[str]]:
        """Copy the loads whose chunks are all in into the engine's blocks, a few layers a step: (requests finished,
        those of them failed). A load is finished once all its layers are copied (or when it failed)."""
        if not self._loads:
            return set(), set()
        now = time.monotonic()
        for load in self._loads:
            if load.reads is not None:
                load.reads.widen(now)
        mine = [self._state(load) for load in self._loads] if self.store is not None else None
        states = self.ranks.agree_states(mine, len(self._loads))
        finished: set[str] = set()
        failed: set[str] = set()
        keep: list[_WholeLoad] = []
        for load, state in zip(self._loads, states, strict=True):
            if state == PENDING:
                keep.append(load)
                continue
            if state == LOADED:
                if self._copy_some(load):
                    finished.add(load.req_id)
                    self.counters["loaded_chunks"] += load.chunks
                    self.counters["loaded_tokens"] += load.tokens
                else:
                    keep.append(load)
                continue
            finished.add(load.req_id)
            failed.add(load.req_id)
            self.counters["load_failures"] += 1
            log.warning(
                "kvstore: request %s's cached prefix failed to load (%s); vLLM recomputes it",
                load.req_id, load.error or "a chunk failed on the reading rank",
            )  # fmt: skip
        self._loads = keep
        return finished, failed

    def _state(self, load: _WholeLoad) -> int:
        """The reading rank's view of ``load``: PENDING, LOADED or FAILED (``load.error`` says why)."""
        if not load.chunks:
            load.error = "the load did not match the engine's blocks"
            return FAILED
        if load.reads is None:
            return FAILED
        state = load.reads.state()
        if state == FAILED:
            load.error = load.reads.error
        return state

    def _copy_some(self, load: _WholeLoad) -> bool:
        """Copy the next layers of a load whose chunks are all in (see :data:`COPY_STEPS`); True once all are.

        The same layers on every rank: how many depends only on the load's size and the layout.
        """
        layers = len(self._layers)
        by_bytes = COPY_BYTES_PER_STEP // max(1, load.chunks * self.layout.layer_nbytes)
        per_step = max(1, by_bytes, -(-layers // COPY_STEPS))
        end = min(layers, load.copied + per_step)
        self._copy_into_blocks(load, range(load.copied, end))
        load.copied = end
        return end == layers

    def _copy_into_blocks(self, load: _WholeLoad, layers: range) -> None:
        """Layers ``layers`` of the staged chunks into their groups' blocks (every rank its heads)."""
        chunk = self.layout.chunk_tokens
        for index in layers:
            layer, group = self._layers[index], self._layer_groups[index]
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
        """Forget every load (the engine is shutting down); reads in flight finish on kvstore's loop, no more start."""
        for load in self._loads:
            if load.reads is not None:
                load.reads.stop()
        self._loads.clear()
