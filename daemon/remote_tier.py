"""The daemon's side of the remote tier: what the engine asks of Redis, and when.

``tiers/remote.py`` is the store (keys, chunks, verification, the breaker); this module
is the policy around it for one daemon:
- Lookups on a local miss never fail the caller: an unreachable Redis is a miss (a
  cache miss is always safe), counted and logged by the store's breaker.
- Copies to remote that nobody waits for (``write_through`` copies after the ack,
  deletes of dropped or overwritten sequences) run on one background thread, in order,
  so a slow Redis delays nothing local. ``close()`` waits for them.
- At most ``max_pending`` copies wait at once: a Redis slow enough to fall behind (but
  healthy: the breaker stays closed) would otherwise grow the queue without end, and
  every drop's delete would wait behind it. A copy past the bound is skipped, counted
  (``skipped``) and logged; the local copy stays authoritative (disk eviction copies it
  to Redis when it needs to), so no park is lost. Deletes are never skipped.
- Restores from remote and demotions into it are the caller's to wait for, and raise
  the store's typed errors (``Unavailable``, ``DeadlineExceeded``, ``NotFound``,
  ``DataLoss``).

Primitives:
- ``RemoteTier(opts, write)``: ``write`` is ``"on_evict"`` or ``"write_through"``.
- ``manifests(ids) -> list[Manifest | None]``; ``present(ids) -> list[bool]``: miss-safe.
- ``copy_state(manifest) -> str``: what Redis holds of that generation (typed errors).
- ``put(manifest, views)``; ``fetch(manifest) -> bytearray``; ``fetch_into(manifest,
  block_views)``: typed errors.
- ``submit(what, fn)``: run ``fn()`` in the background; failures are logged.
- ``copy_later(what, fn) -> bool``: ``submit`` a copy, unless ``max_pending`` copies
  wait already (False: skipped and counted in ``skipped``).
- ``delete_later(manifest)``.
- ``stat(sequences) -> RemoteStat``; ``close()``.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Sequence

from kvpark.proto.errors import DeadlineExceeded, KVParkError, Unavailable
from kvpark.proto.types import RemoteStat
from kvpark.tiers.disk import Manifest
from kvpark.tiers.remote import RemoteOptions, RemoteStore

log = logging.getLogger("kvpark.remote")


class RemoteTier:
    def __init__(self, opts: RemoteOptions, write: str) -> None:
        self.store = RemoteStore(opts)
        self.write = write
        self._bg = ThreadPoolExecutor(1, thread_name_prefix="kvpark-remote-bg")
        self._lock = threading.Lock()
        self._pending = 0
        self.max_pending = opts.max_pending
        self._copies = 0  # write_through copies queued or running
        self.skipped = 0  # copies not queued: max_pending were waiting
        log.info("remote tier: %s%s, namespace %r, %s", opts.url.split("@")[-1], " (cluster)" if opts.cluster else "",
                 opts.namespace, write)

    @property
    def write_through(self) -> bool:
        return self.write == "write_through"

    def manifests(self, seq_ids: Sequence[str]) -> list[Manifest | None]:
        try:
            return self.store.get_manifests(seq_ids)
        except (Unavailable, DeadlineExceeded) as e:
            log.debug("remote lookup of %d id(s) treated as a miss: %s", len(seq_ids), e)
            return [None] * len(seq_ids)

    def present(self, seq_ids: Sequence[str]) -> list[bool]:
        try:
            return self.store.exists(seq_ids)
        except (Unavailable, DeadlineExceeded) as e:
            log.debug("remote presence of %d id(s) treated as a miss: %s", len(seq_ids), e)
            return [False] * len(seq_ids)

    def put(self, m: Manifest, views: Sequence[memoryview]) -> None:
        self.store.put(m, views)

    def copy_state(self, m: Manifest) -> str:
        """What Redis holds of generation ``m.gen`` (``tiers.remote.WHOLE``, ``REPLACED``,
        ``GONE``); typed errors: an unreachable Redis is no answer, never a yes."""
        return self.store.copy_state(m)

    def fetch(self, m: Manifest) -> bytearray:
        return self.store.read(m)

    def fetch_into(self, m: Manifest, outs: Sequence[memoryview]) -> None:
        self.store.read_blocks_into(m, outs)

    def submit(self, what: str, fn: Callable[[], None]) -> None:
        self._submit(what, fn, copy=False)

    def copy_later(self, what: str, fn: Callable[[], None]) -> bool:
        with self._lock:
            if self._copies >= self.max_pending:
                self.skipped += 1
                n = self.skipped
            else:
                self._copies += 1
                n = 0
        if n:
            if n == 1 or n % 1000 == 0:  # one line per thousand, not one per park
                log.warning("remote tier: %d write_through copies wait for Redis (tiers.remote.max_pending); "
                            "%s skipped (%d so far): it stays local until disk eviction copies it", self.max_pending,
                            what, n)
            return False
        self._submit(what, fn, copy=True)
        return True

    def _submit(self, what: str, fn: Callable[[], None], copy: bool) -> None:
        with self._lock:
            self._pending += 1

        def done() -> None:
            with self._lock:
                self._pending -= 1
                if copy:
                    self._copies -= 1

        def run() -> None:
            try:
                fn()
            except KVParkError as e:
                log.warning("remote tier: %s failed: %s", what, e)
            except Exception:  # the background thread must never die
                log.exception("remote tier: %s failed", what)
            finally:
                done()

        try:
            self._bg.submit(run)
        except RuntimeError:  # shut down: the daemon is stopping
            done()

    def delete_later(self, m: Manifest) -> None:
        self.submit(f"delete of {m.seq_id!r}", lambda: self.store.delete(m))

    def stat(self, sequences: int) -> RemoteStat:
        s = self.store.stats()
        with self._lock:
            pending = self._pending
        return RemoteStat(state=s.state, errors=s.errors, refused=s.refused, data_loss=s.data_loss,
                          bytes_written=s.bytes_written, bytes_read=s.bytes_read, outages=s.outages,
                          pending_writes=pending, sequences=sequences)

    def close(self) -> None:
        self._bg.shutdown(wait=True)
        self.store.close()
