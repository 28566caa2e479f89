"""CUDA helpers shared by the daemon and the client. With ``tiers/copy.py``, the only
module that touches ``torch.cuda``; every function is a no-op or a plain error without CUDA.

Primitives:
- ``cuda_available()``; ``is_cuda(tensor)``; ``synchronize(device)``.
- ``pin_host(tensor) -> float``: page-lock an existing host buffer once
  (``cudaHostRegister``); returns seconds taken, 0.0 without CUDA. ``unpin_host``.
- ``ipc_handle(tensor)`` / ``open_ipc(handle, nbytes)``: CUDA IPC for the device pool.
- ``device_uuid(device)`` / ``local_device_for(uuid)``: tell whether two processes share a GPU.
- ``LayerCopier``: the client's copies with per-tensor readiness marks.
"""

from __future__ import annotations

import base64
import json
import time

import torch


def cuda_available() -> bool:
    return torch.cuda.is_available()


def is_cuda(t: torch.Tensor) -> bool:
    return t.device.type == "cuda"


def pin_host(t: torch.Tensor) -> float:
    """Page-lock ``t``'s memory once so H2D/D2H copies are real DMA. No-op without CUDA."""
    if not cuda_available() or t.numel() == 0:
        return 0.0
    t0 = time.perf_counter()
    rc = torch.cuda.cudart().cudaHostRegister(t.data_ptr(), t.numel() * t.element_size(), 0)
    if int(rc) != 0:
        raise RuntimeError(f"cudaHostRegister failed with {rc}")
    return time.perf_counter() - t0


def unpin_host(t: torch.Tensor) -> None:
    if cuda_available() and t.numel():
        torch.cuda.cudart().cudaHostUnregister(t.data_ptr())


def synchronize(device: torch.device | str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def ipc_handle(pool: torch.Tensor) -> bytes:
    """Bytes another process on the same GPU can open with ``open_ipc``.

    The storage's share tuple (ints, bools and opaque handle bytes) travels as JSON, not
    pickle, so a client never unpickles what a daemon sent it.
    """
    if not is_cuda(pool):
        raise RuntimeError("CUDA IPC needs a CUDA tensor")
    fields = pool.untyped_storage()._share_cuda_()
    enc = [{"b64": base64.b64encode(f).decode()} if isinstance(f, bytes) else f for f in fields]
    return json.dumps(enc).encode()


def open_ipc(handle: bytes, nbytes: int) -> torch.Tensor:
    fields = [base64.b64decode(f["b64"]) if isinstance(f, dict) else f for f in json.loads(handle)]
    if not all(isinstance(f, (int, bool, bytes)) for f in fields):
        raise RuntimeError("malformed CUDA IPC handle")
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
        ev = torch.cuda.Event()
        ev.record(self._stream)
        return ev

    def wait(self, mark: object) -> None:
        if mark is not None:
            mark.synchronize()  # type: ignore[attr-defined]

    def synchronize(self) -> None:
        """Wait for every copy queued so far."""
        if self._stream is not None:
            self._stream.synchronize()
