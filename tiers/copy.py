"""The daemon's copy engine. With ``tiers/cuda.py``, the only module that touches ``torch.cuda``.

Moves bytes between memory tiers (device pool <-> host arena) asynchronously:

- ``CopyEngine(max_inflight_bytes)``: one dispatcher thread takes jobs in strict
  priority order (restores/promotions before demotions) and issues them; on CUDA
  they go to a dedicated H2D or D2H stream and complete through pooled events that a
  completion thread per stream synchronises in FIFO order. At most
  ``max_inflight_bytes`` are in flight per direction, because concurrent H2D and D2H
  slow each other down on real PCIe.
- ``submit(pieces, restore=..., on_done=...) -> CopyJob``; ``CopyJob.done()`` (poll),
  ``CopyJob.wait(timeout)``. ``on_done`` runs on the completion path (the completion
  thread on CUDA, the dispatcher thread without it) before waiters wake; the daemon's
  mover attaches the new copy to its sequence there.
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

from .cuda import cuda_available

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
    def __init__(self, max_inflight_bytes: int = 256 << 20) -> None:
        self.cuda = cuda_available()
        self.max_inflight = max_inflight_bytes
        self._cv = threading.Condition()
        self._queue: list[tuple[int, int, CopyJob]] = []
        self._order = itertools.count()
        self._inflight = {True: 0, False: 0}  # restore direction -> bytes
        self._closed = False
        if self.cuda:
            self._streams = {True: torch.cuda.Stream(), False: torch.cuda.Stream()}
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
            self._cv.notify_all()

    def _dispatch(self) -> None:
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
                    for dst, src in job.pieces:
                        dst.copy_(src, non_blocking=True)
                    ev = self._events.pop() if self._events else torch.cuda.Event()
                    ev.record(stream)
                with self._cv:
                    self._pending[job.restore].append((ev, job))
                    self._cv.notify_all()
            except BaseException as e:
                self._release(job)
                job._finish(e)

    def _complete(self, direction: bool) -> None:
        # Events on one stream complete in issue order, so waiting on the head is exact.
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
