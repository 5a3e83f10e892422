"""What a benchmark ran on, printed with its figures: ratios depend on the CPU kind and on the threads used."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

import torch

KERNEL_FLAGS = ("avx2", "avx512f", "amx_tile")  # the instruction sets that choose copy and vLLM CPU kernels


def describe_machine() -> str:
    """CPU model, which of :data:`KERNEL_FLAGS` it has, cores, torch's intra-op threads, load average, NUMA nodes
    and the transparent huge pages mode (memory copies depend on the last two as much as on the CPU)."""
    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    model = next((line.partition(":")[2].strip() for line in info.splitlines() if line.startswith("model name")), "?")
    flags = " ".join(flag for flag in KERNEL_FLAGS if flag in set(info.split())) or "-"
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    nodes = Path("/sys/devices/system/node")
    numa = len(list(nodes.glob("node[0-9]*"))) if nodes.is_dir() else "?"
    return (
        f"{model}; flags {flags}; {os.cpu_count()} cores; torch threads {torch.get_num_threads()}; "
        f"load average {load:.2f}; NUMA nodes {numa}; transparent huge pages {_huge_pages()}"
    )


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
