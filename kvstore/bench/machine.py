"""What a benchmark ran on, printed with its figures: ratios depend on the CPU kind and on the threads used."""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path

import torch

from kvstore.util.units import human_bytes

KERNEL_FLAGS = ("avx2", "avx512f", "amx_tile")  # the instruction sets that choose copy and vLLM CPU kernels


def describe_machine() -> str:
    """CPU model, which of :data:`KERNEL_FLAGS` it has, cores, torch's intra-op threads, load average, NUMA nodes,
    the transparent huge pages mode and how glibc's memcpy copies large blocks (memory copies depend on the
    last three as much as on the CPU)."""
    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    model = next((line.partition(":")[2].strip() for line in info.splitlines() if line.startswith("model name")), "?")
    flags = " ".join(flag for flag in KERNEL_FLAGS if flag in set(info.split())) or "-"
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    nodes = Path("/sys/devices/system/node")
    numa = len(list(nodes.glob("node[0-9]*"))) if nodes.is_dir() else "?"
    return (
        f"{model}; flags {flags}; {os.cpu_count()} cores; torch threads {torch.get_num_threads()}; "
        f"load average {load:.2f}; NUMA nodes {numa}; transparent huge pages {_huge_pages()}; "
        f"memcpy {describe_memcpy()}"
    )


def describe_memcpy() -> str:
    """How this process's glibc copies large blocks, by size: the copies kvstore makes with numpy (and Python's
    own) go through it, while ``Tensor.copy_`` runs torch's own vector loop.

    glibc picks, once per process and per CPU vendor, ``rep movsb`` up to one size and non-temporal stores
    (which bypass the caches) from another, with an ordinary vector loop between on AMD; ``GLIBC_TUNABLES``
    moves the sizes. On this project's Xeon, non-temporal stores from 1 MiB made one thread's whole-chunk
    copies about 1.6x faster (docs/benchmarks.md, "How glibc copies"). Read from the dynamic loader's
    ``--list-diagnostics`` (glibc 2.33 and later); "thresholds ?" where that is not available.
    """
    names = getattr(os, "confstr_names", {})
    version = os.confstr("CS_GNU_LIBC_VERSION") if "CS_GNU_LIBC_VERSION" in names else None
    if not version:
        return "not glibc"
    values = _loader_diagnostics()
    movsb, stop, temporal, leaf_7_ebx = (values.get(name) for name in (*_THRESHOLDS, _LEAF_7_EBX))
    if movsb is None or stop is None or temporal is None or leaf_7_ebx is None:
        return f"{version}, thresholds ?"
    tuned = " (GLIBC_TUNABLES set)" if os.environ.get("GLIBC_TUNABLES") else ""
    if not leaf_7_ebx & _ERMS or movsb >= stop:
        return f"{version}: vector loop, non-temporal stores from {human_bytes(temporal)}{tuned}"
    between = f", vector loop from {human_bytes(stop)}" if stop < temporal else ""
    # rep movsb runs up to its stop size even past the non-temporal threshold (AMD with that threshold under L2)
    return (
        f"{version}: rep movsb from {human_bytes(movsb)}{between}, "
        f"non-temporal stores from {human_bytes(max(stop, temporal))}{tuned}"
    )


_THRESHOLDS = tuple(
    f"x86.cpu_features.{name}" for name in ("rep_movsb_threshold", "rep_movsb_stop_threshold", "non_temporal_threshold")
)
_LEAF_7_EBX = "x86.cpu_features.features[0x1].active[0x1]"  # glibc's usable CPUID leaf 7 EBX bits
_ERMS = 1 << 9  # enhanced rep movsb: without it glibc never copies with rep movsb


def _loader_diagnostics() -> dict[str, int]:
    """The integer values ``ld.so --list-diagnostics`` prints (its own tunables from this environment), or {}."""
    loader = next((path for path in _mapped_files() if _LOADER.fullmatch(Path(path).name)), None)
    if loader is None:
        return {}
    try:
        listing = subprocess.run(
            [loader, "--list-diagnostics"], capture_output=True, text=True, timeout=10, check=True
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    values: dict[str, int] = {}
    for line in listing.splitlines():
        name, _, value = line.partition("=")
        with contextlib.suppress(ValueError):
            values[name] = int(value, 0)
    return values


_LOADER = re.compile(r"ld-linux[\w.-]*\.so(\.\d+)*")  # the dynamic loader's file name, e.g. ld-linux-x86-64.so.2


def _mapped_files() -> list[str]:
    """The paths of the files this process has mapped (a file deleted since is left out)."""
    maps = Path("/proc/self/maps")
    lines = maps.read_text().splitlines() if maps.exists() else []
    fields = (line.split(maxsplit=5) for line in lines)
    return [
        field[5] for field in fields if len(field) == 6 and field[5].startswith("/") and "(deleted)" not in field[5]
    ]


def _huge_pages() -> str:
    """The kernel's transparent huge pages mode (the bracketed word of ``enabled``), or "?"."""
    enabled = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    text = enabled.read_text() if enabled.exists() else ""
    return text.partition("[")[2].partition("]")[0] or "?"


@contextlib.contextmanager
def torch_threads_set(threads: int | None) -> Iterator[None]:
    """torch's intra-op threads set to ``threads`` inside the block (None: left as they are), then restored."""
    previous = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(previous)
