#!/usr/bin/env python
"""What tenants cost per call: an open daemon against one with tenants, side by side.

Two daemons in this process, same config except ``[tenants.*]`` (8 tenants, the caller
one of them, not trusted_local, so both take the inline path). Small calls are where a
per-call cost shows: a 4 KiB park (ParkSmall), its restore (Get), a lookup of 16 ids.
Rounds alternate between the daemons so load on the machine hits both alike; the table
prints calls per second of each and the ratio tenants / open (1.0 = free).

    python bench/auth_overhead.py [--calls 2000] [--rounds 5]
"""

from __future__ import annotations

import argparse
import hashlib
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch

from kvpark.client import Client
from kvpark.daemon.config import load
from kvpark.daemon.server import Daemon


def _config(tmp: Path, tenants: bool) -> object:
    (tmp / "shm").mkdir(parents=True, exist_ok=True)
    o: dict[str, object] = {"server.listen": "127.0.0.1:0", "tiers.device.enabled": "false",
                            "tiers.host.capacity": "256MiB", "tiers.host.shm_dir": str(tmp / "shm"),
                            "tiers.disk.path": str(tmp / "disk"), "metrics.listen": ""}
    if tenants:
        for i in range(8):
            o[f"tenants.t{i}.token_sha256"] = hashlib.sha256(f"token-{i}".encode()).hexdigest()
    return load(env={}, overrides=o)


def _rate(fn: Callable[[int], None], n: int) -> float:
    t0 = time.perf_counter()
    for i in range(n):
        fn(i)
    return n / (time.perf_counter() - t0)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=5)
    a = ap.parse_args()
    x = torch.ones(1024)
    ids = [f"s{i}" for i in range(16)]
    with tempfile.TemporaryDirectory() as tmp:
        with Daemon(_config(Path(tmp) / "open", False)) as d_open, \
                Daemon(_config(Path(tmp) / "ten", True)) as d_ten:
            clients = {"open": Client(d_open.address, transport="inline"),
                       "tenants": Client(d_ten.address, token="token-5", transport="inline")}
            ops: dict[str, Callable[[Client], Callable[[int], None]]] = {
                "park 4KiB": lambda c: lambda i: c.park(f"s{i}", [x], overwrite=True),
                "restore 4KiB": lambda c: lambda i: c.restore(f"s{i % 16}"),
                "lookup 16 ids": lambda c: lambda i: c.lookup(ids),
            }
            rates: dict[tuple[str, str], list[float]] = {}
            for _ in range(a.rounds):
                for op, make in ops.items():
                    for name, c in clients.items():
                        rates.setdefault((op, name), []).append(_rate(make(c), a.calls))
            for c in clients.values():
                c.close()
    print(f"{'call':<16}{'open /s':>10}{'tenants /s':>12}{'ratio':>8}   (median of {a.rounds} rounds of {a.calls})")
    for op in ops:
        o, t = statistics.median(rates[(op, "open")]), statistics.median(rates[(op, "tenants")])
        print(f"{op:<16}{o:>10.0f}{t:>12.0f}{t / o:>8.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
