"""The disk tier's temporary files: named with their writer, so a killed writer's are found and removed.

A write fills ``<key>.kvc.tmp-<writer>-<random>`` and renames it into place (``kvstore gc`` sets a
file aside under ``.tmp-gc-<writer>-<random>`` the same way). A process killed in between leaves
the temporary, which no listing shows. Its name says who wrote it: the pid, the process's start
time (a pid reused by a later process has another) and a hash of the machine's boot id and pid
namespace (where that pid means that process). So a store opening on the directory, and ``kvstore
gc``/``verify``, remove a temporary at once when its writer no longer runs, and any temporary once
it is older than :data:`STALE_TMP_SECONDS`, far above any write's timeout; never a younger one
whose writer runs, or cannot be looked up (another machine sharing the directory, an older
kvstore's name without its writer, no ``/proc``).
"""

from __future__ import annotations

import functools
import hashlib
import os
import re
import secrets
from typing import Literal

TMP_MARK = ".tmp-"  # in every temporary name
STALE_TMP_SECONDS = 600.0

# A temporary's name ends with its writer: ``.tmp-[gc-]<pid>-<machine>-<started>-<random>``, where
# machine is a hash of the boot id and the pid namespace (the machine and boot the pid belongs to) and
# started the process's start time in clock ticks (a pid reused by a later process has another).
_OWNER_PATTERN = re.compile(re.escape(TMP_MARK) + r"(?:gc-)?(\d+)-([0-9a-f]{8})-(\d+)-[0-9a-f]{8}$")
_UNKNOWN_MACHINE = "0" * 8  # where there is no /proc: the writer cannot be looked up, only aged


def temporary_name(final: str, tag: str = "") -> str:
    """A private temporary name for ``final`` owned by this process (``tag``: e.g. ``"gc-"``)."""
    pid = os.getpid()
    return f"{final}{TMP_MARK}{tag}{pid}-{_machine()}-{_started(pid) or 0}-{secrets.token_hex(4)}"


@functools.cache
def _machine() -> str:
    """This boot of this machine, and this pid namespace: where a pid in a temporary's name means this process."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as file:
            boot = file.read().strip()
        namespace = os.readlink("/proc/self/ns/pid")
    except OSError:
        return _UNKNOWN_MACHINE
    return hashlib.blake2b(f"{boot} {namespace}".encode(), digest_size=4).hexdigest()


def _started(pid: int) -> int | None:
    """Process ``pid``'s start time (clock ticks since boot); None if no such process runs (or no /proc)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as file:
            stat = file.read()
    except OSError:
        return None
    try:  # the command name (field 2) may hold spaces and parentheses: count from the last ')'
        return int(stat[stat.rindex(b")") + 2 :].split()[19])
    except (ValueError, IndexError):
        return None


def _writer_gone(name: str) -> bool:
    """Whether the process named in the temporary ``name`` is known to run no more.

    False when that cannot be told: a name without its writer (an older version's), another
    machine's or pid namespace's file (a shared directory), no /proc.
    """
    owner = _OWNER_PATTERN.search(name)
    if owner is None or owner[2] != _machine() or owner[2] == _UNKNOWN_MACHINE:
        return False
    started = _started(int(owner[1]))
    return started is None or started != int(owner[3])


def temporary_state(name: str, mtime: float, now: float) -> Literal["stale", "orphaned", "fresh"] | None:
    """None for a file that is not a writer's temporary; "stale" for one older than ``STALE_TMP_SECONDS``
    (far above any write's timeout: no live writer owns it); "orphaned" for a younger one whose writer,
    named in it, no longer runs (a writer or a gc that was killed); else "fresh" (a write may be in
    progress: its writer runs, or cannot be looked up).

    The one rule a store's open and ``kvstore gc``/``verify`` sweep temporaries by: stale and orphaned go.
    """
    if TMP_MARK not in name:
        return None
    if now - mtime > STALE_TMP_SECONDS:
        return "stale"
    return "orphaned" if _writer_gone(name) else "fresh"
