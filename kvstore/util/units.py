"""Sizes, rates and durations as people write and read them: one place for the units every report uses.

Why here: the CLI tables, the advice sentences, the benchmarks and the demo all print byte counts,
throughputs and ages. Written out at each place they drifted (``MiB`` here, ``M`` there, GB/s
computed three ways); these functions are the one spelling. Pure stdlib plus pydantic's size
parser (the same one the configuration uses), so any layer may import them.

Conventions: sizes print in binary units (KiB, MiB, ... as the configuration accepts them);
throughputs are decimal (GB/s = 1e9 bytes per second, MB/s = 1e6), as storage bandwidth is quoted.
"""

from __future__ import annotations

import math
import re

from pydantic import ByteSize, TypeAdapter, ValidationError

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
MB, GB = 1e6, 1e9

_BINARY_PREFIXES = ("", "Ki", "Mi", "Gi", "Ti")
_DURATION_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
_DURATION_PART = re.compile(r"(\d+(?:\.\d+)?)\s*([smhdw]?)")
_AGE_STEPS = ((120, "s", 1), (7200, "min", 60), (172800, "h", 3600))  # below the limit, in this unit
_SIZE_ADAPTER: TypeAdapter[ByteSize] = TypeAdapter(ByteSize)


def _binary_scale(size: float) -> tuple[float, str]:
    """``size`` divided down to the largest binary prefix that keeps it under 1024 (TiB at most)."""
    for prefix in _BINARY_PREFIXES:
        if abs(size) < 1024 or prefix == _BINARY_PREFIXES[-1]:
            return size, prefix
        size /= 1024
    raise AssertionError("unreachable: the last prefix always returns")


def human_bytes(size: float) -> str:
    """A size as people read it: '512 B', '1.5 MiB', '32.0 GiB' (one decimal above bytes)."""
    value, prefix = _binary_scale(size)
    return f"{value:.0f} B" if not prefix else f"{value:.1f} {prefix}B"


def short_bytes(size: float) -> str:
    """A size for a plot axis, as short as it gets: '64M', '1G', '1.5G' (binary units, no 'iB')."""
    value, prefix = _binary_scale(size)
    return f"{value:.0f}{prefix[:1]}" if value == int(value) else f"{value:.1f}{prefix[:1]}"


def per_second(nbytes: float, seconds: float, unit: float = GB) -> float:
    """Throughput of ``nbytes`` moved in ``seconds``, in ``unit`` per second (GB/s by default).

    A zero duration (a timer too coarse for the work) counts as a nanosecond, so the figure stays finite.
    """
    return nbytes / max(seconds, 1e-9) / unit


def human_age(seconds: float) -> str:
    """How long ago, in the unit that reads best: '90 s', '45 min', '36 h', '2.5 d'; '-' if unknown (inf, nan)."""
    if not math.isfinite(seconds):
        return "-"
    for limit, unit, size in _AGE_STEPS:
        if seconds < limit:
            return f"{seconds / size:.0f} {unit}"
    return f"{seconds / 86400:.1f} d"


def parse_size(text: str) -> int:
    """Bytes in a size as the configuration takes it: '500GiB', '2TB', '1048576'.

    Raises :class:`ValueError` naming the text and showing the forms that work.
    """
    try:
        return int(_SIZE_ADAPTER.validate_python(text))
    except ValidationError:
        raise ValueError(f"{text!r} is not a size; write e.g. 500GiB, 2TB or 1048576") from None


def parse_duration(text: str) -> float:
    """Seconds in '90s', '30m', '12h', '7d', '2w', '1d12h', or plain seconds ('3600').

    Raises :class:`ValueError` naming the text and showing the forms that work.
    """
    cleaned = text.strip().lower()
    parts = _DURATION_PART.findall(cleaned)
    if not parts or _DURATION_PART.sub("", cleaned).strip():
        raise ValueError(f"{text!r} is not a duration; write e.g. 90s, 30m, 12h, 7d or 1d12h")
    return sum(float(number) * _DURATION_UNITS[unit or "s"] for number, unit in parts)
