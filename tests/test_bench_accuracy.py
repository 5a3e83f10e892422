"""The accuracy bench without a model: prompt lengths, the chunk round trip, rows, the table, the CLI's checks.

The bench on the real model is tested in test_codec_accuracy.py.
"""

from __future__ import annotations

import math

import pytest
import torch
from typer.testing import CliRunner

from kvstore.bench import accuracy as a
from kvstore.bench.stdlib_prompts import PROMPT_MODULES, module_documentation, prompt_length
from kvstore.cli import app
from kvstore.codecs import CodecPipeline, IdentityCodec, SegmentSpec, make_codec
from kvstore.layout import KVLayout
from kvstore.util.buffers import Buffer

LAYOUT = KVLayout(num_layers=3, num_kv_heads=2, head_dim=8, dtype=torch.bfloat16)


def prefill_kv(tokens: int, seed: int = 0) -> a.KV:
    """KV as a transformers DynamicCache holds it: per layer [1, kv_heads, tokens, head_dim], float32."""
    generator = torch.Generator().manual_seed(seed)
    shape = (1, LAYOUT.num_kv_heads, tokens, LAYOUT.head_dim)
    return [(torch.randn(shape, generator=generator), torch.randn(shape, generator=generator)) for _ in range(3)]


class RecordingIdentity(IdentityCodec):
    """The identity codec, keeping every segment it encodes (a copy) and the spec it was given."""

    def __init__(self) -> None:
        super().__init__()
        self.segments: list[tuple[SegmentSpec, torch.Tensor]] = []

    def encode(self, data: memoryview, spec: SegmentSpec) -> Buffer:
        values = torch.frombuffer(bytearray(data), dtype=spec.dtype).reshape(spec.shape)
        self.segments.append((spec, values))
        return data


def test_round_trip_packs_chunks_as_the_connector_saves_them():
    """Segments are [2, 256, kv_heads, head_dim] of layer l: keys then values, token-major; only whole chunks."""
    kv = prefill_kv(2 * 256)
    recorder = RecordingIdentity()
    trip = a.round_trip(CodecPipeline([recorder]), LAYOUT, kv)
    assert len(recorder.segments) == 2 * LAYOUT.num_layers  # chunk-major, layer by layer
    for index, (spec, values) in enumerate(recorder.segments):
        chunk, layer = divmod(index, LAYOUT.num_layers)
        assert spec == SegmentSpec(torch.bfloat16, (2, 256, LAYOUT.num_kv_heads, LAYOUT.head_dim))
        span = slice(chunk * 256, (chunk + 1) * 256)
        for plane in range(2):
            assert torch.equal(values[plane], kv[layer][plane][0, :, span].transpose(0, 1).bfloat16())
    for (keys, values), (got_keys, got_values) in zip(kv, trip.kv, strict=True):
        assert got_keys.dtype == torch.float32 and got_keys.shape == keys.shape
        assert torch.equal(got_keys, keys.bfloat16().float()) and torch.equal(got_values, values.bfloat16().float())
    assert trip.nbytes == trip.stored == 2 * LAYOUT.chunk_nbytes
    assert trip.encode_seconds >= 0 and trip.decode_seconds >= 0


def test_round_trip_through_a_lossy_codec_changes_values_a_little():
    kv = prefill_kv(256)
    trip = a.round_trip(make_codec("fp8+zstd"), LAYOUT, kv)
    keys, got = kv[0][0], trip.kv[0][0]
    assert not torch.equal(got, keys.bfloat16().float())
    assert (got - keys).abs().max() < 0.1 * keys.abs().max()
    assert trip.stored < trip.nbytes


def score(agreed: int, nll: float, max_abs: float = 0.5, rel: float = 0.01) -> a.PromptScore:
    return a.PromptScore(agreed, 64, torch.zeros(4), max_abs, rel, nll, 256)


def test_rows_pool_prompts_and_the_table_compares_with_the_exact_row():
    exact = a.AccuracyRow(a.EXACT, lossless=True)
    exact.add(None, score(64, 256 * math.log(10.0)))
    exact.add(None, score(64, 256 * math.log(10.0)))
    lossy = a.AccuracyRow("fp8+zstd", lossless=False)
    trip = a.RoundTrip([], nbytes=4_000_000, stored=1_000_000, encode_seconds=0.01, decode_seconds=0.02)
    lossy.add(trip, score(64, 256 * math.log(11.0), max_abs=2.0, rel=0.03))
    lossy.add(trip, score(32, 256 * math.log(11.0), max_abs=1.0, rel=0.01))
    broken = a.AccuracyRow("int4", lossless=False, error="unknown codec 'int4' | valid: ...")
    assert lossy.ratio == 4.0 and lossy.encode_mbps == pytest.approx(400) and lossy.decode_mbps == pytest.approx(200)
    assert lossy.agreement == 0.75 and lossy.identical == 0.5
    assert lossy.logit_max_abs == 2.0 and lossy.logit_rel == pytest.approx(0.02)
    assert exact.perplexity == pytest.approx(10.0) and lossy.perplexity == pytest.approx(11.0)

    lines = a.markdown_table([exact, lossy, broken]).splitlines()
    assert len(lines) == 5 and all(line.count("|") == len(a.COLUMNS) + 1 for line in lines)
    assert lines[0] == "| " + " | ".join(a.COLUMNS) + " |"
    cells = {
        line.split(" | ")[0].lstrip("| "): [c.strip() for c in line.strip("| ").split(" | ")] for line in lines[2:]
    }
    assert cells[a.EXACT][2:5] == ["-", "-", "-"] and cells[a.EXACT][-1] == "+0.00%"
    assert cells["fp8+zstd"] == [
        "fp8+zstd",
        "no",
        "4.00x",
        "400",
        "200",
        "75.0%",
        "50%",
        "2",
        "2.00e-02",
        "11.000",
        "+10.00%",
    ]
    assert cells["int4"][-1] == "unknown codec 'int4' / valid: ..."  # the error, its '|' kept out of the table


def test_prompt_lengths_are_drawn_from_the_name():
    lengths = [prompt_length(name, 1024, 2048) for name in PROMPT_MODULES]
    assert lengths == [prompt_length(name, 1024, 2048) for name in PROMPT_MODULES]
    assert all(1024 <= n <= 2048 for n in lengths) and len(set(lengths)) > len(lengths) // 2
    assert PROMPT_MODULES == tuple(sorted(PROMPT_MODULES))
    text = module_documentation("json")
    assert text.startswith("JSON (JavaScript Object Notation)") and "\n\ndumps\n" in text


def test_codec_names_are_checked_before_any_work():
    assert a.parse_codecs(" identity , fp8+zstd ") == ["identity", "fp8+zstd"]
    with pytest.raises(ValueError, match="unknown codec 'nope'"):
        a.parse_codecs("identity,nope+zstd")
    made, missing = a.default_codecs()
    assert made == list(a.DEFAULT_CODECS) and missing == []  # every default codec is registered
    assert made[:2] == ["identity", "byteplanes"]  # the baseline, then the default remote codec
    runner = CliRunner()
    for args, expected in (
        (["--accuracy", "smollm2", "--accuracy-codecs", "identity,nope"], "unknown codec 'nope'"),
        (["--accuracy", "gpt9"], "unknown model 'gpt9'"),
        (["--accuracy-codecs", "fp8"], "--accuracy-codecs needs --accuracy smollm2"),
    ):
        result = runner.invoke(app, ["bench", "--no-local", *args])
        assert result.exit_code == 2 and expected in result.output, result.output
