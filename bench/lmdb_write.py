#!/usr/bin/env python
"""LMDB write variants for the disk tier: which environment flags and transaction sizes.

Writes ``--total`` bytes (default 256 MiB) as 1 MiB records shaped like the disk tier's
(``RecordHeader`` + payload under ``blocks``-style keys, see ``kvpark.tiers.disk``) into
a fresh LMDB environment per run, then makes them durable with ``env.sync(True)``. The
timed region is the write transactions plus that final sync; opening the environment
and building the records (xxh3 checksum + header join, timed separately as an info row)
are outside it.

Variants:
- ``writemap`` on / off x ``map_async`` on / off x transaction batching: one txn per
  record, one txn per 64 MiB, one txn for everything. Environments are opened as
  ``DiskStore`` opens them (``sync=False, metasync=False``), so commits do not flush
  and the one flush is the final ``env.sync(True)``.
- The same grid with ``sync=True`` (LMDB's default: every commit flushes). This is where
  ``map_async`` can matter: with ``writemap`` it turns each commit's flush into an
  asynchronous ``msync``; ``env.sync(True)`` at the end still forces everything.
  (LMDB ignores ``map_async`` without ``writemap``.)
- write_through: what ``policy.write = write_through`` does per park: one txn per
  4 MiB sequence (4 records + a manifest), then ``env.sync(True)`` after every commit
  (``DiskStore.write(sync=True)``), for ``writemap`` on and off.
- Every variant twice: into a fresh environment (the file grows: new blocks, and with
  ``writemap`` a page fault per new page), and into a "reused" one where the same amount
  was written and deleted first, so the writes land on free-list pages already in the
  file and mapped, as in a daemon that has been running a while.

Each variant runs ``--reps`` times (fresh environment each time); the table shows the
median and the best in MB/s (1e6 payload bytes per second). The environment lives in a
temporary directory on the same filesystem as the daemon's default data directory
($XDG_DATA_HOME/kvpark, else ~/.local/share/kvpark): the system temp directory when it
is on that filesystem, else a temporary directory next to the data directory.

Usage: ``python bench/lmdb_write.py [--quick] [--reps N] [--dir DIR] [--json PATH]``.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

import lmdb
import numpy as np

from kvpark.tiers.disk import FORMAT_VERSION, HEADER, MAGIC, block_key, checksum

from _common import write_json  # bench/ is on sys.path when a script here runs

MiB = 1 << 20
HERE = Path(__file__).resolve().parent
FINGERPRINT = 0x1234_5678_9ABC_DEF0
MANIFEST = b'{"v":1,"seq_id":"' + b"x" * 32 + b'","tensors":[' + b"0" * 200 + b"]}"  # ~ a real manifest


def default_data_dir() -> str:
    base = os.environ.get("XDG_DATA_HOME") or os.path.join(os.path.expanduser("~"), ".local", "share")
    return os.path.join(base, "kvpark")


def existing_ancestor(path: str) -> str:
    p = os.path.abspath(path)
    while not os.path.exists(p):
        p = os.path.dirname(p)
    return p


def fs_type(path: str) -> str:
    best, kind = "", "?"
    try:
        with open("/proc/mounts") as fh:
            for line in fh:
                parts = line.split()
                if len(parts) >= 3:
                    mnt = parts[1].replace("\\040", " ")
                    if (path == mnt or path.startswith(mnt.rstrip("/") + "/")) and len(mnt) > len(best):
                        best, kind = mnt, parts[2]
    except OSError:
        pass
    return kind


def pick_dir(explicit: str | None) -> tuple[str, str]:
    """A fresh temp dir and a sentence saying where it is."""
    if explicit:
        os.makedirs(explicit, exist_ok=True)
        d = tempfile.mkdtemp(prefix="kvpark-lmdb-bench-", dir=explicit)
        return d, f"a temp dir under --dir ({fs_type(os.path.realpath(d))})"
    data = default_data_dir()
    anchor = existing_ancestor(data)
    tmp = tempfile.gettempdir()
    kind = fs_type(os.path.realpath(anchor))
    if os.stat(tmp).st_dev == os.stat(anchor).st_dev:
        d = tempfile.mkdtemp(prefix="kvpark-lmdb-bench-")
        return d, (f"a temp dir in the system temp directory, the same {kind} filesystem as the default "
                   "data dir (~/.local/share/kvpark)")
    d = tempfile.mkdtemp(prefix="kvpark-lmdb-bench-", dir=anchor)
    return d, f"a temp dir next to the default data dir (~/.local/share/kvpark), {kind} filesystem"


def build_records(total: int, record: int) -> tuple[list[tuple[bytes, bytes]], float]:
    rng = np.random.default_rng(0)
    payload = rng.integers(0, 256, total, dtype=np.uint8)
    mv = memoryview(payload)
    out = []
    t0 = time.perf_counter()
    for i, off in enumerate(range(0, total, record)):
        view = mv[off : off + record]
        head = HEADER.pack(MAGIC, FORMAT_VERSION, 0, 0, FINGERPRINT, len(view), checksum(view))
        out.append((block_key(f"seq-{i // 4:06d}", 1, i % 4), b"".join((head, view))))
    return out, time.perf_counter() - t0


def open_env(path: str, total: int, writemap: bool, map_async: bool, sync: bool) -> tuple[Any, Any, Any]:
    cap = total
    env = lmdb.open(
        path, map_size=cap + cap // 8 + (64 << 20), max_dbs=4, subdir=True, writemap=writemap,
        map_async=map_async, sync=sync, metasync=False, readahead=False, max_readers=1024, lock=True,
    )
    return env, env.open_db(b"blocks"), env.open_db(b"manifests")


def prefill(env: Any, blocks: Any, records: list[tuple[bytes, bytes]], batch: int) -> None:
    """Write every record under other keys, then delete them: the file is allocated and its
    pages are on LMDB's free list, as in a daemon that has been demoting and dropping."""
    for start in range(0, len(records), batch):
        with env.begin(write=True) as txn:
            for key, val in records[start : start + batch]:
                txn.put(b"old-" + key, val, db=blocks)
    env.sync(True)
    with env.begin(write=True) as txn:
        for key, _ in records:
            txn.delete(b"old-" + key, db=blocks)
    for _ in range(2):  # let the freed pages age past the last transaction that saw them
        with env.begin(write=True) as txn:
            txn.put(b"tick", b"", db=blocks)
    env.sync(True)


def run_variant(base: str, records: list[tuple[bytes, bytes]], total: int, v: dict[str, Any]) -> float:
    path = tempfile.mkdtemp(prefix="env-", dir=base)
    # Room for the prefill's pages too while both are in the file.
    env, blocks, manifests = open_env(path, 2 * total, v["writemap"], v["map_async"], v["sync"])
    try:
        if v["file"] == "reused":
            prefill(env, blocks, records, max(1, (64 * MiB) // len(records[0][1])))
        per_txn = v["per_txn"]  # records per transaction
        t0 = time.perf_counter()
        for start in range(0, len(records), per_txn):
            with env.begin(write=True) as txn:
                for key, val in records[start : start + per_txn]:
                    txn.put(key, val, db=blocks)
                if v.get("manifest"):
                    txn.put(records[start][0][:-12], MANIFEST, db=manifests)
            if v.get("sync_each"):
                env.sync(True)
        env.sync(True)
        dt = time.perf_counter() - t0
    finally:
        env.close()
        shutil.rmtree(path, ignore_errors=True)
    return dt


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="64 MiB instead of 256 MiB")
    ap.add_argument("--total", type=int, default=0, help="bytes to write per run (default 256 MiB)")
    ap.add_argument("--reps", type=int, default=3, help="runs per variant (default 3)")
    ap.add_argument("--dir", help="put the temp environments under this directory instead")
    ap.add_argument("--json", default=str(HERE / "results" / "lmdb_write.json"), help="where to write the JSON")
    args = ap.parse_args(argv)

    record = MiB
    total = args.total or (64 if args.quick else 256) * MiB
    total -= total % record
    n = total // record
    batch = max(1, (64 * MiB) // record)
    base, where = pick_dir(args.dir)

    variants: list[dict[str, Any]] = []
    for file in ("fresh", "reused"):
        for sync in (False, True):
            for writemap in (True, False):
                for map_async in (False, True):
                    for label, per_txn in (("txn per record", 1), ("txn per 64 MiB", batch), ("one txn", n)):
                        variants.append(dict(
                            group="commit sync=True (LMDB default)" if sync else "commit sync=False (as DiskStore)",
                            file=file, writemap=writemap, map_async=map_async, sync=sync, batching=label,
                            per_txn=per_txn))
        for writemap in (True, False):
            variants.append(dict(group="write_through (sync every commit)", file=file, writemap=writemap,
                                 map_async=False, sync=False, batching="txn per 4 MiB seq + env.sync(True)",
                                 per_txn=4, manifest=True, sync_each=True))

    print(f"LMDB write benchmark: {total // MiB} MiB as {n} records of {record // MiB} MiB (+{HEADER.size} B header)"
          f", reps={args.reps}; environments in {where}", flush=True)
    records, build_s = build_records(total, record)
    try:
        for v in variants:
            v["times_s"] = [run_variant(base, records, total, v) for _ in range(args.reps)]
            v["median_mbps"] = total / statistics.median(v["times_s"]) / 1e6
            v["best_mbps"] = total / min(v["times_s"]) / 1e6
    finally:
        shutil.rmtree(base, ignore_errors=True)

    lines = ["", f"MB/s (1e6 payload bytes/s), median of {args.reps} (best); timed: all commits + env.sync(True)",
             "file fresh = new environment; reused = the same amount written and deleted first (free-list pages)"]
    hdr = f"{'file':<7}{'group':<34}{'writemap':>9}{'map_async':>10}  {'batching':<36}{'median':>9}{'best':>9}"
    lines.append(hdr)
    group = None
    for v in variants:
        key = (v["file"], v["group"])
        f, g = (v["file"], v["group"]) if key != group else ("", "")
        group = key
        lines.append(f"{f:<7}{g:<34}{'on' if v['writemap'] else 'off':>9}{'on' if v['map_async'] else 'off':>10}  "
                     f"{v['batching']:<36}{v['median_mbps']:9.0f}{v['best_mbps']:9.0f}")
    lines.append(f"(info) building the records (xxh3-64 + header join), no LMDB: {total / build_s / 1e6:.0f} MB/s")
    for file in ("fresh", "reused"):
        best = max((v for v in variants if v["file"] == file), key=lambda v: v["median_mbps"])
        lines.append(f"fastest by median, {file} file: {best['group']}, writemap {'on' if best['writemap'] else 'off'}"
                     f", map_async {'on' if best['map_async'] else 'off'}, {best['batching']}: "
                     f"{best['median_mbps']:.0f} MB/s")
    for file in ("fresh", "reused"):
        for wm in (True, False):
            xs = [v["median_mbps"] for v in variants if v["file"] == file and v["writemap"] == wm]
            lines.append(f"{file} file, writemap {'on ' if wm else 'off'}: median over its variants "
                         f"{statistics.median(xs):.0f} MB/s")
    print("\n".join(lines), flush=True)

    result = dict(
        meta=dict(total_bytes=total, record_bytes=record, records=n, header_bytes=HEADER.size, reps=args.reps,
                  statistic="median of reps (best also given)", mb="1e6 bytes", where=where,
                  filesystem=fs_type(os.path.realpath(tempfile.gettempdir() if not args.dir else args.dir)),
                  lmdb=".".join(map(str, lmdb.version())), py_lmdb=lmdb.__version__,
                  python=platform.python_version(), cpus=os.cpu_count(),
                  record_build_mbps=total / build_s / 1e6, timestamp=time.strftime("%Y-%m-%dT%H:%M:%S%z")),
        variants=variants,
    )
    write_json(args.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
