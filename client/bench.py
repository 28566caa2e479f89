"""``kvpark bench``: the side-by-side suite in one process, a table, ``bench.json`` and a plot.

Primitives:
- ``main(argv) -> exit code``: ``[--quick] [--out DIR] [--reps N]``; needs the ``ui`` extra
  (rich, matplotlib) and says so when it is missing.
- ``run_suite(opts, step) -> Result``: every row, with ``step(label)`` called as each one
  finishes (the progress bar).
- ``Row``: one measured row: its kind ("reference", "peer" or "kvpark"), what moves the bytes
  in ("write": park / upload / SET / put) and out ("read": restore / download / GET / get),
  best and median GB/s of each.
- ``plot(result, path)``: the PNG: one bar pair per row, coloured by kind (the legend lists
  the kinds present), and a second panel with the p50 latency of small parks and restores.
- ``Latency``: p50 milliseconds of a 4 KiB and a 1 MiB park and restore, per transport.

The payload is N tensors of 1 MiB (64 with ``--quick``, 256 without); GB/s is 1e9 bytes per
second, best of ``--reps`` timed runs after one untimed. Rows:
- references (what the same bytes cost through plain tools; not ceilings: kvpark's own
  rows may beat them, e.g. its data channel beats one gRPC stream): single-thread ``copy_``
  into preallocated tensors; one TCP socket on loopback, ``sendall`` / ``recv_into`` (what
  the data channel rides on); one gRPC stream of 1 MiB messages; LMDB with a put per
  record and one fsynced commit, and gets;
- peers: Redis SET / GET through redis-py when a ``redis-server`` binary is on PATH;
- kvpark: shm and inline park / restore(into) against an in-process daemon; disk:
  write-through parks (acknowledged once on disk) and restores served from disk after a
  restart (nothing promoted); cuda_ipc (device tensors, device to device) when CUDA is
  there (written for GPU machines; the development machine has none, so that row has
  not been run).
Everything runs on loopback; the daemon's metrics endpoint is off and temp dirs are removed.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

from kvpark.tiers.cuda import cuda_available

MiB = 1 << 20
KIND_COLOURS = {"reference": "#9e9e9e", "peer": "#e69f00", "kvpark": "#0072b2"}
LATENCY_SIZES = ((4 << 10, "4 KiB"), (1 << 20, "1 MiB"))


@dataclass
class Row:
    name: str
    kind: str  # "reference" | "peer" | "kvpark"
    write: str  # what the write column measures
    read: str  # what the read column measures
    write_s: list[float] = field(default_factory=list)
    read_s: list[float] = field(default_factory=list)
    nbytes: int = 0
    note: str = ""

    def gbps(self, times: list[float], best: bool = True) -> float | None:
        if not times:
            return None
        t = min(times) if best else statistics.median(times)
        return self.nbytes / t / 1e9


@dataclass
class Options:
    quick: bool = False
    reps: int = 3
    out: Path = Path("bench-out")

    @property
    def n(self) -> int:
        return 64 if self.quick else 256


@dataclass
class Latency:
    transport: str
    size: str
    park_p50_ms: float
    restore_p50_ms: float


@dataclass
class Result:
    rows: list[Row]
    meta: dict[str, Any]
    skipped: list[str]
    checks: list[str]
    latency: list[Latency] = field(default_factory=list)


def _steps(cuda: bool) -> int:
    # copy, socket, gRPC, lmdb, redis, shm, inline, disk park, disk restore, latency, (cuda_ipc)
    return 10 + int(cuda)


def run_suite(opts: Options, step: Callable[[str], None]) -> Result:
    import lmdb
    import numpy as np
    import torch

    from kvpark.daemon.config import load
    from kvpark.daemon.server import Daemon

    from .benchkit import (BareClient, BareServicer, BareSocket, RedisServer, cpu_model, same, start_bare_server,
                           timed, touch)
    from .client import Client

    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    src = [torch.randint(0, 256, (MiB,), dtype=torch.uint8, generator=gen) for _ in range(opts.n)]
    dst = [torch.empty_like(t) for t in src]
    touch(dst)
    nbytes = opts.n * MiB
    reps, warm = opts.reps, 1
    rows: list[Row] = []
    latency: list[Latency] = []
    skipped: list[str] = []
    checks: list[str] = []

    def check(label: str) -> None:
        if not same(src, dst):
            checks.append(f"{label}: bytes read back differ")
        touch(dst)

    # limits ---------------------------------------------------------------------------
    r = Row("copy_ (1 thread)", "reference", "copy in", "copy out", nbytes=nbytes)
    scratch = [torch.empty_like(t) for t in src]
    touch(scratch)
    r.write_s = timed(lambda: [d.copy_(s) for d, s in zip(scratch, src)], reps, warm)
    r.read_s = timed(lambda: [d.copy_(s) for d, s in zip(dst, scratch)], reps, warm)
    check("copy_")
    rows.append(r)
    step("copy_")

    views = [memoryview(t.numpy()) for t in src]
    dviews = [memoryview(t.numpy()) for t in dst]
    # What the data channel rides on: one loopback TCP connection, no framing, no copy out.
    r = Row("one TCP socket (loopback)", "reference", "send", "recv_into", nbytes=nbytes)
    sock = BareSocket(nbytes)
    try:
        sock.sources = views
        r.write_s = timed(lambda: sock.upload(views), reps, warm)
        r.read_s = timed(lambda: sock.download(dviews), reps, warm)
        check("TCP socket")
    finally:
        sock.close()
    rows.append(r)
    step("TCP socket")

    bare = BareServicer(nbytes)
    server, address = start_bare_server(bare)
    bc = BareClient(address)
    try:
        bare.sources["b"] = views
        r = Row("one gRPC stream", "reference", "upload", "download", nbytes=nbytes)
        r.write_s = timed(lambda: bc.upload(views), reps, warm)
        r.read_s = timed(lambda: bc.download("b", dviews), reps, warm)
        check("gRPC stream")
        rows.append(r)
    finally:
        bc.close()
        server.stop(0)
    step("gRPC stream")

    tmp = tempfile.mkdtemp(prefix="kvpark-bench-")
    try:
        env = lmdb.open(os.path.join(tmp, "raw"), map_size=4 * nbytes + (64 << 20), writemap=False, sync=True)
        keys = [f"k{i:06d}".encode() for i in range(opts.n)]

        def lmdb_put() -> None:
            with env.begin(write=True) as txn:
                for k, v in zip(keys, views):
                    txn.put(k, v)  # the commit fsyncs (sync=True), as kvpark's disk tier does

        def lmdb_get() -> None:
            with env.begin(buffers=True) as txn:
                for k, d in zip(keys, dviews):
                    d[:] = txn.get(k)

        r = Row("LMDB, a put per record", "reference", "puts + fsynced commit", "get", nbytes=nbytes,
                note="page cache warm on read")
        r.write_s = timed(lmdb_put, reps, warm)
        r.read_s = timed(lmdb_get, reps, warm)
        check("LMDB")
        env.close()
        rows.append(r)
        step("LMDB")

        # peers ------------------------------------------------------------------------
        redis_version = ""
        if shutil.which("redis-server") is None:
            skipped.append("Redis: no redis-server binary on PATH")
        else:
            rs = RedisServer()
            try:
                if not rs.ok:
                    skipped.append(f"Redis: {rs.skip_reason}")
                else:
                    redis_version = rs.version
                    rkeys = [f"b{i}" for i in range(opts.n)]

                    def rset() -> None:
                        p = rs.client.pipeline(transaction=False)
                        for k, v in zip(rkeys, views):
                            p.set(k, v)
                        p.execute()

                    def rget() -> None:
                        for d, v in zip(dviews, rs.client.mget(rkeys)):
                            d[:] = v

                    r = Row("Redis", "peer", "SET (pipeline)", "MGET + copy", nbytes=nbytes)
                    r.write_s = timed(rset, reps, warm)
                    r.read_s = timed(rget, reps, warm)
                    check("Redis")
                    rows.append(r)
            finally:
                rs.close()
        step("Redis")

        # kvpark -----------------------------------------------------------------------
        shm_root = "/dev/shm" if os.access("/dev/shm", os.W_OK) else tmp
        shm_dir = tempfile.mkdtemp(prefix="kvpark-bench-shm-", dir=shm_root)
        base = {
            "server.listen": "127.0.0.1:0",
            "metrics.listen": "",
            "tiers.host.capacity": f"{max(256, 4 * opts.n)}MiB",
            "tiers.host.shm_dir": shm_dir,
            "tiers.disk.path": os.path.join(tmp, "disk"),
            "tiers.disk.capacity": f"{4 * opts.n + 64}MiB",
            "tiers.device.enabled": "true" if cuda_available() else "false",
            "tiers.device.capacity": f"{max(256, 4 * opts.n)}MiB",
            "server.log_level": "warning",
        }
        try:
            with Daemon(load(env={}, overrides={**base, "policy.flush_on_shutdown": "false"})) as d:
                transports = ["shm", "inline"] + (["cuda_ipc"] if cuda_available() else [])
                for transport in transports:
                    # cuda_ipc moves tensors that live on the daemon's GPU, device to device.
                    gpu = transport == "cuda_ipc"
                    s_t = [t.to("cuda:0") for t in src] if gpu else src
                    d_t = [torch.empty_like(t) for t in s_t] if gpu else dst
                    with Client(d.address, transport=transport) as c:
                        sid = f"bench-{transport}"
                        r = Row(f"kvpark {transport}", "kvpark", "park", "restore(into)", nbytes=nbytes)
                        r.write_s = timed(lambda: c.park(sid, s_t), reps, warm, after=lambda: c.drop(sid))
                        c.park(sid, s_t)
                        r.read_s = timed(lambda: c.restore(sid, into=d_t), reps, warm)
                        if gpu:
                            for d_, g in zip(dst, d_t):
                                d_.copy_(g)
                        check(f"kvpark {transport}")
                        c.drop(sid)
                        rows.append(r)
                        if not gpu:
                            latency += small_latencies(c, transport, 20 if opts.quick else 60)
                    step(f"kvpark {transport}")
                step("latency")
            # Disk: parks acknowledged only once written; restores read from disk after a
            # restart (the index is rebuilt from disk; nothing is promoted back to host).
            disk_cfg = {**base, "policy.write": "write_through", "policy.promote_on_restore": "false",
                        "tiers.device.enabled": "false"}
            r = Row("kvpark disk", "kvpark", "park (write-through)", "restore from disk", nbytes=nbytes)
            with Daemon(load(env={}, overrides=disk_cfg)) as d, Client(d.address, transport="shm") as c:
                r.write_s = timed(lambda: c.park("bench-disk", src), reps, warm, after=lambda: c.drop("bench-disk"))
                c.park("bench-disk", src)
            step("kvpark disk park")
            with Daemon(load(env={}, overrides=disk_cfg)) as d, Client(d.address, transport="shm") as c:
                if c.info("bench-disk").tier != "disk":
                    checks.append("kvpark disk: the sequence was not on disk only after the restart")
                r.read_s = timed(lambda: c.restore("bench-disk", into=dst), reps, warm)
                check("kvpark disk")
            rows.append(r)
            step("kvpark disk restore")
        finally:
            shutil.rmtree(shm_dir, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if not cuda_available():
        skipped.append("kvpark cuda_ipc: no CUDA device")
    meta = dict(
        date=time.strftime("%Y-%m-%d %H:%M:%S %Z"), host_cpu=cpu_model(), cpus=os.cpu_count(),
        python=platform.python_version(), torch=torch.__version__, quick=opts.quick, reps=reps, warmup=warm,
        payload=f"{opts.n} x 1 MiB", nbytes=nbytes, gb="1e9 bytes", statistic="best of reps (median also given)",
        redis_server=redis_version, torch_threads=1, numpy=np.__version__,
    )
    return Result(rows=rows, meta=meta, skipped=skipped, checks=checks, latency=latency)


def small_latencies(c: Any, transport: str, iters: int) -> list[Latency]:
    """p50 of a park (overwrite) and a restore of one small tensor, per size: what a
    worker waits for per block, where throughput says nothing."""
    import torch

    out = []
    for nbytes, label in LATENCY_SIZES:
        t = torch.ones(nbytes, dtype=torch.uint8)
        sid = f"lat-{transport}-{nbytes}"
        c.park(sid, [t], overwrite=True)
        park, restore = [], []
        for _ in range(iters):
            t0 = time.perf_counter()
            c.park(sid, [t], overwrite=True)
            park.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            c.restore(sid)
            restore.append(time.perf_counter() - t0)
        c.drop(sid)
        out.append(Latency(transport, label, statistics.median(park) * 1e3, statistics.median(restore) * 1e3))
    return out


def to_json(res: Result) -> dict[str, Any]:
    rows = []
    for r in res.rows:
        d = asdict(r)
        d.update(write_best_gbps=r.gbps(r.write_s), write_median_gbps=r.gbps(r.write_s, best=False),
                 read_best_gbps=r.gbps(r.read_s), read_median_gbps=r.gbps(r.read_s, best=False))
        rows.append(d)
    return dict(meta=res.meta, rows=rows, skipped=res.skipped, checks=res.checks,
                latency=[asdict(x) for x in res.latency])


def table(res: Result) -> Any:
    from rich.table import Table

    t = Table(title=f"kvpark bench: {res.meta['payload']}, GB/s best of {res.meta['reps']} (median)")
    for col, just in (("row", "left"), ("kind", "left"), ("write", "left"), ("GB/s", "right"), ("read", "left"),
                      ("GB/s", "right")):
        t.add_column(col, justify=just)  # type: ignore[arg-type]
    style = {"reference": "dim", "peer": "yellow", "kvpark": "bold cyan"}
    for r in res.rows:
        cells = []
        for times in (r.write_s, r.read_s):
            best, med = r.gbps(times), r.gbps(times, best=False)
            cells.append("-" if best is None else f"{best:.2f} ({med:.2f})")
        t.add_row(r.name, r.kind, r.write, cells[0], r.read, cells[1], style=style[r.kind])
    return t


def plot(res: Result, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only, never a window
    import matplotlib.pyplot as plt

    rows = res.rows
    lat = res.latency
    fig, (ax, lax) = plt.subplots(2, 1, figsize=(9, 0.55 * len(rows) + 1.6 + (2.6 if lat else 0)), dpi=110,
                                  gridspec_kw={"height_ratios": [max(len(rows), 1), 4 if lat else 0.01]})
    h = 0.38
    for i, r in enumerate(rows):
        y = len(rows) - 1 - i
        colour = KIND_COLOURS[r.kind]
        for dy, times, hatch in ((h / 2, r.write_s, ""), (-h / 2, r.read_s, "//")):
            v = r.gbps(times)
            if v is None:
                continue
            ax.barh(y + dy, v, height=h, color=colour, hatch=hatch, edgecolor="white")
            ax.text(v, y + dy, f" {v:.2f}", va="center", fontsize=8)
    ax.set_yticks(range(len(rows)), [f"{r.name}\n({r.write} / {r.read})" for r in reversed(rows)], fontsize=8)
    ax.set_xlabel("GB/s (1e9 B/s), best of reps; solid = write, hatched = read")
    kinds = [k for k in KIND_COLOURS if any(r.kind == k for r in rows)]  # no empty legend entries
    handles = [plt.Rectangle((0, 0), 1, 1, color=KIND_COLOURS[k]) for k in kinds]
    ax.legend(handles, kinds, loc="lower right", fontsize=8)
    ax.set_title(f"kvpark bench, {res.meta['payload']}, {res.meta['date']}\n{res.meta['host_cpu']} "
                 f"({res.meta['cpus']} CPUs)", fontsize=9)
    ax.margins(x=0.15)
    if lat:
        labels = [f"{x.transport} {x.size}" for x in lat]
        ys = range(len(lat))
        # The axis is inverted (first row on top): park above restore, as in the top panel.
        lax.barh([y - 0.19 for y in ys], [x.park_p50_ms for x in lat], height=0.38, color=KIND_COLOURS["kvpark"])
        lax.barh([y + 0.19 for y in ys], [x.restore_p50_ms for x in lat], height=0.38, color=KIND_COLOURS["kvpark"],
                 hatch="//", edgecolor="white")
        for y, x in zip(ys, lat):
            lax.text(x.park_p50_ms, y - 0.19, f" {x.park_p50_ms:.2f}", va="center", fontsize=8)
            lax.text(x.restore_p50_ms, y + 0.19, f" {x.restore_p50_ms:.2f}", va="center", fontsize=8)
        lax.set_yticks(list(ys), labels, fontsize=8)
        lax.invert_yaxis()
        lax.set_xlabel("latency, ms (p50); solid = park, hatched = restore", fontsize=8)
        lax.margins(x=0.15)
    else:
        lax.axis("off")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="kvpark bench", description="side-by-side transfer benchmark")
    ap.add_argument("--quick", action="store_true", help="64 x 1 MiB instead of 256 x 1 MiB (under a minute)")
    ap.add_argument("--out", default="bench-out", help="folder for bench.json and bench.png (default bench-out)")
    ap.add_argument("--reps", type=int, default=0, help="timed runs per row (default 3, 5 without --quick)")
    args = ap.parse_args(argv)
    return run(Options(quick=args.quick, reps=args.reps or (3 if args.quick else 5), out=Path(args.out)))


def run(opts: Options) -> int:
    try:
        import matplotlib  # noqa: F401  (only checked here; plot() imports it)
        from rich.console import Console
        from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
    except ImportError as e:
        print(f"kvpark bench needs the ui extra ({e.name} is missing): pip install 'kvpark[ui]'", file=sys.stderr)
        return 2
    import torch

    console = Console(stderr=True)
    opts.out.mkdir(parents=True, exist_ok=True)
    with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                  TimeElapsedColumn(), console=console) as progress:
        task = progress.add_task("kvpark bench", total=_steps(cuda_available()))

        def step(label: str) -> None:
            progress.update(task, advance=1, description=f"done: {label}")

        res = run_suite(opts, step)
    out = Console()
    # Piped into a file or a CI log, rich would wrap at 80 columns; the table needs about 100.
    (out if out.is_terminal else Console(width=110)).print(table(res))
    for s in res.skipped:
        print(f"skipped: {s}")
    print("reference rows: the same bytes through plain tools (not ceilings); peer rows: other stores; "
          "kvpark rows: kvpark itself")
    for lat in res.latency:
        print(f"latency p50, kvpark {lat.transport}, {lat.size}: park {lat.park_p50_ms:.2f} ms, "
              f"restore {lat.restore_p50_ms:.2f} ms")
    (opts.out / "bench.json").write_text(json.dumps(to_json(res), indent=2))
    plot(res, opts.out / "bench.png")
    print(f"wrote {opts.out / 'bench.json'} and {opts.out / 'bench.png'}")
    if res.checks:
        print("CORRECTNESS PROBLEMS: " + "; ".join(res.checks), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
