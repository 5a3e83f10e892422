"""Where each chunk of a layer stream comes from: one class per kind of source, and the slots a stream holds.

A stream opens its chunks once (:meth:`StreamChunks.open`); each becomes one of:

- :class:`DramChunk`: in a DRAM slot, referenced while the stream runs. Its layers are copied out of
  the slot (into device outputs: they cross the bus straight from it).
- :class:`FileChunk`: on a local tier, its file open. Its layers are blocking positioned reads in the
  I/O threads: straight into the caller's outputs where they allow it (``OutputKind.HOST_IN_PLACE``:
  a run of layers in one vectored read), else through its staging slot (or a temporary).
- :class:`RemoteChunk`: on a range-readable remote tier. Each layer is a verified range read on the loop
  (later layers ride along in the same request), decoded into memory of the stream's own (its staging
  slot, or a temporary), then copied into the outputs on the loop, under the fence: a read a closing
  stream leaves running writes nothing there.

A chunk from a tier gets a staging slot (:meth:`StreamChunks.reserve_staging`): the contiguous memory its
reads need anyway, which the store publishes once the chunk has arrived whole (a promotion). Across all
streams of a store these slots are at most half the pool (:class:`~kvstore.engine.streams.resources.StagingShare`);
a chunk with none is read as without promotion, and its promotion is dropped and counted. A chunk read
in place takes none: the store admits it to DRAM after the stream instead. Once every layer has arrived
verified each chunk from a tier is handed to the store (:meth:`StreamChunks.promote`); nothing of a
stream that failed or closed early is. Readers are closed when the producer ends; slots are released
once the last copy out of them (to a device) has completed, not only when the stream ends.

Everything here runs on the store's loop (no lock); nothing blocks but the batched tier opens, which are
awaited.
"""

from __future__ import annotations

import asyncio
import functools

import torch

from kvstore.engine.streams.outputs import LayerRun, OutputKind
from kvstore.engine.streams.reads import DramCopy, FileRead, RunReads
from kvstore.engine.streams.resources import StreamResources
from kvstore.engine.transfer import Completion
from kvstore.errors import PrefetchError, TierSkipped, TierTimeout
from kvstore.keys import ChunkKey
from kvstore.layout import KVLayout
from kvstore.storage.layer_reader import LayerReader
from kvstore.util.buffers import copy_between, tensor_bytes
from kvstore.util.threads import WriteFence


class DramChunk:
    """A chunk in a DRAM slot (one reference held by the stream until it is released)."""

    def __init__(self, key: ChunkKey, slot: int, layers: torch.Tensor) -> None:
        self.key, self.slot, self.layers = key, slot, layers  # layers: the slot, [num_layers, *layer_shape]

    def schedule(self, run: LayerRun, index: int, reads: RunReads) -> None:
        """Its layers of ``run``: into device outputs straight from the slot (pinned), else copied in a thread."""
        layers = self.layers[run.first : run.first + run.count]
        if run.kind is OutputKind.DEVICE:
            run.hosts[index] = layers
        else:
            reads.copies.append(DramCopy(run, index, layers))


class TierChunk:
    """A chunk read from a tier through ``reader``, and its staging slot (None: no promotion, or read in place)."""

    def __init__(self, key: ChunkKey, reader: LayerReader, layout: KVLayout) -> None:
        self.key, self.reader, self.layout = key, reader, layout
        self.staging: int | None = None  # its DRAM slot for promotion, held from reserve_staging to release
        self.staged: torch.Tensor | None = None  # that slot, [num_layers, *layer_shape]

    def host_run(self, run: LayerRun) -> torch.Tensor:
        """Host memory for its layers of ``run`` on their way to a device: a run of its staging slot, else a
        temporary (pageable: its copy to the device is then synchronous)."""
        if self.staged is not None:
            return self.staged[run.first : run.first + run.count]
        return torch.empty((run.count, *self.layout.layer_shape), dtype=self.layout.dtype)

    def stage(self, layer: int) -> torch.Tensor | None:
        """Its staging slot's layer ``layer``, if it has one."""
        return self.staged[layer] if self.staged is not None else None

    @property
    def promoted(self) -> bool:
        """Whether it is promoted once read whole (through a staging slot), rather than admitted (read in place)."""
        return True


class FileChunk(TierChunk):
    """A chunk on a local tier: blocking reads of its open file, in the store's I/O threads."""

    def __init__(self, key: ChunkKey, reader: LayerReader, layout: KVLayout) -> None:
        super().__init__(key, reader, layout)
        self.in_place = False  # read straight into the outputs (HOST_IN_PLACE: set by reserve_staging), admitted after

    @property
    def promoted(self) -> bool:
        return not self.in_place

    def schedule(self, run: LayerRun, index: int, reads: RunReads) -> None:
        """Its layers of ``run``: into host memory on their way to a device, in place, or through its staging slot."""
        layers = range(run.first, run.first + run.count)
        if run.kind is OutputKind.DEVICE:
            host = run.hosts[index] = self.host_run(run)
            items = [FileRead(self.reader, layer, host[j], None, None, index) for j, layer in enumerate(layers)]
        elif self.in_place:
            items = [
                FileRead(self.reader, layer, run.share(index, j), None, run.planes(index, j), index)
                for j, layer in enumerate(layers)
            ]
        else:
            items = [
                FileRead(self.reader, layer, run.share(index, j), self.stage(layer), None, index)
                for j, layer in enumerate(layers)
            ]
        reads.files.append(items)


class RemoteChunk(TierChunk):
    """A chunk on a remote tier: one verified range read per layer, on the loop, decoded into memory of its own."""

    def __init__(self, key: ChunkKey, reader: LayerReader, layout: KVLayout, ahead: int, timeout: float) -> None:
        """``ahead``: layers a request may fetch beyond the one asked for; ``timeout``: seconds per request."""
        super().__init__(key, reader, layout)
        self._ahead, self._timeout = ahead, timeout

    def schedule(self, run: LayerRun, index: int, reads: RunReads) -> None:
        """Its layers of ``run``: into host memory on their way to a device, else through memory of its own."""
        layers = range(run.first, run.first + run.count)
        if run.kind is OutputKind.DEVICE:
            host = run.hosts[index] = self.host_run(run)
            reads.remote.extend(
                functools.partial(self.read, layer, host[j], None, index, run.fence) for j, layer in enumerate(layers)
            )
        else:
            reads.remote.extend(
                functools.partial(self.read, layer, self.stage(layer), run.share(index, j), index, run.fence)
                for j, layer in enumerate(layers)
            )

    async def read(
        self, layer: int, into: torch.Tensor | None, then: torch.Tensor | None, index: int, fence: WriteFence
    ) -> None:
        """Layer ``layer``, verified, into ``into`` (None: a temporary), then copied into ``then`` if given, on
        the loop under ``fence``. PrefetchError if it cannot be read (counted in the tier's stats)."""
        reader = self.reader
        contiguous = into if into is not None else torch.empty(self.layout.layer_shape, dtype=self.layout.dtype)
        where = f"chunk {reader.key[:16]}... on the {reader.tier.name} tier"
        try:  # later layers ride along in the same request, and the next request starts early
            ok = await reader.tier.guarded(  # open breaker: this layer fails at once, without a wait
                lambda attempt: reader.read_counted(layer, tensor_bytes(contiguous), self._ahead, attempt),
                self._timeout,
            )
        except TierSkipped:
            raise PrefetchError(
                f"layer {layer} of {where} skipped: the tier's circuit breaker is open", chunk=index, layer=layer
            ) from None
        except TierTimeout:
            raise PrefetchError(f"layer {layer} of {where} timed out", chunk=index, layer=layer) from None
        if not ok:
            raise PrefetchError(
                f"layer {layer} of {where} could not be read (counted in the tier's stats)", chunk=index, layer=layer
            )
        if then is not None:
            with fence:
                copy_between(then, contiguous)


ChunkSource = DramChunk | FileChunk | RemoteChunk


class StreamChunks:
    """One stream's chunks, in the order of its keys, each of one source kind: from open to release."""

    def __init__(self, resources: StreamResources, keys: list[ChunkKey]) -> None:
        self._resources, self.keys = resources, keys
        self.sources: list[ChunkSource] = []  # filled by open, emptied by release

    def all_local(self) -> bool:
        """Every chunk from DRAM or a local tier (no remote one)."""
        return not any(isinstance(chunk, RemoteChunk) for chunk in self.sources)

    def any_files(self) -> bool:
        """Some chunk is read from a local tier."""
        return any(isinstance(chunk, FileChunk) for chunk in self.sources)

    async def open(self, ahead: int) -> None:
        """Per chunk: its DRAM slot (referenced), else the fastest tier's reader (each tier opens its batch at once).

        PrefetchError if a chunk is in no tier. ``ahead``: layers a remote request may fetch beyond the one asked.
        Failed or cancelled, what it holds is in ``sources`` still, for :meth:`release`.
        """
        resources, layout = self._resources, self._resources.layout
        slots = resources.pool.acquire_many(self.keys)  # hits told to the eviction policy tail first
        opened: list[ChunkSource | None] = [
            None if slot is None else DramChunk(key, slot, resources.pool.tensor(slot))
            for key, slot in zip(self.keys, slots, strict=True)
        ]
        try:
            resources.hooks.opened(self.keys, slots)
            missing = [index for index, chunk in enumerate(opened) if chunk is None]
            for tier in resources.tiers:
                if not missing:
                    return
                # Files are opened in one thread call that is not cancelled midway (that would leak their
                # descriptors); a remote tier's header reads are bounded by its timeout.
                timeout = None if tier.is_local else resources.read_timeout
                try:  # an open breaker skips the tier at once (TierSkipped, a TierTimeout)
                    readers = await tier.open_layers([self.keys[i] for i in missing], timeout)
                except TierTimeout:
                    continue
                for index, reader in zip(missing, readers, strict=True):
                    if reader is not None and reader.is_local:
                        opened[index] = FileChunk(self.keys[index], reader, layout)
                    elif reader is not None:
                        opened[index] = RemoteChunk(self.keys[index], reader, layout, ahead, resources.read_timeout)
                missing = [index for index in missing if opened[index] is None]
            if missing:
                raise PrefetchError(
                    f"chunk {missing[0]} ({self.keys[missing[0]][:16]}...) is in no tier", chunk=missing[0]
                )
        finally:
            self.sources = [chunk for chunk in opened if chunk is not None]

    def reserve_staging(self, kind: OutputKind) -> None:
        """A DRAM slot per chunk from a tier, where its layers are assembled for promotion.

        None past the store's staging share or with every slot referenced (see StagingShare): that chunk is
        read through a temporary and its promotion dropped (counted when promoted). None too for chunks read
        in place (``kind`` HOST_IN_PLACE, on a local tier): those are admitted to DRAM after the stream.
        """
        resources = self._resources
        for chunk in self.sources:
            if isinstance(chunk, FileChunk):
                chunk.in_place = kind is OutputKind.HOST_IN_PLACE
        for chunk in self.sources:
            if isinstance(chunk, TierChunk) and chunk.promoted:
                chunk.staging = resources.staging.take(resources.pool)
                if chunk.staging is None:
                    return  # the share is used up or no slot is free: the rest is dropped too
                chunk.staged = resources.pool.tensor(chunk.staging)

    def schedule(self, run: LayerRun, reads: RunReads) -> None:
        """Every chunk's reads of ``run`` into ``reads``."""
        for index, chunk in enumerate(self.sources):
            chunk.schedule(run, index, reads)

    def promote(self) -> None:
        """Every layer arrived: hand each chunk from a tier to the store (its slot, or None: dropped)."""
        hooks = self._resources.hooks
        for chunk in self.sources:
            if not isinstance(chunk, TierChunk):
                continue
            if chunk.promoted:  # a chunk stored lossy is written on in its codec (chunk_reads.LossyRead)
                codec = chunk.reader.header.codec
                hooks.promote(chunk.key, chunk.reader.tier, chunk.staging, None if codec.lossless else codec)
            else:
                hooks.admit(chunk.key, chunk.reader.tier)

    def release(self, last_copy: Completion) -> None:
        """Close the readers now; release the slots once ``last_copy`` (the last copy out of them) has completed."""
        chunks, self.sources = self.sources, []
        for chunk in chunks:
            if isinstance(chunk, TierChunk):
                chunk.reader.close()
        resources = self._resources

        def release() -> None:
            for chunk in chunks:
                if isinstance(chunk, DramChunk):
                    resources.pool.release(chunk.slot)
                elif chunk.staging is not None:
                    resources.staging.give_back(resources.pool, chunk.staging)

        resources.transfers.after(last_copy, release, asyncio.get_running_loop())
