"""The connector's saves, worker side: prompt chunks gathered from the paged cache layer by layer, put at step end.

The scheduler names, in each step's metadata, the prompt chunks whose tokens have all been
computed (:class:`~kvstore.connectors.vllm.step_metadata.SaveSpec`: each KV cache group's blocks
of the chunk). After each attention call vLLM hands the connector that layer's paged cache, and
:meth:`ChunkSaves.gather_layer` copies the layer's rows of every chunk to save into a staging
chunk (this rank's heads; rows no sliding window reaches are zeros, see
:mod:`kvstore.connectors.attention_groups`). At the end of the step :meth:`ChunkSaves.put`
hands the staged chunks to the store in one ``put_many`` (a copy into kvstore's DRAM tier; disk,
Redis and S3 follow in the background), so vLLM may free the blocks as soon as the step is done.

With tensor parallelism every rank gathers its heads and the ranks gather them to the reading
rank (the TP group's first), which puts whole chunks
(:mod:`kvstore.connectors.vllm.tensor_parallel`). A save is best effort: one the store rejects or
fails is counted (``save_rejected``) and is a future cache miss, never an error in the engine.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from kvstore.connectors.vllm.step_metadata import SaveSpec
from kvstore.connectors.vllm.worker_context import WorkerContext
from kvstore.keys import ChunkKey

log = logging.getLogger("kvstore.connectors.vllm")
SPARE_CHUNKS = 8  # staging buffers kept between steps (a long prefill step may need more, briefly)


class ChunkSaves:
    """One step's saves: staged layer by layer (:meth:`gather_layer`), put together (:meth:`put`).

    Called on the worker's thread only. ``layers`` and ``layer_groups`` are the connector's lists
    (filled when vLLM registers its caches): each layer's paged cache, and its KV cache group's
    position. ``store`` is None on ranks after the first. ``counters`` is the connector's dict,
    updated in place (``saved_chunks``, ``save_rejected``).
    """

    def __init__(self, worker: WorkerContext) -> None:
        self.layout, self.ranks, self.store = worker.layout, worker.ranks, worker.store
        self._layers, self._layer_groups, self.counters = worker.layers, worker.layer_groups, worker.counters
        # key -> (block ids of each group, chunk)
        self._staging: dict[ChunkKey, tuple[list[torch.Tensor], torch.Tensor]] = {}
        self._spare_chunks: list[torch.Tensor] = []  # staging buffers, reused: fresh ones pay page faults

    def gather_layer(self, saves: Sequence[SaveSpec], index: int) -> None:
        """Copy layer ``index``'s rows of every chunk in ``saves`` from its paged cache into the chunk's staging."""
        layer, group = self._layers[index], self._layer_groups[index]
        for spec in saves:
            staged = self._staging.get(spec.key)
            if staged is None:
                chunk = self._spare_chunks.pop() if self._spare_chunks else self._new_chunk()
                tables = [torch.tensor(run.block_ids, dtype=torch.long) for run in spec.runs]
                staged = self._staging[spec.key] = (tables, chunk)
            tables, chunk = staged
            first_row = spec.runs[group].first_row
            if first_row:  # rows no window reaches (see attention_groups.py): zeros, not a reused buffer's rows
                chunk[index, :, :first_row].zero_()
            layer.gather(tables[group], chunk[index, :, first_row:])

    def _new_chunk(self) -> torch.Tensor:
        """A staging buffer for this rank's heads of one chunk (all heads without tensor parallelism).

        On the GPU cache's device when there is one and no tensor parallelism (whose ranks send their heads
        over CPU tensors): the gather stays on the device and ``put`` copies the chunk out asynchronously
        (kvstore.engine.transfer). Such a buffer is not kept for reuse: torch's allocator hands its memory
        out again only once that copy has read it.
        """
        layers, planes, tokens, heads, head_dim = self.layout.chunk_shape
        shape = (layers, planes, tokens, self.ranks.head_count(heads), head_dim)
        device = self._layers[0].device if self._layers and self.ranks.size == 1 else torch.device("cpu")
        return torch.empty(shape, dtype=self.layout.dtype, device=device if device.type == "cuda" else "cpu")

    def put(self, saves: Sequence[SaveSpec]) -> None:
        """Put the staged chunks of ``saves`` into the store (blocking until they are in its DRAM tier); empty staging.

        Chunks no attention layer ran for this step (nothing computed for them) were not staged and are left out.
        """
        chunks = [(spec.key, self._staging[spec.key][1]) for spec in saves if spec.key in self._staging]
        staged = chunks
        if chunks and self.ranks.size > 1:  # every rank's heads to the first rank, which puts whole chunks
            chunks = self._gather_chunks(chunks)
        if chunks:
            try:  # one hop to kvstore's loop for all of them; each put copies into its DRAM tier
                assert self.store is not None  # chunks to put are on the reading rank only
                parents = {spec.key: spec.parent for spec in saves}  # retention removes a prompt's tail first
                keys = [key for key, _ in chunks]
                # chunks on a GPU cross the bus as one batch, after the gathers queued on this thread's stream
                saved = self.store.put_many(keys, [chunk for _, chunk in chunks], parents=[parents[k] for k in keys])
            except Exception as exc:  # a save is best effort: a missed one is a future cache miss
                log.warning("kvstore: saving %d chunks failed: %r", len(chunks), exc)
                saved = [False] * len(chunks)
            self.counters["saved_chunks"] += sum(saved)
            self.counters["save_rejected"] += len(chunks) - sum(saved)
        # The staging buffers are free again (put copied them): keep a few for the next steps (each once).
        spare = {id(chunk): chunk for _, chunk in staged if chunk.device.type == "cpu"}
        self._spare_chunks.extend(list(spare.values())[: max(0, SPARE_CHUNKS - len(self._spare_chunks))])
        self._staging.clear()

    def close(self) -> None:
        """The connector shuts down: staged chunks are dropped and the store is let go (the connector releases it)."""
        self.store = None
        self._staging.clear()
        self._spare_chunks.clear()

    def _gather_chunks(self, staged: list[tuple[ChunkKey, torch.Tensor]]) -> list[tuple[ChunkKey, torch.Tensor]]:
        """Tensor parallelism: the whole chunks on the reading rank (every rank sends its heads); none elsewhere."""
        local = torch.stack([chunk for _, chunk in staged])
        full = None
        if self.store is not None:
            full = torch.empty((len(staged), *self.layout.chunk_shape), dtype=self.layout.dtype)
        self.ranks.gather_heads(local, full)
        return [] if full is None else [(key, full[i]) for i, (key, _) in enumerate(staged)]
