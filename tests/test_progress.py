"""Long runs talk: plain progress lines off a terminal (a log, CI), a bar on one; stdout stays the run's."""

from __future__ import annotations

import io
import re

from kvstore.util.progress import Progress, track


def test_off_a_terminal_each_step_is_one_plain_line() -> None:
    log = io.StringIO()
    with Progress("encoding", total=3, file=log) as progress:
        for codec in ("identity", "byteplanes", "int8"):
            progress.step(codec)
    lines = log.getvalue().splitlines()
    assert len(lines) == 3, lines
    assert re.fullmatch(r"\[3/3 \d+s\] encoding: int8", lines[-1]), lines


def test_a_loop_of_many_small_steps_is_reported_about_ten_times() -> None:
    log = io.StringIO()
    assert sum(track(range(1000), "replaying", file=log)) == sum(range(1000))
    lines = log.getvalue().splitlines()
    assert 5 <= len(lines) <= 12 and lines[-1].startswith("[1000/1000"), lines


def test_on_a_terminal_a_bar_is_drawn_and_gone_at_the_end() -> None:
    screen = io.StringIO()
    with Progress("replaying", total=2, file=screen, bar=True, keep=False) as progress:
        progress.step()
        progress.step()
    assert "[1/2" not in screen.getvalue()  # no plain lines where a bar is shown
