"""How much memory this process can have: the machine's, within its cgroup's limit (for DRAM capacities).

A DRAM tier larger than the machine cannot be allocated: the configuration refuses one above
:func:`machine_memory`, and the pool, when it is built, one above :func:`available_memory`.
Linux only in what it reads (``sysconf``, ``/proc`` and ``/sys/fs/cgroup``); where something
cannot be read the answer is None (unknown), and a caller then checks nothing. Pure stdlib.
"""

from __future__ import annotations

import os
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
PROC_CGROUP = Path("/proc/self/cgroup")  # this process's cgroups, one "id:controllers:path" line each
MEMINFO = Path("/proc/meminfo")
NO_LIMIT = 1 << 62  # cgroup v1 writes "no limit" as a number near 2**63


def _read_int(path: Path) -> int | None:
    """The integer a file holds; None if it cannot be read or says "max" (no limit)."""
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def _cgroup_dirs() -> list[tuple[Path, str, str, str]]:
    """This process's cgroup directories holding a memory controller, from its own up to the root, each with
    the names of its limit and usage files (cgroup v2: ``memory.max``; v1: ``memory.limit_in_bytes``) and of
    the ``memory.stat`` line of the page cache the kernel reclaims first (``inactive_file``)."""
    try:
        lines = PROC_CGROUP.read_text().splitlines()
    except OSError:
        return []
    found: list[tuple[Path, str, str, str]] = []
    for line in lines:  # "hierarchy-id:controllers:path"
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        if controllers == "":  # v2: one unified hierarchy
            base, limit, usage, cache = CGROUP_ROOT, "memory.max", "memory.current", "inactive_file"
        elif "memory" in controllers.split(","):  # v1: the memory controller's own hierarchy
            base, limit, usage = CGROUP_ROOT / "memory", "memory.limit_in_bytes", "memory.usage_in_bytes"
            cache = "total_inactive_file"
        else:
            continue
        directory = base / path.lstrip("/")
        levels = (level for level in (directory, *directory.parents) if level.is_relative_to(base))
        found += [(level, limit, usage, cache) for level in levels]
    return found


def _cgroup_room() -> tuple[int | None, int | None]:
    """The tightest cgroup memory limit over this process, and the least any limited level leaves now (its limit
    less its usage, the usage without the inactive page cache the kernel reclaims first: a model's weights read
    through the page cache are not memory taken), in bytes; None for either where no level sets a limit."""
    limits: list[int] = []
    rooms: list[int] = []
    for directory, limit_name, usage_name, cache_name in _cgroup_dirs():
        limit = _read_int(directory / limit_name)
        if limit is None or limit >= NO_LIMIT:
            continue
        limits.append(limit)
        usage = _read_int(directory / usage_name)
        if usage is not None:
            rooms.append(max(0, limit - max(0, usage - _stat(directory / "memory.stat", cache_name))))
    return (min(limits) if limits else None), (min(rooms) if rooms else None)


def _stat(path: Path, name: str) -> int:
    """The value of line ``name`` of a ``memory.stat`` file; 0 where it cannot be read."""
    try:
        for line in path.read_text().splitlines():
            key, _, value = line.partition(" ")
            if key == name and value.strip().isdigit():
                return int(value)
    except OSError:
        pass
    return 0


def physical_memory() -> int | None:
    """The machine's physical memory in bytes (``SC_PAGE_SIZE * SC_PHYS_PAGES``); None if unknown."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return None


def machine_memory() -> int | None:
    """The most memory this process could ever have: physical memory, or its cgroup's limit where that is
    smaller (a container's); None if neither can be read."""
    sizes = [size for size in (physical_memory(), _cgroup_room()[0]) if size is not None]
    return min(sizes) if sizes else None


def available_memory() -> int | None:
    """Bytes that can be allocated now without swapping: ``MemAvailable`` of ``/proc/meminfo``, or what the
    cgroup's limit leaves where that is smaller; None if neither can be read."""
    sizes = [size for size in (_mem_available(), _cgroup_room()[1]) if size is not None]
    return min(sizes) if sizes else None


def _mem_available() -> int | None:
    """``MemAvailable`` of ``/proc/meminfo`` in bytes; None where it cannot be read (not Linux, an old kernel)."""
    try:
        with MEMINFO.open() as file:
            for line in file:
                name, _, value = line.partition(":")
                if name == "MemAvailable":
                    number, _, unit = value.strip().partition(" ")
                    return int(number) * (1024 if unit.strip().lower() == "kb" else 1)
    except (OSError, ValueError):
        return None
    return None
