"""Which tokens of a chunk each group of attention layers needs: full attention all, a sliding window its tail.

Hybrid models (Gemma-2/3, gpt-oss, Qwen3.5) mix full-attention layers with sliding-window
layers. An engine with a hybrid KV cache manager (vLLM's) keeps, for a sliding-window layer,
only the blocks inside the window: the token after a prefix of ``N`` tokens attends to tokens
``[N - W + 1, N)``, and every block wholly before that is freed (a "null" block in the request's
block table). kvstore still stores one object per chunk, holding every layer (the canonical
layout, the same as with one group), so a stored prefix is either whole for every group or a
miss; this module says which rows of which chunk a sliding layer really has and needs:

- **To resume after ``N`` tokens** a sliding layer needs the tokens from
  :meth:`AttentionGroup.first_needed_token` on (whole blocks: a block partly in the window is kept
  whole, its earlier tokens masked).
- **Chunk j** (tokens ``[jC, (j + 1)C)``) is the last chunk of the prefix ending at ``(j + 1)C``
  and an earlier chunk of longer ones; the earliest of its rows any of them needs is
  :meth:`AttentionGroup.first_stored_row`. Rows before it are stored as zeros: no prefix ending on
  a chunk boundary after chunk j ever attends them.
- **While a request runs**, the engine frees a sliding layer's out-of-window blocks at each
  step and may hand them to another request at once: a block of the request's table is only
  still its own from :meth:`AttentionGroup.first_live_block` on.

All arithmetic, no engine: the vLLM connector builds :class:`AttentionGroup`\\ s from vLLM's KV
cache groups (``kvstore.connectors.vllm.engine_config``).
"""

from __future__ import annotations

from dataclasses import dataclass

NULL_BLOCK = 0  # vLLM's placeholder for a block the request does not hold (out of window, or not cached)


@dataclass(frozen=True)
class AttentionGroup:
    """One KV cache group of an engine: its layers (indices into a chunk's layers) and their attention span.

    ``window`` is None for full attention; for a sliding window of ``W`` tokens, the token at
    position ``n`` attends to ``[n - W + 1, n]``, and the engine keeps ``extra`` tokens more.
    """

    index: int  # the engine's group id (the position of its block ids in a request's block tables)
    layers: tuple[int, ...]
    block_size: int
    window: int | None = None
    extra: int = 0

    @property
    def sliding(self) -> bool:
        return self.window is not None

    def skipped_tokens(self, tokens: int) -> int:
        """Tokens before the window of the token after ``tokens`` (vLLM's ``get_num_skipped_tokens``)."""
        if self.window is None:
            return 0
        return max(0, tokens - self.window + 1 - self.extra)

    def first_needed_token(self, tokens: int) -> int:
        """The first token whose KV this group holds to go on after ``tokens`` tokens (a block boundary)."""
        return self.skipped_tokens(tokens) // self.block_size * self.block_size

    def first_stored_row(self, chunk: int, chunk_tokens: int) -> int:
        """The first row of chunk ``chunk`` this group stores (and any prefix ending after it may need).

        Relative to the chunk's start: 0 for full attention, and for a window at least as long
        as a chunk; rows before it are zeros in the stored chunk.
        """
        start = chunk * chunk_tokens
        return max(start, self.first_needed_token(start + chunk_tokens)) - start

    def first_live_block(self, computed_tokens: int) -> int:
        """The first block of a request's table still its own while it computes past ``computed_tokens``.

        The engine frees the blocks before the window of the tokens computed so far (at the
        start of each step): those table entries may name blocks now holding other tokens.
        """
        return self.skipped_tokens(computed_tokens) // self.block_size

    def partial_rows(self, chunk_tokens: int) -> bool:
        """Whether some chunk of this group stores fewer than all its rows (a window shorter than a chunk)."""
        return any(self.first_stored_row(chunk, chunk_tokens) for chunk in range(2))


def saved_blocks(
    group: AttentionGroup, table: list[int], chunk: int, chunk_tokens: int, computed_tokens: int
) -> tuple[int, list[int]] | None:
    """The blocks of ``table`` holding what ``group`` stores of chunk ``chunk``: (first row, block ids).

    None when some of them are gone: not in the table yet, a null block (the engine never held
    them for this request: a prefix it had cached itself), or freed since the request computed
    past ``computed_tokens`` (the id may now name another request's block). Such a chunk cannot
    be saved whole, and is not saved.
    """
    first_row = group.first_stored_row(chunk, chunk_tokens)
    first = (chunk * chunk_tokens + first_row) // group.block_size
    end = (chunk + 1) * chunk_tokens // group.block_size
    blocks = table[first:end]
    if len(blocks) != end - first or NULL_BLOCK in blocks or first < group.first_live_block(computed_tokens):
        return None
    return first_row, blocks


def loaded_blocks(group: AttentionGroup, table: list[int], start: int, end: int) -> tuple[int, list[int]]:
    """Where a load of tokens ``[start, end)`` goes in ``group``: (first token, block ids), from ``table``.

    The engine allocated real blocks for the tokens the group needs after ``end`` and null
    blocks before them; the load fills exactly the real ones, which must be one run ending at
    ``end``. Raises ValueError if the table is not of that shape (a load must not guess).
    """
    first, last = start // group.block_size, end // group.block_size
    blocks = table[first:last]
    if len(blocks) != last - first:
        raise ValueError(f"group {group.index}'s block table has {len(table)} blocks, the load needs {last}")
    real = next((i for i, block in enumerate(blocks) if block != NULL_BLOCK), len(blocks))
    if NULL_BLOCK in blocks[real:]:
        raise ValueError(f"group {group.index}'s blocks for tokens {start}-{end} have a null block after a real one")
    needed = max(start, group.first_needed_token(end)) // group.block_size - first
    if real != needed:  # fewer blocks than the window needs, or blocks whose rows may be stored as zeros
        raise ValueError(f"group {group.index} holds blocks from {first + real}, the window needs {first + needed}")
    return (first + real) * group.block_size, blocks[real:]
