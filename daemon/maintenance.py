"""The engine's maintenance side: the background pass, expiry, drops by identity, and
the reconcile at start-up.

Every piece of work here is chosen under the index lock and done after it: it acts on
the record it chose (the ``Seq`` object, so its generation), re-checked under the lock,
never on whatever is under that id by the time it acts. An id re-parked in the gap is a
new version, and the old version's fate (expired, evicted) is not the new one's.

Locks as in ``engine.py``; no disk I/O under the index lock.

Primitives:
- ``maintain(engine)``: the maintenance thread: once, sweep block records no manifest owns
  (``DiskStore.sweep_orphans``); then its loop: reap leases, expire, retry
  failed disk deletes and remote deletes of dropped versions, compact the eviction order,
  make rows of the records nobody uses (``freeze_idle``), relieve tiers past their high marks,
  write back what is past write_back's dirty bounds, and every ``READER_CHECK_S`` free the
  LMDB reader slots of dead processes (``DiskStore.reader_check``).
- ``expire(engine)``: drop versions past their TTL, and shared blocks nobody took up.
- ``retire(engine, seq) -> list[Seq]`` (REQUIRES: index lock): unlink ``seq`` (and the
  shared blocks it leaves unreferenced); returns what has disk copies to delete.
- ``drop_version(engine, seq, everywhere) -> bool``: drop exactly this version, if it is
  still the indexed one; ``FailedPrecondition`` for a shared block in use.
- ``finish_drop(engine, todo, remote)``: delete the disk copies of what ``retire``
  returned (every one tried; a failure is retried by the maintenance pass) and, for
  ``remote``, their remote copies.
- ``reconcile(engine) -> int``: at start-up, after the index is loaded: retire the
  sequences whose referenced shared blocks are missing (a crash between a composite's
  disk write and its blocks'), and delete their records. Unfinished windowed parks
  are deleted when the disk store opens; block records without a manifest by the
  maintenance thread's first pass.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from kvpark.proto.errors import FailedPrecondition
from kvpark.tiers.disk import Manifest

from .model import Seq

if TYPE_CHECKING:
    from .engine import Engine

log = logging.getLogger("kvpark.engine")

READER_CHECK_S = 30.0  # how often LMDB's reader slots of dead processes are freed
# Records made rows per hold of the index lock (~1 ms), and per maintenance pass: a
# million fresh parks become rows within a few passes, and no request waits long for it.
FREEZE_BATCH = 1024
FREEZE_PER_PASS = 262_144


def maintain(engine: "Engine") -> None:
    cat = engine.catalog
    interval = min(1.0, max(0.05, engine.config.leases.ttl_s / 4))
    try:
        engine.disk.sweep_orphans()  # block records a crash left without a manifest (no lock held)
    except Exception:  # the maintenance thread must never die
        log.exception("disk tier: the sweep of orphaned block records failed")
    moved = 0
    readers_checked = time.monotonic()
    while True:
        with cat.lock:
            if engine.closed:
                return
            if not moved:
                # Idle, or nothing could move (disk full, everything leased or pinned):
                # wait for a wake (a tier past its high mark) or the interval; don't spin.
                # After a pass that moved something, go again at once: a write-back
                # or a demotion that is behind catches up at full speed.
                cat.wake.wait(interval)
            if engine.closed:
                return
        moved = 0
        try:
            engine.leases.reap()
            expire(engine)
            engine.mover.retry_deletes()
            if engine.remote is not None:
                engine.remote.retry_forgets()  # dropped versions Redis has not confirmed deleted
                engine.remote.heal()  # a Redis that is back shows as healthy without waiting for work
            with cat.lock:
                cat.order.compact()  # touches without evictions leave stale heap entries
            freeze_idle(engine)
            moved = engine.mover.relieve()
            moved += engine.mover.write_back()  # write_back's dirty bounds
            if time.monotonic() - readers_checked >= READER_CHECK_S:
                # A client killed inside a disk-grant read leaves its LMDB reader slot
                # behind, and with it a snapshot whose pages the writer may not reuse.
                readers_checked = time.monotonic()
                engine.disk.reader_check()
        except Exception:  # the maintenance thread must never die
            log.exception("maintenance pass failed")


def freeze_idle(engine: "Engine", budget: int = FREEZE_PER_PASS) -> int:
    """Turn the ``Seq`` records nobody uses back into rows (``Catalog.freeze_idle``), a
    batch per hold of the index lock, each queued id at most once and at most ``budget``
    per pass; returns how many it looked at."""
    cat = engine.catalog
    with cat.lock:
        # Each queued id at most once: what cannot be frozen yet goes back to the end of
        # the queue, and a pass that came round to it again would spin on it.
        budget = min(budget, cat.freeze_queued())
    looked = 0
    while looked < budget:
        want = min(FREEZE_BATCH, budget - looked)
        with cat.lock:
            if engine.closed:
                break
            n = cat.freeze_idle(want)
        looked += n
        if n < want:
            break  # the queue ran out
    return looked


def expire(engine: "Engine") -> None:
    """Drop versions past their TTL, and shared blocks nobody took up."""
    with engine.catalog.lock:
        ttl, unused = engine.catalog.expired(time.time(), engine.config.leases.ttl_s)
    # A TTL is over for everyone: the remote copy goes too. A shared block nobody here
    # took up may be used by another daemon's sequences: only the local copy goes.
    for seq, everywhere in [(s, True) for s in ttl] + [(s, False) for s in unused]:
        try:
            if drop_version(engine, seq, everywhere):
                log.info("sequence %r expired (TTL, or an unused shared block); dropped", seq.seq_id)
        except FailedPrecondition:
            pass  # a shared block taken up meanwhile


def retire(engine: "Engine", seq: Seq) -> list[Seq]:
    """Unlink ``seq``; returns it and the shared blocks it left unreferenced. REQUIRES: index lock."""
    cat = engine.catalog
    if seq.shared and cat.refcount(seq.seq_id):
        raise FailedPrecondition(
            f"shared block {seq.seq_id!r} is used by {cat.refcount(seq.seq_id)} sequence(s); drop those instead")
    cat.retire(seq)
    return [seq, *cat.take_orphans()]


def drop_version(engine: "Engine", seq: Seq, everywhere: bool) -> bool:
    """Drop ``seq`` if it is still the indexed version of its id; False when it was
    dropped or replaced since it was chosen (the newer version stays)."""
    with engine.catalog.lock:
        if not engine.catalog.current(seq):
            return False
        todo = retire(engine, seq)
        forget = engine.retire_remote([seq]) if everywhere else []
        engine.deletes.claim(todo)
    finish_drop(engine, todo, forget, claimed=True)
    return True


def finish_drop(engine: "Engine", todo: list[Seq], remote: list[Manifest], claimed: bool = False) -> None:
    """Delete the disk copies of ``todo`` and the remote copies of ``remote`` (tombstoned
    by ``Engine.retire_remote`` when they left the index). Every
    delete is tried: one that fails is left to the maintenance pass to retry (the disk
    accounting already follows the index), and the first failure is raised after.
    ``claimed``: ``Deletes.claim(todo)`` was called as they left the index."""
    try:
        failed = engine.mover.delete_all(todo)
        # Not orphaned blocks: other daemons' sequences may use them. Still claimed while
        # the tombstones are written: absence is durable only once a restart cannot adopt
        # the remote copy back.
        failed = engine.forget_remote(remote) or failed
        if engine.remote is not None:
            # A version kept in Redis by a local-only drop: its stub goes too (a restart
            # would index it again; a miss adopts it from Redis all the same). Never a
            # tombstoned one's: ``forget`` removes that only once its tombstone is on disk.
            tombed = {(m.seq_id, m.gen) for m in remote}
            engine.remote.unstub([s.manifest for s in todo if (s.seq_id, s.gen) not in tombed])
    finally:
        if claimed:
            engine.deletes.unclaim(todo)
    if failed is not None:
        raise failed


def reconcile(engine: "Engine") -> int:
    """Retire the loaded sequences that reference a shared block the disk does not
    hold, and delete their records; returns how many. A crash can leave one: a version
    whose disk copy was written before its blocks' (a write_back demotion), or whose
    blocks' delete finished before its own. With a remote tier, a block that moved
    there is adopted instead; when Redis cannot answer, nothing is retired."""
    cat = engine.catalog
    with cat.lock:
        broken = cat.dangling()
        missing = list(dict.fromkeys(r for s in broken for r in s.refs if cat.find(r) is None))
    if not broken:
        return 0
    if engine.remote is not None:
        try:
            found = [m for m in engine.remote.store.get_manifests(missing) if m is not None]
        except Exception as e:  # noqa: BLE001 - a remote tier that cannot answer must not stop the start
            log.warning("start-up: %d sequence(s) reference shared blocks this disk lacks, and the remote tier "
                        "cannot be asked (%s); left as they are", len(broken), e)
            return 0
        with cat.lock:
            engine.deletes.adoptable(found, time.monotonic() + 10.0)
            cat.adopt(m for m in found if not engine.remote.tombed(m))  # never a block dropped here
    with cat.lock:
        broken = [s for s in broken if cat.current(s) and any(
            (b := cat.find(r)) is None or not b.shared for r in s.refs)]
        for seq in broken:
            cat.retire(seq)
        todo = broken + cat.take_orphans() if broken else []
        engine.deletes.claim(todo)
    if not broken:
        return 0
    log.warning("start-up: %d sequence(s) referenced shared blocks that are gone (a crash); removed", len(broken))
    failed = engine.mover.delete_all(todo, claimed=True)
    if failed is not None:
        log.warning("start-up: removing them failed (%s); retried in the background", failed)
    if engine.remote is not None:  # indexed from stubs, some of them: not again at the next start
        engine.remote.unstub([s.manifest for s in todo])
    return len(broken)
