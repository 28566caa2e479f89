"""Byte counts as people read them, in refusals and logs.

Primitives: ``human(n) -> str``: "512 B", "19.5 KiB", "1.0 MiB", "2.0 GiB", "1.5 TiB".
"""

from __future__ import annotations


def human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"
