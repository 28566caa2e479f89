"""The daemon's commands of the ``kvpark`` command line (``kvpark stat``, a client, lives in
``kvpark.client.cli``, which is also the ``kvpark`` entry point and hands these over).

Commands:
- ``kvpark serve [--config FILE] [--listen ADDR] [--data-dir DIR] [--log-level LEVEL]
  [--log-format text|json] [--set KEY=VALUE]`` runs the daemon until SIGTERM/SIGINT, then
  drains gracefully and exits 0.
- ``kvpark config [--config FILE] [--set KEY=VALUE]`` prints the config as TOML that
  ``--config`` reads back: every key with its description and, for enumerated keys, the
  choices. Without options, the defaults; with them, the resolved config they give.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading

from kvpark.proto import VERSION
from kvpark.proto.errors import StartupError

from . import logs
from .config import ConfigError, load, to_toml

log = logging.getLogger("kvpark")


def _overrides(args: argparse.Namespace) -> dict[str, str] | None:
    overrides: dict[str, str] = {}
    for item in args.set or []:
        key, sep, value = item.partition("=")
        if not sep:
            print(f"kvpark: --set expects KEY=VALUE, got {item!r}", file=sys.stderr)
            return None
        overrides[key.strip()] = value.strip()
    return overrides


def _serve(args: argparse.Namespace) -> int:
    overrides = _overrides(args)
    if overrides is None:
        return 2
    if args.listen:
        overrides["server.listen"] = args.listen
    if args.data_dir:
        overrides["tiers.disk.path"] = args.data_dir
    if args.log_level:
        overrides["server.log_level"] = args.log_level
    if args.log_format:
        overrides["server.log_format"] = args.log_format
    # Logging first, so what resolving the config decides (an auto-sized arena) is seen.
    logs.setup(args.log_level or "info", args.log_format or "text")
    try:
        cfg = load(args.config, overrides=overrides)
    except ConfigError as e:
        print(f"kvpark: config error: {e}", file=sys.stderr)
        return 2
    logs.setup(cfg.server.log_level, cfg.server.log_format)
    from .server import Daemon  # after logging is set up

    env_keys = sorted(k for k in os.environ if k.startswith("KVPARK__"))
    log.info("kvpark %s starting; config: %s%s%s", VERSION, args.config or "embedded defaults",
             f", environment {', '.join(env_keys)}" if env_keys else "",
             f", --set {', '.join(sorted(overrides))}" if overrides else "")

    stop = threading.Event()

    def on_signal(signum: int, _frame: object) -> None:
        log.info("received %s; draining", signal.Signals(signum).name)
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        daemon = Daemon(cfg).start()
    except (StartupError, OSError) as e:  # refusals, in one line each: exit 2
        print(f"kvpark: cannot start: {e}", file=sys.stderr)
        return 2
    while not stop.wait(0.5):
        pass
    daemon.stop()
    return 0


def _config(args: argparse.Namespace) -> int:
    overrides = _overrides(args)
    if overrides is None:
        return 2
    if args.config is None and not overrides:
        sys.stdout.write(to_toml())
        return 0
    try:
        cfg = load(args.config, overrides=overrides)
    except ConfigError as e:
        print(f"kvpark: config error: {e}", file=sys.stderr)
        return 2
    sys.stdout.write(to_toml(cfg))
    return 0


def _compact(args: argparse.Namespace) -> int:
    from kvpark.tiers.compact import compact

    path = args.data_dir
    if not path:
        overrides = _overrides(args)
        if overrides is None:
            return 2
        try:
            path = load(args.config, overrides=overrides).tiers.disk.path
        except ConfigError as e:
            print(f"kvpark: config error: {e}", file=sys.stderr)
            return 2
    print(f"compacting {path} (the daemon must be stopped; this copies every live page once)", flush=True)
    try:
        before, after = compact(path)
    except (StartupError, OSError) as e:
        print(f"kvpark: {e}", file=sys.stderr)
        return 2
    print(f"{path}: data.mdb {before / 2**20:.1f} MiB -> {after / 2**20:.1f} MiB")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kvpark", description="KV-cache parking daemon")
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("serve", help="run the daemon")
    s.add_argument("--config", help="TOML config file (default: embedded defaults)")
    s.add_argument("--listen", help="address: host:port or unix:///path (overrides server.listen)")
    s.add_argument("--data-dir", help="disk tier directory (overrides tiers.disk.path)")
    s.add_argument("--log-level", choices=("debug", "info", "warning", "error"))
    s.add_argument("--log-format", choices=("text", "json"), help="json: one object per line (server.log_format)")
    s.add_argument("--set", action="append", metavar="KEY=VALUE", help="override any config key, e.g. "
                   "tiers.host.capacity=1GiB (repeatable)")
    s.set_defaults(fn=_serve)
    c = sub.add_parser("config", help="print the config as TOML (defaults, or what --config/--set give)")
    c.add_argument("--config", help="TOML config file to resolve and print")
    c.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a key (repeatable)")
    c.set_defaults(fn=_config)
    k = sub.add_parser("compact", help="shrink the disk tier's LMDB file to its live pages (daemon stopped)")
    k.add_argument("--data-dir", help="the disk tier's directory (default: tiers.disk.path of the config)")
    k.add_argument("--config", help="TOML config file whose tiers.disk.path to compact")
    k.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a key (repeatable)")
    k.set_defaults(fn=_compact)
    args = p.parse_args(argv)
    return int(args.fn(args))


if __name__ == "__main__":
    sys.exit(main())
