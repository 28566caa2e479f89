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
- **A dropped version is never adopted back.** A drop (or an overwrite, an expiry) is
  acknowledged before Redis deletes the old copy, and Redis may be down for a while. The
  version is tombstoned under the index lock, in the same step that unindexes it
  (``retired``), so no local miss after that adopts it from Redis; the tombstone is
  written to disk before the drop is acknowledged (``forget``: it outlives a kill), and
  goes when Redis confirms the delete (retried by the maintenance pass, and at start).
  A copy this daemon is writing to Redis while the version is dropped is tombstoned the
  same way (``put_begin``), so the window between its write and its own delete is closed too.

Primitives:
- ``RemoteTier(opts, write)``: ``write`` is ``"on_evict"`` or ``"write_through"``.
- ``manifests(ids) -> list[Manifest | None]``; ``present(ids) -> list[bool]``: miss-safe.
- ``copy_state(manifest) -> str``: what Redis holds of that generation (typed errors).
- ``put(manifest, views)``; ``fetch(manifest) -> bytearray``; ``fetch_into(manifest,
  block_views)``: typed errors.
- ``submit(what, fn)``: run ``fn()`` in the background; failures are logged.
- ``copy_later(what, fn) -> bool``: ``submit`` a copy, unless ``max_pending`` copies
  wait already (False: skipped and counted in ``skipped``).
- ``loose(ids)``: ids whose dropped version's tombstone is in memory only and still in
  Redis (absence of them is not durable yet).
- ``retired(seqs) -> list[Manifest]`` (REQUIRES: index lock): tombstone the versions
  leaving the index that may have a remote copy; ``forget(manifests)`` (no lock): write
  their tombstones to disk and delete them from Redis in the background;
  ``retry_forgets()``: resubmit the deletes that failed; ``load_tombs(durable, stubs)``
  at start (their deletes begin at ``started``).
- ``stub(seq)``: before a disk eviction deletes the local records of a version Redis now
  holds alone, its stub on disk (``tiers/stubs.py``); ``unstub(manifests)``: versions
  found gone from Redis lose theirs (a tombstone's ``forget`` removes them too; a failed
  removal is retried by ``retry_forgets`` and makes the id ``loose`` meanwhile);
  ``restub(manifest)``: a pin changed: the stub follows;
  ``load_stubs(indexed) -> list[Manifest]`` at start: the remote-only versions to index.
- ``put_begin(manifest)`` (REQUIRES: index lock), ``put_end(manifest)``: around a copy
  to Redis that a drop may overtake.
- ``probe()`` at start: one ping; down means a warning and a degraded ``stat``;
  ``heal()`` (maintenance): a ping while half-open, so recovery shows without work.
- ``stat(sequences) -> RemoteStat``; ``close()``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Iterable, Sequence

from kvpark.proto.errors import DeadlineExceeded, KVParkError, Unavailable
from kvpark.proto.types import RemoteStat
from kvpark.tiers.disk import Manifest
from kvpark.tiers.remote import TENANT_SEP, RemoteOptions, RemoteStore
from kvpark.tiers.stubs import Stubs
from kvpark.tiers.tombs import Tombs

from .model import INSTANCE_BITS, NS_SEP, Seq

# The store derives a sequence's key space (a tenant's, or an open daemon's) from this.
assert TENANT_SEP == NS_SEP

log = logging.getLogger("kvpark.remote")

Key = tuple[str, int]  # (seq_id, generation)
RETRY_S = 2.0  # how often failed deletes of tombstoned versions are tried again


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
        # Versions dropped here whose remote copies are not yet known deleted: never adopted.
        self._tombs: dict[Key, Manifest] = {}
        self._tomb_ids: Counter[str] = Counter()
        # Tombstones that hold in memory only (their disk write failed) of versions Redis
        # may still hold: a restart would adopt them back, so absence of their ids is not
        # durable until their Redis delete lands (``loose``). Guarded by ``_lock``.
        self._loose: dict[tuple[str, int], None] = {}
        self._loose_ids: Counter[str] = Counter()
        # Tombstones whose delete is queued or running -> whether another was asked for
        # meanwhile (a copy that landed after it started: that delete must run again).
        self._deleting: dict[Key, bool] = {}
        self._putting: Counter[Key] = Counter()  # copies to Redis under way
        # Versions a copy to Redis was attempted for (landed or not: a reply lost to a
        # timeout may hide a write Redis applied), until they leave the index.
        self._tried: set[Key] = set()
        # Generations whose counter is at most this were committed before this start:
        # whether Redis holds them is not known (``on_remote`` is not on disk).
        self._floor = -1
        # Bumped whenever a tombstone goes: a lookup that began before may hold a
        # manifest whose tombstone it never saw (``epoch``, ``adoptable``).
        self._epoch = 0
        self._durable: Tombs | None = None
        # Versions only Redis holds that a disk eviction moved there: id -> the generation
        # of its stub on disk (``tiers/stubs.py``), which indexes it again after a restart.
        # ``_stub_lock`` orders a stub's write after its version's drop has been seen, or
        # the drop's removal of it after the write (``stub``, ``_unstub``).
        self._stubs: Stubs | None = None
        self._stubbed: dict[str, int] = {}
        # Stubs whose removal failed (id -> that version): a restart would index it again,
        # so absence of the id is not durable (``loose``) until ``retry_forgets`` removes it.
        # Changed under ``_stub_lock`` and ``_lock``; read by ``loose`` under ``_lock``.
        self._unstub_left: dict[str, Manifest] = {}
        self._left: list[Manifest] = []  # the last run's tombstones, until ``started``
        self._stub_lock = threading.Lock()
        self._last_retry = 0.0
        log.info("remote tier: %s%s, namespace %r, %s, %s", opts.url.split("@")[-1],
                 " (cluster)" if opts.cluster else "", opts.namespace, write,
                 f"values sealed (AES-256-GCM, {len(opts.keys)} key(s))" if opts.keys else "values not sealed")

    @property
    def write_through(self) -> bool:
        return self.write == "write_through"

    def manifests(self, seq_ids: Sequence[str]) -> list[Manifest | None]:
        """What Redis holds under ``seq_ids`` (None: absent, unreachable, or a version
        dropped here). The caller checks ``tombed`` again under the index lock before it
        adopts: a drop may tombstone a version after this lookup."""
        try:
            found = self.store.get_manifests(seq_ids)
        except (Unavailable, DeadlineExceeded) as e:
            log.debug("remote lookup of %d id(s) treated as a miss: %s", len(seq_ids), e)
            return [None] * len(seq_ids)
        return [None if m is None or self.tombed(m) else m for m in found]

    def present(self, seq_ids: Sequence[str]) -> list[bool]:
        """Whether Redis holds each id (a version not dropped here); miss-safe."""
        for _ in range(3):
            epoch = self.epoch
            try:
                out = self.store.exists(seq_ids)
            except (Unavailable, DeadlineExceeded) as e:
                log.debug("remote presence of %d id(s) treated as a miss: %s", len(seq_ids), e)
                return [False] * len(seq_ids)
            with self._lock:
                doubt = [sid for sid, there in zip(seq_ids, out) if there and self._tomb_ids[sid]]
            if doubt:  # an id with a version dropped here: present only if Redis holds another
                live = {sid for sid, m in zip(doubt, self.manifests(doubt)) if m is not None}
                out = [there and (sid in live or sid not in doubt) for sid, there in zip(seq_ids, out)]
            if self.epoch == epoch:  # no tombstone went meanwhile (what ``exists`` saw may be its version's)
                return out
        return [False] * len(seq_ids)  # tombstones keep going under us: a miss is always safe

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

    # ------------------------------------------------------------------ tombstones

    def tombed(self, m: Manifest) -> bool:
        with self._lock:
            return (m.seq_id, m.gen) in self._tombs

    def retired(self, seqs: Iterable[Seq]) -> list[Manifest]:
        """Tombstone the versions in ``seqs`` (leaving the index, their remote copies to
        be deleted) that Redis may hold: known there, written through, copied (or tried)
        by this daemon, or committed before this start (what an earlier run copied is
        not remembered). REQUIRES: index lock (the same step that unindexed them, so no
        miss after it adopts them). Returns their manifests for ``forget``."""
        with self._lock:
            out = []
            for s in seqs:
                k = (s.seq_id, s.gen)
                if (s.on_remote or self.write_through or k in self._tried
                        or s.gen >> INSTANCE_BITS <= self._floor):
                    out.append(s.manifest)
                    self._tomb(s.manifest)
                self._tried.discard(k)
        return out

    def started(self, counter: int) -> None:
        """The generation counter after the index was loaded: versions at or below it
        were committed by an earlier run (``retired`` treats them as maybe in Redis).
        The deletes of the tombstones the last run left start now, once the stubs were
        read against them (``load_stubs``)."""
        self._floor = counter
        left, self._left = self._left, []
        for m in left:
            self._delete_later(m)

    @property
    def epoch(self) -> int:
        """Taken before a lookup in Redis, given to ``adoptable`` after it."""
        with self._lock:
            return self._epoch

    def adoptable(self, found: Sequence[Manifest], epoch: int) -> list[Manifest] | None:
        """What of ``found`` (looked up since ``epoch``) may be adopted: not tombstoned.
        None when a tombstone went since the lookup began (its delete landed: a manifest
        found before may be that version's): look up again. REQUIRES: index lock."""
        with self._lock:
            if self._epoch != epoch:
                return None
            return [m for m in found if (m.seq_id, m.gen) not in self._tombs]

    def _tomb(self, m: Manifest) -> None:
        """REQUIRES: ``_lock``."""
        k = (m.seq_id, m.gen)
        if k not in self._tombs:
            self._tombs[k] = m
            self._tomb_ids[m.seq_id] += 1

    def forget(self, manifests: Sequence[Manifest]) -> KVParkError | None:
        """Write the tombstones of ``manifests`` to disk (before the drop is acknowledged:
        they outlive a kill) and delete them from Redis in the background. Returns
        ``Unavailable`` when the disk write failed: the tombstones hold in memory, but not
        across a restart, so a drop must not be acknowledged (an overwrite, visible
        already, is: its old version's delete is under way all the same)."""
        if not manifests:
            return None
        with self._lock:
            for m in manifests:
                self._tomb(m)
        failed: KVParkError | None = None
        if self._durable is not None:
            try:
                self._durable.add(manifests)
            except Exception as e:  # noqa: BLE001 - LMDB's errors, typed here
                log.warning("remote tier: tombstones of %d dropped version(s) not written to disk: %s",
                            len(manifests), e)
                failed = Unavailable(f"the drop's tombstone could not be written to the disk tier ({e}); "
                                     "its remote copy is being deleted")
                with self._lock:
                    for m in manifests:
                        if (m.seq_id, m.gen) not in self._loose:
                            self._loose[(m.seq_id, m.gen)] = None
                            self._loose_ids[m.seq_id] += 1
            else:
                # The tombstones hold at a restart now: the stubs may go (one that stays is
                # removed at the next start, beside its tombstone).
                self._unstub(manifests, note=False)
        for m in manifests:
            self._delete_later(m)
        return failed

    def _delete_later(self, m: Manifest) -> None:
        k = (m.seq_id, m.gen)
        with self._lock:
            if k in self._deleting:
                self._deleting[k] = True
                return
            self._deleting[k] = False

        def run() -> None:
            ok = False
            try:
                self.store.delete(m)
                ok = True
            finally:
                with self._lock:
                    again = self._deleting.pop(k)
                    # A copy of it still under way may land after this delete: its
                    # tombstone stays, and that copy's end forgets it again.
                    ok = ok and not again and not self._putting[k]
                    was_loose = ok and self._loose.pop(k, 0) is None
                    if was_loose:  # gone from Redis: nothing to adopt back
                        self._loose_ids[m.seq_id] -= 1
                        if not self._loose_ids[m.seq_id]:
                            del self._loose_ids[m.seq_id]
                    if ok and self._tombs.pop(k, None) is not None:
                        self._epoch += 1
                        self._tomb_ids[m.seq_id] -= 1
                        if not self._tomb_ids[m.seq_id]:
                            del self._tomb_ids[m.seq_id]
                # A stub left (its removal failed) goes before the tombstone does: a stub
                # without one would index the deleted version again at the next start. With
                # no tombstone on disk (its write failed), a failure here leaves the id loose.
                if ok and self._durable is not None and self._unstub([m], note=was_loose):
                    try:
                        self._durable.remove([m])
                    except Exception as e:  # found again at the next start: deleted again, harmlessly
                        log.debug("remote tier: tombstone of %r not removed from disk: %s", m.seq_id, e)
                if again:
                    self._delete_later(m)

        self.submit(f"delete of {m.seq_id!r}", run)

    def probe(self) -> None:
        """Ping Redis once at start: a wrong URL or a Redis that is down is a warning now,
        and ``stat`` says degraded until it answers, not at the first eviction."""
        why = self.store.probe()
        if why is not None:
            log.warning("remote tier: %s does not answer at start (%s): sequences stay local until it does; "
                        "`kvpark stat` shows the remote tier DEGRADED meanwhile", self.store.opts.url.split("@")[-1],
                        why)

    def heal(self) -> None:
        """While the breaker is half-open and nothing else calls Redis, ping it (through
        the breaker), so a Redis that is back shows as healthy without waiting for work."""
        if self.store.breaker.state == "half_open":
            try:
                self.store.ping()
            except KVParkError:
                pass  # still down: the breaker opened again

    def loose(self, seq_ids: Sequence[str]) -> list[str]:
        """The ids with a dropped version whose tombstone is in memory only and whose Redis
        delete has not landed, or whose stub's removal failed: a restart would adopt or
        index it back."""
        with self._lock:
            if not self._loose_ids and not self._unstub_left:
                return []
            return [sid for sid in seq_ids if self._loose_ids[sid] or sid in self._unstub_left]

    def retry_forgets(self) -> int:
        """Resubmit the deletes of tombstoned versions that failed (at most every
        ``RETRY_S``); returns how many."""
        now = time.monotonic()
        with self._lock:
            if now - self._last_retry < RETRY_S:
                return 0
            self._last_retry = now
            todo = [m for k, m in self._tombs.items() if k not in self._deleting]
            stubs = list(self._unstub_left.values())
        if stubs:
            self._unstub(stubs)
        for m in todo:
            self._delete_later(m)
        return len(todo)

    def load_tombs(self, durable: Tombs, stubs: Stubs | None = None) -> int:
        """At start: the tombstones a previous run left (its deletes unconfirmed) hold
        again; their deletes are retried from ``started``. ``stubs``: where this disk
        keeps its remote-only versions (``load_stubs``)."""
        self._durable = durable
        self._stubs = stubs
        left = durable.load()
        with self._lock:
            for m in left:
                self._tomb(m)
        self._left = left
        if left:
            log.info("remote tier: %d dropped version(s) not yet deleted from Redis by the last run; deleting",
                     len(left))
        return len(left)

    # ------------------------------------------------------------------ remote-only stubs

    def stub(self, seq: Seq) -> None:
        """Before a disk eviction deletes ``seq``'s local records (Redis holds the
        version): its stub, so a restart indexes it again. ``Unavailable`` when the write
        fails (the eviction keeps the local copy). Nothing for a version dropped already:
        a drop from now on sees the stub and removes it (``_unstub``, same lock)."""
        if self._stubs is None:
            return
        m = seq.manifest
        with self._stub_lock:
            if seq.dropped:  # set under the index lock before the drop's ``forget``
                return
            self._put_stub(m, "its local copy stays")
            self._stubbed[m.seq_id] = m.gen

    def _put_stub(self, m: Manifest, then: str) -> None:
        """REQUIRES: ``_stub_lock``. ``Unavailable`` (saying ``then``) when the write fails."""
        assert self._stubs is not None
        try:
            self._stubs.put(m)
        except Exception as e:  # noqa: BLE001 - LMDB's errors, typed here
            raise Unavailable(f"the remote-only stub of {m.seq_id!r} could not be written to disk ({e}); "
                              f"{then}") from None

    def unstub(self, manifests: Sequence[Manifest]) -> bool:
        """Versions that left the index with their Redis copy found gone or bad: their
        stubs go (else a restart would index them again, to be found gone once more).
        False when a removal failed."""
        return self._unstub(manifests)

    def settle_stubs(self, seq_ids: Sequence[str]) -> None:
        """Before absence of these ids is answered: the stubs whose removal failed are
        tried again now (``loose`` still names an id whose removal fails again)."""
        with self._lock:
            left = [self._unstub_left[sid] for sid in seq_ids if sid in self._unstub_left] \
                if self._unstub_left else []
        if left:
            self._unstub(left)

    def _unstub(self, manifests: Sequence[Manifest], note: bool = True) -> bool:
        """Remove the stubs of these versions; False when a removal failed (logged, and
        with ``note`` the id is ``loose`` until a retry removes it; without, the caller
        knows the version's tombstone is on disk: the next start removes the stub)."""
        if self._stubs is None:
            return True
        ok = True
        with self._stub_lock:
            for m in manifests:
                if self._stubbed.get(m.seq_id) != m.gen:
                    self._note_unstub(m, False)  # gone, or a newer eviction's stub replaced it
                    continue
                try:
                    self._stubs.remove(m)
                    del self._stubbed[m.seq_id]
                    self._note_unstub(m, False)
                except Exception as e:  # noqa: BLE001 - retried by the maintenance pass
                    log.warning("remote tier: stub of %r not removed from disk: %s", m.seq_id, e)
                    if note:
                        self._note_unstub(m, True)
                    ok = False
        return ok

    def _note_unstub(self, m: Manifest, failed: bool) -> None:
        """REQUIRES: ``_stub_lock``."""
        with self._lock:
            if failed:
                self._unstub_left[m.seq_id] = m
            elif (left := self._unstub_left.get(m.seq_id)) is not None and left.gen == m.gen:
                del self._unstub_left[m.seq_id]

    def restub(self, m: Manifest) -> None:
        """A pin changed on a version whose stub is on disk: the stub follows, so a
        restart indexes it with that pin. ``Unavailable`` when the write fails (the pin
        is then not acknowledged)."""
        if self._stubs is None:
            return
        with self._stub_lock:
            if self._stubbed.get(m.seq_id) == m.gen:
                self._put_stub(m, "pin it again")

    def load_stubs(self, indexed: Callable[[str], Manifest | None]) -> list[Manifest]:
        """At start, after the disk's versions are indexed (``indexed(id)``: the manifest
        indexed for the id, or None) and before ``started``: the remote-only versions to
        index again. A stub of a tombstoned version goes; one under another generation of
        its id on disk is a version that id's later write replaced (a crash before the
        overwrite's tombstone): tombstoned and deleted from Redis now, as the overwrite
        would have."""
        durable = self._stubs
        if durable is None:
            return []
        adopt: list[Manifest] = []
        stale: list[Manifest] = []
        gone: list[Manifest] = []
        for m in durable.load():
            cur = indexed(m.seq_id)
            if self.tombed(m):
                gone.append(m)
            elif cur is None:
                adopt.append(m)
            elif cur.gen != m.gen:
                stale.append(m)
            # else: a crash between the stub and the local delete; the disk copy is it
            if not self.tombed(m):
                self._stubbed[m.seq_id] = m.gen
        for m in gone:
            try:
                durable.remove(m)
            except Exception as e:  # noqa: BLE001 - the tombstone stays until the stub goes
                log.warning("remote tier: stub of dropped %r not removed from disk: %s", m.seq_id, e)
                self._stubbed[m.seq_id] = m.gen
        if stale:
            log.info("remote tier: %d version(s) in Redis replaced here before a crash; deleting them", len(stale))
            failed = self.forget(stale)
            if failed is not None:
                log.warning("remote tier: %s", failed)
        if adopt:
            log.info("remote tier: %d sequence(s) held only in Redis indexed again", len(adopt))
        return adopt

    @property
    def tombs(self) -> int:
        with self._lock:
            return len(self._tombs)

    def put_begin(self, m: Manifest) -> None:
        """A copy of ``m`` to Redis starts: a drop meanwhile tombstones it (``retired``),
        and the tombstone stays until the copy is over (``put_end``) and deleted again.
        REQUIRES: index lock, the caller having checked that ``m`` is still indexed."""
        k = (m.seq_id, m.gen)
        with self._lock:
            self._putting[k] += 1
            self._tried.add(k)

    def put_end(self, m: Manifest) -> None:
        """The copy ``put_begin`` announced is over (written or failed). A version dropped
        meanwhile is the caller's to ``forget`` again: its first delete may have run before
        the copy landed."""
        k = (m.seq_id, m.gen)
        with self._lock:
            self._putting[k] -= 1
            if not self._putting[k]:
                del self._putting[k]
            if k in self._deleting:
                # A delete of it running now may have reached Redis before this copy did,
                # yet check ``_putting`` after this: it must run again, not end the tombstone.
                self._deleting[k] = True

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
