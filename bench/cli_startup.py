"""How long a CLI call takes end to end, as a container exec probe runs it.

Runs, side by side in one process tree against one real daemon: ``kvpark health``,
``kvpark stat`` and ``kvpark info`` (the control commands, which never import torch),
and, as the yardstick, a bare ``python -c "import torch"`` (what each of them cost
before). Reports the median of ``--reps`` runs each and the ratio to the yardstick.
Target: ``kvpark health`` under 0.3 s here (a Kubernetes exec probe times out at 1 s).

Usage: python bench/cli_startup.py [--reps 15] [--json bench-out/cli_startup.json]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from kvpark.client import Client
from kvpark.daemon.config import load
from kvpark.daemon.server import Daemon

from _common import write_json  # bench/ is on sys.path when a script here runs

KVPARK = str(Path(sys.executable).with_name("kvpark"))


def timed(cmd: list[str], reps: int) -> float:
    runs = []
    for _ in range(reps):
        t0 = time.perf_counter()
        subprocess.run(cmd, check=True, capture_output=True)
        runs.append(time.perf_counter() - t0)
    return statistics.median(runs)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--json", default="bench-out/cli_startup.json")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        Path(tmp, "shm").mkdir()
        cfg = load(env={}, overrides={"server.listen": "127.0.0.1:0", "metrics.listen": "",
                                      "tiers.host.capacity": "64MiB", "tiers.host.shm_dir": f"{tmp}/shm",
                                      "tiers.disk.path": f"{tmp}/disk"})
        with Daemon(cfg) as d:
            with Client(d.address) as c:
                c.park("x", [torch.ones(16)])
            a = ["--address", d.address]
            rows = {
                "python -c 'import torch' (the yardstick)": timed([sys.executable, "-c", "import torch"], args.reps),
                "kvpark health": timed([KVPARK, "health", *a], args.reps),
                "kvpark stat": timed([KVPARK, "stat", *a], args.reps),
                "kvpark info x": timed([KVPARK, "info", "x", *a], args.reps),
            }
    base = next(iter(rows.values()))
    print(f"{'command':<44}{'median s':>10}{'vs import torch':>17}")
    for name, s in rows.items():
        print(f"{name:<44}{s:>10.3f}{s / base:>16.2f}x")
    write_json(args.json, {"date": time.strftime("%Y-%m-%d"), "reps": args.reps, "median_s": rows,
                           "target": "kvpark health < 0.3 s"})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
