"""Test-only: vLLM's native tiered KV offloading on vLLM's CPU build.

vLLM's ``CPUOffloadingSpec.get_worker`` (inherited by ``TieringOffloadingSpec``) refuses the
CPU platform ("CPU Offloading is currently only supported on CUDA-alike and XPU GPUs", in
vllm/v1/kv_offload/cpu/spec.py), and its ``CPUOffloadingWorker`` copies with CUDA streams and
events. On the CPU platform the engine's paged KV cache is itself a CPU tensor, so this spec
replaces only that worker: ``SyncCPUOffloadingWorker`` does the same copies (engine blocks <->
the primary tier's shared buffer, in the same byte layout) synchronously with torch. Everything
on the scheduler side, vLLM's CPU primary tier and the secondary tiers (kvstore's among them),
is vLLM's own unmodified code. Load it with (this folder on sys.path):

    {"spec_name": "CPUTestTieringOffloadingSpec", "spec_module_path": "cpu_offload_spec", ...}
"""

from __future__ import annotations

import time

import torch
from vllm.v1.kv_offload.base import (
    CanonicalKVCaches,
    GPULoadStoreSpec,
    LoadStoreSpec,
    OffloadingWorker,
    TransferResult,
)
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec
from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec


class SyncCPUOffloadingWorker(OffloadingWorker):
    """vLLM's ``CPUOffloadingWorker`` without CUDA: each job is copied before submit returns.

    Layouts, as vLLM's worker (vllm/v1/kv_offload/cpu/gpu_worker.py) lays them out:

    - direct (the default): for each engine KV tensor (one per attention layer on CPU), a
      primary row holds ``blocks_per_chunk`` consecutive engine pages of it, in this worker's
      own slot of the row (rank-major: every rank's slot follows the one before, see
      ``SharedOffloadRegion.create_next_worker_view``).
    - canonical (``canonical_layout: true``): every rank writes its bytes of one shared
      canonical page per engine block (all KV heads, the TP-1 page), placed by the page
      mapping vLLM derived for its layer (``CanonicalKVCacheRef.mapping``: runs of
      fragments); ranks that hold the same bytes take turns (``is_writer``), as in
      ``SingleDirectionOffloadingHandler._fill_canonical_ops``.
    """

    def __init__(
        self,
        kv_caches: CanonicalKVCaches,
        blocks_per_chunk: int,
        region: SharedOffloadRegion,
        canonical_layout: bool = False,
    ) -> None:
        self._region: SharedOffloadRegion | None = region
        self._blocks_per_chunk = blocks_per_chunk
        self._refs = kv_caches.group_data_refs
        self._canonical = canonical_layout
        host_page_bytes = [cache.page_size_bytes for cache in kv_caches.tensors]
        if canonical_layout:  # the largest canonical page of the layers sharing a tensor
            host_page_bytes = [0] * len(kv_caches.tensors)
            for ref in (ref for refs in self._refs for ref in refs):
                assert ref.mapping is not None, "canonical_layout needs a page mapping for every layer"
                host_page_bytes[ref.tensor_idx] = max(
                    host_page_bytes[ref.tensor_idx], ref.mapping.canonical_page_size_bytes
                )
        self._host_page_bytes = host_page_bytes
        self._engine: list[torch.Tensor] = []
        self._host: list[torch.Tensor] = []
        for cache, page in zip(kv_caches.tensors, host_page_bytes, strict=True):
            engine = cache.tensor
            assert engine.device.type == "cpu" and engine.dtype == torch.int8 and engine.ndim == 2, engine
            assert engine.shape[1] == cache.page_size_bytes
            self._engine.append(engine)
            if canonical_layout:
                self._host.append(region.create_next_canonical_view(page * blocks_per_chunk))
            else:
                self._host.append(region.create_next_worker_view(page * blocks_per_chunk))
        self._finished: list[TransferResult] = []

    def _transfer(self, engine_spec: GPULoadStoreSpec, host_spec: LoadStoreSpec, to_host: bool) -> int:
        assert isinstance(host_spec, CPULoadStoreSpec), type(host_spec)
        per_chunk = self._blocks_per_chunk
        block_ids, chunk_ids = engine_spec.block_ids, host_spec.block_ids
        block_at = chunk_at = copied = 0
        for group, (size, first_index) in enumerate(
            zip(engine_spec.group_sizes, engine_spec.block_indices, strict=True)
        ):
            if size == 0:
                continue
            skip = first_index % per_chunk  # the first chunk may be covered only from this block on
            n_chunks = -(-(size + skip) // per_chunk)
            blocks = block_ids[block_at : block_at + size]
            chunks = chunk_ids[chunk_at : chunk_at + n_chunks]
            block_at, chunk_at = block_at + size, chunk_at + n_chunks
            slots = [(int(chunk), j) for chunk in chunks for j in range(per_chunk)][skip : skip + size]
            for ref in self._refs[group]:
                engine, host = self._engine[ref.tensor_idx], self._host[ref.tensor_idx]
                page = self._host_page_bytes[ref.tensor_idx]
                for block, (chunk, j) in zip(blocks, slots, strict=True):
                    host_page, engine_page = host[chunk, j * page : (j + 1) * page], engine[int(block)]
                    if not self._canonical:
                        pieces = [(ref.page_size_bytes, 0, 0)]
                    else:  # (size, offset in the engine page, offset in the canonical page)
                        mapping = ref.mapping
                        if to_host and not mapping.is_writer(chunk * per_chunk + j):
                            continue  # another rank holding these bytes writes this page
                        pieces = [
                            (run.fragment_size, run.local_offset + i * run.local_stride,
                             run.canonical_offset + i * run.canonical_stride)
                            for run in mapping.runs
                            for i in range(run.num_fragments)
                        ]  # fmt: skip
                    for n, local, canonical in pieces:
                        host_bytes, engine_bytes = host_page[canonical : canonical + n], engine_page[local : local + n]
                        (host_bytes if to_host else engine_bytes).copy_(engine_bytes if to_host else host_bytes)
                        copied += n
        assert block_at == len(block_ids) and chunk_at == len(chunk_ids), (block_at, chunk_at)
        return copied

    def submit_store(self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec) -> bool:
        started = time.perf_counter()
        copied = self._transfer(src_spec, dst_spec, to_host=True)
        self._finished.append(TransferResult(job_id, True, copied, time.perf_counter() - started))
        return True

    def submit_load(self, job_id: int, src_spec: LoadStoreSpec, dst_spec: GPULoadStoreSpec) -> bool:
        started = time.perf_counter()
        copied = self._transfer(dst_spec, src_spec, to_host=False)
        self._finished.append(TransferResult(job_id, True, copied, time.perf_counter() - started))
        return True

    def get_finished(self) -> list[TransferResult]:
        finished, self._finished = self._finished, []
        return finished

    def wait(self, job_ids: set[int]) -> None:
        return  # every job completed inside its submit call

    def shutdown(self) -> None:
        self._host.clear()
        self._engine.clear()
        if self._region is not None:
            self._region.cleanup()
            self._region = None


class CPUTestTieringOffloadingSpec(TieringOffloadingSpec):
    """``TieringOffloadingSpec`` whose worker runs on the CPU platform (tests only)."""

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if self._worker is None:
            self._worker = self.create_worker(kv_caches)
        return self._worker

    def create_worker(self, kv_caches: CanonicalKVCaches) -> SyncCPUOffloadingWorker:
        """As ``TieringOffloadingSpec.create_worker``: this rank's view of the shared region."""
        rank = 0 if self.replicated_layout else self.config.parallel.rank
        region = SharedOffloadRegion(
            engine_id=self._engine_id,
            num_chunks=self.num_chunks,
            rank=rank,
            kv_bytes_per_chunk=self.kv_bytes_per_chunk,
            cpu_page_size=self.cpu_page_size_per_worker,
        )
        try:
            if self.config.canonical_layout:
                self._validate_canonical_refs(kv_caches)  # vLLM's own check: fails closed
            return SyncCPUOffloadingWorker(kv_caches, self.blocks_per_chunk, region, self.config.canonical_layout)
        except Exception:
            region.cleanup()
            raise
