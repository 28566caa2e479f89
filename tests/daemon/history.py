"""The history checker: many clients over colliding ids, every call recorded, every read checked.

``tests/daemon/test_history.py`` runs a bounded version (and unit-tests the checker on
hand-written histories); ``bench/history.py`` runs long ones. Jepsen-style: real client
processes against a real daemon record a *history*, and a separate, pure checker decides
whether every read is explained by the writes that could have produced it.

How it works:
- **Payloads** (``payload``, ``decode``): every write's value is unique and says who wrote
  it. A segment is an int64 header tensor ``[MAGIC, client, counter, tenant, crc(id),
  crc(body), body tensors, kind]`` followed by its body tensors. A composite sequence
  restores as its shared blocks' segments, then its own. A read therefore names the write
  it came from (``client:counter``, its *tag*), and a torn or mixed payload fails its crc.
- **Workload** (client processes, ``main``): each process runs a few threads, each a
  logical client with its own counter, over a handful of ids shared by all (so collisions
  are constant): park (overwrite), create (no overwrite), composite parks (shared blocks
  created in the same commit), TTL parks, windowed parks (larger than the host tier),
  ``park_batch`` of shared blocks, drop, restore, ``restore_many``, a restore released
  after its first tensor, prefetch and pin/unpin, over the shm and inline transports
  (inline on the data channel, or on gRPC streams), with one or two tenants.
- **Recorder**: a line before each call (its invocation time) and one after (completion
  time, ``ok`` / ``fail`` with the typed error / ``unknown``, and what a read returned).
  ``time.monotonic`` is system-wide on Linux, so times of all processes compare. A call
  with no completion line (its process killed) is ``unknown``: possibly applied.
- **Faults** (seeded): disk write transactions that fail (EIO), fill the map, or stall
  (``FaultyDisk``, through the ``disk_factory`` seam, in-process daemon); SIGTERM and
  SIGKILL restarts of a ``kvpark serve`` subprocess on a unix socket; client processes
  SIGKILLed mid-call and replaced; with the remote tier on, its real Redis killed and
  restarted empty, or one sequence's manifest deleted behind the daemon's back.
- **Checker** (``check``, pure): per (tenant, id) a register with unique values.
  A read of write ``W`` is *wrong* when ``W`` began after the read ended, or another write
  or a drop to that id completed entirely between ``W``'s completion and the read's
  invocation (it was definitely superseded). A ``NotFound`` read is *lost* unless the
  initial state, a drop, a disk eviction, a TTL expiry or a lossy restart could explain it
  the same way. A read of a refused write (or of no write at all) is *phantom*; of another
  tenant's write *cross-tenant*; of bytes that fail their crc, or of a ``DataLoss`` nobody
  injected, *corrupt*. An acknowledged create while the id was definitely present, or an
  ``AlreadyExists`` while it was definitely absent, is a *create* violation.
  Unknown operations may be sources (possibly applied) but never supersede anything.
- **Write modes**: under ``write_through`` nothing acknowledged may be lost across any
  restart. Under ``write_back`` a SIGTERM flushes (no loss allowed), but a SIGKILL may
  lose any acknowledged write or drop not yet flushed: after it, each id may show any
  earlier state (``lossy`` restarts), never bytes nobody wrote.
- After quiescence: ``Engine.check_invariants()`` (in-process daemon) or ``stat`` against
  ``list`` (subprocess).

Primitives: ``payload``, ``block_payload``, ``decode``; ``Op``, ``Event``, ``History``,
``check(history, tolerate=()) -> Report`` (``Report.table()``, ``Report.violations`` each
with its minimal history); ``KNOWN_BUGS`` (names a run may tolerate); ``Recorder``,
``load_ops``; ``FaultyDisk``; ``HistoryConfig``, ``run_history(root, config) -> Report``;
the client process entry point ``main``.
"""

from __future__ import annotations

import argparse
import bisect
import json
import logging
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import torch

REPO = Path(__file__).resolve().parents[2]
KiB, MiB = 1 << 10, 1 << 20
MAGIC = 0x4B56484953540001  # "KVHIST" v1
HEADER_LEN = 8
KIND_SEQ, KIND_BLOCK = 0, 1
TENANTS = ("alice", "carol")  # the two tenants when tenants are on; "" when off
TOKENS = {"alice": "tok-alice-history", "carol": "tok-carol-history"}
BLOCKS = 4  # shared block ids per tenant: b0..b3
# Typed refusals from a live daemon: the operation did not happen.
REFUSALS = ("AlreadyExists", "NotFound", "InvalidArgument", "ResourceExhausted", "FailedPrecondition",
            "LayoutMismatch", "LeaseExpired")
INF = float("inf")
# Violations the checker found (fixed since: no test run tolerates them). A run may still
# tolerate one by name (``check(..., tolerate=...)``, ``bench/history.py --tolerate``) to look
# past it while chasing another bug, and counts what it tolerated. Each is tolerated only
# for a read that a park, create or drop of its id overlapped.
MID_RESTORE = "NotFound(mid-restore)"
RECORD_MISSING = "DataLoss(record missing)"
KNOWN_BUGS = {
    # A restore or a waited prefetch that races an overwrite of its id gets NotFound
    # ("dropped or overwritten during the restore"; "no parked sequence" after the
    # prefetch's wait), though the id was never absent.
    "mid_restore_notfound": MID_RESTORE,
    # A restore served from the disk copy that an overwrite or a drop deletes under it
    # gets DataLoss ("record missing from the disk tier"): nothing was damaged.
    "mid_restore_dataloss": RECORD_MISSING,
}


# ------------------------------------------------------------------ payloads


def _crc(ts: Iterable[torch.Tensor]) -> int:
    c = 0
    for t in ts:
        c = zlib.crc32(t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes(), c)
    return c


def _segment(client: int, counter: int, tenant: int, seq_id: str, body: list[torch.Tensor],
             kind: int) -> list[torch.Tensor]:
    head = torch.tensor([MAGIC, client, counter, tenant, zlib.crc32(seq_id.encode()), _crc(body), len(body), kind],
                        dtype=torch.int64)
    return [head, *body]


def payload(client: int, counter: int, tenant: int, seq_id: str, size: int, seed: int = 0) -> list[torch.Tensor]:
    """The unique value of write ``client:counter`` to ``seq_id``: a header naming it, then
    ``size`` random bytes (and, for some, a small bf16 tensor: a second dtype)."""
    g = torch.Generator().manual_seed((seed * 1_000_003 + client) * 1_000_003 + counter)
    body = [torch.randint(0, 256, (size,), dtype=torch.uint8, generator=g)]
    if counter % 3 == 0:
        body.append(torch.randn(int(torch.randint(1, 32, (1,), generator=g)), 16, generator=g).to(torch.bfloat16))
    return _segment(client, counter, tenant, seq_id, body, KIND_SEQ)


def block_payload(tenant: int, block_id: str) -> list[torch.Tensor]:
    """A shared block's content: a function of its tenant and id (content-addressed, so a
    dedup keeps the same bytes)."""
    key = zlib.crc32(f"{tenant}/{block_id}".encode())
    g = torch.Generator().manual_seed(key)
    body = [torch.randint(0, 256, (int(torch.randint(KiB, 32 * KiB, (1,), generator=g)),), dtype=torch.uint8,
                          generator=g)]
    return _segment(-1, key, tenant, block_id, body, KIND_BLOCK)


class Corrupt(Exception):
    """Restored tensors that are not whole segments of written payloads."""


@dataclass(frozen=True)
class Segment:
    client: int
    counter: int
    tenant: int
    id_crc: int
    kind: int

    @property
    def tag(self) -> str:
        return f"{self.client}:{self.counter}"


def _is_header(t: torch.Tensor) -> bool:
    return t.dtype == torch.int64 and tuple(t.shape) == (HEADER_LEN,) and int(t[0]) == MAGIC


def decode(tensors: Sequence[torch.Tensor]) -> list[Segment]:
    """The segments of a restored payload, each checked against its crc; ``Corrupt`` when
    the tensors are not whole, intact segments."""
    out, i = [], 0
    while i < len(tensors):
        h = tensors[i]
        if not _is_header(h):
            raise Corrupt(f"tensor {i} is not a segment header ({h.dtype}, {tuple(h.shape)})")
        _, client, counter, tenant, id_crc, crc, n, kind = (int(x) for x in h.tolist())
        body = list(tensors[i + 1:i + 1 + n])
        if len(body) != n or any(_is_header(t) for t in body):
            raise Corrupt(f"segment {client}:{counter} is cut short")
        if _crc(body) != crc:
            raise Corrupt(f"segment {client}:{counter}: its bytes fail their crc (torn or mixed)")
        out.append(Segment(client, counter, tenant, id_crc, kind))
        i += 1 + n
    return out


# ------------------------------------------------------------------ history


@dataclass
class Op:
    """One call. ``kind``: park, create, drop or read. ``value``: the tag a write wrote;
    ``read``: the tag a read returned, ``"absent"`` (NotFound), or None (nothing known)."""

    id: str
    client: str
    kind: str
    key: str  # "tenant/seq_id"
    inv: float
    comp: float = INF
    status: str = "unknown"  # ok | fail | unknown
    value: str | None = None
    read: str | None = None
    err: str = ""
    how: str = ""  # the call: park, composite, ttl, windowed, restore, restore_many, ...
    refs: tuple[str, ...] = ()
    ttl: float = 0.0
    blocks: tuple[str, ...] = ()  # the block tags a read returned before the sequence's own
    read_key: str = ""  # the key the value read says it was written to
    read_tenant: str = ""  # the tenant the value read says it belongs to
    corrupt: str = ""  # why the bytes a read returned are not a whole written value
    msg: str = ""  # the error's message, for the printed history

    def line(self) -> str:
        end = "..." if self.comp == INF else f"{self.comp:.4f}"
        what = self.value or ""
        if self.kind == "read":
            what = f"-> {self.read}" if self.read else "-> ?"
        err = (f" {self.err}" if self.err else "") + (f" ({self.msg[:90]})" if self.msg else "")
        return f"[{self.inv:.4f} .. {end}] {self.client:>6} {self.how or self.kind:<13} {self.key:<14} " \
               f"{self.status:<7} {what}{err}"


@dataclass
class Event:
    """Something done to the system, not by a client: a restart (``lossy`` when it may lose
    acknowledged un-flushed state), a disk eviction of ``key`` logged at ``comp``, a fault."""

    kind: str  # restart | evict | fault | client_kill
    inv: float
    comp: float
    key: str = ""
    lossy: bool = False
    what: str = ""

    def line(self) -> str:
        return f"[{self.inv:.4f} .. {self.comp:.4f}] {'nemesis':>6} {self.kind:<13} {self.key:<14} {self.what}" \
               + (" (lossy)" if self.lossy else "")


@dataclass
class History:
    ops: list[Op] = field(default_factory=list)
    events: list[Event] = field(default_factory=list)


@dataclass
class Violation:
    kind: str  # wrong | lost | phantom | cross_tenant | corrupt | create
    key: str
    op: Op
    message: str
    history: list[str] = field(default_factory=list)  # the ops on that id around it

    def text(self) -> str:
        return "\n".join([f"{self.kind.upper()}: {self.key}: {self.message}", *("    " + h for h in self.history)])


VIOLATION_KINDS = ("wrong", "lost", "phantom", "cross_tenant", "corrupt", "create")


@dataclass
class Report:
    ops: int = 0
    reads_verified: int = 0
    values_verified: int = 0  # of those, reads that returned a value (not NotFound)
    faults: int = 0
    restarts: int = 0
    evictions: int = 0
    unknown: int = 0
    tolerated: int = 0  # reads a known bug explains (``check(tolerate=...)``), not checked
    counts: dict[str, int] = field(default_factory=dict)  # "how status" -> n
    violations: list[Violation] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)  # invariants, accounting, harness trouble
    seed: int = 0

    def n(self, kind: str) -> int:
        return sum(v.kind == kind for v in self.violations)

    @property
    def clean(self) -> bool:
        return not self.violations and not self.problems

    def table(self) -> str:
        head = ("ops", "reads_verified", "values", "unknown", "faults", "restarts", "evictions", *VIOLATION_KINDS)
        vals = [self.ops, self.reads_verified, self.values_verified, self.unknown, self.faults, self.restarts,
                self.evictions,
                *(self.n(k) for k in VIOLATION_KINDS)]
        widths = [max(len(h), len(str(v))) for h, v in zip(head, vals)]
        lines = ["  ".join(h.rjust(w) for h, w in zip(head, widths)),
                 "  ".join(str(v).rjust(w) for v, w in zip(vals, widths)),
                 "calls: " + ", ".join(f"{k} {v}" for k, v in sorted(self.counts.items())),
                 f"seed {self.seed}" + (f"; {self.tolerated} read(s) of a known bug tolerated" if self.tolerated
                                        else "")]
        return "\n".join(lines)

    def explain(self, limit: int = 5) -> str:
        out = [v.text() for v in self.violations[:limit]]
        if len(self.violations) > limit:
            out.append(f"... and {len(self.violations) - limit} more violation(s)")
        return "\n".join(out + [f"PROBLEM: {p}" for p in self.problems[:30]])


# ------------------------------------------------------------------ checker


def _prefix_max(xs: list[float]) -> list[float]:
    out, m = [], -INF
    for x in xs:
        m = max(m, x)
        out.append(m)
    return out


def _suffix_min(xs: list[float]) -> list[float]:
    out, m = [0.0] * len(xs), INF
    for n in range(len(xs) - 1, -1, -1):
        m = min(m, xs[n])
        out[n] = m
    return out


class _Key:
    """The ops and events of one (tenant, id), and the questions the checker asks of them.

    Each question is answered from sorted indexes in O(log n), not by scanning the id's
    history (a 30-minute run holds tens of thousands of ops per id). Each rests on one
    monotonicity: ``superseded(t, read)`` can only turn false as ``t`` grows, and
    ``removal_between(a, b)`` only false as ``a.inv`` grows, so the best candidate (the
    latest) answers for all. ``tests/daemon/test_history.py`` checks every answer against
    the plain scans on random histories.
    """

    def __init__(self, key: str, ops: list[Op], events: list[Event], restarts: list[Event]) -> None:
        self.key = key
        self.ops = ops
        self.writes = [o for o in ops if o.kind in ("park", "create")]
        # Definite state changes: acknowledged writes and drops, disk evictions.
        self.definite: list[tuple[float, float]] = [(o.inv, o.comp) for o in ops
                                                    if o.kind in ("park", "create", "drop") and o.status == "ok"]
        self.definite += [(e.inv, e.comp) for e in events if e.kind == "evict"]
        # Possible removals (sources of an absent read): drops that may have happened,
        # evictions, lossy restarts.
        self.removals: list[tuple[float, float]] = [(o.inv, o.comp) for o in ops
                                                    if o.kind == "drop" and o.status in ("ok", "unknown")]
        # What Redis lost: only copies that lived nowhere else, so never a definite change.
        self.removals += [(e.inv, e.comp) for e in events if e.kind in ("evict", "remote_loss")]
        self.lossy = sorted(e.inv for e in restarts if e.lossy)
        self.removals += [(t, t) for t in self.lossy]
        self.events = events
        self._index()

    def _index(self) -> None:
        # superseded: per epoch between lossy restarts, the definite changes completed in
        # it, by invocation, with the least completion of each suffix.
        epochs: list[list[tuple[float, float]]] = [[] for _ in range(len(self.lossy) + 1)]
        for i, c in self.definite:
            epochs[bisect.bisect_right(self.lossy, c)].append((i, c))
        self._sup = []
        for ch in epochs:
            ch.sort()
            self._sup.append(([i for i, _ in ch], _suffix_min([c for _, c in ch])))
        # absent_ok: removals by invocation with the greatest completion of each prefix;
        # TTL writes (not refused) by expiry with the greatest completion of each prefix.
        rem = sorted(self.removals)
        self._rem_inv, self._rem_comp = [i for i, _ in rem], _prefix_max([c for _, c in rem])
        ttl = sorted((w.inv + w.ttl, w.comp, w.inv) for w in self.writes if w.ttl and w.status != "fail")
        self._ttl_end, self._ttl_comp = [e for e, _, _ in ttl], _prefix_max([c for _, c, _ in ttl])
        # removal_between: removals by completion with the least invocation of each suffix;
        # TTL writes by completion with the earliest expiry of each suffix.
        rc = sorted((c, i) for i, c in self.removals)
        self._rc_comp, self._rc_inv = [c for c, _ in rc], _suffix_min([i for _, i in rc])
        tc = [(c, e) for e, c, _ in ttl]
        tc.sort()
        self._tc_comp, self._tc_end = [c for c, _ in tc], _suffix_min([e for _, e in tc])
        # creates: acknowledged writes by completion with the latest invocation of each
        # prefix (and its op); writes not refused by invocation, and by completion with
        # the least invocation of each suffix; acknowledged drops by completion.
        ok = sorted((w.comp, w.inv, n) for n, w in enumerate(self.writes) if w.status == "ok")
        self._ok_comp = [c for c, _, _ in ok]
        self._ok_best: list[int] = []
        best, bi = -INF, -1
        for _, i, n in ok:
            if i > best:
                best, bi = i, n
            self._ok_best.append(bi)
        live = [w for w in self.writes if w.status != "fail"]
        self._live_inv = sorted(w.inv for w in live)
        lc = sorted((w.comp, w.inv) for w in live)
        self._lc_comp, self._lc_inv = [c for c, _ in lc], _suffix_min([i for _, i in lc])
        drops = sorted((o.comp, n) for n, o in enumerate(self.ops) if o.kind == "drop" and o.status == "ok")
        self._drop_comp, self._drop_op = [c for c, _ in drops], [n for _, n in drops]

    def overlapped(self, read: Op) -> bool:
        """A park, create or drop of the id ran while ``read`` did."""
        return any(o.kind in ("park", "create", "drop") and o.inv < read.comp and o.comp > read.inv for o in self.ops)

    def _lost_after(self, t0: float, t1: float) -> bool:
        """A lossy restart in ``(t0, t1)``: what was acknowledged before it may be gone."""
        j = bisect.bisect_right(self.lossy, t0)
        return j < len(self.lossy) and self.lossy[j] < t1

    def superseded(self, src_comp: float, read: Op) -> bool:
        """Some definite change completed entirely after ``src_comp`` and before ``read``
        began (and no lossy restart since could have undone it)."""
        # Only changes completed since the last lossy restart before the read count: those
        # of the read's epoch (a change completed in it and before the read is in it).
        invs, least = self._sup[bisect.bisect_left(self.lossy, read.inv)]
        j = bisect.bisect_right(invs, src_comp)
        return j < len(invs) and least[j] < read.inv

    def source_ok(self, w: Op, read: Op) -> bool:
        return w.inv < read.comp and not self.superseded(w.comp, read)

    def absent_ok(self, read: Op) -> bool:
        if not self.superseded(-INF, read):
            return True  # the initial state
        j = bisect.bisect_left(self._rem_inv, read.comp)  # removals begun before the read ended
        if j and not self.superseded(self._rem_comp[j - 1], read):
            return True
        # A TTL ends the version it was parked with: the read may see it expired.
        j = bisect.bisect_left(self._ttl_end, read.comp)
        return bool(j) and not self.superseded(self._ttl_comp[j - 1], read)

    def removal_between(self, a: Op, b: Op) -> bool:
        """Something may have removed the id after ``a`` began and before ``b`` ended."""
        j = bisect.bisect_right(self._rc_comp, a.inv)
        if j < len(self._rc_comp) and self._rc_inv[j] < b.comp:
            return True
        j = bisect.bisect_right(self._tc_comp, a.inv)
        return j < len(self._tc_comp) and self._tc_end[j] < b.comp

    def latest_acked_before(self, t: float) -> Op | None:
        """The acknowledged write completed before ``t`` that began last."""
        j = bisect.bisect_left(self._ok_comp, t)
        return self.writes[self._ok_best[j - 1]] if j else None

    def begun_before(self, t: float) -> bool:
        """A write not refused began before ``t``."""
        return bool(self._live_inv) and self._live_inv[0] < t

    def written_between(self, t0: float, t1: float) -> bool:
        """A write not refused completed after ``t0`` (or never) and began before ``t1``."""
        j = bisect.bisect_right(self._lc_comp, t0)
        return j < len(self._lc_comp) and self._lc_inv[j] < t1

    def last_drop_before(self, t: float) -> Op | None:
        """The acknowledged drop that completed last before ``t``."""
        j = bisect.bisect_left(self._drop_comp, t)
        return self.ops[self._drop_op[j - 1]] if j else None

    def around(self, lo: float, hi: float, limit: int = 40) -> list[str]:
        rows: list[tuple[float, str]] = [(o.inv, o.line()) for o in self.ops if o.comp >= lo and o.inv <= hi]
        rows += [(e.inv, e.line()) for e in self.events if e.comp >= lo and e.inv <= hi]
        rows.sort()
        if len(rows) > limit:
            rows = rows[:5] + [(0.0, f"... {len(rows) - limit} more ...")] + rows[-(limit - 5):]
        return [r for _, r in rows]


def check(history: History, tolerate: Sequence[str] = ()) -> Report:
    """Check every read and create of ``history``; pure (no I/O). ``tolerate``: names of
    ``KNOWN_BUGS`` whose reads are counted (``Report.tolerated``), not checked."""
    rep = Report(ops=len(history.ops))
    skip = {KNOWN_BUGS[t] for t in tolerate}
    restarts = [e for e in history.events if e.kind == "restart"]
    rep.restarts = len(restarts)
    rep.faults = sum(e.kind in ("fault", "client_kill", "remote_loss") for e in history.events) + len(restarts)
    rep.evictions = sum(e.kind == "evict" for e in history.events)
    by_key: dict[str, list[Op]] = {}
    by_tag: dict[str, Op] = {}
    for o in history.ops:
        by_key.setdefault(o.key, []).append(o)
        if o.value is not None:
            by_tag[o.value] = o
        rep.counts[f"{o.how or o.kind} {o.status}"] = rep.counts.get(f"{o.how or o.kind} {o.status}", 0) + 1
        rep.unknown += o.status == "unknown"
    keys = {k: _Key(k, ops, [e for e in history.events if e.kind in ("evict", "remote_loss") and e.key in (k, "")]
                    + [e for e in history.events if e.kind not in ("evict", "remote_loss")], restarts)
            for k, ops in by_key.items()}

    def flag(kind: str, k: _Key, op: Op, msg: str, lo: float) -> None:
        rep.violations.append(Violation(kind, k.key, op, msg, k.around(lo, op.comp)))

    for k in keys.values():
        for r in k.ops:
            tenant = r.key.split("/", 1)[0]
            if r.err in skip and k.overlapped(r):
                rep.tolerated += 1
                continue
            if r.corrupt:
                flag("corrupt", k, r, r.corrupt, r.inv - 1.0)
                continue
            if r.kind != "read":
                continue
            if r.read is None or r.status != "ok":
                continue
            if r.read_tenant != tenant:
                flag("cross_tenant", k, r, f"{r.how} by tenant {tenant!r} returned tenant {r.read_tenant!r}'s "
                                           f"bytes ({r.read})", r.inv - 1.0)
                continue
            if r.read == "absent":
                if k.absent_ok(r):
                    rep.reads_verified += 1
                else:
                    last = max((o for o in k.writes if o.status == "ok" and o.comp < r.inv), key=lambda o: o.comp,
                               default=None)
                    lo = min(last.inv if last else r.inv, r.inv) - 0.05
                    flag("lost", k, r, f"{r.how} found nothing, but no drop, eviction, TTL or lossy restart explains it"
                         + (f" (last acknowledged write {last.value})" if last else ""), lo)
                continue
            w = by_tag.get(r.read)
            if w is None or w.key != r.key or r.read_key != r.key:
                where = "no write" if w is None else f"a write to {w.key}"
                kind = "cross_tenant" if w is not None and w.key.split("/", 1)[0] != tenant else \
                    ("phantom" if w is None else "wrong")
                flag(kind, k, r, f"{r.how} returned {r.read}, the value of {where}", r.inv - 1.0)
                continue
            if w.status == "fail":
                flag("phantom", k, r, f"{r.how} returned {r.read}, whose write was refused ({w.err})", w.inv - 0.05)
                continue
            if tuple(r.blocks) != tuple(w.refs):
                flag("wrong", k, r, f"{r.how} returned {r.read} with blocks {list(r.blocks)}, it was parked with "
                                    f"{list(w.refs)}", w.inv - 0.05)
                continue
            if w.inv >= r.comp:
                flag("wrong", k, r, f"{r.how} returned {r.read}, written only after the read ended", r.inv - 0.05)
            elif k.superseded(w.comp, r):
                flag("wrong", k, r, f"{r.how} returned {r.read}, which a later write or drop had definitely "
                                    f"replaced before the read began", w.inv - 0.05)
            else:
                rep.reads_verified += 1
                rep.values_verified += 1
        _check_creates(k, flag)
    return rep


def _check_creates(k: _Key, flag: Callable[[str, _Key, Op, str, float], None]) -> None:
    for c in (o for o in k.writes if o.kind == "create"):
        if c.status == "ok":
            # Exactly one create wins: none may succeed while the id was definitely present.
            # The write acknowledged before it that began last is the one least likely to
            # have been removed since: if something may have removed it, any earlier too.
            w = k.latest_acked_before(c.inv)
            if w is not None and not k.removal_between(w, c):
                flag("create", k, c, f"create {c.value} succeeded, but {w.value} was acknowledged before it and "
                                     f"nothing could have removed it", w.inv - 0.05)
        elif c.err == "AlreadyExists":
            # Refused as present: something may have been there.
            if not k.begun_before(c.comp):
                flag("create", k, c, f"create {c.value} was refused AlreadyExists, but no write to the id had begun",
                     c.inv - 1.0)
                continue
            last = k.last_drop_before(c.inv)
            if last is not None and not k.written_between(last.inv, c.comp) and not k._lost_after(last.comp, c.comp):
                flag("create", k, c, f"create {c.value} was refused AlreadyExists, but the id was dropped "
                                     f"before it and nothing wrote it since", last.inv - 0.05)


# ------------------------------------------------------------------ recorder


class Recorder:
    """Appends one JSON line per invocation and per completion to a file of its own (one
    per process); a line is written whole, and the file survives the process's death."""

    def __init__(self, path: Path) -> None:
        self._f = open(path, "a", buffering=1)
        self._lock = threading.Lock()

    def _write(self, rec: dict[str, Any]) -> None:
        line = json.dumps(rec) + "\n"
        with self._lock:
            self._f.write(line)

    def invoke(self, op: Op) -> None:
        op.inv = time.monotonic()
        self._write({"i": op.id, "c": op.client, "f": op.kind, "k": op.key, "t0": op.inv, "v": op.value,
                     "how": op.how, "refs": list(op.refs), "ttl": op.ttl})

    def complete(self, op: Op) -> None:
        op.comp = time.monotonic()
        self._write({"i": op.id, "k": op.key, "t1": op.comp, "st": op.status, "r": op.read, "err": op.err, "b": list(op.blocks),
                     "rk": op.read_key, "rt": op.read_tenant, "x": op.corrupt, "m": op.msg})

    def close(self) -> None:
        self._f.close()


def load_ops(paths: Iterable[Path]) -> list[Op]:
    """The ops of every recorder file; an invocation with no completion stays unknown."""
    ops: dict[str, Op] = {}
    for p in paths:
        for line in p.read_text().splitlines():
            try:
                rec = json.loads(line)
            except ValueError:
                continue  # a line cut by a kill: its op has no completion, so it stays unknown
            if "t0" in rec:
                ops[rec["i"]] = Op(rec["i"], rec["c"], rec["f"], rec["k"], rec["t0"], value=rec["v"], how=rec["how"],
                                   refs=tuple(rec["refs"]), ttl=rec["ttl"])
            elif rec["i"] in ops:
                o = ops[rec["i"]]
                o.comp, o.status, o.read, o.err = rec["t1"], rec["st"], rec["r"], rec["err"]
                o.key = rec.get("k", o.key)  # a restore_many's DataLoss names the id it concerns
                o.blocks, o.read_key, o.read_tenant, o.corrupt = tuple(rec["b"]), rec["rk"], rec["rt"], rec["x"]
                o.msg = rec.get("m", "")
    return list(ops.values())


def events_to_json(events: list[Event]) -> str:
    return json.dumps([e.__dict__ for e in events])


# ------------------------------------------------------------------ workload (client process)


OPS = {  # call -> weight
    "park": 18, "create": 8, "composite": 6, "ttl": 2, "windowed": 1, "blocks": 2,
    "drop": 8, "restore": 24, "restore_many": 6, "batch_read": 1, "partial": 3, "prefetch": 4, "pin": 3,
}


def size_of(rng: random.Random) -> int:
    r = rng.random()
    if r < 0.7:
        return rng.randint(1 * KiB, 32 * KiB)
    if r < 0.97:
        return rng.randint(32 * KiB, 256 * KiB)
    return rng.randint(256 * KiB, 1 * MiB)


class _Conn:
    """One ``Client`` shared by a process's threads, replaced after a call that left the
    connection in doubt (a restarted daemon: its arena and channels are gone)."""

    def __init__(self, address: str, transport: str, token: str | None, stop: Callable[[], bool]) -> None:
        self.address, self.transport, self.token, self.stop = address, transport, token, stop
        self._lock = threading.Lock()
        self._client: Any = None

    def get(self) -> Any:
        from kvpark.client import Client, KVParkError
        with self._lock:
            while self._client is None:
                try:
                    self._client = Client(self.address, timeout=30.0, transport=self.transport, token=self.token)
                except KVParkError:
                    if self.stop():
                        raise
                    time.sleep(0.1)  # the daemon is restarting
            return self._client

    def broken(self, c: Any) -> None:
        # Dropped, not closed: another thread may be mid-call on it, and closing a shm
        # client under a running restore unmaps the arena it copies from (SIGSEGV). The
        # last reference closes it.
        with self._lock:
            if self._client is c:
                self._client = None


@dataclass
class _Ctx:
    root: Path
    rec: Recorder
    conn: _Conn
    tenant: str
    tenant_no: int
    keys: int
    window_bytes: int  # the size of a windowed park (0: none)
    seed: int
    lossless_unavailable: bool  # in-process daemon: UNAVAILABLE is a refusal (the disk), not a restart
    ops: dict[str, int]


def _read_into(op: Op, segs: list[Segment], ids: list[str], ctx: _Ctx, at: int) -> None:
    """Fill ``op`` from the segments of ``ids[at]`` (blocks, then its own)."""
    own = [s for s in segs if s.kind == KIND_SEQ]
    blocks_before: list[list[Segment]] = [[]]
    for s in segs:
        if s.kind == KIND_SEQ:
            blocks_before.append([])
        else:
            blocks_before[-1].append(s)
    if len(own) != len(ids) or blocks_before[-1]:
        op.corrupt = f"{len(own)} sequence segment(s) for {len(ids)} id(s)"
        return
    s = own[at]
    op.read = s.tag
    op.read_tenant = TENANTS[s.tenant] if ctx.tenant else ""
    op.read_key = _key_of(op.read_tenant, s.id_crc, ctx.keys)
    names = {zlib.crc32(f"b{b}".encode()): f"b{b}" for b in range(BLOCKS)}
    op.blocks = tuple(names.get(b.id_crc, f"?{b.id_crc}") for b in blocks_before[at])
    for b in blocks_before[at]:
        if b.tenant != s.tenant:
            op.read_tenant = TENANTS[b.tenant] if ctx.tenant else ""


def _batch_problem(segs: list[Segment], ids: list[str], ctx: _Ctx) -> str:
    """Why the restored batch sequences are not exactly ``ids``' content ("" when they are)."""
    want = [Segment(-1, zlib.crc32(f"{ctx.tenant_no}/{i}".encode()), ctx.tenant_no, zlib.crc32(i.encode()),
                    KIND_BLOCK) for i in ids]
    return "" if segs == want else f"batch sequences {ids} restored as {segs}"


def _key_of(tenant: str, id_crc: int, keys: int) -> str:
    for n in range(keys):
        if zlib.crc32(f"k{n}".encode()) == id_crc:
            return f"{tenant}/k{n}"
    return f"{tenant}/?{id_crc}"


def _thread(ctx: _Ctx, cid: int, stop: Callable[[], bool]) -> None:
    from kvpark.client import KVParkError, NotFound, Unavailable

    rng = random.Random((ctx.seed * 7919 + cid) * 31)
    counter = 0
    names, weights = zip(*ctx.ops.items())
    while not stop():
        how = rng.choices(names, weights)[0]
        sid = f"k{rng.randrange(ctx.keys)}"
        key = f"{ctx.tenant}/{sid}"
        counter += 1
        op = Op(f"{cid}:{counter}", str(cid), "read", key, 0.0, how=how)
        refs: list[str] = []
        data: list[torch.Tensor] = []
        many: list[str] = []
        if how in ("park", "create", "composite", "ttl", "windowed"):
            op.kind = "create" if how == "create" else "park"
            op.value = f"{cid}:{counter}"
            size = ctx.window_bytes if how == "windowed" else size_of(rng)
            data = payload(cid, counter, ctx.tenant_no, sid, size, ctx.seed)
            if how == "composite":
                refs = [f"b{b}" for b in rng.sample(range(BLOCKS), rng.randint(1, 2))]
                op.refs = tuple(refs)
            if how == "ttl":
                op.ttl = rng.uniform(0.5, 2.0)
        elif how == "drop":
            op.kind = "drop"
        elif how in ("blocks", "batch_read"):
            op.kind, op.key = "batch", f"{ctx.tenant}/batch"
        elif how == "pin":
            op.how = "pin" if rng.random() < 0.5 else "unpin"
        elif how == "restore_many":
            many = [sid] + [f"k{n}" for n in rng.sample(range(ctx.keys), 2) if f"k{n}" != sid][:1]
        try:
            c = ctx.conn.get()
        except Exception:  # noqa: BLE001 - told to stop while the daemon was down
            if stop():
                break
            raise
        ctx.rec.invoke(op)
        try:
            if op.kind in ("park", "create"):
                c.park(sid, data, overwrite=how != "create", refs=refs,
                       new_blocks={b: block_payload(ctx.tenant_no, b) for b in refs}, ttl_s=op.ttl or None)
            elif how == "blocks":
                # Content-addressed independent sequences (not shared blocks: those ids
                # would then refuse to be referenced), one commit, present ones skipped.
                c.park_batch({f"p{b}": block_payload(ctx.tenant_no, f"p{b}") for b in range(BLOCKS)})
            elif how == "batch_read":
                ids = [f"p{b}" for b in rng.sample(range(BLOCKS), 2)]
                _, ts = c.restore_many(ids)
                op.corrupt = _batch_problem(decode(ts), ids, ctx)
            elif how == "drop":
                c.drop(sid)
            elif how == "restore":
                _read_into(op, decode(c.restore(sid)), [sid], ctx, 0)
            elif how == "restore_many":
                _, ts = c.restore_many(many)  # both ids' values, under one lease
                _read_into(op, decode(ts), many, ctx, 0)
            elif how == "partial":
                # A reader that lets go after the first tensor: the lease must end, and
                # the first tensor must still be a whole header of a value written there.
                r = c.restore(sid, layerwise=True)
                try:
                    _, first = next(iter(r))
                finally:
                    r.close()
                if _is_header(first) and int(first[7]) == KIND_SEQ:
                    s = Segment(*(int(x) for x in first[[1, 2, 3, 4, 7]].tolist()))
                    op.read, op.read_key = s.tag, _key_of(TENANTS[s.tenant] if ctx.tenant else "", s.id_crc, ctx.keys)
                    op.read_tenant = TENANTS[s.tenant] if ctx.tenant else ""
            elif how == "prefetch":
                c.prefetch(sid, tier="host", wait=rng.random() < 0.5)
            elif how in ("pin", "unpin"):
                c.pin(sid, how == "pin")
            op.status = "ok"
        except Corrupt as e:
            op.status, op.corrupt = "ok", str(e)
        except NotFound as e:
            op.msg = str(e)[:200]
            # A read of absence (a restore, a prefetch or a pin that found nothing), or a
            # composite park whose blocks ... cannot be missing: they come in the same commit.
            op.status, op.err = ("ok", "") if op.kind == "read" else ("fail", type(e).__name__)
            if op.kind == "read" and ("was dropped" in str(e) and "during" in str(e) or how == "prefetch"):
                # The daemon's words ("... during the restore / a move"); a waited
                # prefetch says "no parked sequence" alike: see KNOWN_BUGS.
                op.err = MID_RESTORE
            if op.kind == "read" and how != "restore_many":
                op.read, op.read_tenant = "absent", ctx.tenant
            elif op.kind == "read":
                op.read = None  # one of several ids: which one is not said
        except KVParkError as e:
            name = type(e).__name__
            op.err, op.msg = name, str(e)[:200]
            # A drop leaves the index before its disk records go, so a drop that fails on
            # the disk may have happened: unknown, whatever the error.
            refused = op.kind != "drop" and (name in REFUSALS or (ctx.lossless_unavailable and isinstance(
                e, Unavailable) and "cannot be written" in str(e)))
            if name == "DataLoss":
                op.status, op.corrupt = "ok", f"DataLoss: {e}"
                if "record missing" in str(e):
                    op.err = RECORD_MISSING  # see KNOWN_BUGS
                    named = re.search(r"sequence '([^']+)'", str(e))
                    if named and how == "restore_many":  # the id it names, of the several read
                        op.key = f"{ctx.tenant}/{named.group(1)}"
            elif refused:
                op.status = "fail"
            else:
                op.status = "unknown"
                ctx.conn.broken(c)
        ctx.rec.complete(op)


def _client(a: argparse.Namespace) -> int:
    root = Path(a.dir)
    if a.seed % 2 == 0:
        # Even seeds: a restore of more than 8 KiB takes the lease paths (and, for a
        # sequence on disk only, a disk grant) instead of one unary round trip, so the
        # history races those paths far more often; odd seeds keep the default.
        from kvpark.client import transport

        transport.SMALL_POOL_BYTES = 8 * KiB
    stop = lambda: (root / "stop").exists()  # noqa: E731
    tenant = TENANTS[a.client % 2] if a.tenants else ""
    ctx = _Ctx(root, Recorder(root / f"ops-{a.client}.jsonl"),
               _Conn(a.address, a.transport, TOKENS.get(tenant), stop), tenant,
               TENANTS.index(tenant) if tenant else 0, a.keys, a.window_bytes, a.seed,
               a.lossless_unavailable, json.loads(a.ops))
    ctx.conn.get()
    (root / f"ready{a.client}").write_text("")
    while not (root / "go").exists():
        time.sleep(0.01)
    threads = [threading.Thread(target=_thread, args=(ctx, a.client * 16 + t, stop)) for t in range(a.threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    ctx.rec.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tests.daemon.history")
    sub = ap.add_subparsers(dest="cmd", required=True)
    w = sub.add_parser("client")
    w.add_argument("--dir", required=True)
    w.add_argument("--client", type=int, required=True)
    w.add_argument("--seed", type=int, default=0)
    w.add_argument("--threads", type=int, default=2)
    w.add_argument("--keys", type=int, default=6)
    w.add_argument("--window-bytes", type=int, default=0)
    w.add_argument("--address", required=True)
    w.add_argument("--transport", default="auto")
    w.add_argument("--tenants", action="store_true")
    w.add_argument("--lossless-unavailable", action="store_true")
    w.add_argument("--ops", default=json.dumps(OPS))
    return _client(ap.parse_args(argv))


# ------------------------------------------------------------------ faults


class FaultyDisk:
    """Builds ``DiskStore`` subclasses whose write transactions fail (EIO), hit a full map
    or stall, each with a seeded probability; ``count`` holds what was injected and when."""

    def __init__(self, seed: int, kinds: Sequence[str] = ("eio", "map_full", "slow")) -> None:
        self.rng = random.Random(seed)
        self.lock = threading.Lock()
        # Per write transaction: 3% EIO, 1% a full map, 3% a 50 ms stall.
        self.p = tuple(p if k in kinds else 0.0 for k, p in (("eio", 0.03), ("map_full", 0.01), ("slow", 0.03)))
        self.armed = False
        self.events: list[Event] = []

    def draw(self) -> str:
        with self.lock:
            if not self.armed:
                return ""
            r = self.rng.random()
            p_eio, p_full, p_slow = self.p
            what = "eio" if r < p_eio else "map_full" if r < p_eio + p_full else \
                "slow" if r < p_eio + p_full + p_slow else ""
            if what:
                now = time.monotonic()
                self.events.append(Event("fault", now, now, what=f"disk {what}"))
            return what

    def factory(self) -> Any:
        import lmdb
        from kvpark.tiers.disk import DiskStore
        faults = self

        class _Txn:
            def __init__(self, txn: Any, what: str) -> None:
                self._txn, self._what = txn, what

            def __getattr__(self, name: str) -> Any:
                return getattr(self._txn, name)

            def __enter__(self) -> "_Txn":
                return self

            def __exit__(self, *exc: object) -> None:
                if exc[0] is not None:
                    self._txn.abort()
                    return
                if self._what == "slow":
                    time.sleep(0.05)  # a stalled write: the gap other calls run into
                elif self._what:
                    self._txn.abort()  # nothing of it reaches the file
                    raise (lmdb.MapFullError("mdb_txn_commit: MDB_MAP_FULL") if self._what == "map_full"
                           else lmdb.Error("mdb_txn_commit: Input/output error"))
                self._txn.commit()

        class _Env:
            def __init__(self, env: Any) -> None:
                self._env = env

            def __getattr__(self, name: str) -> Any:
                return getattr(self._env, name)

            def begin(self, *args: Any, write: bool = False, **kw: Any) -> Any:
                txn = self._env.begin(*args, write=write, **kw)
                return _Txn(txn, faults.draw()) if write else txn

        class Faulty(DiskStore):
            def __init__(self, *args: Any, **kw: Any) -> None:
                super().__init__(*args, **kw)
                self.env = _Env(self.env)

        return Faulty


class _Evictions(logging.Handler):
    """Each ``evicted 'ID' from disk (its only copy: dropped)`` as an event, timed when
    logged: after the sequence left the index, so the removal happened before then."""

    def __init__(self, tenants: bool) -> None:
        super().__init__(logging.DEBUG)
        self.tenants = tenants
        self.seen_lock = threading.Lock()  # not `lock`: logging.Handler holds that one around emit()
        self.events: list[Event] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.msg == "evicted %r from disk%s" and record.args and record.args[1]:  # type: ignore[index]
            from kvpark.daemon.model import NS_SEP
            sid = str(record.args[0])  # type: ignore[index]
            tenant, _, bare = sid.rpartition(NS_SEP)
            now = time.monotonic()
            with self.seen_lock:
                # The victim was chosen (and left the index) some time before the line:
                # the event spans a generous second before it.
                self.events.append(Event("evict", now - 1.0, now, key=f"{tenant}/{bare}"))


class _Redis:
    """The remote tier's real Redis (no persistence): killed and restarted (everything in
    it lost), or one sequence's manifest deleted behind the daemon's back. Each is a
    ``remote_loss`` event: a possible removal of every id (a restart) or of one."""

    def __init__(self, root: Path) -> None:
        from tests.redis_servers import RedisServer, have_redis
        why = have_redis()
        if why:
            raise RuntimeError(why)
        self.server = RedisServer(root / "redis").start()

    def kill_and_restart(self, down_s: float) -> Event:
        t0 = time.monotonic()
        self.server.stop()
        time.sleep(down_s)  # an outage the daemon's breaker must ride out
        self.server.start()
        return Event("remote_loss", t0, time.monotonic(), what="redis killed and restarted (empty)")

    def delete_one(self, rng: random.Random) -> Event | None:
        keys = sorted(k for k in self.server.cli("--scan", "--pattern", "hist:*m:*").split() if ":m:" in k)
        if not keys:
            return None
        key = rng.choice(keys)
        t0 = time.monotonic()
        self.server.cli("del", key)
        from kvpark.daemon.model import NS_SEP

        # NS:t:<tenant>:m:<tenant><SEP><id> (a tenant's), NS:o:m:<id> (an open daemon's)
        tenant, _, bare = key.rsplit(":m:", 1)[1].rpartition(NS_SEP)
        return Event("remote_loss", t0, time.monotonic(), key=f"{tenant}/{bare}",
                     what=f"deleted {key} behind the daemon")

    def stop(self) -> None:
        self.server.stop()


# ------------------------------------------------------------------ controller


@dataclass
class HistoryConfig:
    seconds: float = 10.0
    seed: int = 0
    clients: int = 4  # processes
    threads: int = 2  # logical clients per process
    keys: int = 6  # ids per tenant, shared by every client of it
    tenants: bool = True
    write: str = "write_back"
    daemon: str = "inproc"  # inproc: disk faults, evictions, invariants; proc: restarts
    # disk, sigterm, sigkill, client_kill; with ``remote``: redis_kill, redis_delete
    faults: tuple[str, ...] = ("disk", "client_kill")
    ops: dict[str, int] = field(default_factory=lambda: dict(OPS))
    host: str = "4MiB"
    disk: str = "32MiB"
    transports: tuple[str, ...] = ("shm", "inline")
    fault_every: tuple[float, float] = (0.5, 2.0)  # seconds between restarts / client kills
    tolerate: tuple[str, ...] = ()  # KNOWN_BUGS not to fail on
    disk_faults: tuple[str, ...] = ("eio", "map_full", "slow")  # what FaultyDisk injects ("disk" in faults)
    remote: bool = False  # a real redis-server as the remote tier (what the disk evicts goes there)
    data_channel: bool = True  # False: inline clients move bytes on gRPC streams instead
    # carol not trusted_local: her sequences live in the private tier (her clients are the
    # odd ones, which use the inline transport, as an untrusted tenant must)
    untrusted: bool = False
    # write_back's dirty bounds (policy.max_dirty_s): memory-only sequences this old are
    # written back while clients run, so write-back races every call (0: no bound)
    max_dirty_s: float = 0.25


def _daemon_settings(cfg: HistoryConfig, root: Path) -> dict[str, Any]:
    out: dict[str, Any] = {
        "server.grace_s": 1.0, "metrics.listen": "", "tiers.device.enabled": "false",
        "tiers.host.capacity": cfg.host, "tiers.host.shm_dir": str(root / "shm"),
        "tiers.disk.path": str(root / "disk"), "tiers.disk.capacity": cfg.disk,
        "policy.write": cfg.write, "leases.ttl_s": 4.0,  # the reaper (TTLs) runs every second
        "policy.max_dirty_s": cfg.max_dirty_s,
    }
    if not cfg.data_channel:
        out["server.data_channel"] = False
    if cfg.remote:
        out.update({"tiers.remote.namespace": "hist", "tiers.remote.timeout_s": 1.0})
    if cfg.tenants:
        import hashlib
        for name, tok in TOKENS.items():
            out[f"tenants.{name}.token_sha256"] = hashlib.sha256(tok.encode()).hexdigest()
            out[f"tenants.{name}.trusted_local"] = not (cfg.untrusted and name == "carol")
    return out


class _Daemon:
    """The daemon under test: in this process (``inproc``) or a ``kvpark serve``
    subprocess on a unix socket, so the address survives restarts (``proc``)."""

    def __init__(self, cfg: HistoryConfig, root: Path) -> None:
        self.cfg, self.root = cfg, root
        self.settings = _daemon_settings(cfg, root)
        self.inproc: Any = None
        self.popen: subprocess.Popen | None = None
        self.disk = FaultyDisk(cfg.seed, cfg.disk_faults)
        self.address = ""

    def start(self) -> None:
        if self.cfg.daemon == "inproc":
            from kvpark.daemon.config import load
            from kvpark.daemon.server import Daemon
            factory = self.disk.factory() if "disk" in self.cfg.faults else None
            conf = load(env={}, overrides={"server.listen": "127.0.0.1:0", **self.settings})
            self.inproc = Daemon(conf, **({"disk_factory": factory} if factory else {})).start()
            self.address = self.inproc.address
            return
        self.address = f"unix://{self.root / 'kvpark.sock'}"
        log_path = self.root / "daemon.log"
        with open(log_path, "a") as errlog:
            start = errlog.tell()
            sets = [x for k, v in self.settings.items() if k != "tiers.disk.path"
                    for x in ("--set", f"{k}={json.dumps(v) if isinstance(v, bool) else v}")]
            cmd = [sys.executable, "-m", "kvpark.daemon.cli", "serve", "--listen", self.address,
                   "--data-dir", str(self.root / "disk"), *sets]
            env = {k: v for k, v in os.environ.items() if not k.startswith("KVPARK")}
            self.popen = subprocess.Popen(cmd, stderr=errlog, stdout=subprocess.DEVNULL, env=env)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            with open(log_path) as f:
                f.seek(start)
                if "listening on" in f.read():
                    return
            if self.popen.poll() is not None:
                break
            time.sleep(0.05)
        raise RuntimeError(f"daemon did not start; see {log_path}")

    def restart(self, sig: signal.Signals) -> Event:
        assert self.popen is not None
        t0 = time.monotonic()
        self.popen.send_signal(sig)
        self.popen.wait(120)
        self.start()
        lossy = sig == signal.SIGKILL and self.cfg.write == "write_back"
        return Event("restart", t0, time.monotonic(), lossy=lossy, what=sig.name)

    def stop(self) -> None:
        if self.inproc is not None:
            self.inproc.stop(0.5)
        if self.popen is not None and self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(60)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()


def _final_reads(cfg: HistoryConfig, address: str, root: Path) -> None:
    """After quiescence, one restore of every id of every tenant, recorded as ops too."""
    from kvpark.client import Client, KVParkError, NotFound
    rec = Recorder(root / "ops-final.jsonl")
    n = 0
    for t, tenant in enumerate(TENANTS if cfg.tenants else ("",)):
        with Client(address, timeout=60.0, token=TOKENS.get(tenant), transport="inline") as c:
            ctx = _Ctx(root, rec, None, tenant, t, cfg.keys, 0, cfg.seed, True, {})  # type: ignore[arg-type]
            for k in range(cfg.keys):
                n += 1
                op = Op(f"final:{n}", "final", "read", f"{tenant}/k{k}", 0.0, how="final")
                rec.invoke(op)
                try:
                    _read_into(op, decode(c.restore(f"k{k}")), [f"k{k}"], ctx, 0)
                    op.status = "ok"
                except Corrupt as e:
                    op.status, op.corrupt = "ok", str(e)
                except NotFound:
                    op.status, op.read, op.read_tenant = "ok", "absent", tenant
                except KVParkError as e:
                    op.status, op.err = "ok", type(e).__name__
                    op.corrupt = f"{type(e).__name__} at quiescence: {e}"
                rec.complete(op)
    rec.close()


def _quiet_checks(cfg: HistoryConfig, d: _Daemon) -> list[str]:
    from kvpark.client import Client
    problems = []
    if d.inproc is not None:
        d.disk.armed = False
        try:
            d.inproc.engine.check_invariants()
        except AssertionError as e:
            problems.append(f"invariants: {e}")
    for tenant in TENANTS if cfg.tenants else ("",):
        with Client(d.address, timeout=60.0, token=TOKENS.get(tenant), transport="inline") as c:
            listed, st = c.list(), c.stat()
            # A tenant's stat is its own row; without tenants, the daemon's count.
            counted = st.tenants[0].sequences if cfg.tenants and st.tenants else st.sequences
            if counted != len(listed):
                problems.append(f"{tenant or 'stat'}: stat counts {counted} sequence(s), list has {len(listed)}")
            known = {f"{p}{k}" for k in range(cfg.keys) for p in "k"} | {f"{p}{b}" for b in range(BLOCKS) for p in "bp"}
            problems += [f"{tenant}/{i.seq_id}: listed, no client parked it" for i in listed if i.seq_id not in known]
    return problems


def run_history(root: Path, cfg: HistoryConfig) -> Report:
    """Run the workload against one daemon with the faults of ``cfg``, then check it."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "shm").mkdir(exist_ok=True)
    rng = random.Random(cfg.seed)
    mover_log = logging.getLogger("kvpark.mover")
    ev = _Evictions(cfg.tenants)
    old_level = mover_log.level
    mover_log.addHandler(ev)
    mover_log.setLevel(logging.DEBUG)
    redis = _Redis(root) if cfg.remote else None
    d = _Daemon(cfg, root)
    if redis is not None:
        d.settings["tiers.remote.url"] = redis.server.url
    events: list[Event] = []
    procs: dict[int, subprocess.Popen] = {}
    killed: list[subprocess.Popen] = []
    problems: list[str] = []
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    env = {k: v for k, v in env.items() if not k.startswith("KVPARK")}
    window = _size(cfg.host) + 512 * KiB if cfg.ops.get("windowed") else 0

    def spawn(n: int) -> None:
        cmd = [sys.executable, "-m", "tests.daemon.history", "client", "--dir", str(root), "--client", str(n),
               "--seed", str(cfg.seed), "--threads", str(cfg.threads), "--keys", str(cfg.keys),
               "--window-bytes", str(window), "--address", d.address,
               "--transport", cfg.transports[n % len(cfg.transports)], "--ops", json.dumps(cfg.ops)]
        cmd += ["--tenants"] if cfg.tenants else []
        cmd += ["--lossless-unavailable"] if cfg.daemon == "inproc" else []
        procs[n] = subprocess.Popen(cmd, cwd=REPO, env=env)

    try:
        d.start()
        for n in range(cfg.clients):
            spawn(n)
        deadline = time.monotonic() + 300
        while not all((root / f"ready{n}").exists() for n in range(cfg.clients)):
            if time.monotonic() > deadline or any(p.poll() is not None for p in procs.values()):
                raise RuntimeError("history clients did not start")
            time.sleep(0.05)
        d.disk.armed = True
        (root / "go").write_text("")
        end = time.monotonic() + cfg.seconds
        nemeses = [f for f in cfg.faults if f in ("sigterm", "sigkill", "client_kill", "redis_kill", "redis_delete")]
        if cfg.daemon != "proc":
            nemeses = [f for f in nemeses if f not in ("sigterm", "sigkill")]
        if redis is None:
            nemeses = [f for f in nemeses if not f.startswith("redis")]
        # Each kind once first (restarts first: they are what a short run is for), in a
        # seeded order, then at random: a bounded run never misses a kind it was given.
        first = sorted(rng.sample(nemeses, len(nemeses)), key=lambda f: f not in ("sigterm", "sigkill"))
        next_n = cfg.clients
        while True:
            left = end - time.monotonic()
            if left <= 0:
                break
            time.sleep(min(left, rng.uniform(*cfg.fault_every)))
            if time.monotonic() >= end or not nemeses:
                continue
            f = first.pop(0) if first else rng.choice(nemeses)
            if f == "client_kill":
                victim = rng.choice(sorted(procs))
                t0 = time.monotonic()
                procs[victim].kill()
                procs[victim].wait()
                killed.append(procs.pop(victim))
                events.append(Event("client_kill", t0, time.monotonic(), what=f"client process {victim}"))
                spawn(next_n)  # a new process: new logical clients, new counters
                next_n += 1
            elif f == "redis_kill" and redis is not None:
                events.append(redis.kill_and_restart(rng.uniform(0.2, 1.0)))
            elif f == "redis_delete" and redis is not None:
                e = redis.delete_one(rng)
                events += [e] if e is not None else []
            else:
                events.append(d.restart(signal.SIGTERM if f == "sigterm" else signal.SIGKILL))
        (root / "stop").write_text("")
        for n, p in procs.items():
            try:
                if p.wait(timeout=120) != 0:
                    problems.append(f"client process {n} exited {p.returncode}")
            except subprocess.TimeoutExpired:
                problems.append(f"client process {n} hung after stop")
        d.disk.armed = False
        _final_reads(cfg, d.address, root)
        problems += _quiet_checks(cfg, d)
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()
        d.stop()
        if redis is not None:
            redis.stop()
        mover_log.removeHandler(ev)
        mover_log.setLevel(old_level)
    with ev.seen_lock:
        events += ev.events
    events += d.disk.events
    (root / "events.json").write_text(events_to_json(events))
    hist = History(load_ops(sorted(root.glob("ops-*.jsonl"))), events)
    rep = check(hist, cfg.tolerate)
    rep.problems += problems
    rep.seed = cfg.seed
    (root / "report.txt").write_text(rep.table() + "\n" + rep.explain(limit=50) + "\n")
    return rep


def _size(text: str) -> int:
    units = {"KiB": KiB, "MiB": MiB, "GiB": 1 << 30}
    for u, m in units.items():
        if text.endswith(u):
            return int(float(text[:-len(u)]) * m)
    return int(text)


if __name__ == "__main__":
    sys.exit(main())
