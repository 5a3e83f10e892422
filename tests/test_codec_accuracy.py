"""Codecs on a real model's answers: SmolLM2-135M, prompts of standard-library documentation, KV through each codec.

A fast cut of ``kvstore bench --accuracy smollm2`` (kvstore.bench.accuracy, where the full
table comes from): 2 prompts of 512..768 tokens, 32 greedy tokens each (the bench: 64). Deterministic inputs (a
fixed list of modules, lengths drawn from their names), no timing asserted. A lossless codec must
give exactly what the bf16 identity round trip gives (the same decoded bits, so the same logits);
a lossy one must keep most greedy tokens, with thresholds well below what was measured.

The model and transformers are installed by scripts/test.sh; if they are missing this module
fails to import: these tests never skip.
"""

from __future__ import annotations

import pytest
import torch

from kvstore.bench import accuracy as a
from kvstore.bench.stdlib_prompts import prompt_length, stdlib_prompts

CODECS = ["identity", "byteplanes", "fp8", "int8+zstd", "int4+zstd", "nope+zstd"]
# Measured on this machine (2 prompts): see the assertions; the bars sit well below.
MIN_AGREEMENT = {"identity": 0.9, "fp8": 0.6, "int8+zstd": 0.8, "int4+zstd": 0.6}


@pytest.fixture(scope="module")
def rows(smollm2) -> dict[str, a.AccuracyRow]:
    torch.manual_seed(0)
    tokenizer, model = smollm2
    prompts = stdlib_prompts(tokenizer, 2, min_tokens=512, max_tokens=768)
    assert [len(prompt.ids) for prompt in prompts] == [
        prompt_length(prompt.source, 512, 768) for prompt in prompts
    ]  # each truncated to its drawn length
    return {row.codec: row for row in a.run_accuracy(model, prompts, CODECS, generated=32)}


def test_exact_kv_reproduces_the_recompute(rows: dict[str, a.AccuracyRow]):
    """The harness's floor: teacher forcing on the exact float32 KV gives the greedy reference's tokens."""
    exact = rows[a.EXACT]
    assert len(exact.scores) == 2 and exact.agreement == 1.0
    assert exact.logit_max_abs < 1e-2


def test_a_lossless_codec_gives_exactly_the_bf16_round_trip(rows: dict[str, a.AccuracyRow]):
    identity, byteplanes = rows["identity"], rows["byteplanes"]
    assert byteplanes.lossless and byteplanes.ratio > 1.3 and identity.ratio == 1.0
    for mine, cast in zip(byteplanes.scores, identity.scores, strict=True):
        assert torch.equal(mine.first_logits, cast.first_logits)
        assert (mine.agreed, mine.nll) == (cast.agreed, cast.nll)


@pytest.mark.parametrize("codec", ["identity", "fp8", "int8+zstd", "int4+zstd"])
def test_greedy_tokens_mostly_agree(rows: dict[str, a.AccuracyRow], codec: str):
    row = rows[codec]
    assert row.agreement >= MIN_AGREEMENT[codec], a.markdown_table([rows[a.EXACT], row])
    assert row.perplexity < rows[a.EXACT].perplexity * 1.1


def test_ratios(rows: dict[str, a.AccuracyRow]):
    assert rows["fp8"].ratio > 1.9  # fp8: one byte a value, plus its scales
    assert rows["int8+zstd"].ratio > 1.9  # the targets: int8 >= 1.9x, int4 >= 3.5x
    assert rows["int4+zstd"].ratio > 3.5


def test_an_unknown_codec_is_a_row_with_its_error(rows: dict[str, a.AccuracyRow]):
    assert "unknown codec 'nope'" in rows["nope+zstd"].error and not rows["nope+zstd"].scores
    table = a.markdown_table(list(rows.values()))
    assert len(table.splitlines()) == 2 + 1 + len(CODECS) and "unknown codec 'nope'" in table
