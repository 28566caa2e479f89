"""Interning of the per-sequence metadata that a million blocks repeat.

The vLLM connector parks every KV block as its own sequence, and all blocks of one model
carry the same tensor metadata and the same attrs (``{"layout": <fingerprint>}``). Each
request decodes them afresh (protobuf or JSON), so without interning every block would
keep its own ``TensorMeta`` tuple, shape tuple, attrs dict and strings: about half of
the daemon's metadata per block. These tables hand back one shared object per distinct
value instead.

The shared objects are never changed in place: ``Manifest.tensors`` is a tuple of
frozen ``TensorMeta``; an interned attrs dict is only ever read or copied (``Seq.attrs``
and ``Manifest.encode`` copy it).

Primitives:
- ``layout(tensors) -> (tensors, fingerprint)``: the shared tuple and its layout
  fingerprint (``kvpark.proto.layout.fingerprint``), computed once per distinct layout.
- ``layout_json(raw) -> (tensors, fingerprint)``: the same from a manifest's JSON
  ``tensors`` list, without building ``TensorMeta`` objects for a layout already seen.
- ``attrs(d) -> dict``: the shared dict equal to ``d``; ``attrs_json(raw)``: the same from
  a manifest's JSON attrs object.
- ``number(n)``: the shared int equal to ``n`` (block sizes repeat too).
- ``form(value, key)``: the shared object equal to ``value`` under ``key`` (a
  manifest's ``Form``: everything but its id, generation and times).
The tables are bounded (``MAX_ENTRIES`` each; full, they start over), so sequences that
each carry unique attrs cost nothing extra here. Callers hold no lock: a race between
two threads at worst interns one value twice.
"""

from __future__ import annotations

from typing import TypeVar

from kvpark.proto.layout import TensorMeta, fingerprint

MAX_ENTRIES = 4096
T = TypeVar("T")

_layouts: dict[tuple[TensorMeta, ...], tuple[tuple[TensorMeta, ...], int]] = {}
_json_layouts: dict[tuple, tuple[tuple[TensorMeta, ...], int]] = {}
_attrs: dict[tuple[tuple[str, str], ...], dict[str, str]] = {}
_json_attrs: dict[tuple, dict[str, str]] = {}
_numbers: dict[int, int] = {}
_forms: dict[tuple, object] = {}


def _put(table: dict, key: object, value: object) -> None:
    if len(table) >= MAX_ENTRIES:
        table.clear()
    table[key] = value


def layout(tensors: tuple[TensorMeta, ...]) -> tuple[tuple[TensorMeta, ...], int]:
    hit = _layouts.get(tensors)
    if hit is None:
        hit = (tuple(tensors), fingerprint(tensors))
        _put(_layouts, hit[0], hit)
    return hit


def layout_json(raw: list) -> tuple[tuple[TensorMeta, ...], int]:
    key = tuple((t[0], tuple(t[1]), t[2]) for t in raw)
    hit = _json_layouts.get(key)
    if hit is None:
        hit = layout(tuple(TensorMeta.from_json(t) for t in raw))
        _put(_json_layouts, key, hit)
    return hit


def attrs(d: dict[str, str]) -> dict[str, str]:
    key = tuple(d.items())
    hit = _attrs.get(key)
    if hit is None:
        hit = dict(d)
        _put(_attrs, key, hit)
    return hit


def attrs_json(raw: dict) -> dict[str, str]:
    """``attrs`` of a decoded manifest's attrs object (keys and values made strings)."""
    key = tuple(raw.items())
    hit = _json_attrs.get(key)
    if hit is None:
        hit = attrs({str(k): str(v) for k, v in raw.items()})
        _put(_json_attrs, key, hit)
    return hit


def number(n: int) -> int:
    hit = _numbers.get(n)
    if hit is None:
        _put(_numbers, n, n)
        hit = n
    return hit


def form(value: T, key: tuple) -> T:
    hit = _forms.get(key)
    if hit is None:
        _put(_forms, key, value)
        return value
    return hit  # type: ignore[return-value]
