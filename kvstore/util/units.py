"""Sizes, rates and durations as people write and read them: one place for the units every report uses.

Why here: the CLI tables, the advice sentences, the benchmarks and the demo all print byte counts,
throughputs and ages. Written out at each place they drifted (``MiB`` here, ``M`` there, GB/s
computed three ways); these functions are the one spelling. Pure stdlib, so any layer may import them.

Parsing is strict, for the configuration and the CLI alike (one parser each for sizes and for
durations): a value parses whole or fails with a message that shows a valid one. A lenient parser
once read ``kvstore gc --max-bytes 12,5GB`` as 12 bytes and would have deleted nearly everything.

Conventions: sizes print in binary units (KiB, MiB, ... as the configuration accepts them);
throughputs are decimal (GB/s = 1e9 bytes per second, MB/s = 1e6), as storage bandwidth is quoted.
"""

from __future__ import annotations

import math
import re
from decimal import Decimal

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
MB, GB = 1e6, 1e9
MAX_SIZE = (1 << 63) - 1  # the largest size parsed (8 EiB): what a signed 64-bit offset holds
EXACT_FLOAT_LIMIT = 1 << 53  # a size given as a float must lie below this: above it not every whole number is one

_BINARY_PREFIXES = ("", "Ki", "Mi", "Gi", "Ti")
_NUMBER = r"(?:\d+(?:\.\d*)?|\.\d+)"  # 12, 12.5, .5: no sign, exponent, comma or underscore
_SIZE_TEXT = re.compile(rf"\s*(-?)\s*({_NUMBER})\s*([A-Za-z]*)\s*")
# Units as pydantic's ByteSize (which the configuration used before) reads them, case-insensitively.
_SIZE_UNITS = {"": 1, "b": 1} | {
    unit: scale
    for power, letter in enumerate("kmgtpe", start=1)
    for unit, scale in ((letter, 1000**power), (f"{letter}b", 1000**power), (f"{letter}ib", 1024**power))
}
_SIZE_EXAMPLES = "e.g. 500GiB, 12.5GB or 1048576 (bytes)"
_DURATION_UNITS = {
    **dict.fromkeys(("ms", "msec", "millisecond", "milliseconds"), 0.001),
    **dict.fromkeys(("", "s", "sec", "secs", "second", "seconds"), 1),
    **dict.fromkeys(("m", "min", "mins", "minute", "minutes"), 60),
    **dict.fromkeys(("h", "hr", "hrs", "hour", "hours"), 3600),
    **dict.fromkeys(("d", "day", "days"), 86400),
    **dict.fromkeys(("w", "week", "weeks"), 7 * 86400),
}
_DURATION_PART = re.compile(rf"\s*({_NUMBER})\s*([a-z]*)\s*")
_DURATION_EXAMPLES = "e.g. 90s, 500ms, 10m, 10 minutes, 12h, 1h30m or 7d (a bare number is seconds)"
_SHOWN_CHARS = 60  # an error quotes at most this much of the text it rejects
_AGE_STEPS = ((120, "s", 1), (7200, "min", 60), (172800, "h", 3600))  # below the limit, in this unit


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


def clip(text: str, limit: int = _SHOWN_CHARS) -> str:
    """``text`` cut to about ``limit`` characters: an error message never quotes a megabyte back."""
    return text if len(text) <= limit else f"{text[: limit - 20]}...{text[-12:]} ({len(text):,} characters)"


def shown(value: object, limit: int = _SHOWN_CHARS) -> str:
    """``repr(value)`` for an error message, clipped (:func:`clip`)."""
    return clip(repr(value), limit)


def _plain_number(value: object, what: str, examples: str) -> float | None:
    """A number given as a number (TOML, JSON, Python): finite and not a bool; None for text."""
    if isinstance(value, str):
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{shown(value)} is not {what}; write {examples}")
    if not math.isfinite(value):
        raise ValueError(f"{value} is not {what}: it must be finite; write {examples}")
    return float(value)


def parse_size(value: str | int | float, minimum: int = 0, why: str = "a size cannot be negative") -> int:
    """Bytes in a size as the configuration and the CLI take it: '500GiB', '12.5GB', '5 MB', '1048576'.

    Units are case-insensitive: B; K/KB, M/MB, G/GB, T/TB, P/PB, E/EB (powers of 1000); KiB, MiB,
    GiB, TiB, PiB, EiB (powers of 1024). A decimal point is fine (a fraction of a byte is dropped);
    a comma, an exponent, a sign or an unknown unit is not. A number (not text) is bytes and must
    be whole; a float must also be below 2**53, where floats stop holding every whole number
    (``1e30`` fails as ``'1e30B'`` does). A result above 8 EiB (2**63 - 1 bytes), in either form,
    fails as too large; one below ``minimum`` fails with ``why``.

    Raises :class:`ValueError` quoting (at most the start of) the text and showing a valid value.
    """
    if isinstance(value, int) and not isinstance(value, bool):
        size = value  # exact as it is: a float of it would round above 2**53 (and overflow above 1e308)
    else:
        size = _size_of(value)
    if size > MAX_SIZE:
        huge = isinstance(value, int) and size.bit_length() > 1000  # its repr would be thousands of digits
        what = f"a {size.bit_length()}-bit number" if huge else shown(value)
        raise ValueError(f"{what} is too large: a size is at most 8 EiB ({MAX_SIZE:,} bytes), {_SIZE_EXAMPLES}")
    if size < minimum:
        raise ValueError(f"{shown(value)} is too small: {why}; write {_SIZE_EXAMPLES}")
    return size


def _size_of(value: str | float) -> int:
    """The bytes in a size given as text or as a float (a float: whole, and below 2**53)."""
    number = _plain_number(value, "a size", _SIZE_EXAMPLES)
    if number is None:
        return _parse_size_text(str(value))
    if number >= EXACT_FLOAT_LIMIT:  # 1e30 is a float: not the bytes anyone meant, and '1e30B' is refused too
        raise ValueError(
            f"{value} is not a whole number of bytes that a float holds exactly (a float must be below 2**53); "
            f"write 1000 or 1KB rather than an exponent, or a whole number: {_SIZE_EXAMPLES}"
        )
    if number != int(number):
        raise ValueError(f"{value} is not a whole number of bytes; write {_SIZE_EXAMPLES}")
    return int(number)


def _parse_size_text(text: str) -> int:
    """The signed size ``text`` spells (a sign is parsed so that the caller can say why it is wrong)."""
    match = _SIZE_TEXT.fullmatch(text)
    if match is None:
        hint = "write the decimal point as '.', with no thousands separator; " if "," in text else ""
        hint += "write 1000 or 1KB rather than an exponent; " if re.search(r"\d[eE][-+]?\d", text) else ""
        problem = "an empty size" if not text.strip() else f"{shown(text)} is not a size"
        raise ValueError(f"{problem}: {hint or 'a number and an optional unit, '}{_SIZE_EXAMPLES}")
    sign, number, unit = match.groups()
    scale = _SIZE_UNITS.get(unit.lower())
    if scale is None:
        raise ValueError(
            f"{shown(text)} has an unknown unit {shown(unit)}: use B, KB, MB, GB, TB, PB (powers of 1000) "
            f"or KiB, MiB, GiB, TiB, PiB (powers of 1024), {_SIZE_EXAMPLES}"
        )
    exact = Decimal(number) * scale
    size = MAX_SIZE + 1 if exact > MAX_SIZE else int(exact)  # never a million-digit int from a million digits
    return -size if sign else size


def _needs_unit(number: str) -> str:
    """The error for a bare number where a duration must say its unit."""
    return f"{shown(number)} has no unit: write {number}d, {number}h, {number}m or {number}s"


def parse_duration(value: str | int | float, unit_required: bool = False) -> float:
    """Seconds in a duration as the configuration and the CLI take it: '90s', '500ms', '10m', '10 minutes',
    '12h', '7d', '2w', '1h30m', '1.5h', or a bare number of seconds ('3600', or a number given as one).

    Units: ms, s, m (minutes), h, d, w, and their words (sec, min, minutes, hours, days, ...). A
    bare number stands alone; a sign, an exponent, an unknown unit, or 'inf' fail. With
    ``unit_required`` (the CLI's options, where ``--max-age 7`` could mean days and delete
    everything as seconds) a bare number fails too, naming the readings it could have.

    Raises :class:`ValueError` quoting (at most the start of) the text and showing a valid value.
    """
    number = _plain_number(value, "a duration", _DURATION_EXAMPLES)
    if number is not None:
        if unit_required:
            raise ValueError(_needs_unit(str(value)))
        if number < 0:
            raise ValueError(f"{value} is negative: a duration is 0 or more; write {_DURATION_EXAMPLES}")
        return number
    text = str(value).lower()
    parts = [match.groups() for match in _DURATION_PART.finditer(text)]
    if not text.strip() or "".join(m.group(0) for m in _DURATION_PART.finditer(text)) != text:
        problem = "an empty duration" if not text.strip() else f"{shown(value)} is not a duration"
        hint = " (a duration cannot be negative)" if text.strip().startswith("-") else ""
        raise ValueError(f"{problem}{hint}: write {_DURATION_EXAMPLES}")
    unknown = [unit for _, unit in parts if unit not in _DURATION_UNITS]
    if unknown or (len(parts) > 1 and any(not unit for _, unit in parts)):
        what = f"an unknown unit {shown(unknown[0])}" if unknown else "a number without a unit"
        raise ValueError(f"{shown(value)} has {what}: write {_DURATION_EXAMPLES}")
    if unit_required and not parts[0][1]:
        raise ValueError(_needs_unit(text.strip()))
    return sum(float(number) * _DURATION_UNITS[unit] for number, unit in parts)
