"""kvstore.connectors.attention_groups: which rows and blocks of a chunk a sliding-window group stores and loads.

The block tables below are those real vLLM 0.32 gave a Gemma-3-style model (window 256, blocks of
128 tokens) with its hybrid KV cache manager: 0 is vLLM's null block.
"""

from __future__ import annotations

import pytest

from kvstore.connectors.attention_groups import AttentionGroup, loaded_blocks, saved_blocks

FULL = AttentionGroup(index=1, layers=(1, 3), block_size=128)
SLIDING = AttentionGroup(index=0, layers=(0, 2), block_size=128, window=256)


def test_full_attention_needs_every_token_and_stores_every_row():
    assert FULL.first_needed_token(10_000) == 0
    assert [FULL.first_stored_row(chunk, 256) for chunk in range(4)] == [0, 0, 0, 0]
    assert not FULL.partial_rows(256)


def test_a_sliding_window_needs_the_blocks_its_window_touches():
    # The token after 768 attends to [513, 768]: block 4 (tokens 512-639) is the first it touches.
    assert SLIDING.first_needed_token(768) == 512
    assert SLIDING.first_needed_token(200) == 0
    assert SLIDING.first_needed_token(1280) == 1024
    # A window as long as a chunk reaches back to each chunk's first row from the chunk after it.
    assert [SLIDING.first_stored_row(chunk, 256) for chunk in range(4)] == [0, 0, 0, 0]
    assert not SLIDING.partial_rows(256)
    # Chunks of 512 tokens: the prefix ending after chunk j needs only its last 256 rows of it.
    assert [SLIDING.first_stored_row(chunk, 512) for chunk in range(3)] == [256, 256, 256]
    assert SLIDING.partial_rows(512)
    # vLLM's extra retained tokens widen the window.
    wider = AttentionGroup(index=0, layers=(0,), block_size=128, window=256, extra=128)
    assert wider.first_needed_token(768) == 384 and wider.first_stored_row(1, 512) == 128


def test_a_load_fills_exactly_the_real_blocks_vllm_allocated():
    # 768 external tokens, nothing local: the sliding group holds blocks 4 and 5 only.
    sliding = [0, 0, 0, 0, 2, 1, 19, 20, 21]
    full = [4, 3, 15, 16, 17, 18, 22, 23, 24]
    assert loaded_blocks(SLIDING, sliding, 0, 768) == (512, [2, 1])
    assert loaded_blocks(FULL, full, 0, 768) == (0, [4, 3, 15, 16, 17, 18])
    # vLLM had 1024 tokens itself, kvstore adds 256: only blocks 8 and 9 in either group.
    sliding = [0, 0, 0, 0, 0, 0, 0, 0, 24, 21, 25]
    full = [5, 6, 7, 8, 11, 12, 13, 14, 1, 2, 26]
    assert loaded_blocks(SLIDING, sliding, 1024, 1280) == (1024, [24, 21])
    assert loaded_blocks(FULL, full, 1024, 1280) == (1024, [1, 2])


def test_a_load_refuses_a_table_it_cannot_account_for():
    with pytest.raises(ValueError, match="window needs"):  # a block the window needs is null
        loaded_blocks(SLIDING, [0, 0, 0, 0, 0, 1], 0, 768)
    with pytest.raises(ValueError, match="null block after a real one"):
        loaded_blocks(SLIDING, [0, 0, 0, 0, 2, 0], 0, 768)
    with pytest.raises(ValueError, match="window needs"):  # more real blocks than the window reaches
        loaded_blocks(SLIDING, [0, 0, 0, 7, 2, 1], 0, 768)
    with pytest.raises(ValueError, match="the load needs"):
        loaded_blocks(FULL, [4, 3], 0, 768)


def test_a_save_takes_only_blocks_still_the_requests_own():
    # Prefill in steps of 512: after the first step vLLM freed the sliding blocks of tokens 0-255
    # (ids 1, 2) and handed them back to the same request for tokens 512-767.
    table = [1, 2, 3, 4, 2, 1, 9, 10]
    assert saved_blocks(SLIDING, table, 1, 256, computed_tokens=0) == (0, [3, 4])
    assert saved_blocks(SLIDING, table, 2, 256, computed_tokens=512) == (0, [2, 1])
    # Chunk 0's blocks were freed once 512 tokens were computed: its ids now hold other tokens.
    assert saved_blocks(SLIDING, table, 0, 256, computed_tokens=512) is None
    # A prefix vLLM had cached itself: its out-of-window blocks are null, nothing to save.
    assert saved_blocks(SLIDING, [0, 0, 0, 0, 0, 0, 9, 10, 2], 1, 256, computed_tokens=1024) is None
    # Full attention keeps every block; a chunk not yet in the table is not saved.
    assert saved_blocks(FULL, [5, 6, 7, 8], 1, 256, computed_tokens=512) == (0, [7, 8])
    assert saved_blocks(FULL, [5, 6, 7], 1, 256, computed_tokens=512) is None
    # Chunks of 512 with a window of 256: only the chunk's last 256 rows, the blocks holding them.
    assert saved_blocks(SLIDING, [1, 2, 3, 4, 5, 6, 7, 8], 1, 512, computed_tokens=768) == (256, [7, 8])
