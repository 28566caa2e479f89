#!/usr/bin/env python
"""The cost of end-to-end verification (``Client(verify=True)``), per transport.

Parks and restores (``restore(into=...)``) the same payloads with verify off and on,
side by side in one run, on (a) 64 tensors of 1 MiB and (b) one 256 MiB tensor, over:

- ``shm``: the host arena mapped by the client;
- ``inline data channel``: a daemon with ``server.data_channel=true``;
- ``inline gRPC``: a daemon with ``server.data_channel=false`` (the streamed fallback).

Verify costs one xxh3-64 pass over the payload at park (before the bytes leave) and one
at restore (after they land); the daemon does nothing extra. Off and on alternate
within each repetition so drift on a shared machine hits both alike. Each cell is the
best of ``--reps`` runs after ``--warmup`` untimed ones (interference only slows a run
down); the ratio is on/off of the bests, and of the medians in parentheses. Both daemons run in this process on host tiers only (1 GiB arena).

Usage: ``python bench/verify.py [--reps N] [--warmup N] [--quick] [--json PATH]``.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import tempfile
import time
from typing import Any, Callable

import torch
import xxhash

from _common import write_json  # bench/ is on sys.path when a script here runs

from kvpark.client import Client
from kvpark.client.benchkit import MiB, cpu_model, timed, touch
from kvpark.daemon.config import load
from kvpark.daemon.server import Daemon

PATHS = {"shm": ("shm", "true"), "inline data channel": ("inline", "true"), "inline gRPC": ("inline", "false")}


def start(tmp: str, name: str, data_channel: str) -> Daemon:
    shm_root = "/dev/shm" if os.access("/dev/shm", os.W_OK) else tmp
    overrides = {
        "server.listen": "127.0.0.1:0",
        "server.data_channel": data_channel,
        "tiers.host.capacity": "1GiB",
        "tiers.host.shm_dir": tempfile.mkdtemp(prefix=f"kvpark-verify-{name}-", dir=shm_root),
        "tiers.disk.path": os.path.join(tmp, name, "disk"),
        "tiers.disk.capacity": "4GiB",
        "policy.flush_on_shutdown": "false",
        "tiers.device.enabled": "false",
        "metrics.listen": "",
    }
    return Daemon(load(env={}, overrides=overrides)).start()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="64 MiB instead of 256 MiB for case b, 3 reps")
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    if args.quick:
        args.reps = 3
    size_b = (64 if args.quick else 256) * MiB
    g = torch.Generator().manual_seed(0)
    cases = {
        "a: 64 x 1 MiB": [torch.randint(0, 256, (MiB,), dtype=torch.uint8, generator=g) for _ in range(64)],
        f"b: 1 x {size_b // MiB} MiB": [torch.randint(0, 256, (size_b,), dtype=torch.uint8, generator=g)],
    }
    # The floor of verify's cost: hashing the payload once, single-threaded.
    hash_s = {case: min(timed(lambda: [xxhash.xxh3_64_intdigest(t.numpy()) for t in ts], 5, 1))
              for case, ts in cases.items()}
    tmp = tempfile.mkdtemp(prefix="kvpark-verify-")
    rows: list[dict[str, Any]] = []
    daemons: list[Daemon] = []
    try:
        for path, (transport, dc) in PATHS.items():
            d = start(tmp, path.replace(" ", "-"), dc)
            daemons.append(d)
            with Client(d.address, transport=transport) as off, \
                    Client(d.address, transport=transport, verify=True) as on:
                for case, src in cases.items():
                    dst = [torch.empty_like(t) for t in src]
                    touch(dst)
                    samples: dict[tuple[str, bool], list[float]] = {}
                    for rep in range(args.warmup + args.reps):
                        for v, c in ((False, off), (True, on)):
                            sid = f"v-{int(v)}"
                            park: Callable[[], Any] = lambda: c.park(sid, src)
                            restore: Callable[[], Any] = lambda: c.restore(sid, into=dst)
                            tp = timed(park, 1, 0)[0]
                            tr = timed(restore, 1, 0)[0]
                            c.drop(sid)
                            if rep >= args.warmup:
                                samples.setdefault(("park", v), []).append(tp)
                                samples.setdefault(("restore", v), []).append(tr)
                    nbytes = sum(t.numel() for t in src)
                    if not all(torch.equal(a, b) for a, b in zip(src, dst)):
                        raise SystemExit(f"{path} {case}: restored bytes differ")
                    for op in ("park", "restore"):
                        t_off, t_on = min(samples[(op, False)]), min(samples[(op, True)])
                        m_off = statistics.median(samples[(op, False)])
                        m_on = statistics.median(samples[(op, True)])
                        rows.append({"transport": path, "case": case, "op": op, "off_s": t_off, "on_s": t_on,
                                     "off_gbs": nbytes / t_off / 1e9, "on_gbs": nbytes / t_on / 1e9,
                                     "ratio": t_on / t_off, "median_ratio": m_on / m_off})
                    print(f"  done: {path} {case}", flush=True)
    finally:
        for d in daemons:
            d.stop(0.5)
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"\n{time.strftime('%Y-%m-%d')}  {platform.node()}  {cpu_model()}  {os.cpu_count()} CPUs  "
          f"torch {torch.__version__}  best of {args.reps}")
    for case, s in hash_s.items():
        nbytes = sum(t.numel() for t in cases[case])
        print(f"xxh3-64 of the payload, one thread, {case}: {s * 1e3:.1f} ms ({nbytes / s / 1e9:.1f} GB/s)")
    print("\n| transport | case | op | off GB/s | on GB/s | time on/off (medians) |\n| --- | --- | --- | ---: | ---: | ---: |")
    for r in rows:
        print(f"| {r['transport']} | {r['case']} | {r['op']} | {r['off_gbs']:.2f} | {r['on_gbs']:.2f} "
              f"| {r['ratio']:.2f} ({r['median_ratio']:.2f}) |")
    if args.json:
        write_json(args.json, {"rows": rows, "hash_s": hash_s, "reps": args.reps, "cpu": cpu_model(),
                               "cpus": os.cpu_count()})


if __name__ == "__main__":
    main()
