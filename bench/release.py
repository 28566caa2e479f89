"""A shm restore's Release, waited for against not waited for, side by side.

One daemon in its own process (as in production), one shm client, one sequence per
size parked in the host tier. Each round times ``restore(into=...)`` of each size both
ways, alternating which goes first: with ``Shm.releases_behind`` off (every restore
waits for its Release's answer, as before) and on (the default: the lease id is carried
by the next call, ``client/releases.py``). Both in a tight loop, and with 20 ms of
busy work between restores (a scheduler step), where the background thread sends the
release. The figure is the median per-restore time of each row and the ratio
waited / behind (above 1: not waiting is faster).

    .venv/bin/python bench/release.py [--rounds 5] [--sizes 256KiB,1MiB,8MiB,64MiB]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from _common import serve_process, write_json  # bench/ is on sys.path when a script here runs

from kvpark.client import Client
from kvpark.client.transport import Shm
from kvpark.daemon.config import parse_size

HERE = Path(__file__).resolve().parent
WORK_S = 0.02


def daemon_config(tmp: str, shm: str) -> dict[str, str]:
    """A daemon with a 1 GiB host arena in ``shm`` and its disk tier under ``tmp``."""
    return {"server.listen": "127.0.0.1:0", "tiers.host.capacity": "1GiB", "tiers.host.shm_dir": shm,
            "tiers.disk.path": os.path.join(tmp, "disk"), "tiers.device.enabled": "false",
            "metrics.listen": "", "policy.flush_on_shutdown": "false"}


def _spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5, help="alternating rounds (default 5)")
    ap.add_argument("--sizes", default="256KiB,1MiB,8MiB,64MiB", help="sequence sizes, comma-separated")
    ap.add_argument("--json", default=str(HERE / "results" / "release.json"), help="where to write the JSON")
    args = ap.parse_args(argv)
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    modes = ("waited", "behind", "waited, 20 ms work", "behind, 20 ms work")
    times: dict[tuple[int, str], list[float]] = {(s, m): [] for s in sizes for m in modes}
    shm_root = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
    with tempfile.TemporaryDirectory() as tmp, tempfile.TemporaryDirectory(dir=shm_root) as shm:
        with serve_process(daemon_config(tmp, shm)) as address:
            try:
                with Client(address, transport="shm") as c:
                    outs = {}
                    for s in sizes:
                        src = torch.randint(0, 256, (s,), dtype=torch.uint8)
                        c.park(f"s{s}", [src])
                        outs[s] = torch.empty_like(src)
                    for rnd in range(args.rounds):
                        for s in sizes:
                            for m in modes if rnd % 2 else modes[::-1]:
                                Shm.releases_behind = m.startswith("behind")
                                work = "work" in m
                                n = 20 if work else 100
                                for _ in range(3):
                                    c.restore(f"s{s}", into=[outs[s]])
                                spent = 0.0
                                for _ in range(n):
                                    t0 = time.perf_counter()
                                    c.restore(f"s{s}", into=[outs[s]])
                                    spent += time.perf_counter() - t0
                                    if work:
                                        _spin(WORK_S)
                                times[(s, m)].append(spent / n)
                        print(f"  round {rnd + 1}/{args.rounds} done", flush=True)
            finally:
                Shm.releases_behind = True
    rows: list[dict[str, Any]] = []
    print(f"{'size':>8} | " + " | ".join(f"{m:>18}" for m in modes) + " | waited/behind tight | with work")
    for s in sizes:
        med = {m: statistics.median(times[(s, m)]) for m in modes}
        tight, work = med["waited"] / med["behind"], med["waited, 20 ms work"] / med["behind, 20 ms work"]
        print(f"{s >> 10:>5} KiB | " + " | ".join(f"{med[m] * 1e3:>15.3f} ms" for m in modes) +
              f" | {tight:>19.2f} | {work:.2f}")
        rows.append(dict(nbytes=s, median_s=med, samples_s={m: times[(s, m)] for m in modes},
                         ratio_tight=tight, ratio_with_work=work))
    write_json(args.json, dict(rounds=args.rounds, rows=rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
