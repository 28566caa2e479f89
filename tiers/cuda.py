"""CUDA helpers shared by the daemon and the client. With ``tiers/copy.py``, the only
module that touches ``torch.cuda``; every function is a no-op or a plain error without CUDA.

Primitives:
- ``cuda_available()``; ``is_cuda(tensor)``; ``indexed(device)``; ``synchronize(device)``.
- ``pin_host(tensor) -> float | None``: page-lock an existing host buffer once
  (``cudaHostRegister``); returns seconds taken, None when it stays pageable (no CUDA,
  or the runtime refused: a warning, and the pending CUDA error is cleared). ``unpin_host``.
- ``ipc_handle(tensor)`` (export once) / ``open_ipc(handle, nbytes, device)``: CUDA IPC
  for the device pool, opened on the client's own index of that GPU.
- ``to_host(parts)`` / ``to_device(dst, src)``: batched D2H through one page-locked
  buffer; H2D through page-locked staging (device-tier reads and writes).
- ``Fence(*devices)``: events on those devices' current streams; ``wait()`` returns once
  the work queued there so far is done (no device-wide synchronize).
- ``device_uuid(device)`` / ``local_device_for(uuid)``: tell whether two processes share a GPU.
- ``LayerCopier``: the client's copies with per-tensor readiness marks.
"""

from __future__ import annotations

import base64
import ctypes
import json
import logging
import os
import time
from typing import Sequence

import torch

log = logging.getLogger("kvpark.cuda")


def cuda_available() -> bool:
    return torch.cuda.is_available()


def is_cuda(t: torch.Tensor) -> bool:
    return t.device.type == "cuda"


def indexed(device: torch.device) -> torch.device:
    """``device`` with its index: a bare ``cuda`` means the current device."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def pin_host(t: torch.Tensor) -> float | None:
    """Page-lock ``t``'s memory once so H2D/D2H copies are real DMA.

    Returns the seconds it took, or None when ``t`` stays pageable: no CUDA, or
    ``cudaHostRegister`` refused (some container runtimes do). A refusal is a warning,
    not a failure: copies still work, only slower. Registered *portable*, so the pages
    count as pinned for every GPU's context, not only the current device's.
    """
    if not cuda_available() or t.numel() == 0:
        return None
    t0 = time.perf_counter()
    rc = int(torch.cuda.cudart().cudaHostRegister(t.data_ptr(), t.numel() * t.element_size(), _HOST_REGISTER_PORTABLE))
    if rc != 0:
        # The runtime also keeps the failure as this thread's "last error"; left there,
        # the next kernel launch check on this thread would raise it.
        _clear_last_cuda_error()
        log.warning("cannot page-lock %d MiB of host memory (cudaHostRegister error %d); running unpinned, "
                    "host<->device copies will be slower", (t.numel() * t.element_size()) >> 20, rc)
        return None
    return time.perf_counter() - t0


def unpin_host(t: torch.Tensor) -> None:
    """Undo a successful ``pin_host``."""
    if cuda_available() and t.numel():
        torch.cuda.cudart().cudaHostUnregister(t.data_ptr())


_HOST_REGISTER_PORTABLE = 1  # cudaHostRegisterPortable


def _clear_last_cuda_error() -> None:
    """Reset the calling thread's pending CUDA runtime error (``cudaGetLastError``).

    torch does not bind ``cudaGetLastError``; the CUDA runtime torch loaded is found in
    this process's mappings and called through ctypes (the same library instance, so
    the same per-thread error state).
    """
    try:
        with open("/proc/self/maps") as fh:
            fields = [line.split(maxsplit=5) for line in fh]
        paths = {f[5].strip() for f in fields if len(f) == 6 and os.path.basename(f[5].strip()).startswith("libcudart.so")}
        for path in sorted(paths):
            ctypes.CDLL(path).cudaGetLastError()
            return
        log.debug("no libcudart mapped; a pending CUDA error could not be cleared")
    except (OSError, AttributeError) as e:
        log.debug("cannot clear the pending CUDA error: %s", e)


def to_host(parts: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """CPU copies of ``parts`` (device slices): one page-locked buffer, asynchronous DMA
    per part on the current stream, one blocking event for all of them. CPU parts are
    returned as they are."""
    devs = [p.device for p in parts if is_cuda(p)]
    if not devs:
        return list(parts)
    total = sum(p.numel() for p in parts)
    buf = torch.empty(total, dtype=torch.uint8, pin_memory=True)  # torch caches pinned blocks
    out, pos = [], 0
    for p in parts:
        n = p.numel()
        dst = buf[pos : pos + n]
        dst.copy_(p.reshape(-1).view(torch.uint8), non_blocking=True)
        out.append(dst)
        pos += n
    Fence(*devs).wait()
    return out


def to_device(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Copy CPU bytes ``src`` into device memory ``dst`` through a page-locked staging
    buffer (DMA, not the driver's pageable path) and wait on an event for it."""
    if not is_cuda(dst):
        dst.copy_(src)
        return
    staging = torch.empty(src.numel(), dtype=src.dtype, pin_memory=True)
    staging.copy_(src)
    dst.copy_(staging, non_blocking=True)
    Fence(dst.device).wait()  # the staging buffer goes back to torch's cache after this


def synchronize(device: torch.device | str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def ipc_handle(pool: torch.Tensor) -> bytes:
    """Bytes another process on the same GPU can open with ``open_ipc``.

    Call once per pool: every export takes another reference on the storage's IPC
    ref-counter that is never given back.

    The storage's share tuple (ints, bools and opaque handle bytes) travels as JSON, not
    pickle, so a client never unpickles what a daemon sent it.
    """
    if not is_cuda(pool):
        raise RuntimeError("CUDA IPC needs a CUDA tensor")
    fields = pool.untyped_storage()._share_cuda_()
    enc = [{"b64": base64.b64encode(f).decode()} if isinstance(f, bytes) else f for f in fields]
    return json.dumps(enc).encode()


def open_ipc(handle: bytes, nbytes: int, device: torch.device) -> torch.Tensor:
    """Map the pool behind ``handle`` on ``device``: *this* process's index of the GPU
    (found by UUID), which differs from the daemon's under another CUDA_VISIBLE_DEVICES."""
    fields = [base64.b64decode(f["b64"]) if isinstance(f, dict) else f for f in json.loads(handle)]
    if not fields or not all(isinstance(f, (int, bool, bytes)) for f in fields):
        raise RuntimeError("malformed CUDA IPC handle")
    if device.type != "cuda" or device.index is None:
        raise RuntimeError(f"CUDA IPC needs an indexed CUDA device, got {device}")
    fields[0] = device.index  # the share tuple starts with the exporter's device ordinal
    storage = torch.UntypedStorage._new_shared_cuda(*fields)
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage, 0, (nbytes,), (1,))


def device_uuid(device: torch.device) -> str:
    """A stable id of the physical GPU (empty for CPU), so clients can tell they share it."""
    if device.type != "cuda":
        return ""
    return str(torch.cuda.get_device_properties(device).uuid)


def local_device_for(uuid: str) -> torch.device | None:
    """The local CUDA device with this UUID, if this process can see it."""
    if not uuid or not cuda_available():
        return None
    for i in range(torch.cuda.device_count()):
        if str(torch.cuda.get_device_properties(i).uuid) == uuid:
            return torch.device("cuda", i)
    return None


class Fence:
    """One event on the current stream of each CUDA device given (CPU devices ignored).

    ``wait()`` returns once everything queued on those streams so far has finished: the
    precise wait a caller needs before handing memory to another process, without a
    device-wide ``synchronize`` that would also wait for unrelated work (a queued
    forward pass). The events are blocking, so waiting sleeps instead of spinning.
    """

    def __init__(self, *devices: torch.device) -> None:
        self._events: list[torch.cuda.Event] = []
        seen: set[int] = set()
        for d in devices:
            if d.type != "cuda":
                continue
            idx = d.index if d.index is not None else torch.cuda.current_device()
            if idx in seen:
                continue
            seen.add(idx)
            ev = torch.cuda.Event(blocking=True)
            ev.record(torch.cuda.current_stream(idx))
            self._events.append(ev)

    def wait(self) -> None:
        for ev in self._events:
            ev.synchronize()


class LayerCopier:
    """Client-side copies with per-tensor readiness marks.

    On CUDA (either end on a GPU) the copies are queued on a side stream and ``mark()``
    records an event, so ``wait(mark)`` returns as soon as that tensor has landed while
    later ones keep copying. On CPU copies run at once and marks are no-ops, so the
    same API completes in order.
    """

    def __init__(self, src: torch.device, dst: torch.device) -> None:
        dev = src if src.type == "cuda" else dst
        self._cuda = dev.type == "cuda"
        self._stream = torch.cuda.Stream(device=dev) if self._cuda else None
        if self._stream is not None:
            self._stream.wait_stream(torch.cuda.current_stream(dev))

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        if self._stream is None:
            dst.copy_(src)
            return
        with torch.cuda.stream(self._stream):
            dst.copy_(src, non_blocking=True)

    def mark(self) -> object:
        if self._stream is None:
            return None
        ev = torch.cuda.Event(blocking=True)
        ev.record(self._stream)
        return ev

    def wait(self, mark: object) -> None:
        if mark is not None:
            mark.synchronize()  # type: ignore[attr-defined]

    def synchronize(self) -> None:
        """Wait for every copy queued so far (a blocking event: no spinning)."""
        mark = self.mark()
        self.wait(mark)
