"""``kvstore bench --device cpu|cuda``: the paths between the store and an engine's memory, against raw copies.

Every kvstore figure goes through the public API (``put`` + ``flush``, ``get_many(keys, outs)``,
``prefetch(keys, outs=...)``) and is printed beside a baseline that moves the same bytes in the
same run, best of ``repeats``, alternating:

- on ``cuda``: pinned host to device ``copy_(non_blocking=True)`` (H2D) and device to pinned (D2H),
  the bus's ceiling; chunks and outputs on the device, a ``torch.cuda.synchronize()`` before each clock read;
- on ``cpu``: ``Tensor.copy_`` of the same bytes into pre-allocated, pre-touched memory (a memcpy, and for
  streams a gather of each chunk's layer into place), with torch's intra-op threads;
- a layer stream from disk is also compared with ``get_many`` from disk into the same memory (page
  cache warm): both read the same files, so the ratio is the stream's own overhead;
- on ``cpu``, kvstore's two copy kernels themselves, one thread each (glibc's ``memmove`` through
  ``numpy.copyto``, and numpy's own vector loop: :mod:`kvstore.util.copy_kernels`, which picks one per
  block size) against ``Tensor.copy_`` (torch's vector loop, the baselines'), for whole chunks and for a
  chunk's layer: where glibc's way of copying is the slower on a CPU, these rows show it.

The layer stream's outputs are what an engine hands it: one tensor per layer,
``[planes, n * chunk_tokens, heads, head_dim]``, pre-allocated on the device; it runs
:data:`ENGINE_DEPTH` layers ahead, as the vLLM connector's streams do (a stream allowed to run
every layer ahead hid what a run of few layers in flight costs: 0.94x of ``get_many`` from disk
at depth 32, 0.54x at depth 4, before the runs in flight shared the read threads).
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path

import numpy as np
import torch

from kvstore.bench.local import LAYOUTS, Row, _best_pair, _sample_chunks
from kvstore.bench.machine import torch_threads_set
from kvstore.config import StoreConfig
from kvstore.engine.store import KVStore
from kvstore.keys import chunk_keys
from kvstore.util.copy_kernels import copy_memmove, copy_vector_loop

ENGINE_DEPTH = 4  # layers a stream runs ahead: the vLLM connector's default (kvstore_prefetch_depth)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


async def bench_paths(
    device: str = "cpu",
    layout_name: str = "Llama-3-8B",
    chunks: int = 16,
    repeats: int = 3,
    directory: Path | None = None,
) -> list[Row]:
    """The rows for ``device``: puts, ``get_many`` and layer streams from DRAM and disk, each beside its baseline."""
    target_device = torch.device(device)
    if target_device.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("--device cuda: torch.cuda.is_available() is False here")
    layout = LAYOUTS[layout_name]
    pinned = target_device.type == "cuda"
    hosts = [chunk.pin_memory() if pinned else chunk for chunk in _sample_chunks(layout, chunks, seed=3)]
    sources = [chunk.to(target_device) for chunk in hosts]  # what an engine would put
    outs = [torch.zeros_like(chunk, device=target_device) for chunk in hosts]  # get_many's targets
    shape = (layout.kv_planes, chunks * layout.chunk_tokens, layout.num_kv_heads, layout.head_dim)
    layer_outs = [torch.zeros(shape, dtype=layout.dtype, device=target_device) for _ in range(layout.num_layers)]
    landing = [torch.empty_like(chunk, pin_memory=pinned) for chunk in hosts]  # the raw D2H baseline's targets
    total = chunks * layout.chunk_nbytes
    keys = [k for i in range(chunks) for k in chunk_keys([i] * layout.chunk_tokens, layout, f"bench-{layout_name}")]

    def timed(work: Callable[[], None]) -> Callable[[], Awaitable[float]]:
        async def run() -> float:
            _sync(target_device)
            start = time.perf_counter()
            work()
            _sync(target_device)
            return time.perf_counter() - start

        return run

    raw_in = timed(lambda: _copy_all(outs, hosts))  # host to device (or memcpy)
    # the stream's baseline: the bus on a GPU; on the CPU a plain gather of each layer of each chunk into place
    gather = timed(lambda: _gather(layer_outs, hosts)) if not pinned else raw_in
    # the stream's copy pattern alone, no kvstore: one copy per chunk and layer (1 MiB for Llama-3-8B)
    pieces = [torch.empty_like(hosts[0][0], device=target_device) for _ in range(chunks)]
    raw_pieces = timed(
        lambda: [_copy_all(pieces, [host[layer] for host in hosts]) for layer in range(layout.num_layers)]
    )
    raw_out = timed(lambda: _copy_all(landing, sources))  # device to host
    raw_label = "pinned copy_(non_blocking) H2D" if pinned else "memcpy"
    rows: list[Row] = []
    capacity = (2 * chunks + 2) * layout.chunk_nbytes  # the chunks, and a stream's staging share
    with tempfile.TemporaryDirectory(prefix="kvstore-bench-device-", dir=directory) as scratch:
        for tier in ("dram", "disk"):  # DRAM rows on a DRAM-only store: no cascade in a put's flush
            disk = {"path": Path(scratch) / "tier", "capacity": 1 << 50} if tier == "disk" else {"enabled": False}
            config = StoreConfig(dram={"capacity": capacity}, disk=disk)
            async with KVStore(config, layout, namespace=f"bench-{layout_name}") as store:

                async def clear(store: KVStore = store) -> None:
                    await store.flush()  # promotions, admissions and writes of the last round: outside the timings
                    for key in keys:
                        store.pool.discard(key)

                async def put_flush(store: KVStore = store) -> float:
                    await clear()
                    _sync(target_device)
                    start = time.perf_counter()
                    accepted = await store.put_many(keys, sources)
                    await store.flush()
                    elapsed = time.perf_counter() - start
                    if not all(accepted):
                        raise RuntimeError("DRAM refused a put during the benchmark")
                    return elapsed

                async def get_many(store: KVStore = store) -> float:
                    _sync(target_device)
                    start = time.perf_counter()
                    results = await store.get_many(keys, outs)
                    _sync(target_device)
                    if any(result is None for result in results):
                        raise RuntimeError("a chunk went missing during the benchmark")
                    return time.perf_counter() - start

                async def stream(store: KVStore = store) -> float:
                    _sync(target_device)
                    start = time.perf_counter()
                    async with store.prefetch(keys, depth=ENGINE_DEPTH, outs=layer_outs) as layers:
                        async for _ in layers:
                            pass
                    _sync(target_device)
                    return time.perf_counter() - start

                def from_disk(read: Callable[[], Awaitable[float]]) -> Callable[[], Awaitable[float]]:
                    async def run() -> float:
                        await clear()  # DRAM emptied: every chunk comes from the disk tier (files in the page cache)
                        return await read()

                    return run

                base, mine = await _best_pair(raw_out, put_flush, repeats)
                if tier == "dram":
                    put_label = "put from the device + flush, DRAM" if pinned else "put + flush, DRAM"
                    rows.append(Row(layout_name, put_label, total, mine, base, _d2h_label(pinned)))
                    base, mine = await _best_pair(raw_in, get_many, repeats)
                    rows.append(Row(layout_name, "get_many -> outs, DRAM", total, mine, base, raw_label))
                    _check_chunks(outs, hosts)
                    base, mine = await _best_pair(gather, stream, repeats)
                    label = raw_label if pinned else "gather"
                    rows.append(Row(layout_name, "stream DRAM -> outs", total, mine, base, label))
                    if pinned:  # what the copy pattern alone costs: the part of the stream's gap that is the bus's
                        base, mine = await _best_pair(raw_in, raw_pieces, repeats)
                        rows.append(Row(layout_name, "raw H2D, a copy per chunk-layer", total, mine, base, raw_label))
                    _check_layers(layer_outs, hosts)
                    continue
                disk_get, disk_stream = from_disk(get_many), from_disk(stream)
                await disk_get()  # the files are in the page cache from here on (warm)
                base, mine = await _best_pair(raw_in, disk_get, repeats)
                rows.append(Row(layout_name, "get_many -> outs, disk (warm)", total, mine, base, raw_label))
                base, mine = await _best_pair(disk_get, disk_stream, repeats)
                label = "get_many -> outs, disk (warm)"
                rows.append(Row(layout_name, "stream disk -> outs (warm)", total, mine, base, label))
                _check_layers(layer_outs, hosts)
    if not pinned:
        rows += await _copy_kernel_rows(layout_name, outs, hosts, layer_outs, repeats)
    return rows


async def _copy_kernel_rows(
    layout_name: str,
    outs: Sequence[torch.Tensor],
    hosts: Sequence[torch.Tensor],
    layer_outs: Sequence[torch.Tensor],
    repeats: int,
) -> list[Row]:
    """Each of kvstore's copy kernels (:mod:`kvstore.util.copy_kernels`: glibc's memmove, numpy's vector loop)
    against ``Tensor.copy_``, one thread each, on whole chunks and on a chunk's layer (a stream's piece)."""
    total = sum(host.numel() * host.element_size() for host in hosts)
    chunks = list(zip(outs, hosts, strict=True))
    tokens = hosts[0].shape[2]
    pieces = [  # (a chunk's layer in its layer output, that layer of the chunk)
        (out[:, index * tokens : (index + 1) * tokens], host[layer])
        for layer, out in enumerate(layer_outs)
        for index, host in enumerate(hosts)
    ]

    def copy_with(
        kernel: Callable[[np.ndarray, np.ndarray], None], pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]
    ) -> Callable[[], Awaitable[float]]:
        arrays = [(_array(target), _array(source)) for target, source in pairs]

        async def run() -> float:
            start = time.perf_counter()
            for target, source in arrays:
                kernel(target, source)
            return time.perf_counter() - start

        return run

    def torch_copy(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> Callable[[], Awaitable[float]]:
        async def run() -> float:
            start = time.perf_counter()
            for target, source in pairs:
                target.copy_(source)
            return time.perf_counter() - start

        return run

    for target in (*outs, *layer_outs):  # the checks below then see what the kernels copied, not earlier rows'
        target.zero_()
    rows: list[Row] = []
    with torch_threads_set(1):
        for name, kernel in (("memmove", copy_memmove), ("vector loop", copy_vector_loop)):
            for what, pairs in (("whole chunks", chunks), ("chunk layers", pieces)):
                base, mine = await _best_pair(torch_copy(pairs), copy_with(kernel, pairs), repeats)
                rows.append(Row(layout_name, f"{name}, {what}", total, mine, base, "Tensor.copy_, 1 thread"))
    _check_chunks(outs, hosts)
    _check_layers(layer_outs, hosts)
    return rows


def _array(tensor: torch.Tensor) -> np.ndarray:
    """A CPU tensor's bytes as a numpy array (its last dimension in bytes): numpy has no bfloat16."""
    return tensor.view(torch.uint8).numpy()


def _d2h_label(pinned: bool) -> str:
    return "device to pinned copy_(non_blocking) D2H" if pinned else "memcpy"


def _copy_all(targets: Sequence[torch.Tensor], sources: Sequence[torch.Tensor]) -> None:
    """The raw baseline: each source into its pre-allocated target (asynchronous across the bus)."""
    for target, source in zip(targets, sources, strict=True):
        target.copy_(source, non_blocking=True)


def _gather(layer_outs: Sequence[torch.Tensor], hosts: Sequence[torch.Tensor]) -> None:
    """Each layer of each chunk into its place in the layer outputs, as an engine would: ``Tensor.copy_``, with
    torch's intra-op threads (``--torch-threads``)."""
    tokens = hosts[0].shape[2]
    for layer, out in enumerate(layer_outs):
        for index, host in enumerate(hosts):
            out[:, index * tokens : (index + 1) * tokens].copy_(host[layer])


def _check_chunks(outs: Sequence[torch.Tensor], hosts: Sequence[torch.Tensor]) -> None:
    for out, host in zip(outs, hosts, strict=True):
        if not torch.equal(out.cpu(), host):
            raise RuntimeError("a chunk came back changed")


def _check_layers(layer_outs: Sequence[torch.Tensor], hosts: Sequence[torch.Tensor]) -> None:
    """Every layer of every chunk, bit for bit, where the stream put it."""
    tokens = hosts[0].shape[2]
    for layer, out in enumerate(layer_outs):
        got = out.cpu()
        for index, host in enumerate(hosts):
            if not torch.equal(got[:, index * tokens : (index + 1) * tokens], host[layer]):
                raise RuntimeError(f"layer {layer} of chunk {index} came back changed")
