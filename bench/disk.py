#!/usr/bin/env python
"""Disk tier against raw LMDB: kvpark's spill and restore-from-disk next to the limit.

In one run, on ``--seqs`` sequences of ``--seq-mib`` MiB each (default 16 x 16 MiB; one
tensor per sequence, so 1 MiB disk records, as a daemon with 1 MiB slots writes them):

- ``raw LMDB write`` (the limit of the spill): the same records (the same payload bytes
  and sizes, under block-style keys) put into a fresh environment opened as
  ``DiskStore`` opens it (``sync=False, metasync=False``, no writemap), all in one write
  transaction (the fastest pattern, bench/lmdb_write.py), then one ``env.sync(True)``:
  exactly the durability the spill gives.
- ``kvpark spill``: ``Client.flush()`` on a daemon (in this process) holding the same
  sequences in its host tier: host -> disk for all of them (records with header and
  xxh3, manifests, one fsync).
- ``raw LMDB read + copy into dst`` (the limit of the restore): the environment
  reopened (as the daemon restart below reopens its own), a read transaction, ``get``
  of every record (a zero-copy view of the map) copied into preallocated tensors; the
  same bytes a restore lands. An info row adds the xxh3 every kvpark read from disk
  computes before it trusts a record.
- ``kvpark restore from disk``: ``Client.restore(into=...)`` of every sequence after a
  daemon restart (untimed), so each one is on disk only. Over shm (the default for a
  local client) three ways: the default (a disk grant: the client reads the verified
  records itself, and the promotion ``policy.promote_on_restore`` asks for runs in the
  background), ``no promotion`` (``promote_on_restore = false``), and ``arena``
  (``tiers.disk.direct_reads = false``: the daemon verifies and promotes into the arena,
  the client copies out and releases, as every shm restore from disk did before disk
  grants); and inline. Each shm variant once more with ``Client.restore_many`` of all
  of them (one ``Acquire`` instead of one per sequence).

Both sides read what they just wrote, so both read from the page cache (the same
conditions). Each row runs ``--reps`` times (best and median); ratios use the best. The
data directory is a temporary one under ``--dir`` (default: the system temp directory).
GB/s means 1e9 bytes per second.

Daemons run in this process (one GIL for both sides), or with ``--servers process`` each
in its own ``kvpark serve`` process, as in production: there the promotion the default
asks for runs on the daemon's cores, not between the client's copies.

Usage: ``python bench/disk.py [--quick] [--reps N] [--dir DIR] [--servers process] [--json PATH]``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator, Sequence

import lmdb
import torch

from _common import serve_process, write_json  # bench/ is on sys.path when a script here runs

from kvpark.client import Client
from kvpark.client.benchkit import cpu_model, same, touch
from kvpark.daemon.config import load
from kvpark.daemon.server import Daemon
from kvpark.tiers.disk import block_key, checksum

MiB = 1 << 20
HERE = Path(__file__).resolve().parent
TARGET = 0.8  # spill and restore-from-disk >= 0.8x raw LMDB on the same records


@contextlib.contextmanager
def serving(overrides: dict[str, Any], process: bool) -> Iterator[str]:
    """A daemon on ``overrides``, in this process or its own; yields its address."""
    if process:
        with serve_process(overrides) as address:
            yield address
        return
    with Daemon(load(env={}, overrides=overrides)) as d:
        yield d.address


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="4 sequences instead of 16")
    ap.add_argument("--seqs", type=int, default=0, help="sequences (default 16; 4 with --quick)")
    ap.add_argument("--seq-mib", type=int, default=16, help="MiB per sequence (default 16)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--dir", default=tempfile.gettempdir(), help="where the temporary data directories go")
    ap.add_argument("--json", default=str(HERE / "results" / "disk.json"))
    ap.add_argument("--servers", choices=("inprocess", "process"), default="inprocess",
                    help="daemons in this process (default) or each in its own kvpark serve process")
    args = ap.parse_args(argv)
    nseq = args.seqs or (4 if args.quick else 16)
    size = args.seq_mib * MiB
    total = nseq * size
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    src = [torch.randint(0, 256, (size,), dtype=torch.uint8, generator=gen) for _ in range(nseq)]
    dst = [torch.empty_like(t) for t in src]
    touch(dst)
    ids = [f"disk-{i:04d}" for i in range(nseq)]
    root = tempfile.mkdtemp(prefix="kvpark-disk-bench-", dir=args.dir)
    times: dict[str, list[float]] = {}
    checks: list[str] = []
    process = args.servers == "process"
    print(f"disk tier benchmark: {nseq} sequences x {args.seq_mib} MiB = {total / 1e6:.0f} MB; reps={args.reps}; "
          f"servers {args.servers}; data under {root}", flush=True)

    def add(row: str, t: float) -> None:
        times.setdefault(row, []).append(t)

    base: dict[str, Any] = {
        "server.listen": "127.0.0.1:0", "metrics.listen": "", "tiers.device.enabled": "false",
        "tiers.host.capacity": str(total + 64 * MiB), "tiers.host.shm_dir": "/dev/shm" if os.path.isdir("/dev/shm")
        else "", "tiers.disk.path": os.path.join(root, "kvpark"), "tiers.disk.capacity": str(4 * total),
        # The rows below time their own moves: no background demotion in between.
        "policy.high_watermark": 0.99, "policy.low_watermark": 0.98,
    }

    # The shm rows: the default (a disk grant, the promotion for next time in the
    # background), a disk grant with no promotion, and the arena path that every shm
    # restore from disk took before disk grants (promote into the arena, copy out, Release).
    variants: list[tuple[str, dict[str, Any]]] = [
        ("", base),
        (", no promotion", {**base, "policy.promote_on_restore": False}),
        (", arena", {**base, "tiers.disk.direct_reads": False}),
    ]

    def raw_env(path: str) -> lmdb.Environment:
        return lmdb.open(path, map_size=4 * total + (64 << 20), max_dbs=4, subdir=True, writemap=False,
                         sync=False, metasync=False, readahead=False, lock=True)

    path = os.path.join(root, "raw")
    os.makedirs(path)
    try:
        for rep in range(args.reps):
            # ---- raw LMDB write, then read + copy into dst. One environment for every
            # rep, emptied (untimed) after each, as the daemon's is by the drops below: from
            # the second rep on, both write into free pages of a file already grown.
            env = raw_env(path)
            db = env.open_db(b"blocks")
            views = [[memoryview(t.numpy())[o : o + MiB] for o in range(0, size, MiB)] for t in src]
            t0 = time.perf_counter()
            with env.begin(write=True) as txn:  # one transaction, as the spill writes them
                for sid, vs in zip(ids, views):
                    for i, v in enumerate(vs):
                        txn.put(block_key(sid, 1, i), v, db=db)
            env.sync(True)
            add("raw LMDB write (+ sync)", time.perf_counter() - t0)
            # Reopened, as the daemon's restart below reopens its environment: both reads
            # start from a fresh mapping of pages that are in the page cache.
            env.close()
            env = raw_env(path)
            db = env.open_db(b"blocks")
            dnp = [t.numpy() for t in dst]
            t0 = time.perf_counter()
            with env.begin(buffers=True) as txn:
                for sid, d in zip(ids, dnp):
                    for i, o in enumerate(range(0, size, MiB)):
                        d[o : o + MiB] = memoryview(txn.get(block_key(sid, 1, i), db=db))
            add("raw LMDB read + copy into dst", time.perf_counter() - t0)
            if not same(src, dst):
                checks.append("raw LMDB read: bytes differ")
            touch(dst)
            t0 = time.perf_counter()
            with env.begin(buffers=True) as txn:
                for sid, d in zip(ids, dnp):
                    for i, o in enumerate(range(0, size, MiB)):
                        v = txn.get(block_key(sid, 1, i), db=db)
                        checksum(v)  # what every kvpark read from disk must do
                        d[o : o + MiB] = memoryview(v)
            add("raw LMDB read + xxh3 + copy (info)", time.perf_counter() - t0)
            with env.begin(write=True) as txn:
                txn.drop(db, delete=False)
            env.sync(True)
            env.close()
            touch(dst)

            # ---- kvpark: park into host (untimed), spill to disk (timed)
            with serving(base, process) as address, Client(address) as c:
                for sid, t in zip(ids, src):
                    c.park(sid, [t], overwrite=True)
                t0 = time.perf_counter()
                c.flush()
                add("kvpark spill (host -> disk, flush)", time.perf_counter() - t0)
            # ---- restore_many over shm: one Acquire (+ one Release on the arena path) for
            # all of them, so the gap to the per-sequence rows below is the per-sequence
            # round trips. (Each restart leaves every sequence on disk only again.)
            for label, conf in variants:
                with serving(conf, process) as address, Client(address) as c:
                    t0 = time.perf_counter()
                    c.restore_many(ids, into=dst)
                    add(f"kvpark restore_many from disk (shm{label})", time.perf_counter() - t0)
                    if not same(src, dst):
                        checks.append(f"kvpark restore_many from disk (shm{label}): bytes differ")
                    touch(dst)
            # ---- restart: every sequence is on disk only; restore each (timed)
            for transport, label, conf in [("shm", lb, cf) for lb, cf in variants] + [("inline", "", base)]:
                with serving(conf, process) as address, Client(address, transport=transport) as c:
                    t0 = time.perf_counter()
                    for sid, t in zip(ids, dst):
                        c.restore(sid, into=[t])
                    add(f"kvpark restore from disk ({transport}{label})", time.perf_counter() - t0)
                    if not same(src, dst):
                        checks.append(f"kvpark restore from disk ({transport}{label}): bytes differ")
                    touch(dst)
                    if transport == "inline":
                        for sid in ids:
                            c.drop(sid)
            print(f"  rep {rep + 1}/{args.reps} done", flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)

    rows = []
    for name, ts in times.items():
        rows.append(dict(row=name, times_s=ts, best_gbps=total / min(ts) / 1e9,
                         median_gbps=total / statistics.median(ts) / 1e9))
    best = {r["row"]: r["best_gbps"] for r in rows}
    ratios = []

    def ratio(label: str, num: str, den: str) -> None:
        v = best[num] / best[den]
        ratios.append(dict(ratio=label, value=v, target=TARGET, verdict="MET" if v >= TARGET else "MISSED"))

    ratio("spill / raw LMDB write", "kvpark spill (host -> disk, flush)", "raw LMDB write (+ sync)")
    for row in [f"shm{lb}" for lb, _ in variants] + ["inline"]:
        ratio(f"restore from disk ({row}) / raw LMDB read + copy", f"kvpark restore from disk ({row})",
              "raw LMDB read + copy into dst")
    for lb, _ in variants:
        ratio(f"restore_many from disk (shm{lb}) / raw LMDB read + copy", f"kvpark restore_many from disk (shm{lb})",
              "raw LMDB read + copy into dst")
    w = 48
    print(f"\nThroughput, GB/s: best of {args.reps} (median)")
    for r in rows:
        print(f"{r['row']:<{w}}{r['best_gbps']:8.2f} ({r['median_gbps']:5.2f})")
    print("\nRatios (best) and targets")
    for r in ratios:
        print(f"{r['ratio']:<{w + 12}}{r['value']:7.3f}  >= {r['target']:g}  {r['verdict']}")
    if checks:
        print("CORRECTNESS PROBLEMS: " + "; ".join(checks))
    write_json(args.json, dict(
        meta=dict(cpu=cpu_model(), cpus=os.cpu_count(), python=platform.python_version(), torch=torch.__version__,
                  lmdb=lmdb.__version__, seqs=nseq, seq_mib=args.seq_mib, reps=args.reps, gb="1e9 bytes",
                  servers=args.servers,
                  timestamp=time.strftime("%Y-%m-%dT%H:%M:%S%z")),
        throughput=rows, ratios=ratios, checks=checks))
    return 1 if checks else 0


if __name__ == "__main__":
    sys.exit(main())
