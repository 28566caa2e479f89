"""The ``kvpark`` command line: the entry point, and the commands that are clients of a daemon.

Commands (``--address`` defaults to ``$KVPARK_ADDRESS``, else 127.0.0.1:50551):
- ``kvpark --version``.
- ``kvpark health``: exit 0 when the daemon answers SERVING, 1 otherwise (scripts, probes).
- ``kvpark stat``: a summary (sequences and shared blocks, then per tier its state,
  capacity, use, copies held and evictions, and the caller's tenant row: usage and quota
  per tier); ``--all`` lists every sequence with its tier,
  size, pin, TTL and age; ``--json``; ``--watch [SECONDS]`` a live view (rich) with a bar
  per tier and rates.
- ``kvpark info ID``, ``drop ID``, ``pin ID``, ``unpin ID``, ``flush`` (write every
  memory-only sequence to disk now). An unknown id is one line on stderr and exit 1.
- ``kvpark bench [--quick] [--out DIR]``: ``kvpark.client.bench``.
- ``kvpark serve ...`` and ``kvpark config ...`` are the daemon's (``kvpark.daemon.cli``);
  they are handed over unchanged, so the daemon package never imports the client.

``KVPARK_TOKEN`` and ``KVPARK_TLS_CA`` / ``KVPARK_TLS_CERT`` / ``KVPARK_TLS_KEY`` are used as
the ``Client`` uses them.

Output into a closed pipe (``kvpark stat | head -1``) ends quietly with exit 0.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict
from typing import Any, Callable

from kvpark.proto import VERSION
from kvpark.proto.errors import KVParkError, Unavailable
from kvpark.proto.sizes import human
from kvpark.proto.types import SeqInfo, Stat, TierStat

from .address import normalize
from .control import DEFAULT_ADDRESS, Control, tls_from_env
from .rpc import open_channel

EXIT_ERROR = 1


def _duration(s: float) -> str:
    s = max(0.0, s)
    if s < 120:
        return f"{s:.0f}s"
    if s < 7200:
        return f"{s / 60:.0f}m"
    if s < 172800:
        return f"{s / 3600:.1f}h"
    return f"{s / 86400:.1f}d"


def _address(args: argparse.Namespace) -> str:
    return args.address or os.environ.get("KVPARK_ADDRESS") or DEFAULT_ADDRESS


def _fail(e: BaseException) -> int:
    print(f"kvpark: {type(e).__name__}: {e}", file=sys.stderr)
    return EXIT_ERROR


def _client_call(args: argparse.Namespace, fn: Callable[[Control], int]) -> int:
    address = _address(args)
    try:
        with Control(address, timeout=args.timeout) as c:
            return fn(c)
    except Unavailable as e:
        if "failed to connect" in str(e) or "Connection refused" in str(e):
            # The usual first-hour case: say what it means and what to do, not gRPC's words.
            print(f"kvpark: no daemon answers at {address}: is `kvpark serve` running there? (another address: "
                  f"--address HOST:PORT or $KVPARK_ADDRESS)", file=sys.stderr)
            return EXIT_ERROR
        return _fail(e)
    except KVParkError as e:
        return _fail(e)


# ---------------------------------------------------------------------- health


def _health(args: argparse.Namespace) -> int:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    try:
        address = normalize(_address(args))
    except KVParkError as e:
        return _fail(e)
    with open_channel(address, **tls_from_env()) as ch:
        try:
            resp = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""),
                                                        timeout=args.timeout)
        except grpc.RpcError as e:
            print(f"kvpark: {address}: not serving ({e.code().name})", file=sys.stderr)
            return EXIT_ERROR
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)
    if resp.status != health_pb2.HealthCheckResponse.SERVING:
        print(f"kvpark: {address}: {status}", file=sys.stderr)
        return EXIT_ERROR
    print(f"{address}: {status}")
    return 0


# ---------------------------------------------------------------------- stat


def _seq_json(s: SeqInfo, now: float) -> dict[str, Any]:
    return {"seq_id": s.seq_id, "tier": s.tier, "nbytes": s.nbytes, "num_tensors": s.num_tensors,
            "num_blocks": s.num_blocks, "priority": s.priority, "pinned": s.pinned,
            "ttl_s": max(0.0, s.expires_at - now) if s.expires_at else None,
            "age_s": max(0.0, now - s.created_at) if s.created_at else None,
            "last_access": s.last_access, "shared": s.shared, "refcount": s.refcount}


def _summary(st: Stat, seqs: list[SeqInfo]) -> dict[str, int]:
    shared = sum(1 for s in seqs if s.shared)
    return {"sequences": len(seqs) - shared, "shared_blocks": shared, "leases": st.leases, "damaged": st.damaged,
            "pinned_bytes": sum(st.pinned.values())}


def _print_summary(address: str, st: Stat, seqs: list[SeqInfo]) -> None:
    s = _summary(st, seqs)
    print(f"kvpark at {address}: {s['sequences']} sequence(s), {s['shared_blocks']} shared block(s), "
          f"{s['leases']} lease(s)")
    if st.damaged:
        print(f"DAMAGED: {st.damaged} sequence(s) failed verification on disk; reading them is DATA_LOSS "
              "(drop or re-park them)")
    if st.pinned:
        print("page-locked: " + ", ".join(f"{human(n)} {kind}" for kind, n in sorted(st.pinned.items())))
    print()
    print(f"{'tier':<8}{'state':<10}{'used':>11}{'capacity':>11}{'use%':>7}{'held':>8}{'evictions':>11}")
    for name, t in st.tiers.items():
        pct = 100.0 * t.used_bytes / t.capacity_bytes if t.capacity_bytes else 0.0
        print(f"{name:<8}{t.state:<10}{human(t.used_bytes):>11}{human(t.capacity_bytes):>11}{pct:>6.1f}%"
              f"{t.sequences:>8}{t.evictions:>11}")
    r = st.remote
    if r is not None:
        state = "ok" if r.state == "closed" else f"DEGRADED (circuit {r.state})"
        print(f"{'remote':<8} {state}: {r.sequences} sequence(s) known there, {human(r.bytes_written)} written, "
              f"{human(r.bytes_read)} read, {r.pending_writes} pending, {r.errors} error(s), "
              f"{r.refused} refused, {r.outages} outage(s), {r.data_loss} bad value(s) deleted")
    for ts in st.tenants:
        use = [f"{tier} {human(ts.used.get(tier, 0))} of "
               + (human(ts.quota[tier]) if tier in ts.quota else "unlimited") for tier in ("device", "host", "disk")]
        print(f"tenant {ts.name}: {ts.sequences} sequence(s); " + ", ".join(use))
    print()
    print("held: sequences and shared blocks with a copy in the tier (one may be in several tiers)")
    if st.tenants:
        print("tenant disk: every byte the tenant has parked (each may land on disk)")


def _print_all(seqs: list[SeqInfo], now: float) -> None:
    width = max(6, min(48, max((len(s.seq_id) for s in seqs), default=6)))
    print(f"{'seq_id':<{width}}  {'tier':<7}{'size':>11}{'pinned':>8}{'ttl':>7}{'age':>7}{'shared':>8}")
    for s in seqs:
        ttl = _duration(s.expires_at - now) if s.expires_at else "-"
        age = _duration(now - s.created_at) if s.created_at else "-"
        shared = f"x{s.refcount}" if s.shared else ""
        print(f"{s.seq_id[:width]:<{width}}  {s.tier:<7}{human(s.nbytes):>11}{'yes' if s.pinned else '':>8}"
              f"{ttl:>7}{age:>7}{shared:>8}")


def _stat(args: argparse.Namespace) -> int:
    if args.watch is not None:
        return _watch(args)

    def run(c: Control) -> int:
        st, seqs = c.stat(), c.list()
        now = time.time()
        if args.json:
            out = {"version": c.server_version(), "address": c.address, **_summary(st, seqs),
                   "tiers": {k: asdict(v) for k, v in st.tiers.items()},
                   "remote": asdict(st.remote) if st.remote is not None else None,
                   "tenants": [asdict(t) for t in st.tenants],
                   "sequence_list": [_seq_json(s, now) for s in seqs]}
            print(json.dumps(out, indent=2))
            return 0
        _print_summary(c.address, st, seqs)
        if args.all:
            print()
            _print_all(seqs, now)
        return 0

    return _client_call(args, run)


def _watch_rates(ts: TierStat, prev: TierStat | None, dt: float) -> tuple[str, str]:
    """``stat --watch``'s "used/s" (signed bytes per second) and "evictions/s" of a tier
    since the previous refresh ``dt`` seconds ago; "-" without one."""
    if prev is None or dt <= 0:
        return "-", "-"
    sign = "+" if ts.used_bytes >= prev.used_bytes else "-"
    return f"{sign}{human(abs(ts.used_bytes - prev.used_bytes) / dt)}", f"{(ts.evictions - prev.evictions) / dt:.1f}"


def _watch_view(address: str, st: Stat, seqs: list[SeqInfo], prev: tuple[float, Stat] | None, now: float) -> Any:
    """One ``stat --watch`` frame: a row per tier with its fill bar and its rates since
    ``prev`` (the monotonic time and stat of the frame before). Needs rich."""
    from rich.console import Group
    from rich.progress_bar import ProgressBar
    from rich.table import Table

    s = _summary(st, seqs)
    t = Table(title=f"kvpark at {address}: {s['sequences']} sequences, {s['shared_blocks']} shared blocks, "
                    f"{s['leases']} leases", expand=False)
    for col in ("tier", "state", "use", "used / capacity", "held", "evictions", "used/s", "evictions/s"):
        t.add_column(col, justify="left" if col in ("tier", "state", "use") else "right")
    for name, ts in st.tiers.items():
        frac = ts.used_bytes / ts.capacity_bytes if ts.capacity_bytes else 0.0
        before = prev[1].tiers.get(name) if prev is not None else None
        d_used, d_ev = _watch_rates(ts, before, now - prev[0] if prev is not None else 0.0)
        t.add_row(name, ts.state, ProgressBar(total=1.0, completed=frac, width=24),
                  f"{human(ts.used_bytes)} / {human(ts.capacity_bytes)}", str(ts.sequences),
                  str(ts.evictions), d_used, d_ev)
    return Group(t)


def _watch(args: argparse.Namespace) -> int:
    try:
        from rich.live import Live
    except ImportError:
        print("kvpark stat --watch needs rich: pip install 'kvpark[ui]'", file=sys.stderr)
        return 2
    period = max(0.1, args.watch)
    view = _watch_view

    def run(c: Control) -> int:
        prev: tuple[float, Stat] | None = None
        n = 0
        with Live(refresh_per_second=4, transient=False) as live:
            try:
                while args.iterations is None or n < args.iterations:
                    st, seqs, now = c.stat(), c.list(), time.monotonic()
                    live.update(view(c.address, st, seqs, prev, now))
                    prev, n = (now, st), n + 1
                    if args.iterations is None or n < args.iterations:
                        time.sleep(period)
            except KeyboardInterrupt:
                pass
        return 0

    return _client_call(args, run)


# ---------------------------------------------------------------------- one sequence


def _info(args: argparse.Namespace) -> int:
    def run(c: Control) -> int:
        s = c.info(args.seq_id)
        now = time.time()
        d = _seq_json(s, now)
        d["tensors"] = [{"dtype": m.dtype, "shape": list(m.shape), "nbytes": m.nbytes} for m in s.tensors]
        d["attrs"], d["refs"] = s.attrs, list(s.refs)
        if args.json:
            print(json.dumps(d, indent=2))
            return 0
        # The JSON keeps machine units (seconds, epoch); people get durations and times.
        labels = {"ttl_s": "expires in", "age_s": "age", "last_access": "last access"}
        for k, v in d.items():
            if k == "nbytes":
                v = f"{v} ({human(v)})"
            elif k in ("ttl_s", "age_s"):
                v = "never" if v is None and k == "ttl_s" else "-" if v is None else _duration(v)
            elif k == "last_access":
                v = "-" if not v else (f"{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(v))} "
                                       f"({_duration(now - v)} ago)")
            elif k == "tensors":
                v = ", ".join(f"{m['dtype']}{m['shape']}" for m in v)
            print(f"{labels.get(k, k):<12} {v}")
        return 0

    return _client_call(args, run)


def _drop(args: argparse.Namespace) -> int:
    def run(c: Control) -> int:
        if not c.drop(args.seq_id):
            print(f"kvpark: no parked sequence {args.seq_id!r}", file=sys.stderr)
            return EXIT_ERROR
        print(f"dropped {args.seq_id}")
        return 0

    return _client_call(args, run)


def _pin(args: argparse.Namespace) -> int:
    pinned = args.cmd == "pin"

    def run(c: Control) -> int:
        s = c.pin(args.seq_id, pinned)
        print(f"{'pinned' if s.pinned else 'unpinned'} {s.seq_id} (in {s.tier})")
        return 0

    return _client_call(args, run)


def _flush(args: argparse.Namespace) -> int:
    def run(c: Control) -> int:
        n = c.flush()
        print(f"{n} sequence(s) written to disk")
        return 0

    return _client_call(args, run)


# ---------------------------------------------------------------------- entry point


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvpark", description="KV-cache parking daemon")
    p.add_argument("--version", action="version", version=f"kvpark {VERSION}")
    sub = p.add_subparsers(dest="cmd", required=True)
    conn = argparse.ArgumentParser(add_help=False)
    conn.add_argument("--address", help=f"daemon address (default: $KVPARK_ADDRESS, else {DEFAULT_ADDRESS})")
    conn.add_argument("--timeout", type=float, default=10.0, help="seconds per call (default 10)")
    sub.add_parser("serve", help="run the daemon (kvpark serve -h for its options)")
    sub.add_parser("config", help="print the config as TOML (kvpark config -h)")
    sub.add_parser("compact", help="shrink the disk tier's LMDB file, offline (kvpark compact -h)")
    h = sub.add_parser("health", parents=[conn], help="exit 0 when the daemon is serving, 1 otherwise")
    h.set_defaults(fn=_health)
    st = sub.add_parser("stat", parents=[conn], help="tiers and sequences: a summary, --all, --json, --watch")
    st.add_argument("--all", action="store_true", help="every sequence: tier, size, pinned, TTL, age")
    st.add_argument("--json", action="store_true", help="machine-readable output (every sequence included)")
    st.add_argument("--watch", type=float, nargs="?", const=1.0, metavar="SECONDS",
                    help="live view, refreshed every SECONDS (default 1); Ctrl-C ends it")
    st.add_argument("--iterations", type=int, help=argparse.SUPPRESS)  # --watch: stop after N refreshes
    st.set_defaults(fn=_stat)
    i = sub.add_parser("info", parents=[conn], help="one sequence in detail")
    i.add_argument("seq_id")
    i.add_argument("--json", action="store_true")
    i.set_defaults(fn=_info)
    for name, fn, help_ in (("drop", _drop, "drop one sequence (all its tiers)"),
                            ("pin", _pin, "pin one sequence: never demoted below the tier it is in"),
                            ("unpin", _pin, "unpin one sequence")):
        x = sub.add_parser(name, parents=[conn], help=help_)
        x.add_argument("seq_id")
        x.set_defaults(fn=fn)
    f = sub.add_parser("flush", parents=[conn], help="write every memory-only sequence to disk now")
    f.set_defaults(fn=_flush)
    sub.add_parser("bench", help="side-by-side transfer benchmark with a plot (kvpark bench -h)")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        if argv and argv[0] in ("serve", "config", "compact"):
            from kvpark.daemon.cli import main as daemon_main  # the daemon's own commands

            return daemon_main(argv)
        if argv and argv[0] == "bench":
            from .bench import main as bench_main  # rich and matplotlib load only here

            return bench_main(argv[1:])
        args = _parser().parse_args(argv)
        return int(args.fn(args))
    except BrokenPipeError:
        # The reader went away (`kvpark stat | head -1`): what it wanted it got. Point
        # stdout at /dev/null so the interpreter's final flush does not raise again.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())
