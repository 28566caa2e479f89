"""Per-tensor digests for end-to-end verification, as the daemon keeps them.

A client parked with ``verify=True`` sends the xxh3-64 of each tensor's bytes
(``ParkHeader.xxh3``). The daemon stores them in the sequence's manifest under one
reserved attrs key, so they travel with the manifest to every tier (device, host, disk,
remote) and survive restarts with no format change. That key is the daemon's alone:
a park whose attrs name it is refused, and ``SeqInfo.attrs`` never shows it (the
digests come back in ``SeqInfo.xxh3``).

Primitives:
- ``HASH_ATTR``: the reserved attrs key.
- ``encode(digests) -> str`` / ``decode(text) -> tuple[int, ...]`` (``()`` when absent
  or malformed: nothing to check, never a false alarm).
- ``split(attrs) -> (user_attrs, digests)``.
"""

from __future__ import annotations

from typing import Mapping

HASH_ATTR = "kvpark.xxh3"
_HEX = 16  # characters per 64-bit digest


def encode(digests: tuple[int, ...]) -> str:
    return "".join(f"{d:016x}" for d in digests)


def decode(text: str) -> tuple[int, ...]:
    if not text or len(text) % _HEX:
        return ()
    try:
        return tuple(int(text[i : i + _HEX], 16) for i in range(0, len(text), _HEX))
    except ValueError:
        return ()


def split(attrs: Mapping[str, str]) -> tuple[dict[str, str], tuple[int, ...]]:
    """The user's attrs (the reserved key removed) and the digests it held."""
    if HASH_ATTR not in attrs:
        return dict(attrs), ()
    user = {k: v for k, v in attrs.items() if k != HASH_ATTR}
    return user, decode(attrs[HASH_ATTR])
