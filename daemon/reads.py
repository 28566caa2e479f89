"""The restore side of the engine: leasing readable copies and streaming their bytes.

``Engine.acquire`` and ``Engine.iter_chunks`` delegate here; the engine's state (index,
leases, mover, windows, tiers, disk, remote) is read through the engine passed in. A
restore leases each part in the same step that finds its copy ready (under the index
lock), so no demotion can take it away in between; a part with no memory copy is read
from disk inside one read transaction, each block verified before any of its bytes
leave, and one moved to remote between the lease and the read is served from there.

Locks as in ``engine.py``: ``Lease.lock`` -> ``Seq.move_lock`` -> ``Catalog.lock``; no
disk or Redis I/O under the index lock.

Primitives:
- ``acquire(engine, seq_ids, need, stream, expect_layout, inline_max) -> ReadHandle``: a
  try that fails because an overwrite replaced a version under it (``NotFound`` or
  ``DataLoss`` while its id is indexed as a newer version, or while Redis holds another
  daemon's newer one) leases the new version instead, at most ``REPLACED_RETRIES`` times;
  a drop stays ``NotFound``.
- ``replaced(engine, tops) -> bool``: whether one of ``tops`` was overwritten, none dropped.
- ``acquire_part(engine, seq, need, want, lease) -> Part``: one part, promoting first
  when the restore wants a memory tier.
- ``lease_part(seq, need, want, lease, final) -> Part | None`` (REQUIRES: index lock).
- ``iter_chunks(engine, handle, chunk_size)``: (payload offset, views) pieces.
- ``evicted(engine, seq) -> bool``; ``remote_blocks(engine, manifest)``: a part read
  from remote after it left the disk.
- ``adopt(engine, seq_ids)``: index ids only the remote tier has (a miss when Redis is
  unreachable).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Iterator

from kvpark.proto.errors import DataLoss, InvalidArgument, LayoutMismatch, NotFound, ResourceExhausted
from kvpark.proto.layout import validate_seq_id
from kvpark.proto.wire import regroup
from kvpark.tiers.disk import Manifest

from .model import MAX_PARTS, Lease, Part, ReadHandle, Seq

# Tries of a restore whose version an overwrite replaced under it (each overwrite that
# lands mid-read costs one); past them the last error stands.
REPLACED_RETRIES = 8
# How long adopting a version waits for a local delete of the same generation under way.
ADOPT_WAIT_S = 10.0

if TYPE_CHECKING:
    from .engine import Engine


def acquire(engine: "Engine", seq_ids: str | list[str], need: str | None = None, stream: bool = False,
            expect_layout: str = "", inline_max: int = 0, disk: bool = False) -> ReadHandle:
    """Lease readable copies of one or more sequences, served as one payload.

    A sequence that references shared blocks expands to those blocks, then itself.
    ``need`` forces a memory tier (shm: host, cuda_ipc: device); otherwise each part
    is served from its fastest CPU-readable copy, or from disk. A payload of at most
    ``inline_max`` bytes is served that way even with ``need`` (the caller sends it
    inline), so it never goes host -> device -> host. A sequence whose copies belong in
    the private tier is promoted and served there, whatever ``need`` or
    ``policy.restore_to`` say (``placement.py``). With ``expect_layout``, every
    named sequence must carry ``attrs["layout"]`` equal to it. ``stream``: the lease
    is held by this call's stream (no deadline). ``disk``: the caller reads the disk
    tier's records itself; when every part is on disk only, the answer is a disk grant
    (``ReadHandle.direct``: no lease, no promotion, nothing to release).
    """
    ids = [seq_ids] if isinstance(seq_ids, str) else list(seq_ids)
    if not ids:
        raise InvalidArgument("no sequence ids given")
    if len(ids) > MAX_PARTS:
        raise InvalidArgument(f"{len(ids)} ids; at most {MAX_PARTS} per call")
    for sid in ids:
        validate_seq_id(sid)
    engine.check_open()
    if need is not None:
        engine.tier_arg(need)
    adopt(engine, ids)
    # An overwrite that lands while this restore promotes the old version from disk
    # retires (and deletes) it under us. The id was never absent, so the answer is the
    # old or the new version: lease the current one again. Only a drop is NOT_FOUND.
    with engine.absent(ids):  # NOT_FOUND only once the absence is durable
        for attempt in range(REPLACED_RETRIES):
            tops: list[Seq] = []
            try:
                return _acquire_once(engine, ids, need, stream, expect_layout, inline_max, tops, disk)
            except (NotFound, DataLoss):
                if attempt == REPLACED_RETRIES - 1:
                    raise
                if not replaced(engine, tops):
                    # A version found gone from Redis leaves the index (``remote_guard``);
                    # another daemon sharing the namespace may have replaced it there: looked
                    # up again, that version is read. Nothing found (or a tombstone): gone.
                    adopt(engine, ids)
                    if not replaced(engine, tops):
                        raise
    raise AssertionError("unreachable")


def replaced(engine: "Engine", tops: list[Seq]) -> bool:
    """Whether one of ``tops`` was overwritten (its id indexed as another version) and
    none was dropped: a read that failed on them may lease the current versions."""
    with engine.catalog.lock:
        now = [engine.catalog.find(t.seq_id) for t in tops]
    return bool(tops) and all(n is not None for n in now) and any(n is not t for n, t in zip(now, tops))


def _acquire_once(engine: "Engine", ids: list[str], need: str | None, stream: bool, expect_layout: str,
                  inline_max: int, tops: list[Seq], disk: bool = False) -> ReadHandle:
    """One try of ``acquire``; fills ``tops`` with the versions it found."""
    with engine.catalog.lock:
        tops.extend(engine.catalog.get(sid) for sid in ids)
        for t in tops:
            have = t.attrs.get("layout", "")
            if expect_layout and have != expect_layout:
                raise LayoutMismatch(
                    f"sequence {t.seq_id!r} was parked with layout {have or '(none)'}; the caller expects "
                    f"{expect_layout}"
                )
        comps: list[Seq] = []
        for t in tops:
            comps.extend(engine.catalog.get(r) for r in t.refs)
            comps.append(t)
        now = time.time()
        for c in comps:
            c.manifest.last_access = now
            c.access_count += 1
            engine.catalog.touch(c)  # its place in each tier's eviction order
        if need is not None and sum(c.manifest.nbytes for c in comps) <= inline_max:
            need = None
        elif disk and all(not c.res and c.on_disk for c in comps):
            # A disk grant: the caller reads the records in its own read transaction. No
            # lease: a version's record keys carry its generation, unique to one daemon
            # start, so whatever happens to it meanwhile (evicted, dropped, overwritten)
            # the caller finds exactly these bytes or nothing, and asks again without
            # ``disk`` (an answer linearised here, as a lease's is at its grant).
            return ReadHandle(engine.catalog.info_of(tops, comps), [Part(c.manifest, None, "disk", c) for c in comps],
                              None, direct=True)
        one = engine.placement.tier(comps[0].seq_id, need) if need is not None and len(comps) == 1 else None
        big = one is not None and one not in comps[0].res and engine.windows.needed(comps[0].manifest.nbytes, one)
    if big:
        assert one is not None
        return engine.windows.open_read(tops, comps[0], one)
    want = need or engine.restore_to
    if want not in engine.tiers:
        want = None  # restore_to = "device" on a daemon whose device tier did not come up
    lease = engine.leases.new_read(stream)
    parts: list[Part] = []
    try:
        if want:
            engine.mover.promote_batch(comps, want)
        for c in comps:
            parts.append(acquire_part(engine, c, need, want, lease))
    except BaseException:
        with engine.catalog.lock:
            engine.leases.end_read(lease)
        raise
    with engine.catalog.lock:
        if lease.parts:
            engine.leases.add(lease)
        info = engine.catalog.info_of(tops, comps)
    return ReadHandle(info, parts, lease if lease.parts else None)


def acquire_part(engine: "Engine", seq: Seq, need: str | None, want: str | None, lease: Lease) -> Part:
    place = engine.placement
    need = place.tier(seq.seq_id, need) if need else None
    want = place.tier(seq.seq_id, want) if want else None
    with engine.catalog.lock:
        part = lease_part(seq, need, want, lease, final=False)
    if part is not None:
        return part
    if want:
        engine.mover.promote(seq, want, make_room=need is not None, lease=lease)
    # Still only on remote (no promotion wanted, or no room for it): onto disk first.
    engine.mover.fetch_remote(seq)
    with engine.catalog.lock:
        part = lease_part(seq, need, want, lease, final=True)
        assert part is not None
        return part


def lease_part(seq: Seq, need: str | None, want: str | None, lease: Lease, final: bool) -> Part | None:
    """Lease ``seq``'s copy to read from, in the same step that finds it. REQUIRES: index lock.

    Before a promotion (``final`` False) only the copy the restore wants counts.
    """
    if seq.dropped:
        raise NotFound(f"sequence {seq.seq_id!r} was dropped or overwritten during the restore")
    held = next((t for s, t in lease.parts if s is seq), None)
    if held is not None:  # the promotion leased it as it made it ready (or an earlier part is it)
        return Part(seq.manifest, seq.res[held] if held != "disk" else None, held, seq)
    if not final and (want and want not in seq.res or not seq.res and not seq.on_disk):
        return None
    if need is not None:
        if need not in seq.res:
            raise ResourceExhausted(
                f"sequence {seq.seq_id!r} ({seq.manifest.nbytes} bytes) is not in the {need} tier and "
                "there is no room to stage it there (leased or pinned sequences cannot be demoted)"
            )
        tiers: tuple[str, ...] = (need,)
    else:
        tiers = ("host", "private", "device")  # streams read CPU memory best
    for t in tiers:
        if t in seq.res:
            seq.add_reader(t)
            lease.parts.append((seq, t))
            return Part(seq.manifest, seq.res[t], t, seq)
    # Served from disk: the lease pins the disk copy (no eviction takes it, to remote or
    # away) until the read is done or the lease expires. A drop still drops it: the
    # read then answers NOT_FOUND.
    seq.add_reader("disk")
    lease.parts.append((seq, "disk"))
    return Part(seq.manifest, None, "disk", seq)


def iter_chunks(engine: "Engine", handle: ReadHandle, chunk_size: int) -> Iterator[tuple[int, list[memoryview]]]:
    """(payload offset, views) pieces of at most ``chunk_size`` bytes, in payload order.

    Disk-served parts are read inside one read transaction; each block is verified
    before any of its bytes are yielded.
    """
    def views(r: object) -> Iterator[memoryview]:
        for p in handle.parts:
            if p.alloc is not None:
                yield from engine.tiers[p.tier].views(p.alloc)
            else:
                m = p.manifest
                for i, n in enumerate(m.block_lengths):
                    try:
                        yield r.read_block(m, i, n)  # type: ignore[attr-defined]
                    except DataLoss:
                        if p.seq is not None and p.seq.dropped:  # deleted under us: gone, not corrupt
                            raise NotFound(f"sequence {m.seq_id!r} was dropped or overwritten during the "
                                           "restore") from None
                        if i == 0 and evicted(engine, p.seq):
                            # Moved to remote between the lease and this read: serve it from there.
                            yield from remote_blocks(engine, m)
                            break
                        raise

    if all(p.alloc is not None for p in handle.parts):
        yield from regroup(views(None), chunk_size)
        return
    # A NOT_FOUND mid-stream (dropped under the read) waits for the absence to be
    # durable, after the read transaction is over.
    with engine.absent([p.manifest.seq_id for p in handle.parts]):
        with engine.disk.read_txn() as r:
            yield from regroup(views(r), chunk_size)


def evicted(engine: "Engine", seq: Seq | None) -> bool:
    with engine.catalog.lock:
        return seq is not None and engine.remote is not None and seq.on_remote and not seq.on_disk


def remote_blocks(engine: "Engine", m: Manifest) -> Iterator[memoryview]:
    assert engine.remote is not None
    view = memoryview(engine.remote.fetch(m))
    off = 0
    for n in m.block_lengths:
        yield view[off:off + n]
        off += n


def adopt(engine: "Engine", seq_ids: list[str]) -> None:
    """Index the ids this daemon lacks that the remote tier has (with the shared
    blocks they reference). Redis unreachable: nothing is adopted. Never a version
    dropped here (tombstoned), even one whose tombstone went during the lookup."""
    remote = engine.remote
    if remote is None:
        return
    for _ in range(3):
        with engine.catalog.lock:
            # Presence only: an indexed row is not made a ``Seq`` to answer it.
            ids = list(dict.fromkeys(seq_ids))
            missing = [sid for sid, p in zip(ids, engine.catalog.present(ids)) if not p]
        if not missing:
            return
        epoch = remote.epoch
        found = [m for m in remote.manifests(missing) if m is not None]
        names = {m.seq_id for m in found}
        with engine.catalog.lock:
            refs = [r for m in found for r in m.refs if r not in names and r not in engine.catalog]
        if refs:
            found += [m for m in remote.manifests(list(dict.fromkeys(refs))) if m is not None]
        if not found:
            return
        with engine.catalog.lock:
            # A delete under way of a retired version with a generation adopted here (the
            # same record keys) finishes first; later ones see the adopted twin (``deletes.py``).
            engine.deletes.adoptable(found, time.monotonic() + ADOPT_WAIT_S)
            # A version dropped since the lookup is tombstoned; one whose tombstone went
            # meanwhile (its delete landed) may be what the lookup found: look again.
            ok = remote.adoptable(found, epoch)
            if ok is not None:
                engine.catalog.adopt(ok)
                return
    # Tombstones kept going under the lookups: not adopted now (a miss is always safe).
