"""Long history-checker runs: prints operations, restores verified, faults, restarts and
wrong / lost / phantom / cross_tenant / corrupt / create violations (each must be 0).

The harness is ``tests/daemon/history.py``; the test suite runs a bounded version of the
same thing (``tests/daemon/test_history.py``). Run from the repository root:

    .venv/bin/python bench/history.py --seconds 120 --clients 4 --seed 7
    .venv/bin/python bench/history.py --faults sigkill,client_kill --write write_back
    .venv/bin/python bench/history.py --seeds 20 --seconds 10      # many short seeded runs

``--faults`` picks from ``disk`` (seeded EIO, map full and stalls in disk write
transactions; in-process daemon), ``sigterm`` and ``sigkill`` (restarts of a ``kvpark
serve`` subprocess), ``client_kill``, and with ``--remote`` ``redis_kill`` (Redis killed and
restarted empty) and ``redis_delete`` (one sequence's manifest deleted behind the daemon's
back). Any of ``sigterm``/``sigkill`` runs the daemon as
a subprocess, where ``disk`` cannot be injected. ``--tolerate`` names violations
(``KNOWN_BUGS`` in the harness, fixed since) not to fail on; by default none is tolerated.

Exit status 1 when any run found a violation (its minimal history and seed are printed).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the tests package, for the harness

from tests.daemon.history import KNOWN_BUGS, OPS, HistoryConfig, run_history  # noqa: E402

FAULTS = ("disk", "sigterm", "sigkill", "client_kill", "redis_kill", "redis_delete")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=60.0, help="how long the clients run, per seed")
    ap.add_argument("--seed", type=int, default=0, help="the first seed")
    ap.add_argument("--seeds", type=int, default=1, help="how many seeds, one run each")
    ap.add_argument("--clients", type=int, default=4, help="client processes")
    ap.add_argument("--threads", type=int, default=2, help="threads (logical clients) per process")
    ap.add_argument("--keys", type=int, default=6, help="ids per tenant, shared by every client")
    ap.add_argument("--faults", default="disk,client_kill", help=f"comma-separated, of {', '.join(FAULTS)}; "
                                                                  "'none' for none")
    ap.add_argument("--disk-faults", default="eio,map_full,slow", help="what 'disk' injects")
    ap.add_argument("--write", choices=("write_back", "write_through"), default="write_back")
    ap.add_argument("--no-tenants", action="store_true", help="one namespace instead of two tenants")
    ap.add_argument("--untrusted", action="store_true", help="the second tenant not trusted_local: its sequences "
                    "in the daemon's private tier")
    ap.add_argument("--no-data-channel", action="store_true", help="inline clients on gRPC streams, not the "
                                                                   "daemon's data channel")
    ap.add_argument("--remote", action="store_true", help="a real redis-server as the remote tier (faults "
                                                          "redis_kill, redis_delete)")
    ap.add_argument("--host", default="4MiB", help="host tier capacity")
    ap.add_argument("--max-dirty-s", type=float, default=0.25, help="write_back: policy.max_dirty_s (0: no bound)")
    ap.add_argument("--disk", default="", help="disk tier capacity (default 12MiB in-process, 256MiB subprocess)")
    ap.add_argument("--without", default="", help=f"comma-separated calls to leave out, of {', '.join(OPS)}")
    ap.add_argument("--tolerate", default="", help=f"comma-separated known bugs, of {', '.join(KNOWN_BUGS)}")
    ap.add_argument("--dir", help="work directory (default: a temporary one, removed afterwards)")
    a = ap.parse_args()
    faults = tuple(f for f in a.faults.split(",") if f and f != "none")
    if bad := [f for f in faults if f not in FAULTS]:
        ap.error(f"unknown fault(s) {bad}; choose from {', '.join(FAULTS)}")
    proc = any(f in ("sigterm", "sigkill") for f in faults)
    if proc and "disk" in faults:
        ap.error("'disk' needs the in-process daemon; restarts need the subprocess: pick one")
    ops = {k: v for k, v in OPS.items() if k not in a.without.split(",")}
    failed = 0
    for seed in range(a.seed, a.seed + a.seeds):
        cfg = HistoryConfig(seconds=a.seconds, seed=seed, clients=a.clients, threads=a.threads, keys=a.keys,
                            tenants=not a.no_tenants, write=a.write, remote=a.remote, max_dirty_s=a.max_dirty_s,
                            data_channel=not a.no_data_channel, untrusted=a.untrusted,
                            daemon="proc" if proc else "inproc",
                            faults=faults, disk_faults=tuple(a.disk_faults.split(",")), ops=ops, host=a.host,
                            disk=a.disk or ("256MiB" if proc else "12MiB"),
                            tolerate=tuple(t for t in a.tolerate.split(",") if t))
        with tempfile.TemporaryDirectory(prefix="kvpark-history-") as tmp:
            root = Path(a.dir) / f"seed{seed}" if a.dir else Path(tmp)
            t0 = time.monotonic()
            rep = run_history(root, cfg)
            print(rep.table())
            print(f"({time.monotonic() - t0:.0f} s, {a.clients}x{a.threads} clients, "
                  f"faults {','.join(faults) or 'none'}, {a.write}, seed {seed})")
            if not rep.clean:
                failed += 1
                print(rep.explain(limit=10))
    if a.seeds > 1:
        print(f"{a.seeds - failed} of {a.seeds} seeds clean")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
