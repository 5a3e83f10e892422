"""Progress of long runs (examples, benchmarks) on stderr: a bar on a terminal, plain lines elsewhere.

On a terminal, a rich progress bar names the step being run and prints each finished step's
message above it (``keep=False``: only the bar, gone at the end). Elsewhere (a log, CI, a pipe),
one plain line per step, ``[3/12 41s] description: message``, flushed at once, so a long run is
never silent; a run of thousands of small steps is reported every tenth of the way, and
``announce=True`` also prints a line when a step starts (for steps of minutes). stdout stays the
run's own output.

The bar is redrawn only when a step starts or ends (no refresh thread), and steps are the caller's
to place: benchmarks mark them between their timed sections, never inside one.

    with Progress("replaying", total=len(requests)) as progress:
        for request in requests:
            progress.doing(request.name)   # optional: what runs now
            ...
            progress.step("its result")    # or progress.step()
    for item in track(items, "encoding"):  # the same, for a loop
        ...
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Iterable, Iterator
from types import TracebackType
from typing import IO, TypeVar

T = TypeVar("T")
PLAIN_LINES = 10  # at most about this many lines for a run of many small steps, off a terminal
REDRAW_SECONDS = 0.1  # the bar's fastest redraw, for runs of many small steps


class Progress:
    """Counts steps of a run of ``total`` (None: not known yet; :meth:`set_total` can tell it later)."""

    def __init__(
        self,
        description: str,
        total: int | None = None,
        *,
        file: IO[str] | None = None,
        bar: bool | None = None,
        keep: bool = True,
        announce: bool = False,
    ) -> None:
        self.description = description
        self.keep = keep  # on a terminal, print each step's message above the bar
        self.announce = announce  # off a terminal, a line when a step starts too
        self.total = total
        self.done = 0
        self._file = file if file is not None else sys.stderr
        self._bar_wanted = _is_terminal(self._file) if bar is None else bar
        self._started = time.monotonic()
        self._drawn = 0.0
        self._rich = None  # the rich Progress, on a terminal
        self._task = None
        self._log_handlers: list[tuple[logging.StreamHandler, IO[str]]] = []  # retargeted, put back at exit

    def __enter__(self) -> Progress:
        self._started = time.monotonic()
        if self._bar_wanted:
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn
            from rich.progress import Progress as RichProgress

            console = Console(file=self._file)
            self._rich = RichProgress(
                TextColumn("{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                console=console,
                auto_refresh=False,
                transient=True,
                # what else is printed meanwhile goes above the bar (stdout only when it shares the terminal)
                redirect_stdout=_is_terminal(sys.stdout),
                redirect_stderr=self._file is sys.stderr,
            )
            original_stderr = sys.stderr
            self._rich.start()
            if sys.stderr is not original_stderr:  # log lines too: handlers hold the stream they were made with
                for handler in logging.getLogger().handlers:
                    if isinstance(handler, logging.StreamHandler) and handler.stream is original_stderr:
                        self._log_handlers.append((handler, original_stderr))
                        handler.setStream(sys.stderr)
            self._task = self._rich.add_task(self.description, total=self.total)
            self._rich.refresh()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        if self._rich is not None:
            for handler, stream in self._log_handlers:
                handler.setStream(stream)
            self._log_handlers.clear()
            self._rich.stop()
            self._rich = None
        elif kind is None and self.done and not self._plain_due():  # the last line of a sampled run
            self._line("done")

    def set_total(self, total: int) -> None:
        self.total = total
        if self._rich is not None:
            self._rich.update(self._task, total=total)
            self._rich.refresh()

    def doing(self, what: str) -> None:
        """What runs now: the bar shows it; off a terminal, a line only with ``announce``."""
        if self._rich is not None:
            self._rich.update(self._task, description=f"{self.description}: {what}")
            self._rich.refresh()
        elif self.announce:
            self._line(f"{what} ...", count=self.done + 1)

    def step(self, message: str = "") -> None:
        """One step done; ``message`` (its result) is printed above the bar, or as the plain line."""
        self.done += 1
        if self._rich is not None:
            if message and self.keep:
                self._rich.console.print(message, markup=False, highlight=False)
            self._rich.update(self._task, completed=self.done, description=self.description)
            now = time.monotonic()
            if message or now - self._drawn >= REDRAW_SECONDS or self.done == self.total:
                self._drawn = now
                self._rich.refresh()
        elif message or self._plain_due():
            self._line(message)

    def _plain_due(self) -> bool:
        if self.total is None or self.total <= PLAIN_LINES * 2:
            return True
        return self.done == self.total or self.done % max(1, self.total // PLAIN_LINES) == 0

    def _line(self, message: str, count: int | None = None) -> None:
        number = self.done if count is None else count
        counted = f"{number}/{self.total}" if self.total is not None else str(number)
        text = f"[{counted} {time.monotonic() - self._started:.0f}s] {self.description}"
        print(f"{text}: {message}" if message else text, file=self._file, flush=True)


def track(
    items: Iterable[T], description: str, total: int | None = None, *, file: IO[str] | None = None
) -> Iterator[T]:
    """``items``, one step each (``total`` defaults to ``len(items)`` where there is one)."""
    if total is None and hasattr(items, "__len__"):
        total = len(items)  # type: ignore[arg-type]
    with Progress(description, total, file=file) as progress:
        for item in items:
            yield item
            progress.step()


def _is_terminal(file: IO[str]) -> bool:
    try:
        return file.isatty()
    except (AttributeError, ValueError):  # a closed or odd stream
        return False
