"""Layer-by-layer loads of a prefix, streamed while the forward pass runs: how one-group models load.

Each load is a layer stream (``store.prefetch``) started before the forward pass; layer i is
copied into the paged blocks when the attention of layer i asks for it, so later layers keep
arriving while earlier ones compute. A stream lands its layers in a ring of ``depth + 1`` layer
buffers (see ``LayerStream``), each released once its layer is in the blocks: on the GPU cache's
device with one rank (the layers cross the bus asynchronously, through the store's transfer layer,
and are put in the blocks by the engine's stream), in host memory otherwise.

A chunk that cannot be loaded (corrupt, vanished, a tier timing out) fails with the chunks after
it: their blocks are reported through ``get_block_ids_with_load_errors`` and vLLM recomputes those
tokens, while the chunks before it are streamed again and kept.

With tensor parallelism only the reading rank (the TP group's first) streams; for each layer it
broadcasts the agreed outcome (:class:`~kvstore.connectors.vllm.tensor_parallel.LoadStatus`) and
scatters each rank its heads, so every rank reports the same blocks failed.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

import torch

from kvstore.connectors.paged import PagedLayer
from kvstore.connectors.vllm.step_metadata import BlockRun, LoadSpec
from kvstore.connectors.vllm.tensor_parallel import LoadStatus
from kvstore.connectors.vllm.worker_context import WorkerContext
from kvstore.engine.sync import SyncLayerStream
from kvstore.errors import KVStoreError

log = logging.getLogger("kvstore.connectors.vllm")


@dataclass
class _ActiveLoad:
    spec: LoadSpec
    stream: SyncLayerStream | None  # None: it could not start (see ``error``), or this rank does not read
    block_ids: torch.Tensor
    failed: bool = False
    layers_done: int = 0
    error: str = ""  # why the stream is gone, once it is (the reading rank only)


class LayerStreamLoads:
    """The loads of one step, layer by layer (see the module docstring); blocking where a layer is late.

    :meth:`start` opens the streams (does not wait); :meth:`load_layer` waits for layer ``i`` of
    every load (at most ``wait_timeout`` each) and copies it into the blocks; :meth:`end_step`
    fails the loads the forward pass did not take every layer of. ``counters`` is the connector's.
    """

    def __init__(
        self, worker: WorkerContext, chunk_tokens: int, block_size: int, prefetch_depth: int, wait_timeout: float
    ) -> None:
        self.layout, self.ranks, self.store, self.counters = worker.layout, worker.ranks, worker.store, worker.counters
        self.chunk_tokens, self.block_size = chunk_tokens, block_size
        self.prefetch_depth, self.wait_timeout = prefetch_depth, wait_timeout
        self._loads: list[_ActiveLoad] = []
        self._failed_blocks: set[int] = set()
        # where the streams' ring buffers live: the GPU cache's device with one rank (set when the caches are)
        self.device = torch.device("cpu")

    def start(self, spec: LoadSpec) -> None:
        load = _ActiveLoad(spec, None, torch.tensor(spec.runs[0].block_ids, dtype=torch.long))
        self._loads.append(load)
        if self.store is not None:  # the reading rank; a stream that cannot start fails at layer 0, agreed
            self._start_stream(load, "the stream did not start")

    def load_layer(self, index: int, layer: PagedLayer) -> None:
        """Copy layer ``index`` of every load into its blocks (every rank, in the same order)."""
        for load in self._loads:
            if load.failed or load.layers_done != index:
                continue
            # Every rank runs this for the same loads in the same order: the statuses are agreed.
            kv = self._read_layer(load, index) if self.store is not None else None
            blocks = len(load.spec.runs[0].block_ids)
            status = self.ranks.agree(
                LoadStatus(kv is not None, len(load.spec.keys), blocks) if self.store is not None else None
            )
            if status.blocks < blocks:  # the reading rank narrowed the load (reported there)
                self._narrow(load, status.keys, status.blocks, f"layer {index}: another rank's chunk failed")
            if not status.loaded:
                self._fail(load, load.error or f"layer {index} failed on the reading rank")
                continue
            rows = len(load.block_ids) * self.block_size
            layer.scatter(load.block_ids, self.ranks.scatter_heads(kv, self.layout, rows))
            if load.stream is not None:  # its buffer may take a later layer once the copies queued so far end
                load.stream.release(index)
            load.layers_done += 1
        self._finish_loads(complete_only=True)

    def end_step(self) -> None:
        """Fail the loads the forward pass did not take every layer of (it cannot have used them)."""
        for load in self._loads:
            if not load.failed and load.layers_done < self.layout.num_layers:
                self._fail(load, f"only {load.layers_done} of {self.layout.num_layers} layers were taken")
        self._finish_loads(complete_only=False)

    def take_failed_blocks(self) -> set[int]:
        """The blocks reported failed since the last call (vLLM recomputes them)."""
        failed, self._failed_blocks = self._failed_blocks, set()
        return failed

    def close(self) -> None:
        for load in self._loads:
            load.failed = True
        self._finish_loads(complete_only=False)

    def _start_stream(self, load: _ActiveLoad, failure: str, first_layer: int = 0) -> None:
        """Open ``load``'s stream; ``first_layer``: the layer the forward pass is at (a restart), the ones
        before it are released at once (they are not taken again)."""
        if not load.spec.keys:
            load.error = "the load did not match the engine's blocks"
            return
        try:
            assert self.store is not None
            load.stream = self.store.prefetch(load.spec.keys, depth=self.prefetch_depth, outs=self._ring(load))
            if first_layer:
                load.stream.release(first_layer - 1)
        except Exception as exc:  # noqa: BLE001 - a closed store, no memory: this load fails, agreed at layer 0
            load.stream, load.error = None, f"{failure}: {exc!r}"

    def _ring(self, load: _ActiveLoad) -> list[torch.Tensor]:
        """Buffers for ``depth + 1`` layers of ``load`` (all of its layers if it has fewer), on ``self.device``: as
        far as the stream may run ahead of the layer being put in the blocks, so the ring never holds it back.
        Device memory outside vLLM's budget (5 x 128 MiB for a 32K-token Llama-3-8B prompt at depth 4, besides
        the stream's upload scratch): where the device has none left, the buffers are in host memory."""
        layout = self.layout
        shape = (layout.kv_planes, len(load.spec.keys) * self.chunk_tokens, layout.num_kv_heads, layout.head_dim)
        count = min(layout.num_layers, self.prefetch_depth + 1)
        try:
            return [torch.empty(shape, dtype=layout.dtype, device=self.device) for _ in range(count)]
        except torch.OutOfMemoryError:  # vLLM holds the GPU's memory: this load goes through host memory, as at TP>1
            self.counters["host_ring_loads"] += 1
            log.warning("kvstore: no GPU memory for a load's %d layer buffers of %s; loading through host memory",
                        count, tuple(shape))  # fmt: skip
            return [torch.empty(shape, dtype=layout.dtype) for _ in range(count)]

    def _read_layer(self, load: _ActiveLoad, index: int) -> torch.Tensor | None:
        """The reading rank: layer ``index`` of the load's blocks (all heads), or None (``load.error`` says why).

        A chunk that fails narrows the load to the chunks before it and the stream starts again
        (:meth:`_keep_sound_chunks`), so this returns the layer of fewer blocks, never wrong rows.
        """
        while load.stream is not None:
            try:
                kv = load.stream.wait_layer(index, self.wait_timeout)
                skip = load.spec.runs[0].first_row
                return kv[:, skip : skip + len(load.block_ids) * self.block_size]
            # PrefetchError (a layer that cannot come, or is late), a closed store, anything else: the
            # load fails (on every rank, agreed), the engine goes on.
            except Exception as exc:  # noqa: BLE001
                if not self._keep_sound_chunks(load, exc, index):
                    load.error = f"layer {index}: {exc}"
                    self._close_stream(load)
                    load.stream = None
        return None

    def _keep_sound_chunks(self, load: _ActiveLoad, exc: KVStoreError, index: int) -> bool:
        """After chunk c of ``load`` failed, go on loading its chunks before c; False if none are left.

        Only chunk c's blocks and those after it are reported failed: vLLM recomputes from
        there, not the whole prefix. The chunks before c are streamed again from a new stream
        (their layers up to the failed one included: the old stream fails that layer as a whole).
        Each narrowing drops at least one chunk, so a load is retried at most once per chunk.
        """
        bad = getattr(exc, "chunk", None)  # None: not one chunk's fault (a late layer, a closed store)
        run = load.spec.runs[0]
        keep = 0 if bad is None else (bad * self.chunk_tokens - run.first_row) // self.block_size
        if bad is None or keep <= 0 or keep >= len(run.block_ids):
            return False
        self._close_stream(load)
        self._narrow(load, bad, keep, f"chunk {bad} of {len(load.spec.keys)}: {exc}")
        self._start_stream(load, f"the stream of its first {bad} chunks did not start", first_layer=index)
        return True

    def _narrow(self, load: _ActiveLoad, keys: int, blocks: int, reason: str) -> None:
        """Keep the first ``keys`` chunks (``blocks`` blocks) of ``load``; report the rest failed."""
        spec, run = load.spec, load.spec.runs[0]
        self._report_failed(spec, run.block_ids[blocks:], reason)
        self.counters["partial_loads"] += 1
        kept = BlockRun(run.first_row, run.block_ids[:blocks])
        load.spec = dataclasses.replace(spec, keys=spec.keys[:keys], runs=[kept], tokens=blocks * self.block_size)
        load.block_ids = load.block_ids[:blocks]

    def _fail(self, load: _ActiveLoad, reason: str) -> None:
        load.failed = True
        self._report_failed(load.spec, load.spec.runs[0].block_ids, reason)

    def _report_failed(self, spec: LoadSpec, block_ids: list[int], reason: str) -> None:
        """Blocks of ``spec`` that vLLM must recompute (counted once per failure)."""
        self.counters["load_failures"] += 1
        self.counters["failed_blocks"] += len(block_ids)
        self._failed_blocks.update(block_ids)
        log.warning(
            "kvstore: %d of %d blocks of request %s's cached prefix failed to load (%s); vLLM recomputes them",
            len(block_ids), len(spec.runs[0].block_ids), spec.req_id, reason,
        )  # fmt: skip

    @staticmethod
    def _close_stream(load: _ActiveLoad) -> None:
        try:
            if load.stream is not None:
                load.stream.close()
        except Exception as exc:  # closing must not turn a finished load into an engine error
            log.debug("kvstore: closing a layer stream failed: %r", exc)

    def _finish_loads(self, complete_only: bool) -> None:
        keep: list[_ActiveLoad] = []
        for load in self._loads:
            finished = load.failed or load.layers_done == self.layout.num_layers
            if complete_only and not finished:
                keep.append(load)
                continue
            if not load.failed:
                self.counters["loaded_chunks"] += len(load.spec.keys)
                self.counters["loaded_tokens"] += len(load.spec.runs[0].block_ids) * self.block_size
            self._close_stream(load)
        self._loads = keep
