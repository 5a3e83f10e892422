"""The research benchmarks run from a clone as the docs show them: ``python -m benchmarks.NAME`` from the root.

Their measuring is tested beside what it measures (test_eviction.py, test_adaptive.py,
test_planner.py, test_bench_serving.py); here, that each command the docs show is a module of
``benchmarks/`` whose options parse, that the benchmarks page lists every module, and that the
convention itself works: a fresh interpreter started in the clone's root, with no PYTHONPATH, runs one.
"""

from __future__ import annotations

import importlib
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MODULES = sorted(path.stem for path in (ROOT / "benchmarks").glob("*.py") if path.stem != "__init__")
COMMAND = re.compile(r"python -m benchmarks\.([a-z_]+)")  # NAME (the pattern) is not one


def documented() -> dict[str, list[str]]:
    """Each ``python -m benchmarks.NAME`` in the README and docs: NAME -> the pages that show it."""
    found: dict[str, list[str]] = {}
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        for name in COMMAND.findall(page.read_text()):
            found.setdefault(name, []).append(page.name)
    return found


def test_every_documented_command_is_a_benchmark_and_the_benchmarks_page_lists_them_all() -> None:
    shown = documented()
    assert {"eviction", "serving"} <= set(MODULES)
    assert sorted(set(shown) - set(MODULES)) == [], "docs show benchmarks that do not exist"
    listed = set(COMMAND.findall((ROOT / "docs" / "benchmarks.md").read_text()))
    assert sorted(set(MODULES) - listed) == [], "benchmarks the benchmarks page does not show how to run"


@pytest.mark.parametrize("name", MODULES)
def test_each_benchmarks_options_parse(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    """``--help`` prints the usage under the command's name and stops before any work."""
    module = importlib.import_module(f"benchmarks.{name}")
    with pytest.raises(SystemExit) as stopped:
        module.main(["--help"])
    assert stopped.value.code == 0
    assert f"usage: python -m benchmarks.{name}" in capsys.readouterr().out


def test_a_benchmark_runs_from_the_root_of_a_clone() -> None:
    """As the docs run them: ``python -m benchmarks.serving`` in the root, nothing added to the path."""
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.serving", "--help"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    assert "--configs" in done.stdout


def test_the_stall_benchmark_counts_the_gaps_that_overlap_the_loads() -> None:
    """``benchmarks.stall`` on made-up stamps (no server): a gap counts when it overlaps first sent..last TTFT."""
    from benchmarks.stall import Load, Run, markdown_table, score

    loads = [Load(sent=10.0, first=12.0), Load(sent=13.0, first=14.5)]  # the loads run from 10 to 14.5
    # one of the others, first token at 9.0: gaps end at 9.1, 9.2, 11.2 (overlaps), 11.3, 15.3 (overlaps), 15.4
    bench = {"completed": 1, "start_times": [8.0], "ttfts": [1.0], "itls": [[0.1, 0.1, 2.0, 0.1, 4.0, 0.1]]}
    run = Run("forward-pass", 0)
    score(run, loads, bench)
    assert run.load_ttfts_s == [2.0, 1.5] and run.load_gaps_s == [2.0, 0.1, 4.0] and run.covered
    assert run.worst_gap_at_s == pytest.approx((1.3, 5.3))  # 11.3 to 15.3, from the first load sent at 10
    row = markdown_table([run]).splitlines()[2]
    assert row.startswith("| forward-pass | 1.75 | ") and "| 40.0 | 1.0 |" in row  # 4 s (inside), 0.1 s (outside)
