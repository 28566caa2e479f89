"""The daemon's copy engine. With ``tiers/cuda.py``, the only module that touches ``torch.cuda``.

Moves bytes between memory tiers (device pool <-> host arena) asynchronously:

- ``CopyEngine(max_inflight_bytes, device=None)``: one queue per DMA direction (H2D,
  D2H, D2D), each in priority order (restores and promotions before demotions, then
  first come first served). One dispatcher thread issues the best queued job of *any*
  direction that has budget (at most ``max_inflight_bytes`` in flight per direction),
  so a restore waiting for H2D budget never holds up a demotion on an idle D2H link:
  the two run at once (duplex). Jobs go out in chunks of at most ``CHUNK_BYTES``, so a
  small restore waits behind at most one chunk of a multi-GiB transfer, not all of it;
  small jobs queued in one direction go out together, up to one chunk's worth under one
  event (a demotion of many 2 MiB blocks pays the dispatch once, not per block).
  With a CUDA ``device`` (the device pool's) each direction has its own stream *on that
  device*; every chunk completes through a pooled event that the direction's completion
  thread synchronises in FIFO order. Without one (no device tier, or a CPU stand-in)
  each direction's thread does the copies itself, synchronously and in order, so the
  queues, budgets, chunks and duplex are exercised by the CPU tests as they run on a GPU.
- ``submit(pieces, restore=..., on_done=..., direction=None) -> CopyJob``: the copy is
  ordered after everything the caller has queued on its current CUDA stream(s). Its
  direction comes from the pieces (which side is on a GPU), or from ``direction`` when
  neither is (the CPU stand-in of the device pool: the caller knows which tier is the
  device); ``restore`` is only the priority. ``CopyJob.done()`` (poll),
  ``CopyJob.wait(timeout)``. ``on_done`` runs on the completion path (the direction's
  thread) before waiters wake; the daemon's mover attaches the new copy to its
  sequence there.
- ``completed``: how many jobs have finished (tests count the jobs one restore takes);
  ``issued``: how many batches went out.
- ``close()``: no new jobs; waits (bounded) for what is queued and in flight to finish,
  so the memory they copy is not unmapped under them.
- ``runs(src_extents, dst_extents)``: coalesce two partitions of one payload into the
  fewest ``(src_offset, dst_offset, length)`` runs, so a contiguous slot run moves in
  one ``copy_`` instead of one Python-level copy per block.
- ``direction_of(pieces, restore, hint=None) -> str``; ``chunked(pieces, limit)``: the
  pieces cut into chunks of at most ``limit`` bytes (a flat piece is cut into views).
"""

from __future__ import annotations

import heapq
import itertools
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from kvpark.proto.layout import overlaps

from .cuda import cuda_available, is_cuda, side_stream

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


H2D, D2H, D2D = "h2d", "d2h", "d2d"
DIRECTIONS = (H2D, D2H, D2D)
# The most one job puts in flight at once: a higher-priority job waits at most this much
# of another's transfer (about 1.5 ms at 40 GB/s).
CHUNK_BYTES = 64 << 20
# How long close() waits for queued and in-flight copies before it gives up on them.
CLOSE_WAIT_S = 60.0

Pair = tuple[torch.Tensor, torch.Tensor]  # (dst, src)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def direction_of(pieces: Sequence[Pair], restore: bool, hint: str | None = None) -> str:
    """The DMA direction of a copy, from which side of its pieces is on a GPU. Pieces
    with no GPU side (the CPU stand-in of the device pool) take ``hint``, else the usual
    direction of their priority (a restore goes to the device)."""
    dst_gpu = any(is_cuda(d) for d, _ in pieces)
    src_gpu = any(is_cuda(s) for _, s in pieces)
    if dst_gpu and src_gpu:
        return D2D
    if dst_gpu:
        return H2D
    if src_gpu:
        return D2H
    if hint is not None:
        if hint not in DIRECTIONS:
            raise ValueError(f"direction must be one of {DIRECTIONS}, got {hint!r}")
        return hint
    return H2D if restore else D2H


def chunked(pieces: Sequence[Pair], limit: int) -> list[list[Pair]]:
    """``pieces`` in order, cut into chunks of at most ``limit`` bytes each. A flat
    contiguous piece larger than what is left of a chunk is cut into views; any other
    piece goes whole (a chunk then holds just it)."""
    out: list[list[Pair]] = []
    cur: list[Pair] = []
    room = limit
    for dst, src in pieces:
        n = _nbytes(dst)
        flat = (dst.dim() == 1 and src.dim() == 1 and dst.is_contiguous() and src.is_contiguous()
                and dst.dtype == src.dtype and dst.numel() == src.numel())
        if n <= room or not flat:
            if cur and n > room:
                out.append(cur)
                cur, room = [], limit
            cur.append((dst, src))
            room -= n
            if room <= 0:
                out.append(cur)
                cur, room = [], limit
            continue
        per = max(1, dst.element_size())
        if cur and room < per:
            out.append(cur)
            cur, room = [], limit
        at, total = 0, dst.numel()
        while at < total:
            take = min(total - at, max(1, room // per))
            cur.append((dst[at : at + take], src[at : at + take]))
            at += take
            room -= take * per
            if room < per:
                out.append(cur)
                cur, room = [], limit
    if cur:
        out.append(cur)
    return out


@dataclass(eq=False)
class CopyJob:
    pieces: list[Pair]
    nbytes: int
    restore: bool
    on_done: Callable[["CopyJob"], None] | None = None
    error: BaseException | None = None
    after: list = field(default_factory=list)  # CUDA events the copy stream waits on first
    direction: str = H2D
    _done: threading.Event = field(default_factory=threading.Event)
    _chunks: deque = field(default_factory=deque)  # (pieces, nbytes) not yet issued
    _outstanding: int = 0  # chunks issued and not yet complete

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
        except BaseException:  # a callback bug must not kill the completion thread
            log.exception("copy completion callback failed")
        finally:
            self._done.set()


class CopyEngine:
    def __init__(self, max_inflight_bytes: int = 256 << 20, device: torch.device | None = None,
                 chunk_bytes: int = CHUNK_BYTES) -> None:
        # Copies touch the device pool on one GPU: streams, events and the threads that
        # issue and wait on them all belong to that device. A stream made without a
        # device lives on the current one (cuda:0), and an event recorded there would
        # complete at once while the copies run on cuda:N's default stream.
        self.cuda = device is not None and device.type == "cuda" and cuda_available()
        if self.cuda and device is not None and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device if self.cuda else None
        self.max_inflight = max_inflight_bytes
        self.chunk_bytes = max(1, chunk_bytes)
        self._cv = threading.Condition()
        self._queues: dict[str, list[tuple[int, int, CopyJob]]] = {d: [] for d in DIRECTIONS}
        self._order = itertools.count()
        self._inflight = {d: 0 for d in DIRECTIONS}  # bytes issued and not yet complete
        # Issued chunks per direction, completed in order by that direction's thread:
        # (event or None on CPU, job, pieces, nbytes).
        self._pending: dict[str, deque] = {d: deque() for d in DIRECTIONS}
        self._workers: dict[str, threading.Thread] = {}
        self._closed = False
        self.completed = 0  # jobs finished (copied or failed): how many copies a step took
        self.issued = 0  # batches issued (each one event and one completion wake-up)
        if self.cuda:
            # The process's long-lived side streams, one per direction, not fresh ones
            # from torch's shared pool (``cuda.side_stream``).
            self._streams = {d: side_stream(device, f"engine-{d}") for d in DIRECTIONS}
            self._events: list[torch.cuda.Event] = []
        self._thread = threading.Thread(target=self._dispatch, name="kvpark-copy", daemon=True)
        self._thread.start()

    def submit(self, pieces: list[Pair], *, restore: bool, on_done: Callable[[CopyJob], None] | None = None,
               direction: str | None = None) -> CopyJob:
        d = direction_of(pieces, restore, direction)
        job = CopyJob(pieces, sum(_nbytes(dst) for dst, _ in pieces), restore, on_done, direction=d)
        job._chunks.extend((c, sum(_nbytes(x) for x, _ in c)) for c in chunked(pieces, self.chunk_bytes))
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
            if not job._chunks:  # nothing to copy
                self.completed += 1
                done_now = True
            else:
                done_now = False
                self._worker(d)
                # Priority 0 for restores: they leave their direction's queue before any demotion.
                heapq.heappush(self._queues[d], (0 if restore else 1, next(self._order), job))
                self._cv.notify_all()
        if done_now:
            job._finish(None)
        return job

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        deadline = time.monotonic() + CLOSE_WAIT_S
        self._thread.join(CLOSE_WAIT_S)
        for t in list(self._workers.values()):
            t.join(max(0.0, deadline - time.monotonic()))

    def _worker(self, d: str) -> None:
        # REQUIRES: self._cv. One completion thread per direction that is used.
        if d not in self._workers:
            t = threading.Thread(target=self._complete, args=(d,), daemon=True, name=f"kvpark-copy-{d}")
            self._workers[d] = t
            t.start()

    def _idle(self) -> bool:
        return not any(self._queues.values()) and not any(self._inflight.values())

    def _next(self) -> list[tuple[CopyJob, list[Pair], int]] | None:
        """The next chunks to issue together: the next chunk of the best job at the head of
        any direction's queue whose direction has budget for it, then, while they fit in
        one chunk's worth of bytes and the budget, the next chunks of that direction's
        queue in order, of the same priority. Small jobs (a demotion of a 2 MiB block) so
        go out many to one event and one wake-up of the completion thread, not one each."""
        with self._cv:
            while True:
                best: tuple[tuple[int, int], str] | None = None
                for d, q in self._queues.items():
                    self._skip_failed(q)
                    if not q:
                        continue
                    prio, order, job = q[0]
                    busy, n = self._inflight[d], job._chunks[0][1]
                    if (busy == 0 or busy + n <= self.max_inflight) and (best is None or (prio, order) < best[0]):
                        best = ((prio, order), d)
                if best is not None:
                    d = best[1]
                    q = self._queues[d]
                    prio = q[0][0]
                    batch = [self._take(q, d)]
                    total = batch[0][2]
                    while True:
                        self._skip_failed(q)
                        if not q or q[0][0] != prio:
                            # One priority per batch: a batch completes as a whole, so a
                            # restore batched with demotions would wait for their copies.
                            break
                        n = q[0][2]._chunks[0][1]
                        if total + n > self.chunk_bytes or self._inflight[d] + n > self.max_inflight:
                            break
                        batch.append(self._take(q, d))
                        total += n
                    return batch
                if self._closed and not any(self._queues.values()):
                    return None
                self._cv.wait(0.1)

    @staticmethod
    def _skip_failed(q: list[tuple[int, int, CopyJob]]) -> None:
        # REQUIRES: self._cv.
        while q and not q[0][2]._chunks:  # a failed job's chunks were dropped
            heapq.heappop(q)

    def _take(self, q: list[tuple[int, int, CopyJob]], d: str) -> tuple[CopyJob, list[Pair], int]:
        """The next chunk of the job at the head of ``q``, counted as issued."""
        # REQUIRES: self._cv; q non-empty, its head with chunks left.
        job = q[0][2]
        chunk, n = job._chunks.popleft()
        if not job._chunks:
            heapq.heappop(q)
        self._inflight[d] += n
        job._outstanding += 1
        return job, chunk, n

    def _chunk_done(self, job: CopyJob, n: int, err: BaseException | None) -> None:
        with self._cv:
            self._inflight[job.direction] -= n
            job._outstanding -= 1
            if err is not None and job.error is None:
                job.error = err
                job._chunks.clear()  # the rest is not issued; the job fails as a whole
            finished = job._outstanding == 0 and not job._chunks
            if finished:
                self.completed += 1
            self._cv.notify_all()
        if finished:
            job._finish(job.error)

    def _bind_thread(self) -> None:
        if self.device is not None:
            torch.cuda.set_device(self.device)

    def _dispatch(self) -> None:
        self._bind_thread()
        while True:
            batch = self._next()
            if batch is None:
                return
            d = batch[0][0].direction
            self.issued += 1
            if not self.cuda:
                with self._cv:
                    self._pending[d].append((None, batch))
                    self._cv.notify_all()
                continue
            stream = self._streams[d]
            try:
                with torch.cuda.stream(stream):
                    for job, chunk, _n in batch:
                        after, job.after = job.after, []  # the first chunk waits; later ones follow it on the stream
                        for ev in after:
                            stream.wait_event(ev)
                        for dst, src in chunk:
                            dst.copy_(src, non_blocking=True)
                    # Blocking events: the completion thread sleeps in synchronize()
                    # instead of spinning a core for the length of the copy.
                    ev = self._events.pop() if self._events else torch.cuda.Event(blocking=True)
                    ev.record(stream)
                with self._cv:
                    self._pending[d].append((ev, batch))
                    self._cv.notify_all()
            except BaseException as e:
                # Some copies of the batch may be queued already: they land before the
                # jobs fail (a failed job's slots are freed, and must not be written after).
                try:
                    stream.synchronize()
                except BaseException:  # noqa: BLE001 - a broken context runs no more copies
                    pass
                for job, _chunk, n in batch:
                    self._chunk_done(job, n, e)

    def _complete(self, d: str) -> None:
        # Chunks of one direction complete in issue order (one stream, or this thread's
        # own copies on CPU), so waiting on the head is exact.
        self._bind_thread()
        q = self._pending[d]
        while True:
            with self._cv:
                while not q:
                    # Exit only when nothing is queued or in flight: a chunk the dispatcher
                    # took may not have reached the pending list yet.
                    if self._closed and not self._queues[d] and self._inflight[d] == 0:
                        return
                    self._cv.wait(0.1)
                ev, batch = q[0]
            errors: list[BaseException | None] = []
            if ev is None:
                for job, chunk, _n in batch:
                    err = None
                    try:
                        if job.error is None:  # a chunk of a job that failed meanwhile is not copied
                            for dst, src in chunk:
                                dst.copy_(src)
                    except BaseException as e:  # reported to the waiter, never fatal here
                        err = e
                    errors.append(err)
            else:
                err = None
                try:
                    ev.synchronize()  # issued already: a GPU chunk cannot be taken back
                except BaseException as e:  # reported to every job of the batch
                    err = e
                errors = [err] * len(batch)
            with self._cv:
                q.popleft()
                if ev is not None:
                    self._events.append(ev)
            for (job, _chunk, n), err in zip(batch, errors):
                self._chunk_done(job, n, err)
