"""The ``kvpark`` command line: the entry point, and ``kvpark stat`` (a client of a running daemon).

Commands:
- ``kvpark stat [--address ADDR] [--json]`` prints the tiers and parked sequences.
- ``kvpark serve ...`` and ``kvpark config`` are the daemon's (``kvpark.daemon.cli``); this
  module hands them over unchanged, so the daemon package never imports the client.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict

from kvpark.proto.errors import KVParkError

from .client import Client


def _human(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    return str(n)


def _stat(args: argparse.Namespace) -> int:
    try:
        with Client(args.address, timeout=10.0) as c:
            st = c.stat()
            seqs = c.list()
    except KVParkError as e:
        print(f"kvpark: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    if args.json:
        out = {
            "tiers": {k: asdict(v) for k, v in st.tiers.items()},
            "sequences": [
                {"seq_id": s.seq_id, "nbytes": s.nbytes, "tier": s.tier, "num_tensors": s.num_tensors,
                 "priority": s.priority, "last_access": s.last_access}
                for s in seqs
            ],
            "leases": st.leases,
            "remote": asdict(st.remote) if st.remote is not None else None,
        }
        print(json.dumps(out, indent=2))
        return 0
    print(f"{'tier':<8}{'used':>12}{'capacity':>12}{'use%':>7}{'blocks':>9}{'seqs':>7}")
    for name, t in st.tiers.items():
        pct = 100.0 * t.used_bytes / t.capacity_bytes if t.capacity_bytes else 0.0
        print(f"{name:<8}{_human(t.used_bytes):>12}{_human(t.capacity_bytes):>12}{pct:>6.1f}%{t.blocks:>9}"
              f"{t.sequences:>7}")
    r = st.remote
    if r is not None:
        state = "ok" if r.state == "closed" else f"DEGRADED (circuit {r.state})"
        print(f"{'remote':<8} {state}: {r.sequences} sequence(s) known there, {_human(r.bytes_written)} written, "
              f"{_human(r.bytes_read)} read, {r.pending_writes} pending, {r.errors} error(s), "
              f"{r.refused} refused, {r.outages} outage(s), {r.data_loss} bad value(s) deleted")
    print()
    print(f"{len(seqs)} sequence(s), {st.leases} lease(s)")
    if seqs:
        width = max(6, min(48, max(len(s.seq_id) for s in seqs)))
        print(f"{'seq_id':<{width}}  {'tier':<6}{'size':>12}{'tensors':>9}{'prio':>6}")
        for s in seqs:
            print(f"{s.seq_id[:width]:<{width}}  {s.tier:<6}{_human(s.nbytes):>12}{s.num_tensors:>9}{s.priority:>6}")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in ("serve", "config"):
        from kvpark.daemon.cli import main as daemon_main  # the daemon's own commands

        return daemon_main(argv)
    p = argparse.ArgumentParser(prog="kvpark", description="KV-cache parking daemon")
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("serve", help="run the daemon (kvpark serve -h for its options)")
    st = sub.add_parser("stat", help="print tiers and parked sequences")
    st.add_argument("--address", help="daemon address (default: $KVPARK_ADDRESS, else 127.0.0.1:50551)")
    st.add_argument("--json", action="store_true", help="machine-readable output")
    sub.add_parser("config", help="list every config key with its default")
    args = p.parse_args(argv)
    return _stat(args)


if __name__ == "__main__":
    sys.exit(main())
