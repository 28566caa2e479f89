"""Long kill -9 torture runs: prints ``kills, acked, verified, lost, corrupt, phantom``.

The harness is ``tests/daemon/torture.py`` (the test suite runs a bounded version of the
same thing: ``tests/daemon/test_torture.py``). Run from the repository root:

    .venv/bin/python bench/torture.py --kills 50 --workers 4 --max-kib 2048

Exit status 1 when anything acknowledged was lost or corrupt, or anything phantom,
orphaned or miscounted was found (the problems are printed).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the tests package, for the harness

from tests.daemon.torture import KiB, Torture  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kills", type=int, default=20)
    ap.add_argument("--workers", type=int, default=4, help="client processes")
    ap.add_argument("--keys", type=int, default=8, help="ids per client")
    ap.add_argument("--max-kib", type=int, default=1024, help="largest sequence, KiB")
    ap.add_argument("--min-run", type=float, default=0.3, help="shortest time between restart and kill, s")
    ap.add_argument("--max-run", type=float, default=3.0, help="longest time between restart and kill, s")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dir", help="work directory (default: a temporary one, removed afterwards)")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="kvpark-torture-") as tmp:
        root = Path(a.dir) if a.dir else Path(tmp)
        t0 = time.monotonic()
        t = Torture(root, workers=a.workers, keys=a.keys, max_bytes=a.max_kib * KiB, seed=a.seed)
        tally = t.run(kills=a.kills, run_s=(a.min_run, a.max_run))
        print(tally.table())
        print(f"({time.monotonic() - t0:.0f} s, {a.workers} client processes, seed {a.seed})")
        for p in tally.problems:
            print("PROBLEM:", p)
    return 0 if tally.clean and not tally.problems else 1


if __name__ == "__main__":
    sys.exit(main())
