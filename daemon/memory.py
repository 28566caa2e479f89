"""The daemon's memory tiers: the optional device pool, the shared host arena, and the
private tier.

Primitives:
- ``MemoryTiers.open(TiersConfig, PolicyConfig)``: the device pool (when enabled; its
  CUDA IPC handle exported once), the host arena (stale arena files removed first;
  page-locked once when the device pool is on a GPU) and, when
  ``tiers.private.capacity`` resolved above 0 (a tenant is not trusted_local), the
  private tier: daemon-private memory (``kvpark.tiers.private``) that no client maps.
- ``auto_device_capacity(free, total, fraction, floor, ceiling) -> (bytes, why)``: the
  size of a ``tiers.device.capacity = "auto"`` pool (pure; the start-up log gives ``why``).
- ``tiers``: name -> ``MemTier``, fastest first; ``arena``; ``ipc_handle`` (empty
  without a CUDA pool); ``arena_pinned``; ``close()``.

The private tier is never page-locked: its sequences never go to or come from the
device pool (``placement.py``), so it has no copies that page-locking would speed up.
"""

from __future__ import annotations

import logging

import torch

from kvpark.proto.errors import StartupError
from kvpark.tiers import cuda
from kvpark.tiers.memory import MemTier
from kvpark.tiers.private import PrivateMemory
from kvpark.tiers.shm import SharedArena, remove_stale

from .config import PolicyConfig, TiersConfig
from .placement import PRIVATE

log = logging.getLogger("kvpark.engine")


def auto_device_capacity(free: int | None, total: int | None, fraction: float, floor: int,
                         ceiling: int) -> tuple[int, str]:
    """The size of an auto-sized device pool, and why, in words for the start-up log.

    ``fraction`` of the GPU's free memory, between ``floor`` and ``ceiling``: small, so
    an engine started next (vLLM asks for ``gpu_memory_utilization`` of the whole GPU)
    still fits. 0, with the reason, when even ``floor`` would take more than half of
    what is free. ``free`` None: not a GPU (the CPU stand-in) or unknown: ``floor``."""
    if free is None:
        return floor, f"auto: {floor >> 20} MiB, auto_min (free memory unknown on this device)"
    want = min(max(int(free * fraction), floor), ceiling)
    if want > free // 2:
        return 0, (f"off: auto sizing found {free >> 20} MiB free of {(total or 0) >> 20} MiB, too little for "
                   f"auto_min = {floor >> 20} MiB; set tiers.device.capacity to size it by hand")
    bound = "auto_max" if want == ceiling else "auto_min" if want == floor else f"{fraction:g} of it"
    return want, (f"auto: {free >> 20} MiB free of {(total or 0) >> 20} MiB at start, {bound}")


class MemoryTiers:
    def __init__(self, tiers: dict[str, MemTier], arena: SharedArena, ipc_handle: bytes, arena_pinned: bool,
                 private: PrivateMemory | None = None) -> None:
        self.tiers = tiers
        self.arena = arena
        self.ipc_handle = ipc_handle
        self.arena_pinned = arena_pinned
        self.private = private

    @classmethod
    def open(cls, config: TiersConfig, pol: PolicyConfig) -> "MemoryTiers":
        host, dev = config.host, config.device
        tiers: dict[str, MemTier] = {}
        ipc_handle = b""
        device = torch.device(dev.device)
        cap, why = 0, ""
        wanted = dev.enabled == "true" or (dev.enabled == "auto" and device.type == "cuda" and cuda.cuda_available())
        if wanted:
            if device.type == "cuda" and not cuda.cuda_available():
                raise StartupError(f"tiers.device.enabled = true and tiers.device.device = {dev.device}, but CUDA "
                                   'is not available here; set tiers.device.enabled = "auto" or "false"')
            if dev.capacity == "auto":
                free, total = cuda.memory_info(device)
                cap, why = auto_device_capacity(free, total, dev.auto_fraction, dev.auto_min, dev.auto_max)
            else:
                cap, why = int(dev.capacity), "tiers.device.capacity"
            cap = (cap // host.slot_size) * host.slot_size
        if wanted and cap:
            pool = torch.empty(cap, dtype=torch.uint8, device=device)
            tiers["device"] = MemTier("device", pool, host.slot_size, dev.high_watermark or pol.high_watermark,
                                      dev.low_watermark or pol.low_watermark)
            log.info("device tier: %d MiB on %s (%s)", cap >> 20, device, why)
            if device.type == "cuda":
                # Exported once, not per Hello: each export takes an IPC reference on the
                # pool's storage that is never given back. A pool torch cannot share (an
                # allocator with expandable segments may refuse) still serves every other
                # path: only cuda_ipc is off, and the log says why.
                try:
                    ipc_handle = cuda.ipc_handle(pool)
                except RuntimeError as e:
                    log.warning("device tier: cuda_ipc off, the pool cannot be shared with other processes (%s); "
                                "clients use shm or inline", e)
        elif wanted:
            log.warning("device tier: %s", why if why.startswith("off") else f"off ({why} holds no slot)")
        elif dev.enabled == "false":
            log.info("device tier: off (tiers.device.enabled = false)")
        elif device.type != "cuda":
            log.info("device tier: off (tiers.device.device = %s is not a GPU)", dev.device)
        else:
            log.info("device tier: off (no CUDA device here; tiers.device.enabled = auto)")

        removed = remove_stale(host.shm_dir)
        if removed:
            log.info("removed %d stale arena file(s) from %s", len(removed), host.shm_dir)
        cap = int(host.capacity)
        arena = SharedArena.create(host.shm_dir, cap, prefault=host.prefault, group=host.group)
        # A slow start is mostly the prefault: say what shortens it.
        hint = ("; to start faster: tiers.host.prefault = false (page faults then land on first use) or a smaller "
                "tiers.host.capacity") if host.prefault and arena.prefault_s >= 1.0 else ""
        log.info("host arena: %d MiB in %d slots of %d KiB, %s (%.2fs to map%s)", cap >> 20, cap // host.slot_size,
                 host.slot_size >> 10, arena.path or "private memory", arena.prefault_s, hint)
        # Page-locking only pays off for copies to and from a GPU pool; without one it
        # would create a CUDA context for nothing.
        gpu = tiers.get("device")
        took = cuda.pin_host(arena.tensor, gpu.device) if gpu is not None and gpu.device.type == "cuda" else None
        if took is not None:
            log.info("host arena page-locked in %.2fs", took)
        tiers["host"] = MemTier("host", arena.tensor, host.slot_size, host.high_watermark or pol.high_watermark,
                                host.low_watermark or pol.low_watermark, view=arena.view)
        private = None
        priv = config.private
        if priv.capacity:
            try:
                private = PrivateMemory.create(priv.capacity, prefault=host.prefault)
            except BaseException:
                if took is not None:
                    cuda.unpin_host(arena.tensor, gpu.device if gpu is not None else None)
                arena.close(unlink=True)
                raise
            tiers[PRIVATE] = MemTier(PRIVATE, private.tensor, host.slot_size,
                                     priv.high_watermark or pol.high_watermark, priv.low_watermark or pol.low_watermark,
                                     view=private.view)
            log.info("private tier: %d MiB of daemon-private memory for tenants that are not trusted_local",
                     priv.capacity >> 20)
        return cls(tiers, arena, ipc_handle, took is not None, private)

    def close(self) -> None:
        if self.arena_pinned:
            gpu = self.tiers.get("device")
            cuda.unpin_host(self.arena.tensor, gpu.device if gpu is not None else None)
        self.tiers.clear()
        self.arena.close(unlink=True)
        if self.private is not None:
            self.private.close()
