#!/usr/bin/env python
"""A sequence larger than the host tier (windowed) against a plain spill of the same bytes.

Two daemons in this process, one data dir each, measured side by side in one run:

- ``windowed``: a host tier a third of the sequence's size, so the park streams to disk
  through one window of slots at a time and the restore reads it back the same way
  (shm), or the daemon streams it from disk (inline).
- ``plain spill``: a host tier that holds the sequence; the park lands in memory and is
  then written to disk (``flush``), its memory copy dropped (``demote``), the path every
  sequence takes when the host tier spills. The restore reads that disk-resident copy
  (promoting it into host on the way, the default).

Both write the same bytes to LMDB under the same write policy (write_back, no fsync per
park). Rows: park (park + the spill's disk write) and restore (into preallocated
tensors), MB/s best of ``--reps`` (interleaved: one of each row per round) after one
warm-up, and windowed / plain as a ratio.
Absolute numbers depend on the machine and its load; the ratio is the figure.

``--one-window`` holds one window instead of two, to see what the overlap of disk I/O
with the client's copies buys.

Usage: ``python bench/large_seq.py [--size-mib 192] [--reps 5] [--one-window] [--json PATH]``.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import write_json  # noqa: E402

from kvpark.client import Client  # noqa: E402
from kvpark.daemon.config import load  # noqa: E402
from kvpark.daemon.server import Daemon  # noqa: E402

MiB = 1 << 20


def start(root: Path, shm: Path, name: str, host: int) -> Daemon:
    (shm / name).mkdir(parents=True)
    cfg = load(env={}, overrides={
        "server.listen": "127.0.0.1:0", "tiers.device.enabled": "false", "metrics.listen": "",
        "tiers.host.capacity": host, "tiers.host.shm_dir": str(shm / name),
        "tiers.disk.path": str(root / name / "disk"), "tiers.disk.capacity": 8 * host,
    })
    return Daemon(cfg).start()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-mib", type=int, default=192)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--json", default="")
    ap.add_argument("--one-window", action="store_true",
                    help="hold one window instead of two (no overlap of disk I/O and the client's copies)")
    args = ap.parse_args()
    if args.one_window:
        from kvpark.daemon.window import Windows
        Windows.buffers_for = lambda self, tier: 1  # type: ignore[method-assign]
    size = args.size_mib * MiB
    data = [torch.randint(0, 256, (size // 4,), dtype=torch.uint8) for _ in range(4)]
    into = [torch.empty_like(t) for t in data]
    rows: dict[str, dict[str, float]] = {}
    shm_base = "/dev/shm" if Path("/dev/shm").is_dir() else None  # the arenas on a tmpfs where there is one
    with tempfile.TemporaryDirectory() as tmp, tempfile.TemporaryDirectory(dir=shm_base) as shm_tmp:
        root, shm = Path(tmp), Path(shm_tmp)
        win = start(root, shm, "windowed", size // 3)  # the sequence is 3x its host tier
        plain = start(root, shm, "plain", 2 * size)
        try:
            for transport in ("shm", "inline"):
                cw, cp = Client(win.address, transport=transport), Client(plain.address, transport=transport)

                def park_windowed() -> None:
                    info = cw.park("s", data, overwrite=True)
                    assert info.tier == "disk"

                def park_plain() -> None:
                    cp.park("s", data, overwrite=True)
                    plain.engine.flush()  # the spill's disk write
                    assert plain.engine.mover.demote("s", "host") and cp.info("s").tier == "disk"

                def restore_windowed() -> None:
                    cw.restore("s", into=into)

                def restore_plain() -> None:
                    if cp.info("s").tier != "disk":  # promoted by the previous restore: spill it again
                        assert plain.engine.mover.demote("s", "host")
                    t0 = time.perf_counter()
                    cp.restore("s", into=into)
                    return time.perf_counter() - t0  # type: ignore[return-value]

                steps = (("park windowed", park_windowed), ("park plain spill", park_plain),
                         ("restore windowed", restore_windowed), ("restore plain spill", restore_plain))
                for _, fn in steps:
                    fn()  # warm-up
                times: dict[str, list[float]] = {name: [] for name, _ in steps}
                for _ in range(args.reps):  # interleaved, so load that comes and goes hits both sides
                    for name, fn in steps:
                        t0 = time.perf_counter()
                        inner = fn()
                        times[name].append(inner if isinstance(inner, float) else time.perf_counter() - t0)
                best = {name: size / min(ts) / 1e6 for name, ts in times.items()}
                assert all(torch.equal(a, b) for a, b in zip(into, data))
                cw.close()
                cp.close()
                rows[transport] = best
        finally:
            win.stop(0.5)
            plain.stop(0.5)
    print(f"{args.size_mib} MiB sequence (4 tensors), windowed host tier {args.size_mib // 3} MiB"
          f"{' (one window)' if args.one_window else ''}; MB/s, best of {args.reps}")
    print(f"{'transport':<10}{'park win':>10}{'park plain':>12}{'ratio':>8}{'rest win':>10}{'rest plain':>12}"
          f"{'ratio':>8}")
    for t, b in rows.items():
        pw, pp, rw, rp = b["park windowed"], b["park plain spill"], b["restore windowed"], b["restore plain spill"]
        print(f"{t:<10}{pw:>10.0f}{pp:>12.0f}{pw / pp:>7.2f}x{rw:>10.0f}{rp:>12.0f}{rw / rp:>7.2f}x")
    if args.json:
        write_json(args.json, {"size_mib": args.size_mib, "reps": args.reps, "mb_per_s": rows})


if __name__ == "__main__":
    main()
