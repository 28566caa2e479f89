"""The daemon's copy engine. With ``tiers/cuda.py``, the only module that touches ``torch.cuda``.

Moves bytes between memory tiers (device pool <-> host arena) asynchronously:

- ``CopyEngine(max_inflight_bytes, device=None)``: one dispatcher thread takes jobs in
  strict priority order (restores/promotions before demotions) and issues them; with a
  CUDA ``device`` (the device pool's) they go to a dedicated H2D or D2H stream *on that
  device* and complete through pooled events that a completion thread per stream
  synchronises in FIFO order. Without one (no device tier, or a CPU stand-in) no CUDA
  context, stream or thread is created. At most ``max_inflight_bytes`` are in flight
  per direction, because concurrent H2D and D2H slow each other down on real PCIe.
- ``submit(pieces, restore=..., on_done=...) -> CopyJob``: the copy is ordered after
  everything the caller has queued on its current CUDA stream(s); ``CopyJob.done()`` (poll),
  ``CopyJob.wait(timeout)``. ``on_done`` runs on the completion path (the completion
  thread on CUDA, the dispatcher thread without it) before waiters wake; the daemon's
  mover attaches the new copy to its sequence there.
- ``completed``: how many jobs have finished (tests count the jobs one restore takes).
- ``runs(src_extents, dst_extents)``: coalesce two partitions of one payload into the
  fewest ``(src_offset, dst_offset, length)`` runs, so a contiguous slot run moves in
  one ``copy_`` instead of one Python-level copy per block.

Without CUDA the same bookkeeping runs with synchronous ``copy_`` calls on the
dispatcher thread, so every state transition is exercised by the CPU tests.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import threading
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from kvpark.proto.layout import overlaps

from .cuda import cuda_available, is_cuda

log = logging.getLogger("kvpark.copy")


def runs(src: Sequence[tuple[int, int]], dst: Sequence[tuple[int, int]]) -> list[tuple[int, int, int]]:
    out: list[list[int]] = []
    for si, so, di, do, n in overlaps([n for _, n in src], [n for _, n in dst]):
        s, d = src[si][0] + so, dst[di][0] + do
        if out and out[-1][0] + out[-1][2] == s and out[-1][1] + out[-1][2] == d:
            out[-1][2] += n
        else:
            out.append([s, d, n])
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
        self.completed = 0  # jobs finished (copied or failed): how many copies a step took
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
            self.completed += 1
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
