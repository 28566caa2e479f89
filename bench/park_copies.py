"""A CPU shm park's copies: one ``torch.cat`` per arena run (``payload.gather``, the
default) against a view and a ``copy_`` per tensor run (``payload.runs``, as before),
side by side, with the single-thread ``copy_`` limit of ``bench/transport.py``.

One daemon in its own process (as in production), one shm client, torch at one thread.
Each round times, in alternating order, the limit (``copy_`` of each tensor into a
preallocated one), a park with ``gather`` and a park with ``runs``, for 256 x 1 MiB
(the issue's case) and 4096 x 64 KiB (many small blocks). Figures: the median of the
rounds, and each park's ratio to the limit (1.0: as fast as copying).

    .venv/bin/python bench/park_copies.py [--rounds 9]
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
from release import daemon_config

from kvpark.client import Client, transport

HERE = Path(__file__).resolve().parent
CASES = ((256, 1 << 20), (4096, 64 << 10))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=9, help="alternating rounds (default 9)")
    ap.add_argument("--json", default=str(HERE / "results" / "park_copies.json"), help="where to write the JSON")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    real = transport.gather
    modes = ("copy_ limit", "park, gather", "park, runs")
    times: dict[tuple[int, str], list[float]] = {(n, m): [] for n, _ in CASES for m in modes}
    shm_root = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
    with tempfile.TemporaryDirectory() as tmp, tempfile.TemporaryDirectory(dir=shm_root) as shm:
        with serve_process(daemon_config(tmp, shm)) as address:
            try:
                with Client(address, transport="shm") as c:
                    for n, size in CASES:
                        srcs = [torch.randint(0, 256, (size,), dtype=torch.uint8) for _ in range(n)]
                        dsts = [torch.empty_like(s) for s in srcs]
                        for rnd in range(args.rounds + 1):  # the first round warms up, untimed
                            for m in modes if rnd % 2 else modes[::-1]:
                                transport.gather = real if m == "park, gather" else (lambda *a: False)
                                t0 = time.perf_counter()
                                if m == "copy_ limit":
                                    for d, s in zip(dsts, srcs):
                                        d.copy_(s)
                                else:
                                    c.park("p", srcs)
                                spent = time.perf_counter() - t0
                                if m != "copy_ limit":
                                    c.drop("p")
                                if rnd:
                                    times[(n, m)].append(spent)
                        print(f"  {n} x {size >> 10} KiB done", flush=True)
            finally:
                transport.gather = real
    rows: list[dict[str, Any]] = []
    print(f"{'case':>16} | " + " | ".join(f"{m:>12}" for m in modes) + " | gather / limit | runs / limit")
    for n, size in CASES:
        med = {m: statistics.median(times[(n, m)]) for m in modes}
        g, r = med["copy_ limit"] / med["park, gather"], med["copy_ limit"] / med["park, runs"]
        print(f"{n:>5} x {size >> 10:>4} KiB | " + " | ".join(f"{med[m] * 1e3:>9.2f} ms" for m in modes) +
              f" | {g:>14.2f} | {r:.2f}")
        rows.append(dict(tensors=n, nbytes=size, median_s=med, samples_s={m: times[(n, m)] for m in modes},
                         gather_ratio=g, runs_ratio=r))
    write_json(args.json, dict(rounds=args.rounds, rows=rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
