"""What the load planner measured, in one file per namespace: shared by an engine's processes, kept across restarts.

An engine is several processes: under vLLM's default multiprocessing the scheduler's store only
looks chunks up (it decides what to load) while the worker's store reads them (it learns each
tier's speed), and the scheduler times the engine's prefill. Each process's planner
(:class:`~kvstore.engine.planner.LoadPlanner`) writes what it measured itself into
``<planner.state_dir>/<hash of namespace and layout>.json`` and takes from it what it did not
measure (:meth:`LoadPlanner.borrow`): the scheduler plans with the worker's read rates, and an
engine restarted plans with the prefill rate of its last run instead of loading every hit until
it has measured one.

The file is JSON (never unpickled), written whole and renamed into place under an exclusive
``flock`` (two processes merge, neither loses the other's fields), mode 0600 in a 0700 directory.
What it holds is checked as it is read: a value that is not a finite positive number, or a file
that is not this format, is ignored (logged once), never trusted. ``planner.state_dir`` null (or
'') keeps everything in memory.
"""

from __future__ import annotations

import asyncio
import fcntl
import hashlib
import json
import logging
import math
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvstore.engine.planner import LoadPlanner

log = logging.getLogger(__name__)

FORMAT = "kvstore-planner/1"
SHARE_INTERVAL = 2.0  # seconds between a store's exchanges with the file (and at open and close)


def state_path(state_dir: Path, namespace: str, layout_fingerprint: bytes) -> Path:
    """The file of ``namespace`` and layout in ``state_dir`` (a hash: a namespace may hold any character)."""
    digest = hashlib.sha256(namespace.encode() + b"\0" + layout_fingerprint).hexdigest()[:32]
    return state_dir / f"{digest}.json"


class SharedEstimates:
    """One planner's exchange with its namespace's file (blocking file I/O: call it off the event loop)."""

    def __init__(self, planner: LoadPlanner, path: Path) -> None:
        self.planner, self.path = planner, path
        self._warned = False

    def exchange(self) -> None:
        """Write what this planner measured into the file, then borrow what the others did; never raises."""
        try:
            self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            with open(self.path.with_suffix(".lock"), "a", opener=_private) as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)
                shared = self._read()
                self._merge(shared, self.planner.measured_here())
                self._write(shared)
        except OSError as exc:
            self._warn(f"could not be written: {exc!r}")
            return
        self.planner.borrow(shared["prefill_rates"], _with_ages(shared["tiers"]))

    async def keep_sharing(self, sync: Callable[[], bool]) -> None:
        """Every :data:`SHARE_INTERVAL` seconds, until cancelled or ``sync()`` returns False: ``sync()`` on the
        loop (the tiers' counters into the planner; False: the store is gone), then :meth:`exchange` on a thread."""
        while True:
            await asyncio.sleep(SHARE_INTERVAL)
            if not sync():
                return
            await asyncio.to_thread(self.exchange)

    def _read(self) -> dict[str, Any]:
        """The file's content, checked (an empty one if missing or not this format)."""
        empty: dict[str, Any] = {"format": FORMAT, "prefill_rates": [], "tiers": {}}
        try:
            data = json.loads(self.path.read_text())
        except FileNotFoundError:
            return empty
        except (OSError, ValueError) as exc:
            self._warn(f"could not be read ({exc!r}); it is written anew")
            return empty
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            self._warn("is not a planner file of this version; it is written anew")
            return empty
        rates = [rate for rate in data.get("prefill_rates") or [] if _positive(rate)]
        tiers = {
            str(name): tier
            for name, tier in (data.get("tiers") or {}).items()
            if isinstance(tier, dict)
            and all(_positive(tier.get(field)) for field in ("bytes_per_s", "reads", "at"))
            and _positive(tier.get("latency_s"), zero=True)
        }
        return {"format": FORMAT, "prefill_rates": rates, "tiers": tiers}

    @staticmethod
    def _merge(shared: dict[str, Any], mine: dict[str, Any]) -> None:
        now = time.time()
        if mine.get("prefill_rates"):
            shared["prefill_rates"] = list(mine["prefill_rates"])
        for name, tier in mine["tiers"].items():
            shared["tiers"][name] = {
                "latency_s": tier["latency_s"],
                "bytes_per_s": tier["bytes_per_s"],
                "reads": tier["reads"],
                "at": now - tier["age_s"],  # wall clock: the file outlives this process's monotonic clock
            }

    def _write(self, shared: dict[str, Any]) -> None:
        temporary = self.path.with_suffix(f".{os.getpid()}.tmp")
        with open(temporary, "w", opener=_private) as f:
            json.dump(shared, f)
        os.replace(temporary, self.path)

    def _warn(self, what: str) -> None:
        if not self._warned:
            self._warned = True
            log.warning("kvstore planner: the shared estimates file %s %s", self.path, what)


def _with_ages(tiers: dict[str, dict[str, float]]) -> dict[str, dict[str, float]]:
    now = time.time()
    return {name: {**tier, "age_s": max(0.0, now - tier["at"])} for name, tier in tiers.items()}


def _positive(value: object, zero: bool = False) -> bool:
    """A finite number above zero (or at ``zero``), not a bool."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return False
    return value >= 0 if zero else value > 0


def _private(path: str, flags: int) -> int:
    """Open with mode 0600 (the file names what this user's engine serves)."""
    return os.open(path, flags, 0o600)
