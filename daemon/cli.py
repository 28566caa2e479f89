"""The ``kvpark`` command line.

Commands:
- ``kvpark serve [--config FILE] [--listen ADDR] [--data-dir DIR] [--log-level LEVEL] [--set KEY=VALUE]``
  runs the daemon until SIGTERM/SIGINT, then drains gracefully and exits 0.
- ``kvpark stat [--address ADDR] [--json]`` prints the tiers and parked sequences.
- ``kvpark config`` prints every config key with its default and description.
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
import threading
from dataclasses import asdict

from kvpark.proto.errors import StartupError

from .config import ConfigError, load, reference

log = logging.getLogger("kvpark")


def _human(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    return str(n)


def _serve(args: argparse.Namespace) -> int:
    overrides: dict[str, str] = {}
    if args.listen:
        overrides["server.listen"] = args.listen
    if args.data_dir:
        overrides["tiers.disk.path"] = args.data_dir
    if args.log_level:
        overrides["server.log_level"] = args.log_level
    for item in args.set or []:
        key, sep, value = item.partition("=")
        if not sep:
            print(f"kvpark: --set expects KEY=VALUE, got {item!r}", file=sys.stderr)
            return 2
        overrides[key.strip()] = value.strip()
    # Logging first, so what resolving the config decides (an auto-sized arena) is seen.
    logging.basicConfig(
        level=getattr(logging, (args.log_level or "info").upper()),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    try:
        cfg = load(args.config, overrides=overrides)
    except ConfigError as e:
        print(f"kvpark: config error: {e}", file=sys.stderr)
        return 2
    logging.getLogger().setLevel(getattr(logging, cfg.server.log_level.upper()))
    from .server import Daemon  # after logging is set up

    stop = threading.Event()

    def on_signal(signum: int, _frame: object) -> None:
        log.info("received %s; draining", signal.Signals(signum).name)
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        daemon = Daemon(cfg).start()
    except StartupError as e:
        print(f"kvpark: cannot start: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        log.error("cannot start: %s", e)
        return 1
    while not stop.wait(0.5):
        pass
    daemon.stop()
    return 0


def _stat(args: argparse.Namespace) -> int:
    from kvpark.client import Client, KVParkError

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
        }
        print(json.dumps(out, indent=2))
        return 0
    print(f"{'tier':<8}{'used':>12}{'capacity':>12}{'use%':>7}{'blocks':>9}{'seqs':>7}")
    for name, t in st.tiers.items():
        pct = 100.0 * t.used_bytes / t.capacity_bytes if t.capacity_bytes else 0.0
        print(f"{name:<8}{_human(t.used_bytes):>12}{_human(t.capacity_bytes):>12}{pct:>6.1f}%{t.blocks:>9}"
              f"{t.sequences:>7}")
    print()
    print(f"{len(seqs)} sequence(s), {st.leases} lease(s)")
    if seqs:
        width = max(6, min(48, max(len(s.seq_id) for s in seqs)))
        print(f"{'seq_id':<{width}}  {'tier':<5}{'size':>12}{'tensors':>9}{'prio':>6}")
        for s in seqs:
            print(f"{s.seq_id[:width]:<{width}}  {s.tier:<5}{_human(s.nbytes):>12}{s.num_tensors:>9}{s.priority:>6}")
    return 0


def _config(_args: argparse.Namespace) -> int:
    for key, default, help_ in reference():
        print(f"{key} = {default!r}\n    {help_}")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kvpark", description="KV-cache parking daemon")
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("serve", help="run the daemon")
    s.add_argument("--config", help="TOML config file (default: embedded defaults)")
    s.add_argument("--listen", help="address: host:port or unix:///path (overrides server.listen)")
    s.add_argument("--data-dir", help="disk tier directory (overrides tiers.disk.path)")
    s.add_argument("--log-level", choices=("debug", "info", "warning", "error"))
    s.add_argument("--set", action="append", metavar="KEY=VALUE", help="override any config key, e.g. "
                   "tiers.host.capacity=1GiB (repeatable)")
    s.set_defaults(fn=_serve)
    st = sub.add_parser("stat", help="print tiers and parked sequences")
    st.add_argument("--address", help="daemon address (default: $KVPARK_ADDRESS, else 127.0.0.1:50551)")
    st.add_argument("--json", action="store_true", help="machine-readable output")
    st.set_defaults(fn=_stat)
    c = sub.add_parser("config", help="list every config key with its default")
    c.set_defaults(fn=_config)
    args = p.parse_args(argv)
    return int(args.fn(args))


if __name__ == "__main__":
    sys.exit(main())
