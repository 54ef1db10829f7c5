"""Byte and time quantities: parsing what users type, printing what people read."""

from __future__ import annotations

import re

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
          "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}


def parse_bytes(text: str) -> int:
    """'2GiB' -> 2147483648, '12.49GB' -> 12490000000, '4096' -> 4096."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"not a byte size: {text!r} (examples: 4096, 512MiB, 2GiB, 12.5GB)")
    value = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    if value <= 0:
        raise ValueError(f"byte size must be positive: {text!r}")
    return value


def fmt_bytes(n: float | None) -> str:
    """Both units, labelled: '42.95 GB (40.00 GiB)'; small values in KB / KiB. The decimal unit
    picks the scale (1,057 MB reads 1.06 GB (0.98 GiB))."""
    if n is None:
        return "-"
    for scale, binary, digits, unit in ((1e9, 2**30, 2, "G"), (1e6, 2**20, 1, "M"), (1e3, 2**10, 1, "K")):
        if abs(round(n / scale, digits)) >= 1:
            return f"{n / scale:,.{digits}f} {unit}B ({n / binary:,.{digits}f} {unit}iB)"
    return f"{n:,.0f} B"


def fmt_iec(n: float) -> str:
    """One binary unit, for tables where columns must stay narrow: '22.5 KiB', '512 B'."""
    for scale, unit in ((2**40, "TiB"), (2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
        if abs(n) >= scale:
            return f"{n / scale:,.1f} {unit}"
    return f"{n:,.0f} B"


def fmt_count(n: float) -> str:
    """Parameters and other large counts in the unit that keeps digits: '135 M', '1.7 B', '671 B'.
    The unit is chosen after rounding, so 999.9 M reads '1.0 B', not '1,000 M'."""
    if abs(n) < 1e3:
        return f"{n:,.0f}"
    for scale, unit in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        v = n / scale
        if abs(round(v, 1)) >= 1:
            break
    return f"{v:,.1f} {unit}" if abs(round(v, 1)) < 100 else f"{v:,.0f} {unit}"


def plural(n: int, word: str) -> str:
    """'1 user', '16 users', '2,048 users'."""
    return f"{n:,} {word}{'' if n == 1 else 's'}"


def fmt_seconds(s: float) -> str:
    """'1.25 s', '3.40 ms', '12.5 µs' (a token's load from a prefix tier)."""
    if s < 1e-3:
        return f"{s * 1e6:,.1f} µs"
    return f"{s * 1e3:,.2f} ms" if s < 1 else f"{s:,.2f} s"


def fmt_flops(n: float) -> str:
    """'22.31 TFLOP', '351.2 GFLOP', '12.0 MFLOP'."""
    for scale, unit in ((1e12, "TFLOP"), (1e9, "GFLOP")):
        if n >= scale:
            return f"{n / scale:,.2f} {unit}"
    return f"{n / 1e6:,.1f} MFLOP"
