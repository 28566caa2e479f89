"""Inline transport tuning: message (chunk) size and HTTP/2 lookahead, measured side by side.

For each setting, a fresh in-process daemon; park and restore(into=) of one 128 MiB
tensor over transport="inline"; best of N, GB/s. The chosen defaults live in
``server.chunk_size`` and ``kvpark.proto.GRPC_OPTIONS``.

    .venv/bin/python bench/inline_tuning.py [--reps 4] [--json bench/results/inline_tuning.json]
"""

from __future__ import annotations

import argparse
import tempfile
import time

import torch

import kvpark.proto as kp
from kvpark.client import Client
from kvpark.daemon.config import load
from kvpark.daemon.server import Daemon

from _common import write_json  # bench/ is on sys.path when a script here runs

MiB = 1 << 20


def measure(chunk: int, lookahead: int, nbytes: int, reps: int) -> tuple[float, float]:
    opts = dict(kp.GRPC_OPTIONS)
    opts["grpc.http2.lookahead_bytes"] = lookahead
    saved = list(kp.GRPC_OPTIONS)
    kp.GRPC_OPTIONS[:] = list(opts.items())  # both ends read the shared list at start
    try:
        with tempfile.TemporaryDirectory() as tmp:
            cfg = load(env={}, overrides={
                "server.listen": "127.0.0.1:0", "server.chunk_size": chunk, "tiers.host.capacity": "512MiB",
                "tiers.host.shm_dir": tmp, "tiers.disk.path": tmp, "tiers.device.enabled": "false",
                "policy.flush_on_shutdown": False,
            })
            with Daemon(cfg) as d, Client(d.address, transport="inline") as c:
                src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8)
                dst = torch.empty_like(src)
                park, restore = [], []
                for _ in range(reps):
                    t = time.perf_counter()
                    c.park("x", [src], overwrite=True)
                    park.append(time.perf_counter() - t)
                    t = time.perf_counter()
                    c.restore("x", into=[dst])
                    restore.append(time.perf_counter() - t)
                assert torch.equal(src, dst)
                return nbytes / min(park) / 1e9, nbytes / min(restore) / 1e9
    finally:
        kp.GRPC_OPTIONS[:] = saved


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=4)
    ap.add_argument("--mib", type=int, default=128)
    ap.add_argument("--json", default="bench/results/inline_tuning.json")
    args = ap.parse_args()
    rows = []
    print(f"inline park / restore(into) of {args.mib} MiB, best of {args.reps}, GB/s")
    print(f"{'chunk':>8}{'lookahead':>11}{'park':>8}{'restore':>9}")
    for chunk in (256 << 10, 512 << 10, 1 * MiB, 2 * MiB, 4 * MiB):
        for lookahead in (64 << 10, 8 * MiB):
            p, r = measure(chunk, lookahead, args.mib * MiB, args.reps)
            rows.append({"chunk": chunk, "lookahead": lookahead, "park_gbps": p, "restore_gbps": r})
            print(f"{chunk >> 10:>6}Ki{lookahead >> 10:>9}Ki{p:>8.2f}{r:>9.2f}")
    write_json(args.json, {"date": time.strftime("%Y-%m-%d"), "mib": args.mib, "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
