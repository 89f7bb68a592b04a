"""Byte sizes on the command line: `parse_size("2GiB") == 2 * 1024**3`, and back for display."""

from __future__ import annotations

import re

from maxsim_cli.errors import UsageError

# Decimal units are powers of 1000, binary ones powers of 1024 (IEC), as `ls`/`df` users expect.
UNITS: dict[str, int] = {
    "b": 1,
    "kb": 1000,
    "mb": 1000**2,
    "gb": 1000**3,
    "tb": 1000**4,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
}

_SIZE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str, *, option: str = "size") -> int:
    """Parse a byte count such as `2GiB`, `512 MB`, `1.5GiB` or `4096` (bytes) into an int.

    Units (case-insensitive): B, KB, MB, GB, TB (powers of 1000) and KiB, MiB, GiB, TiB (powers of
    1024). A fractional result is rounded down to whole bytes. Raises `UsageError` (exit 2) naming
    `option` on anything else.
    """
    match = _SIZE.match(str(text))
    unit = match.group(2).lower() if match else ""
    if match is None or (unit and unit not in UNITS):
        raise UsageError(
            f"{option}: invalid size {text!r}; give a number with an optional unit "
            "B, KB, MB, GB, TB, KiB, MiB, GiB or TiB, for example 2GiB"
        )
    return int(float(match.group(1)) * UNITS[unit or "b"])


def format_size(num_bytes: int) -> str:
    """Format a byte count for people: binary units, three significant digits (`1.50 GiB`)."""
    value = float(num_bytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{int(value)} B" if unit == "B" else f"{value:.3g} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def format_count(count: int) -> str:
    """A count for people, the same in every summary: thousands separated by commas (`80,000`)."""
    return f"{int(count):,}"


def format_si(value: float) -> str:
    """A rate or a large figure, three significant digits with K, M or G (`92.0K`, `5.16M`, `455`)."""
    for unit, scale in (("G", 1e9), ("M", 1e6), ("K", 1e3)):
        if value >= scale:
            return f"{value / scale:.3g}{unit}"
    return f"{value:.3g}"


def format_rate(count: float, seconds: float, what: str) -> str:
    """``count`` things in ``seconds`` as a rate for people, e.g. ``92.0K pairs/s`` (``- pairs/s`` when
    no time was measured)."""
    return f"{format_si(count / seconds)} {what}/s" if seconds > 0 else f"- {what}/s"


def format_counted(count: int, singular: str, plural: str) -> str:
    """A count and its noun, e.g. ``1 query``, ``16,934 candidates``."""
    return f"{format_count(count)} {singular if count == 1 else plural}"
