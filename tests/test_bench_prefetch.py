"""Smoke test of the layer-stream overlap bench (figures are printed, never asserted: the machine is noisy)."""

from __future__ import annotations

import math

import pytest
from typer.testing import CliRunner

from kvstore.bench.prefetch import parse_tiers, run_overlap
from kvstore.cli import app


def test_overlap_rows_for_local_tiers():
    rows = run_overlap(["dram", "disk"], chunks=2, repeats=1)
    assert [(row.tier, row.layers) for row in rows] == [("dram", 30)] * 2 + [("disk", 30)] * 2
    for row in rows:
        assert row.fetch_per_layer > 0 and row.ttfl > 0 and row.total >= row.ttfl
        assert row.compute_per_layer >= row.fetch_per_layer * 0.9  # it really computed (slept) c = k * f
        assert math.isfinite(row.efficiency) and row.efficiency <= 1.0
        if row.ttfl < row.layers * row.fetch_per_layer:  # (a noisy pass could wait longer for layer 0 alone)
            assert row.efficiency_after_first <= 1.0  # T >= time to layer 0 + the compute after it


def test_unknown_tier_is_rejected():
    with pytest.raises(ValueError, match="choose from"):
        parse_tiers("dram,tape")
    result = CliRunner().invoke(app, ["bench", "--no-local", "--prefetch", "tape"])
    assert result.exit_code != 0 and "tape" in result.output
