"""CUDA helpers shared by the daemon and the client. With ``tiers/copy.py``, the only
module that touches ``torch.cuda``; every function is a no-op or a plain error without CUDA.

Primitives:
- ``cuda_available()``; ``is_cuda(tensor)``; ``indexed(device)``; ``synchronize(device)``.
- ``on_device(device)``: a context that makes ``device`` current for the calling thread
  (a no-op for CPU devices or ``None``). Every CUDA call a thread makes that is not tied
  to a tensor (``cudaHostRegister``, pinned allocations, events) runs under it: a thread
  that never set its device would otherwise open a context on GPU 0.
- ``pin_host(tensor, device=None) -> float | None``: page-lock an existing host buffer
  once (``cudaHostRegister``, portable), under ``device``; returns seconds taken, None
  when it stays pageable (no CUDA, or the runtime refused: a warning, and the pending
  CUDA error is cleared through torch's own runtime). ``unpin_host(tensor, device=None)``.
- ``ipc_handle(tensor)`` (export once) / ``open_ipc(handle, nbytes, device)``: CUDA IPC
  for the device pool, opened on the client's own index of that GPU. A handle exported
  by this very process (an in-process daemon) opens as the pool itself: CUDA refuses to
  open its own export.
- ``Staging(device, chunk)``: two reusable page-locked bounce buffers per direction,
  guarded by events (``download(parts)``: D2H into fresh pageable tensors; ``upload(dst,
  src)``: pageable bytes to device memory), so no copy pins or allocates per call.
  ``staging(device)``: the process's one ``Staging`` per device. ``pinned_bytes()``: the
  page-locked memory this process holds for staging and registered mappings.
- ``to_host(parts)`` / ``to_device(dst, src)``: device-tier reads and writes through
  ``staging``.
- ``memory_info(device) -> (free, total)``: the GPU's memory now ((None, None) off CUDA).
- ``as_index(ids, device)``: an index tensor uploaded without a stream sync;
  ``record_event(device)``: a blocking event on the current stream (None off CUDA).
- ``Fence(*devices)``: events on those devices' current streams; ``wait()`` returns once
  the work queued there so far is done (no device-wide synchronize).
- ``device_uuid(device)`` / ``local_device_for(uuid)``: tell whether two processes share a GPU.
- ``side_stream(device, role)``: the process's one stream per role and device;
  ``on_stream(device, role)``: that stream made current inside a block.
- ``LayerCopier``: the client's copies with per-tensor readiness marks, on a side stream.
"""

from __future__ import annotations

import base64
import json
import logging
import threading
import time
import weakref
from contextlib import nullcontext
from typing import ContextManager, Sequence

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


def on_device(device: torch.device | None) -> ContextManager[object]:
    """Make ``device`` current for the calling thread inside the block (CPU or None: no-op)."""
    if device is None or device.type != "cuda" or not cuda_available():
        return nullcontext()
    return torch.cuda.device(indexed(device))


_pinned_lock = threading.Lock()
_pinned: dict[int, int] = {}  # data_ptr -> bytes registered by pin_host, for pinned_bytes()


def pin_host(t: torch.Tensor, device: torch.device | None = None) -> float | None:
    """Page-lock ``t``'s memory once so H2D/D2H copies are real DMA.

    Returns the seconds it took, or None when ``t`` stays pageable: no CUDA, or
    ``cudaHostRegister`` refused (some container runtimes do). A refusal is a warning,
    not a failure: copies still work, only slower. Registered *portable*, so the pages
    count as pinned for every GPU's context; the call runs under ``device`` so that a
    thread that never chose one does not open a context on GPU 0.
    """
    if not cuda_available() or t.numel() == 0:
        return None
    nbytes = t.numel() * t.element_size()
    with on_device(device):
        t0 = time.perf_counter()
        rc = int(torch.cuda.cudart().cudaHostRegister(t.data_ptr(), nbytes, _HOST_REGISTER_PORTABLE))
        if rc != 0:
            # The runtime also keeps the failure as this thread's "last error"; left there,
            # the next kernel launch check on this thread would raise it.
            _clear_last_cuda_error()
            log.warning("cannot page-lock %d MiB of host memory (cudaHostRegister error %d); running unpinned, "
                        "host<->device copies will be slower", nbytes >> 20, rc)
            return None
    with _pinned_lock:
        _pinned[t.data_ptr()] = nbytes
    return time.perf_counter() - t0


def unpin_host(t: torch.Tensor, device: torch.device | None = None) -> None:
    """Undo a successful ``pin_host``."""
    if cuda_available() and t.numel():
        with on_device(device):
            rc = int(torch.cuda.cudart().cudaHostUnregister(t.data_ptr()))
            if rc != 0:
                _clear_last_cuda_error()  # else the next kernel launch on this thread raises it
                log.warning("cudaHostUnregister of %d MiB failed (error %d)", (t.numel() * t.element_size()) >> 20,
                            rc)
                return
        with _pinned_lock:
            _pinned.pop(t.data_ptr(), None)


def pinned_bytes() -> dict[str, int]:
    """Page-locked host memory this process holds: ``registered`` (mappings pinned with
    ``pin_host``) and ``staging`` (every ``Staging``'s bounce buffers)."""
    with _pinned_lock:
        registered = sum(_pinned.values())
    with _staging_lock:
        staged = sum(s.pinned_bytes for s in _stagings.values())
    return {"registered": registered, "staging": staged}


_HOST_REGISTER_PORTABLE = 1  # cudaHostRegisterPortable


def _clear_last_cuda_error() -> None:
    """Reset the calling thread's pending CUDA runtime error.

    torch does not bind ``cudaGetLastError``, and a process may have two ``libcudart``
    mapped (torch's and another library's), each with its own error state. So the error
    is cleared through torch's own runtime: a tiny kernel launch, whose launch check
    calls ``cudaGetLastError`` (which resets it) and raises what was pending.
    """
    try:
        torch.empty(1, dtype=torch.uint8, device="cuda").zero_()
    except RuntimeError as e:  # the pending error, now cleared
        log.debug("cleared a pending CUDA error: %s", e)


STAGE_CHUNK = 8 << 20  # bytes per bounce buffer: 2 per direction, so 32 MiB pinned per device


def plan_chunks(lengths: Sequence[int], chunk: int) -> list[list[tuple[int, int, int, int]]]:
    """Pieces of the byte streams ``lengths`` grouped into buffer-sized rounds.

    Each round is a list of ``(part, part_offset, buffer_offset, n)``; a round fills at
    most ``chunk`` bytes of one bounce buffer, small parts share a round, a large part
    spans several. Pure: the CPU tests check it."""
    rounds: list[list[tuple[int, int, int, int]]] = []
    cur: list[tuple[int, int, int, int]] = []
    used = 0
    for i, n in enumerate(lengths):
        off = 0
        while off < n:
            take = min(n - off, chunk - used)
            cur.append((i, off, used, take))
            off += take
            used += take
            if used == chunk:
                rounds.append(cur)
                cur, used = [], 0
    if cur:
        rounds.append(cur)
    return rounds


class Staging:
    """Two reusable bounce buffers per direction for one device, page-locked on CUDA.

    Copies between device memory and pageable host memory go through them a round at a
    time, double-buffered: the DMA of one round runs while the CPU fills (or drains) the
    other buffer, and an event per buffer says when it may be touched again. So no copy
    allocates or pins memory per call (torch's pinned allocator rounds every size up to
    a power of two and caches it for ever; a new size takes a global lock mid-copy), and
    the page-locked memory is bounded: ``4 * chunk`` per device, reported by
    ``pinned_bytes``. One caller per direction at a time (a lock each); on a CPU device
    the same rounds run with plain buffers and synchronous copies, which is how the CPU
    tests exercise the plan.
    """

    def __init__(self, device: torch.device, chunk: int = STAGE_CHUNK) -> None:
        self.device = indexed(device)
        self.chunk = int(chunk)
        self.cuda = self.device.type == "cuda" and cuda_available()
        self._locks = {"d2h": threading.Lock(), "h2d": threading.Lock()}
        self._bufs: dict[str, list[torch.Tensor]] = {}
        self._streams: dict[str, object] = {}  # per direction, so the two run at once
        self.rounds = 0  # rounds run, both directions (tests: the double-buffering ran)

    @property
    def pinned_bytes(self) -> int:
        bufs = list(self._bufs.values())  # a copy: another thread may add a direction (GIL-atomic)
        return sum(b.numel() for pair in bufs for b in pair if b.is_pinned()) if self.cuda else 0

    def _buffers(self, direction: str) -> list[torch.Tensor]:
        bufs = self._bufs.get(direction)
        if bufs is None:
            with on_device(self.device):
                try:
                    bufs = [torch.empty(self.chunk, dtype=torch.uint8, pin_memory=self.cuda) for _ in range(2)]
                except RuntimeError as e:
                    # Still correct, only slower: a copy out of or into pageable memory
                    # is done with it before it returns.
                    log.warning("cannot page-lock %d MiB of staging (%s); staging through pageable memory",
                                (2 * self.chunk) >> 20, e)
                    bufs = [torch.empty(self.chunk, dtype=torch.uint8) for _ in range(2)]
                if self.cuda:
                    self._streams[direction] = side_stream(self.device, f"staging-{direction}")
            self._bufs[direction] = bufs
        return bufs

    def _record(self, direction: str) -> object:
        if not self.cuda:
            return None
        ev = torch.cuda.Event(blocking=True)
        ev.record(self._streams[direction])  # type: ignore[arg-type]
        return ev

    @staticmethod
    def _wait(ev: object) -> None:
        if ev is not None:
            ev.synchronize()  # type: ignore[attr-defined]

    def _side(self, direction: str) -> ContextManager[object]:
        if not self.cuda:
            return nullcontext()
        stream = self._streams[direction]
        # Whatever the caller queued on its current stream (the bytes being read, or a
        # reader of the destination) is ordered before the staged copies.
        stream.wait_stream(torch.cuda.current_stream(self.device))  # type: ignore[attr-defined]
        return torch.cuda.stream(stream)  # type: ignore[arg-type]

    def download(self, parts: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Pageable CPU copies of the flat ``uint8`` device tensors ``parts``."""
        out = [torch.empty(p.numel(), dtype=torch.uint8) for p in parts]
        flat = [p.reshape(-1).view(torch.uint8) for p in parts]
        with self._locks["d2h"], on_device(self.device):
            bufs = self._buffers("d2h")
            pending: list[tuple[object, list[tuple[int, int, int, int]]] | None] = [None, None]

            def drain(slot: int) -> None:
                job = pending[slot]
                if job is not None:
                    self._wait(job[0])
                    for i, off, boff, n in job[1]:
                        out[i][off : off + n].copy_(bufs[slot][boff : boff + n])
                    pending[slot] = None

            try:
                with self._side("d2h"):
                    for k, rnd in enumerate(plan_chunks([p.numel() for p in flat], self.chunk)):
                        slot = k % 2
                        drain(slot)  # the round before last used this buffer: empty it first
                        for i, off, boff, n in rnd:
                            bufs[slot][boff : boff + n].copy_(flat[i][off : off + n], non_blocking=True)
                        pending[slot] = (self._record("d2h"), rnd)
                        self.rounds += 1
                for slot in (0, 1):
                    drain(slot)
            except BaseException:
                self._settle(pending)
                raise
        return out

    def upload(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Copy the CPU bytes ``src`` into device memory ``dst`` (flat, same size); returns
        once they have landed."""
        d = dst.reshape(-1).view(torch.uint8)
        s = src.reshape(-1).view(torch.uint8)
        if d.numel() != s.numel():
            raise ValueError(f"upload of {s.numel()} bytes into {d.numel()}")
        with self._locks["h2d"], on_device(self.device):
            bufs = self._buffers("h2d")
            events: list[object] = [None, None]
            try:
                with self._side("h2d"):
                    for k, rnd in enumerate(plan_chunks([s.numel()], self.chunk)):
                        slot = k % 2
                        self._wait(events[slot])  # its last DMA has read the buffer
                        for _i, off, boff, n in rnd:
                            bufs[slot][boff : boff + n].copy_(s[off : off + n])
                            d[off : off + n].copy_(bufs[slot][boff : boff + n], non_blocking=True)
                        events[slot] = self._record("h2d")
                        self.rounds += 1
            finally:
                # Landed before the caller (or the next upload) goes on.
                for ev in events:
                    self._wait(ev)
            if self.cuda:
                torch.cuda.current_stream(self.device).wait_stream(self._streams["h2d"])  # type: ignore[arg-type]

    def _settle(self, pending: list) -> None:
        """After a failure: no DMA may still be writing a buffer the next caller reuses."""
        for job in pending:
            if job is not None:
                try:
                    self._wait(job[0])
                except Exception:  # noqa: BLE001 - a broken context runs no more copies
                    pass


_staging_lock = threading.Lock()
_stagings: dict[str, Staging] = {}


def staging(device: torch.device) -> Staging:
    """This process's one ``Staging`` for ``device``."""
    key = str(indexed(device))
    with _staging_lock:
        st = _stagings.get(key)
        if st is None:
            st = _stagings[key] = Staging(torch.device(key))
        return st


def to_host(parts: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """CPU copies of ``parts`` (flat uint8 device slices), through the device's staging
    buffers. CPU parts are returned as they are."""
    devs = {p.device for p in parts if is_cuda(p)}
    if not devs:
        return list(parts)
    if len(devs) > 1 or not all(is_cuda(p) for p in parts):
        return [p.cpu() if is_cuda(p) else p for p in parts]  # mixed devices: not a path kvpark takes
    return staging(next(iter(devs))).download(parts)


def to_device(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Copy CPU bytes ``src`` into device memory ``dst`` through the device's staging
    buffers; returns once they have landed."""
    if not is_cuda(dst):
        dst.copy_(src)
        return
    staging(dst.device).upload(dst, src)


def memory_info(device: torch.device) -> tuple[int | None, int | None]:
    """``(free, total)`` bytes of ``device`` now; ``(None, None)`` for a CPU stand-in."""
    if device.type != "cuda" or not cuda_available():
        return None, None
    free, total = torch.cuda.mem_get_info(indexed(device))
    return int(free), int(total)


def as_index(ids: Sequence[int], device: torch.device) -> torch.Tensor:
    """``ids`` as a ``long`` tensor on ``device``. On a GPU it goes up from page-locked
    memory without blocking: ``torch.as_tensor(ids, device=cuda)`` copies from pageable
    memory, which waits for everything queued on the stream first (a sync per call)."""
    idx = torch.as_tensor(ids, dtype=torch.long)
    if device.type == "cpu":
        return idx
    if device.type != "cuda" or not cuda_available():
        return idx.to(device)
    # torch's pinned allocator keeps the source until the queued copy has read it.
    return idx.pin_memory().to(device, non_blocking=True)


def record_event(device: torch.device) -> "torch.cuda.Event | None":
    """A blocking event recorded now on ``device``'s current stream (None off CUDA)."""
    if device.type != "cuda" or not cuda_available():
        return None
    ev = torch.cuda.Event(blocking=True)
    ev.record(torch.cuda.current_stream(device))
    return ev


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
    # The share tuple is torch's private layout: it is tagged with the torch release that
    # made it, and another release refuses it in words instead of misreading it.
    handle = json.dumps({"torch": _torch_release(), "fields": enc}).encode()
    with _exported_lock:
        for dead in [h for h, r in _exported.items() if r() is None]:
            del _exported[dead]
        _exported[handle] = weakref.ref(pool)
    return handle


# Handles this process exported, to the pool behind each: CUDA refuses to open an IPC
# handle in the process that made it, so a client of an in-process daemon (``kvpark
# bench``, tests, an embedded daemon) gets the pool itself. Weak: a closed daemon's pool
# is not kept alive by its handle.
_exported_lock = threading.Lock()
_exported: "dict[bytes, weakref.ref[torch.Tensor]]" = {}


def open_ipc(handle: bytes, nbytes: int, device: torch.device) -> torch.Tensor:
    """Map the pool behind ``handle`` on ``device``: *this* process's index of the GPU
    (found by UUID), which differs from the daemon's under another CUDA_VISIBLE_DEVICES."""
    try:
        doc = json.loads(handle)
        made_by, raw = doc["torch"], doc["fields"]
        fields = [base64.b64decode(f["b64"]) if isinstance(f, dict) else f for f in raw]
    except (ValueError, KeyError, TypeError) as e:
        raise RuntimeError(f"malformed CUDA IPC handle ({type(e).__name__})") from None
    if made_by != _torch_release():
        raise RuntimeError(f"the daemon's torch {made_by} shares its pool in a form this process's torch "
                           f"{_torch_release()} may misread; run both on one torch release")
    if not fields or not all(isinstance(f, (int, bool, bytes)) for f in fields):
        raise RuntimeError("malformed CUDA IPC handle")
    if device.type != "cuda" or device.index is None:
        raise RuntimeError(f"CUDA IPC needs an indexed CUDA device, got {device}")
    with _exported_lock:
        ref = _exported.get(handle)
    own = ref() if ref is not None else None
    if own is not None:
        if own.device != device or own.numel() < nbytes:
            raise RuntimeError(f"this process exported that pool on {own.device} ({own.numel()} bytes), "
                               f"not {nbytes} bytes on {device}")
        return own[:nbytes]
    fields[0] = device.index  # the share tuple starts with the exporter's device ordinal
    storage = torch.UntypedStorage._new_shared_cuda(*fields)
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage, 0, (nbytes,), (1,))


def _torch_release() -> str:
    """torch's major.minor: the share tuple's layout changes between releases, not patches."""
    return ".".join(torch.__version__.split("+")[0].split(".")[:2])


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


_streams_lock = threading.Lock()
_streams: dict[tuple[str, str], object] = {}


def side_stream(device: torch.device, role: str) -> "torch.cuda.Stream":
    """This process's one side stream for ``role`` on ``device``, made once.

    ``torch.cuda.Stream()`` hands out streams from a small pool per priority, round robin,
    shared with every other user in the process (an engine's own side streams too): a new
    one per call soon lands copies on a stream that runs model work. One long-lived stream
    per role and device (``"d2h"``, ``"h2d"``, ``"d2d"``, ``"staging-d2h"``,
    ``"staging-h2d"``, ``"saver"``), one per direction so the two run at once, from the
    high-priority pool, which few users draw from (and which lets a load's copies go
    ahead of queued bulk work). Sharing with another user of that pool is still possible;
    it costs time, never correctness (every wait is on an event)."""
    dev = indexed(device)
    key = (str(dev), role)
    with _streams_lock:
        st = _streams.get(key)
        if st is None:
            with on_device(dev):
                st = _streams[key] = torch.cuda.Stream(device=dev, priority=-1)
        return st  # type: ignore[return-value]


def on_stream(device: torch.device | None, role: str) -> ContextManager[object]:
    """Make this process's ``role`` side stream current on ``device`` inside the block
    (CPU or None: no-op): a background thread's copies and waits then stay off the
    default stream, which the model's work may be queued on."""
    if device is None or device.type != "cuda" or not cuda_available():
        return nullcontext()
    return torch.cuda.stream(side_stream(device, role))


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
        role = "d2d" if src.type == dst.type == "cuda" else "d2h" if src.type == "cuda" else "h2d"
        self._stream = side_stream(dev, role) if self._cuda else None
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
