"""Tensors <-> payload bytes on the client side, device-agnostic.

Primitives:
- ``as_tensors(items, what) -> list[torch.Tensor]``: a caller's list checked before
  anything is sent: torch tensors as they are, numpy arrays through ``torch.from_numpy``
  (sharing their memory), anything else (a nested list, a scalar, ``None``) raises
  ``InvalidArgument`` naming the item.
- ``check_into(into)``: the same for a restore's ``into`` (tensors only: the bytes land
  in place).
- ``byte_view(t) -> torch.Tensor``: a flat ``uint8`` view of ``t``'s bytes (made
  contiguous first if needed; stays on ``t``'s device).
- ``Outputs(metas, device, into)``: destination tensors for a restore, checked against
  ``into`` (or one flat ``into_flat``); ``.flats`` are their byte views;
  ``.finish_one(i)`` hands tensor ``i`` over once its bytes have landed.
- ``pieces(src_lengths, dst_lengths)``: ``kvpark.proto.layout.overlaps``, the walk over
  two partitions of one byte range.
- ``runs(flats, segments) -> [(source view, pool offset, n)]``: the copies that put the
  byte views ``flats`` into the pool ``segments`` (``(offset, length)``), neighbours
  merged where both sides continue in memory (one copy per contiguous run, not per
  tensor: a vLLM save's blocks are views of one snapshot, its slots mostly adjacent).
- ``gather(flats, pool, segments) -> bool``: the same copies for CPU flats into a CPU
  pool, one ``torch.cat`` per pool segment (False, nothing copied: not that case).
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import torch

from kvpark.proto.errors import InvalidArgument
from kvpark.proto.layout import TensorMeta, overlaps as pieces, torch_dtype

__all__ = ["Outputs", "as_tensors", "byte_view", "check_into", "pieces", "runs"]


def _is_list(items: Any) -> bool:
    return isinstance(items, (list, tuple))


def as_tensors(items: Any, what: str = "tensors") -> list[torch.Tensor]:
    if not _is_list(items):
        raise InvalidArgument(f"{what} must be a list or tuple of tensors, got {type(items).__name__}")
    out = []
    for i, t in enumerate(items):
        if isinstance(t, np.ndarray):
            # Accepted: numpy is how many callers hold host buffers, and from_numpy is a
            # zero-copy view. Dtypes torch has no match for (object, strings) are refused.
            try:
                t = torch.from_numpy(np.ascontiguousarray(t)) if t.flags.writeable else torch.tensor(t)
            except (TypeError, ValueError) as e:
                raise InvalidArgument(f"{what}[{i}]: numpy array of dtype {t.dtype} has no torch dtype ({e})") from None
        elif not isinstance(t, torch.Tensor):
            hint = " (nested lists are not tensors: pass torch.tensor(...))" if _is_list(t) else ""
            raise InvalidArgument(f"{what}[{i}] is a {type(t).__name__}, not a tensor{hint}")
        out.append(t)
    return out


def check_into(into: Any) -> None:
    if into is None:
        return
    if not _is_list(into):
        raise InvalidArgument(f"into must be a list or tuple of tensors, got {type(into).__name__}")
    for i, t in enumerate(into):
        if not isinstance(t, torch.Tensor):
            hint = " (wrap a numpy array with torch.from_numpy)" if isinstance(t, np.ndarray) else ""
            raise InvalidArgument(f"into[{i}] is a {type(t).__name__}, not a tensor{hint}")


def byte_view(t: torch.Tensor) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise InvalidArgument(f"expected a torch.Tensor, got {type(t).__name__}")
    t = t.detach()
    if not t.is_contiguous():
        t = t.contiguous()
    return t.reshape(-1).view(torch.uint8)


def _address(t: torch.Tensor, offset: int) -> tuple[torch.device, int, int]:
    """Where byte ``offset`` of the flat view ``t`` lives: (device, storage base, byte)."""
    st = t.untyped_storage()
    return t.device, st.data_ptr(), t.storage_offset() * t.element_size() + offset


def runs(flats: Sequence[torch.Tensor], segments: Sequence[tuple[int, int]]) -> list[tuple[torch.Tensor, int, int]]:
    out: list[tuple[torch.Tensor, int, int]] = []
    # The run being grown: a flat of its storage, that storage's (device, base), the
    # byte it starts at there, where its pool copy starts, and its length.
    cur: tuple[torch.Tensor, tuple[torch.device, int], int, int, int] | None = None
    for si, so, di, do, n in pieces([f.numel() for f in flats], [length for _, length in segments]):
        dst = segments[di][0] + do
        dev, base, byte = _address(flats[si], so)
        if cur is not None:
            c_flat, c_where, c_byte, c_dst, c_n = cur
            if c_where == (dev, base) and c_byte + c_n == byte and c_dst + c_n == dst:
                cur = (c_flat, c_where, c_byte, c_dst, c_n + n)
                continue
            out.append(_span(c_flat, c_byte, c_dst, c_n))
        cur = (flats[si], (dev, base), byte, dst, n)
    if cur is not None:
        c_flat, _where, c_byte, c_dst, c_n = cur
        out.append(_span(c_flat, c_byte, c_dst, c_n))
    return out


def gather(flats: Sequence[torch.Tensor], pool: torch.Tensor, segments: Sequence[tuple[int, int]]) -> bool:
    """Copy the CPU byte views ``flats``, in payload order, into the CPU ``pool``'s
    ``segments``: one ``torch.cat`` into each segment. That is one call into torch per
    segment, where ``runs`` costs a view, a copy and their Python per tensor: a park of
    256 x 1 MiB spends ~1 ms on those alone, and thousands of small blocks more than
    their copies. Neighbours in one storage are one part, as in ``runs``. False, with
    nothing copied, unless every flat and the pool are on the CPU and the flats fill the
    segments exactly (the caller then copies ``runs``)."""
    if pool.device.type != "cpu" or any(f.device.type != "cpu" for f in flats):
        return False
    lengths = [f.numel() for f in flats]
    if sum(lengths) != sum(length for _, length in segments):
        return False
    groups: list[list[torch.Tensor]] = [[] for _ in segments]
    # The part being grown: its segment, its first tensor, its root (``_base``), where it
    # starts and ends in memory, and whether a neighbour joined it.
    cur: list[Any] = []
    for si, so, di, _do, n in pieces(lengths, [length for _, length in segments]):
        f = flats[si]
        part = f if n == lengths[si] else f[so : so + n]
        at = part.data_ptr()
        if cur and cur[4] == at and cur[0] == di:
            # Side by side in memory. Joined when in one storage (a vLLM save's blocks are
            # views of one snapshot: one ``_base``), so torch spreads a run of small
            # blocks over its threads as ``runs`` does, instead of copying each on one.
            root = part._base
            if (root is not None and root is cur[2]) or _one_storage(cur[1], part):
                cur[4], cur[5] = at + n, True
                continue
        if cur:
            groups[cur[0]].append(_joined(cur))
        cur = [di, part, part._base, at, at + n, False]
    if cur:
        groups[cur[0]].append(_joined(cur))
    for (offset, length), parts in zip(segments, groups):
        if parts:
            # Exactly ``length`` bytes: ``out`` is never resized (a view into the mapping).
            torch.cat(parts, out=pool[offset : offset + length])
    return True


def _joined(cur: list[Any]) -> torch.Tensor:
    """The grown part: its first tensor as it is, or one view of its storage spanning it
    and the neighbours joined to it."""
    _di, first, _root, start, end, joined = cur
    if not joined:
        return first
    return _span(first, start - first.untyped_storage().data_ptr(), 0, end - start)[0]


def _one_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def _span(flat: torch.Tensor, byte: int, dst: int, n: int) -> tuple[torch.Tensor, int, int]:
    """``n`` bytes of ``flat``'s storage from byte ``byte`` on, as one flat uint8 view."""
    view = torch.empty(0, dtype=torch.uint8, device=flat.device).set_(flat.untyped_storage(), byte, (n,), (1,))
    return view, dst, n


class Outputs:
    """Where restored bytes go: fresh tensors on ``device``, or the caller's ``into``."""

    def __init__(self, metas: Sequence[TensorMeta], device: torch.device | str | None,
                 into: Sequence[torch.Tensor] | None, staging_device: str | torch.device | None = None,
                 into_flat: torch.Tensor | None = None) -> None:
        self.metas = list(metas)
        self.into = list(into) if into is not None else None
        if into_flat is not None:
            # The whole payload lands in one caller buffer (adapters: one staging tensor).
            total = sum(m.nbytes for m in self.metas)
            flat = into_flat.reshape(-1).view(torch.uint8) if into_flat.is_contiguous() else None
            if flat is None or flat.numel() != total:
                raise InvalidArgument(f"into_flat must be a contiguous tensor of {total} bytes")
            ok = staging_device is None or into_flat.device == torch.device(staging_device)
            self._flat_user = None if ok else flat
            self.flat = flat if ok else torch.empty(total, dtype=torch.uint8, device=staging_device)
            self.targets = []
            self.flats = [self.flat]
            self.device = into_flat.device
            return
        self.flat = None
        if self.into is not None:
            if len(self.into) != len(self.metas):
                raise InvalidArgument(f"into has {len(self.into)} tensors; the sequence has {len(self.metas)}")
            for i, (t, m) in enumerate(zip(self.into, self.metas)):
                if not isinstance(t, torch.Tensor):
                    raise InvalidArgument(f"into[{i}] is not a tensor")
                if tuple(t.shape) != m.shape or str(t.dtype).removeprefix("torch.") != m.dtype:
                    raise InvalidArgument(
                        f"into[{i}] is {list(t.shape)} {t.dtype}; parked tensor is {list(m.shape)} torch.{m.dtype}"
                    )
        target = torch.device(device) if device is not None else torch.device("cpu")
        # Bytes land in ``self.targets``; when a target cannot take them in place (an
        # ``into`` tensor that is not contiguous on the staging device), a staging copy
        # takes them and ``finish`` copies once more.
        stage = torch.device(staging_device) if staging_device is not None else None
        self.targets: list[torch.Tensor] = []
        for i, m in enumerate(self.metas):
            if self.into is not None:
                t = self.into[i]
                ok = t.is_contiguous() and (stage is None or t.device == stage)
                self.targets.append(t if ok else torch.empty(m.shape, dtype=torch_dtype(m.dtype),
                                                            device=stage or t.device))
            else:
                self.targets.append(torch.empty(m.shape, dtype=torch_dtype(m.dtype), device=stage or target))
        self.flats = [t.reshape(-1).view(torch.uint8) for t in self.targets]
        self.device = target

    def finish_flat(self) -> None:
        if self.flat is not None and self._flat_user is not None:
            self._flat_user.copy_(self.flat)

    def finish_one(self, i: int) -> torch.Tensor:
        """Tensor ``i`` once its bytes have landed (copied to the caller's/target place)."""
        tgt = self.targets[i]
        if self.into is not None:
            t = self.into[i]
            if t is not tgt:
                t.copy_(tgt)
            return t
        return tgt if tgt.device == self.device else tgt.to(self.device)
