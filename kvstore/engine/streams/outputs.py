"""Where a layer stream's layers land: the caller's ``outs`` (or tensors of the stream's own), of one kind.

The kind is decided once, when the stream opens (:func:`output_kind`), and everything that depends on it
reads it from there:

- ``DEVICE``: CUDA outputs (or CPU ones a test treats as device memory). Each chunk's run of layers is
  gathered in host memory first (its DRAM slot as it is, else its staging slot or a temporary), then
  crosses the bus as queued copies on the store's upload stream (:meth:`LayerOutputs.upload`); a layer's
  :class:`~kvstore.engine.transfer.Completion` is what its consumer waits on.
- ``HOST_IN_PLACE``: CPU outputs whose planes are contiguous. A chunk on a local tier is read straight
  into its share of them (no staging copy); the others are copied or read through memory of their own.
- ``HOST``: any other CPU outputs (strided), or none given (tensors of the stream's own): every chunk's
  layer is copied into its share, from its DRAM slot or from where it was read (a staging slot, else
  a temporary).

:class:`LayerOutputs` also holds the :class:`~kvstore.util.threads.WriteFence` over the caller's outputs:
every write into them (a copy, a file read in place, the queuing of device copies) is made under it, and
:meth:`LayerOutputs.close` ends them all. No I/O here; ``close`` is the only wait.
"""

from __future__ import annotations

import asyncio
import enum
from collections.abc import Sequence

import torch

from kvstore.engine.transfer import DONE, Completion, DeviceTransfers, UploadScratch
from kvstore.layout import KVLayout
from kvstore.util.buffers import tensor_bytes
from kvstore.util.threads import WriteFence, wait_through_cancel


class OutputKind(enum.Enum):
    """What a stream's outputs are, and so how every chunk's layers get into them (see the module)."""

    DEVICE = "device"
    HOST_IN_PLACE = "host, contiguous planes"
    HOST = "host"


def output_kind(outs: Sequence[torch.Tensor] | None, transfers: DeviceTransfers) -> OutputKind:
    """The kind of ``outs`` (checked alike already: one device, one shape): decided once per stream."""
    if not outs:
        return OutputKind.HOST  # tensors of the stream's own: its chunks are staged, to be promoted
    if transfers.crosses_bus(outs[0]):
        return OutputKind.DEVICE
    return OutputKind.HOST_IN_PLACE if all(out.is_contiguous() for out in outs) else OutputKind.HOST


class LayerRun:
    """Layers ``first`` to ``first + count - 1`` being fetched: the tensor each lands in, and each chunk's share.

    Made by :meth:`LayerOutputs.run` and filled in by the chunks (``hosts``, on the loop), whose reads then
    write the tensors it hands out (in worker threads and on the loop); for device outputs it is then
    handed to :meth:`LayerOutputs.upload`. Its own fields are touched on the loop only.
    """

    def __init__(
        self, kind: OutputKind, first: int, layers: list[torch.Tensor], chunks: int, tokens: int, fence: WriteFence
    ) -> None:
        self.kind, self.first, self.layers, self.fence = kind, first, layers, fence
        self._chunks, self._tokens = chunks, tokens
        # DEVICE: per chunk, its layers of the run in host memory, [count, *layer_shape] (set by the chunk)
        self.hosts: list[torch.Tensor | None] = [None] * chunks
        self._parts: dict[int, list[list[memoryview]]] = {}  # HOST_IN_PLACE: per layer, each chunk's planes

    @property
    def count(self) -> int:
        return len(self.layers)

    def share(self, chunk: int, j: int) -> torch.Tensor:
        """Chunk ``chunk``'s share of layer ``first + j`` in its output (host kinds: a strided view)."""
        return self.layers[j][:, chunk * self._tokens : (chunk + 1) * self._tokens]

    def planes(self, chunk: int, j: int) -> list[memoryview]:
        """``share`` as bytes, one contiguous run per plane, for a read straight into it (HOST_IN_PLACE only)."""
        assert self.kind is OutputKind.HOST_IN_PLACE
        if j not in self._parts:  # one byte view of the layer, sliced: a chunk's share of a plane is contiguous
            whole = tensor_bytes(self.layers[j])
            planes = self.layers[j].shape[0]
            plane = len(whole) // planes
            width = plane // self._chunks
            self._parts[j] = [
                [whole[p * plane + i * width : p * plane + (i + 1) * width] for p in range(planes)]
                for i in range(self._chunks)
            ]
        return self._parts[j][chunk]

    def complete_before(self, layer: int) -> list[torch.Tensor]:
        """The layers of the run before ``layer``, complete in their outputs (DEVICE: none, nothing was queued)."""
        return [] if self.kind is OutputKind.DEVICE else self.layers[: max(0, layer - self.first)]


class LayerOutputs:
    """The tensors a stream's layers land in, their kind, and the fence over them.

    ``outs``: one tensor per layer, or a ring of fewer (layer i in ``outs[i % len(outs)]``); None: a
    fresh tensor per layer. Owned by one stream, used on its loop; device copies are queued from there.
    """

    def __init__(
        self,
        outs: Sequence[torch.Tensor] | None,
        shape: tuple[int, ...],
        layout: KVLayout,
        transfers: DeviceTransfers,
        ready: Completion | None,
    ) -> None:
        """Checks ``outs`` (ValueError): ``layout.num_layers`` or fewer tensors of ``shape`` on one CPU or CUDA
        device. ``ready``: with device outputs, the consumer's stream when it handed them over (its work may
        still read that memory): the copies into them wait for it."""
        if outs is not None:
            check_outputs(outs, shape, layout)
        self.kind = output_kind(outs, transfers)
        self._outs, self._shape, self._layout, self._transfers = outs, shape, layout, transfers
        # Fewer outputs than layers: a ring, layer i lands in outs[i % ring] once layer i - ring is released.
        self.ring = len(outs) if outs is not None and len(outs) < layout.num_layers else 0
        self.fence = WriteFence()  # over the caller's outs: every write into them is made under it (see close)
        self.last_copy = DONE  # the latest device copy queued: the slots copied from are held until it is done
        self._ready = ready
        self._scratch: UploadScratch | None = None  # device staging of runs of layers (upload_layers)

    def run(self, first: int, count: int, chunks: int) -> LayerRun:
        """Layers ``first`` to ``first + count - 1`` of ``chunks`` chunks: the tensors they land in."""
        if self._outs is not None:
            layers = [self._outs[i % len(self._outs)] for i in range(first, first + count)]
        else:
            layers = [torch.empty(self._shape, dtype=self._layout.dtype) for _ in range(count)]
        return LayerRun(self.kind, first, layers, chunks, self._layout.chunk_tokens, self.fence)

    def upload(self, run: LayerRun, longest: int, before: list[Completion]) -> list[Completion]:
        """DEVICE: queue the copies of ``run``'s host memory into its outputs, on the loop; one completion per layer.

        On the loop: a copy's launch costs microseconds (a thread hop per layer left the bus idle between
        layers: 0.47x of raw H2D on an H100). ``longest``: the most layers a run has (the device scratch's
        size); ``before[j]``: what must end before layer j's buffer is written (a ring's last reader).
        """
        hosts = [host for host in run.hosts if host is not None]
        assert len(hosts) == len(run.hosts), "every chunk's layers are in host memory before they cross the bus"
        if self._scratch is None:  # once per stream, reused by every run of layers (one stream, in order)
            self._scratch = self._transfers.scratch_for(run.layers[0], len(hosts), longest, self._ready)
        with self.fence:  # closed: no copy into outs is queued any more
            completions = self._transfers.upload_layers(run.layers, hosts, self._scratch, before)
        self.last_copy = completions[-1]  # one stream: it completes after every earlier copy
        return completions

    async def close(self) -> bool:
        """Return once nothing writes into the outputs any more, and no write will start; True if cancelled meanwhile.

        Closes the fence (waits for the writes in progress: a copy, one run of layers read from a file),
        then for the device copies already queued. A cancellation meanwhile does not cut either wait
        short: it is reported (True) for the caller to raise once its own clean-up is done.
        """
        cancelled = False
        try:
            await self.fence.close()  # no write into outs is in progress, and none will start
        except asyncio.CancelledError:  # (raised once the writes in progress have ended)
            cancelled = True
        copies = self._transfers.completed(self.last_copy)  # the copies to a device already queued
        if await wait_through_cancel(copies):
            cancelled = True
        if copies.done() and not copies.cancelled():
            copies.exception()  # retrieved: a device error was logged where it happened
        return cancelled


def check_outputs(outs: Sequence[torch.Tensor], shape: tuple[int, ...], layout: KVLayout) -> None:
    """ValueError unless ``outs`` are 1 to ``num_layers`` tensors of ``shape`` and the layout's dtype, on one
    CPU or CUDA device."""
    if not 1 <= len(outs) <= layout.num_layers:
        raise ValueError(
            f"prefetch: {layout.num_layers} layers but {len(outs)} output tensors "
            f"(one per layer, or from 1 to {layout.num_layers - 1} used in turn: see LayerStream)"
        )
    for out in outs:
        if tuple(out.shape) != shape or out.dtype != layout.dtype:
            raise ValueError(f"prefetch outputs must be {layout.dtype} tensors of shape {shape}")
        if out.device != outs[0].device or out.device.type not in ("cpu", "cuda"):
            raise ValueError(
                f"prefetch outputs must all be on one CPU or CUDA device, got {out.device} and {outs[0].device}"
            )
