"""Prefetches: a sequence promoted into a memory tier ahead of its restore.

One background promotion per (id, tier, generation) at a time: a second prefetch of the
same version joins the first; a newer version's prefetch is its own. A waited prefetch of a
version an overwrite replaced meanwhile is retried as the version now indexed (the id was
never absent); only a drop is ``NotFound``. A sequence larger than the tier stays on disk
(restores stream it): a waited prefetch says so (``ResourceExhausted``).

Primitives: ``Prefetches(mover)``; ``prefetch(seq, tier, wait, timeout, then=None) -> str``
(the tier it is in after; ``then()`` is called once the promotion it started or joined
has ended, on the prefetch thread, unless shutdown cancelled it); ``close()`` (queued
prefetches cancelled, running ones finish).
"""

from __future__ import annotations

import concurrent.futures
import logging
from typing import TYPE_CHECKING, Callable

from kvpark.proto.errors import DeadlineExceeded, NotFound, ResourceExhausted, Unavailable

from .model import Seq

if TYPE_CHECKING:
    from .mover import Mover

log = logging.getLogger("kvpark.mover")


class Prefetches:
    def __init__(self, mover: "Mover") -> None:
        self.mover = mover
        self._futures: dict[tuple[str, str, int], concurrent.futures.Future[None]] = {}
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="kvpark-prefetch")

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)

    def prefetch(self, seq: Seq, tier: str, wait: bool = False, timeout: float | None = None,
                 then: Callable[[], None] | None = None, _tries: int = 8) -> str:
        cap = self.mover.tiers[tier].alloc.capacity
        if seq.manifest.nbytes > cap:
            if wait:
                raise ResourceExhausted(f"sequence {seq.seq_id!r} ({seq.manifest.nbytes} bytes) is larger than the "
                                        f"{tier} tier ({cap} bytes): it stays on disk, and restores stream it")
            with self.mover.catalog.lock:
                return seq.tier
        started = False
        with self.mover.catalog.lock:
            if tier in seq.res:
                return seq.tier
            key = (seq.seq_id, tier, seq.manifest.gen)  # by version: a newer one's prefetch is its own
            fut = self._futures.get(key)
            if fut is None or fut.done():
                try:
                    fut = self._pool.submit(self.mover.promote, seq, tier, True)
                except RuntimeError:  # the pool has shut down: the daemon is stopping
                    raise Unavailable(f"prefetch of {seq.seq_id!r}: the daemon is stopping") from None
                self._futures[key] = fut
                started = True
        if started:
            # Outside the index lock: a promotion that has already ended (a fast one, on a
            # pool thread that ran before this line) calls ``_done`` right here, and
            # ``_done`` takes the index lock.
            fut.add_done_callback(lambda f, k=key: self._done(k, f))
        if then is not None:  # outside the index lock: a future already done calls it at once, here
            fut.add_done_callback(lambda f: self._then(f, then))
        if wait:
            try:
                fut.result(timeout=timeout)
            except concurrent.futures.TimeoutError:
                raise DeadlineExceeded(f"prefetch of {seq.seq_id!r} to {tier} did not finish within {timeout}s") \
                    from None
            except NotFound:
                pass  # dropped or replaced under the promotion: told apart below
            with self.mover.catalog.lock:
                now = self.mover.catalog.find(seq.seq_id) if seq.dropped else seq
                if now is None or (now is not seq and _tries <= 1):
                    raise NotFound(f"no parked sequence {seq.seq_id!r}")
                if now is seq and tier not in seq.res:
                    raise ResourceExhausted(f"no room in the {tier} tier for {seq.seq_id!r} (leased or pinned data)")
            if now is not seq:  # overwritten meanwhile, never absent: prefetch the version now indexed
                return self.prefetch(now, tier, wait, timeout, then, _tries - 1)
        with self.mover.catalog.lock:
            return seq.tier

    def _then(self, fut: concurrent.futures.Future[None], then: Callable[[], None]) -> None:
        if fut.cancelled() or self.mover.closed:
            return
        try:
            then()
        except Exception:  # noqa: BLE001 - a prefetch thread must not die of it
            log.exception("after a prefetch")

    def _done(self, key: tuple[str, str, int], fut: concurrent.futures.Future[None]) -> None:
        with self.mover.catalog.lock:
            if self._futures.get(key) is fut:
                del self._futures[key]
        if not fut.cancelled() and fut.exception() is not None:
            log.warning("prefetch of %r to %s failed: %s", key[0], key[1], fut.exception())

