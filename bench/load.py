"""Load: N client processes park, restore, prefetch and drop under memory pressure.

Prints calls, ops/s and p50/p99 latency per call, and the end-of-run checks (every held
sequence restores bit-exact or was evicted by the disk tier; the accounting is exact).
The harness is ``tests/daemon/load.py``; ``tests/daemon/test_load.py`` runs a bounded
version. Run from the repository root:

    .venv/bin/python bench/load.py --clients 16 --seconds 60 --host 8MiB --disk 32MiB

Absolute figures depend on the machine and what else runs on it; compare runs made side
by side (e.g. two tier sizes) as ratios. Exit status 1 when any check failed.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the tests package, for the harness

from tests.daemon.load import MiB, run_load  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clients", type=int, default=16, help="client processes")
    ap.add_argument("--seconds", type=float, default=30.0, help="how long the clients run")
    ap.add_argument("--keys", type=int, default=6, help="ids per client")
    ap.add_argument("--max-mib", type=float, default=2.0, help="largest sequence, MiB")
    ap.add_argument("--host", default="4MiB", help="tiers.host.capacity")
    ap.add_argument("--disk", default="12MiB", help="tiers.disk.capacity")
    ap.add_argument("--write", default="write_back", choices=["write_back", "write_through"], help="policy.write")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="kvpark-load-") as tmp:
        res = run_load(Path(tmp), clients=a.clients, seconds=a.seconds, keys=a.keys,
                       max_bytes=int(a.max_mib * MiB), host=a.host, disk=a.disk, seed=a.seed,
                       overrides={"policy.write": a.write})
    print(res.table())
    for p in res.problems:
        print("PROBLEM:", p)
    return 1 if res.problems else 0


if __name__ == "__main__":
    sys.exit(main())
