"""How the tensor-parallel workers of one vLLM engine share one kvstore: rank 0 reads and writes, every rank scatters.

With tensor parallelism each worker holds a slice of the KV heads of every layer; kvstore's
chunks hold all heads in canonical order (``[layers, planes, tokens, heads, head_dim]``), so a
chunk written at TP=2 is the same object as one written at TP=1 or TP=8, and is reused across
TP degrees. The ranks cooperate over their TP group's CPU process group (gloo):

- **One store, on rank 0.** Only the first rank of the group opens a kvstore (its DRAM pool,
  disk, Redis, S3): one object per chunk on every tier, one DRAM pool per engine, one writer.
- **Saves**: each rank gathers its heads of a chunk from its paged cache; at the end of the step
  the ranks ``gather`` those slices to rank 0, which puts the canonical chunk.
- **Loads**: rank 0 streams the chunk layer by layer; for each layer it broadcasts a small status
  (loaded, or narrowed to its first chunks, or failed) and then ``scatter``\\ s each rank its
  heads. Every rank acts on the same status, so ranks never disagree about which blocks loaded:
  a failure on rank 0 is every rank's failure, reported for the same blocks.

The tensors exchanged are always CPU tensors on the CPU group, so the path the CPU tests run is
the path a GPU engine runs (its blocks are copied to and from the device by the paged layer, as
with one worker). Heads are split as vLLM splits them: rank ``r`` of ``n`` holds heads
``[r * H / n, (r + 1) * H / n)`` when ``H >= n``, else one head, ``r * H // n``, replicated
(an MLA latent, one "head", is replicated on every rank).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from kvstore.errors import ConfigError
from kvstore.layout import KVLayout


@dataclass(frozen=True)
class LoadStatus:
    """What rank 0 tells every rank about one layer of one load: the agreed outcome."""

    loaded: bool  # the layer's rows follow (a scatter); False: the load failed for good
    keys: int  # chunks still in the load (fewer than before: the chunks from a bad one on failed)
    blocks: int  # blocks still in the load


class TensorParallelRanks:
    """This worker's place in its TP group, and the collectives kvstore's connector needs.

    With one rank (no tensor parallelism) every method is a local no-op, and no process group is
    touched. All methods are blocking collectives: every rank of the group must call them in
    the same order with the same shapes, which the connector guarantees by driving them from
    the step's metadata (identical on every rank) and from agreed statuses only.
    """

    def __init__(self, rank: int = 0, size: int = 1, group: Any = None, first_global_rank: int = 0) -> None:
        if not 0 <= rank < size:
            raise ValueError(f"rank {rank} is not in a group of {size}")
        self.rank, self.size, self.group, self._src = rank, size, group, first_global_rank

    @classmethod
    def of_vllm_worker(cls) -> TensorParallelRanks:
        """The TP group of this vLLM worker (vLLM's distributed state is initialized before connectors)."""
        from vllm.distributed.parallel_state import get_tp_group

        tp = get_tp_group()
        if tp.world_size == 1:
            return cls()
        return cls(tp.rank_in_group, tp.world_size, tp.cpu_group, tp.first_rank)

    @property
    def is_reader(self) -> bool:
        """Whether this rank opens the store, streams loads and puts saves (the first rank only)."""
        return self.rank == 0

    def heads(self, total: int) -> slice:
        """The KV heads (of ``total``, in canonical order) this rank holds, as vLLM splits them."""
        if total >= self.size:
            if total % self.size:
                raise ConfigError(
                    f"{total} KV heads do not split evenly over tensor_parallel_size {self.size}; use a "
                    "tensor_parallel_size that divides the model's KV heads, or one they divide"
                )
            count = total // self.size
            return slice(self.rank * count, (self.rank + 1) * count)
        if self.size % total:
            raise ConfigError(
                f"tensor_parallel_size {self.size} is not a multiple of the model's {total} KV heads; use a "
                "tensor_parallel_size that divides the KV heads, or a multiple of them"
            )
        start = self.rank * total // self.size
        return slice(start, start + 1)

    def head_count(self, total: int) -> int:
        """How many of ``total`` KV heads this rank holds."""
        heads = self.heads(total)
        return heads.stop - heads.start

    def agree(self, status: LoadStatus | None) -> LoadStatus:
        """Rank 0's ``status`` on every rank (other ranks pass None)."""
        sent = None if status is None else [int(status.loaded), status.keys, status.blocks]
        loaded, keys, blocks = self.agree_states(sent, 3)
        return LoadStatus(bool(loaded), keys, blocks)

    def agree_states(self, states: list[int] | None, count: int) -> list[int]:
        """Rank 0's ``states`` (``count`` small integers) on every rank (other ranks pass None)."""
        if self.size == 1:
            assert states is not None
            return states
        message = torch.tensor(states if states is not None else [0] * count, dtype=torch.int64)
        torch.distributed.broadcast(message, src=self._src, group=self.group)
        return [int(value) for value in message]

    def scatter_heads(self, layer: torch.Tensor | None, layout: KVLayout, tokens: int) -> torch.Tensor:
        """This rank's heads of rank 0's ``layer`` (``[planes, tokens, heads, head_dim]`` of ``layout``).

        Other ranks pass ``layer=None``; each gets a new ``[planes, tokens, its heads, head_dim]``
        tensor. With one rank, ``layer`` itself (no copy).
        """
        if self.size == 1:
            assert layer is not None
            return layer
        out = torch.empty(
            (layout.kv_planes, tokens, self.head_count(layout.num_kv_heads), layout.head_dim), dtype=layout.dtype
        )
        parts = None
        if layer is not None:
            slices = [TensorParallelRanks(r, self.size).heads(layer.shape[2]) for r in range(self.size)]
            parts = [_bytes(layer[:, :, heads].contiguous()) for heads in slices]
        torch.distributed.scatter(_bytes(out), parts, src=self._src, group=self.group)
        return out

    def gather_heads(self, local: torch.Tensor, full: torch.Tensor | None) -> None:
        """Every rank's ``local`` slices (``[..., heads of the rank, head_dim]``) into rank 0's ``full``.

        ``local`` is contiguous; ``full`` (rank 0 only, else None) has all heads in the
        second-to-last dimension. Replicated heads arrive from several ranks: the copies are equal.
        """
        if self.size == 1:
            assert full is not None
            full.copy_(local)
            return
        parts = [torch.empty_like(_bytes(local)) for _ in range(self.size)] if full is not None else None
        torch.distributed.gather(_bytes(local), parts, dst=self._src, group=self.group)
        if full is not None and parts is not None:
            total = full.shape[-2]
            for r, part in enumerate(parts):
                heads = TensorParallelRanks(r, self.size).heads(total)
                full[..., heads, :] = part.view(local.dtype).view(local.shape)


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's bytes as uint8 (gloo moves bytes of any dtype: bfloat16, fp8)."""
    return tensor.view(torch.uint8)
