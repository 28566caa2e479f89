"""The copy engine: the only module that touches ``torch.cuda``.

Moves bytes between memory tiers (device pool <-> host arena) asynchronously:

- ``CopyEngine(max_inflight_bytes, device=None)``: one dispatcher thread takes jobs in
  strict priority order (restores/promotions before demotions) and issues them; with a
  CUDA ``device`` (the device pool's) they go to a dedicated H2D or D2H stream *on that
  device* and complete through pooled events that a completion thread per stream
  synchronises in FIFO order. Without one (no device tier, or a CPU stand-in) no CUDA
  context, stream or thread is created. At most
  ``max_inflight_bytes`` are in flight per direction, because concurrent H2D and D2H
  slow each other down on real PCIe.
- ``submit(pieces, restore=...) -> CopyJob``: the copy is ordered after everything the
  caller has queued on its current CUDA stream(s); ``CopyJob.done()`` (poll),
  ``CopyJob.wait(timeout)``; the completion callback runs on the completion thread
  and is where the engine marks a copy ready.
- ``runs(src_extents, dst_extents)``: coalesce two partitions of one payload into the
  fewest ``(src_offset, dst_offset, length)`` runs, so a contiguous slot run moves in
  one ``copy_`` instead of one Python-level copy per block.
- ``pin_host(tensor) -> float | None``: page-lock an existing host buffer once
  (``cudaHostRegister``); returns seconds taken, None when it stays pageable (no CUDA,
  or the runtime refused: a warning, and the pending CUDA error is cleared).
- ``ipc_handle(tensor)`` (export once) / ``open_ipc(handle, nbytes, device)``: CUDA IPC
  for the device pool, opened on the client's own index of that GPU.
- ``to_host(parts)`` / ``to_device(dst, src)``: batched D2H through one page-locked
  buffer; H2D through page-locked staging (device-tier reads and writes).
- ``Fence(*devices)``: events on those devices' current streams; ``wait()`` returns once
  the work queued there so far is done (no device-wide synchronize).
- ``LayerCopier(src, dst)``: client-side copies on a side stream with per-tensor marks.
- ``cuda_available()``, ``synchronize(device)``.

Without CUDA the same bookkeeping runs with synchronous ``copy_`` calls on the
dispatcher thread, so every state transition is exercised by the CPU tests.
"""

from __future__ import annotations

import base64
import ctypes
import heapq
import itertools
import json
import logging
import os
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

log = logging.getLogger("kvpark.copy")


def cuda_available() -> bool:
    return torch.cuda.is_available()


def is_cuda(t: torch.Tensor) -> bool:
    return t.device.type == "cuda"


def runs(src: Sequence[tuple[int, int]], dst: Sequence[tuple[int, int]]) -> list[tuple[int, int, int]]:
    out: list[list[int]] = []
    si = di = so = do = 0
    while si < len(src) and di < len(dst):
        if src[si][1] == so:
            si, so = si + 1, 0
            continue
        if dst[di][1] == do:
            di, do = di + 1, 0
            continue
        n = min(src[si][1] - so, dst[di][1] - do)
        s, d = src[si][0] + so, dst[di][0] + do
        if out and out[-1][0] + out[-1][2] == s and out[-1][1] + out[-1][2] == d:
            out[-1][2] += n
        else:
            out.append([s, d, n])
        so += n
        do += n
    return [(a, b, c) for a, b, c in out]


@dataclass(eq=False)
class CopyJob:
    pieces: list[tuple[torch.Tensor, torch.Tensor]]  # (dst, src)
    nbytes: int
    restore: bool
    on_done: Callable[["CopyJob"], None] | None = None
    error: BaseException | None = None
    after: list = field(default_factory=list)  # CUDA events the copy stream waits on first
    _done: threading.Event = field(default_factory=threading.Event)

    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        """True once the copy has completed; re-raises a copy failure."""
        ok = self._done.wait(timeout)
        if ok and self.error is not None:
            raise self.error
        return ok

    def _finish(self, error: BaseException | None = None) -> None:
        self.error = error
        try:
            if self.on_done is not None:
                self.on_done(self)
        except Exception:  # a callback bug must not kill the completion thread
            log.exception("copy completion callback failed")
        finally:
            self._done.set()


class CopyEngine:
    def __init__(self, max_inflight_bytes: int = 256 << 20, device: torch.device | None = None) -> None:
        # Copies touch the device pool on one GPU: streams, events and the threads that
        # issue and wait on them all belong to that device. A stream made without a
        # device lives on the current one (cuda:0), and an event recorded there would
        # complete at once while the copies run on cuda:N's default stream.
        self.cuda = device is not None and device.type == "cuda" and cuda_available()
        if self.cuda and device is not None and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device if self.cuda else None
        self.max_inflight = max_inflight_bytes
        self._cv = threading.Condition()
        self._queue: list[tuple[int, int, CopyJob]] = []
        self._order = itertools.count()
        self._inflight = {True: 0, False: 0}  # restore direction -> bytes
        self._closed = False
        self.stats = {"restore_bytes": 0, "demote_bytes": 0, "jobs": 0}
        if self.cuda:
            self._streams = {True: torch.cuda.Stream(device=device), False: torch.cuda.Stream(device=device)}
            self._events: list[torch.cuda.Event] = []
            self._pending: dict[bool, deque[tuple[torch.cuda.Event, CopyJob]]] = {True: deque(), False: deque()}
            for direction in (True, False):
                threading.Thread(target=self._complete, args=(direction,), daemon=True,
                                 name=f"kvpark-copy-done-{'h2d' if direction else 'd2h'}").start()
        self._thread = threading.Thread(target=self._dispatch, name="kvpark-copy", daemon=True)
        self._thread.start()

    def submit(self, pieces: list[tuple[torch.Tensor, torch.Tensor]], *, restore: bool,
               on_done: Callable[[CopyJob], None] | None = None) -> CopyJob:
        job = CopyJob(pieces, sum(d.numel() * d.element_size() for d, _ in pieces), restore, on_done)
        if self.cuda:
            # The copy runs on our own stream, so it must start only after whatever the
            # caller queued on its current stream (e.g. the kernel that filled the
            # source): an event recorded now, per CUDA device the pieces touch, which
            # the copy stream waits on before issuing.
            for dev in {t.device for pair in pieces for t in pair if is_cuda(t)}:
                ev = torch.cuda.Event()
                ev.record(torch.cuda.current_stream(dev))
                job.after.append(ev)
        with self._cv:
            if self._closed:
                raise RuntimeError("copy engine is closed")
            # Priority 0 for restores: they always leave the queue before any demotion.
            heapq.heappush(self._queue, (0 if restore else 1, next(self._order), job))
            self._cv.notify_all()
        return job

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        self._thread.join()

    def _next(self) -> CopyJob | None:
        with self._cv:
            while True:
                if self._queue:
                    prio, _, job = self._queue[0]
                    busy = self._inflight[job.restore]
                    if busy == 0 or busy + job.nbytes <= self.max_inflight:
                        heapq.heappop(self._queue)
                        self._inflight[job.restore] += job.nbytes
                        return job
                elif self._closed:
                    return None
                self._cv.wait(0.1)

    def _release(self, job: CopyJob) -> None:
        with self._cv:
            self._inflight[job.restore] -= job.nbytes
            self.stats["restore_bytes" if job.restore else "demote_bytes"] += job.nbytes
            self.stats["jobs"] += 1
            self._cv.notify_all()

    def _bind_thread(self) -> None:
        if self.device is not None:
            torch.cuda.set_device(self.device)

    def _dispatch(self) -> None:
        self._bind_thread()
        while True:
            job = self._next()
            if job is None:
                return
            if not self.cuda:
                err = None
                try:
                    for dst, src in job.pieces:
                        dst.copy_(src)
                except BaseException as e:  # reported to the waiter, never fatal here
                    err = e
                self._release(job)
                job._finish(err)
                continue
            try:
                stream = self._streams[job.restore]
                with torch.cuda.stream(stream):
                    for ev in job.after:
                        stream.wait_event(ev)
                    for dst, src in job.pieces:
                        dst.copy_(src, non_blocking=True)
                    # Blocking events: the completion thread sleeps in synchronize()
                    # instead of spinning a core for the length of the copy.
                    ev = self._events.pop() if self._events else torch.cuda.Event(blocking=True)
                    ev.record(stream)
                with self._cv:
                    self._pending[job.restore].append((ev, job))
                    self._cv.notify_all()
            except BaseException as e:
                self._release(job)
                job._finish(e)

    def _complete(self, direction: bool) -> None:
        # Events on one stream complete in issue order, so waiting on the head is exact.
        self._bind_thread()
        q = self._pending[direction]
        while True:
            with self._cv:
                while not q:
                    # Exit only when nothing is queued or in flight: a job the dispatcher
                    # popped may not have reached the pending list yet.
                    if self._closed and not self._queue and self._inflight[direction] == 0:
                        return
                    self._cv.wait(0.1)
                ev, job = q[0]
            err = None
            try:
                ev.synchronize()
            except BaseException as e:
                err = e
            with self._cv:
                q.popleft()
                self._events.append(ev)
            self._release(job)
            job._finish(err)


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
