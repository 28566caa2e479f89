"""A memory tier: one flat byte pool (host arena or device pool) plus its slot allocator.

Primitives:
- ``MemTier(name, pool, slot_size, high, low)``; ``alloc`` is its ``SlotAllocator``.
- ``views(allocation)`` / ``views_at(extents)`` -> ``list[memoryview]``: CPU-readable block views (zero-copy for CPU
  pools; a device pool's blocks come over in one batched page-locked D2H, for the rare
  disk write or stream served from device).
- ``write(offset, data)``: put CPU bytes at a pool offset (inline parks, disk promotions);
  into a device pool through page-locked staging.
- ``tensor(offset, n)``: a device-agnostic slice for the copy engine.
"""

from __future__ import annotations

import warnings
from typing import Sequence

import numpy as np
import torch

from . import cuda
from .arena import Allocation, SlotAllocator

# torch warns once per process when it wraps a read-only buffer (received gRPC
# messages are immutable bytes); we only ever read from those wrappers.
warnings.filterwarnings("ignore", message="The given buffer is not writable")


class MemTier:
    def __init__(self, name: str, pool: torch.Tensor, slot_size: int, high: float, low: float,
                 view: memoryview | None = None) -> None:
        assert pool.dtype == torch.uint8 and pool.dim() == 1
        self.name = name
        self.pool = pool
        self.alloc = SlotAllocator(pool.numel(), slot_size)
        self.high = high
        self.low = low
        self.on_cpu = pool.device.type == "cpu"
        if view is not None:
            self._view: memoryview | None = view
        elif self.on_cpu:
            self._view = memoryview(pool.numpy()) if pool.numel() else memoryview(b"")
        else:
            self._view = None

    @property
    def device(self) -> torch.device:
        return self.pool.device

    def tensor(self, offset: int, n: int) -> torch.Tensor:
        return self.pool[offset : offset + n]

    def views(self, a: Allocation) -> list[memoryview]:
        return self.views_at(a.extents)

    def views_at(self, extents: Sequence[tuple[int, int]]) -> list[memoryview]:
        if self._view is not None:
            v = self._view
            return [v[o : o + n] for o, n in extents]
        return [memoryview(t.numpy()) for t in cuda.to_host([self.pool[o : o + n] for o, n in extents])]

    def write(self, offset: int, data: memoryview) -> None:
        n = len(data)
        if self._view is not None:
            self._view[offset : offset + n] = data
        else:
            cuda.to_device(self.pool[offset : offset + n], torch.from_numpy(np.frombuffer(data, dtype=np.uint8)))
