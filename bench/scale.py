#!/usr/bin/env python
"""A million blocks: the daemon's index at 10k, 100k and 1M small content-addressed blocks.

What it parks is the vLLM connector's shape (``kvpark.client.vllm.save_blocks``): many
independent plain sequences, each one *full* KV block of every layer, keyed by a chained
content hash (``kvblk-`` + 32 hex digits), committed in batches (``park_batch``: one
commit, empty ``seq_id``, the blocks carried as ``ParkHeader.blocks``, each with
``attrs = {"layout": <fingerprint>}``). Each block here is one bf16 tensor
``[2 layers, 2, 16 tokens, 1 head, 8]`` = **1 KiB** (``--block-bytes``), so that a million
of them fit the host arena (64 KiB slots: a 1 KiB block takes one 1 KiB granule).

The requests go through the daemon's own code from the protobuf message down: the
client's header builder, the servicer's ``ParkHeader -> ParkSpec`` conversion, then the
engine (``reserve`` inline, ``write_chunk``, ``commit``; ``present``; ``acquire`` +
``iter_chunks`` + ``release``; ``drop``), all in this process with the maintenance
thread running. gRPC is left out on purpose: its ~0.3-0.5 ms per call is the same at
every size and would hide what the index costs.

Per size N (the index grows from one size to the next; ``--sizes 10k,100k,1M``):
- metadata per block: the growth of the process's *anonymous* resident memory
  (``RssAnon`` in /proc/self/status, after ``gc.collect()`` and ``malloc_trim``) from an
  empty engine to N blocks, divided by N. Payload bytes are not in it: the arena is a
  shared-memory file (``RssShmem``) and LMDB is a file mapping (``RssFile``). With
  ``--tracemalloc`` the Python-allocated growth is reported too, with the top sites.
- p50 / p99 of ``--ops`` operations each: park (one fresh block, one commit), lookup
  (``present`` of 16 random parked keys: one ``Lookup`` RPC's work), restore (one random
  block: acquire, read its bytes, release), drop (the blocks the park step added) and
  make_room (the index-lock part of making room in a full host tier: one slot's worth of
  victims from the eviction order, and ``busy()``);
  beside the p99 of wall time, the p99 of the thread's CPU time, the full garbage
  collections and the involuntary context switches during the ops (on a shared machine a
  wall-time p99 far above the CPU-time p99 is time spent waiting for a core).
- at the largest size, "settled": once write-back has caught up with its bounds, a
  freeze pass makes rows of every record nobody holds (``daemon/rows.py``; the
  maintenance thread does the same within seconds), then RssAnon (and, with
  ``--tracemalloc``, the live Python bytes) per block again. What stays memory-only under
  the dirty bounds stays a ``Seq``; RssAnon keeps what the allocator has not returned.
- then ``close(flush=True)`` (every block written to LMDB), and the restart: a new
  ``Engine`` on the same directory, timed until it has rebuilt the index from disk (as
  rows), and its metadata per block.

Usage: ``python bench/scale.py [--sizes 10k,100k,1M] [--ops 1000] [--tracemalloc]
[--profile-restart] [--json PATH]``. 1M takes several minutes on a 2-core machine.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import subprocess
import gc
import os
import platform
import random
import resource
import shutil
import statistics
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path
from typing import Any, Callable

import torch
import xxhash

from kvpark.client.client import _header
from kvpark.daemon.config import Config, load
from kvpark.daemon import maintenance
from kvpark.daemon.engine import Engine
from kvpark.daemon.servicer import _spec
from kvpark.proto.v1 import kvpark_pb2 as pb

from _common import write_json  # bench/ is on sys.path when a script here runs

HERE = Path(__file__).resolve().parent
SLOT = 64 << 10
LAYOUT = "vllm:bench-scale:bfloat16:bs16:h1:d8:L2:flash_attn:" + "0" * 32  # a connector-like fingerprint
BATCH = 2048  # blocks per populating commit
LOOKUP_KEYS = 16


def parse_count(s: str) -> int:
    s = s.strip().lower()
    mult = {"k": 1_000, "m": 1_000_000}.get(s[-1:], 1)
    return int(float(s[:-1] if mult > 1 else s) * mult)


def key(i: int) -> str:
    return "kvblk-" + xxhash.xxh3_128_hexdigest(i.to_bytes(8, "little"))


def rss_anon() -> int:
    """Anonymous resident bytes of this process (heap, not the shm arena or LMDB's map)."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)  # hand freed heap back, so RSS shows what is live
    except OSError:
        pass
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no RssAnon in /proc/self/status (Linux only)")


def make_config(root: Path, shm: Path, capacity_blocks: int, block_bytes: int, arena_blocks: int = 0,
                dirty_bounds: bool = True) -> Config:
    granule = SLOT // 64
    arena = ((arena_blocks or capacity_blocks) * -(-block_bytes // granule) * granule * 11 // 10 // SLOT + 2) * SLOT
    return load(env={}, overrides={
        "tiers.device.enabled": "false",
        "tiers.host.capacity": str(arena),
        "tiers.host.slot_size": str(SLOT),
        "tiers.host.shm_dir": str(shm),
        "tiers.host.prefault": "false",
        "tiers.disk.path": str(root / "disk"),
        "tiers.disk.capacity": str(max(1 << 30, capacity_blocks * block_bytes * 2)),
        "policy.write": "write_back",
        "metrics.listen": "",
        # write_back's dirty bounds at their defaults, or all off (the old behaviour)
        **({} if dirty_bounds else {"policy.max_dirty_s": 0, "policy.max_dirty_bytes": 0,
                                    "policy.max_dirty_sequences": 0}),
    })


def restart_child(config: Config, profile: bool) -> dict[str, Any]:
    """The restart, in this fresh process: open an engine on the data directory, timed."""
    base = rss_anon()
    prof = None
    if profile:
        import cProfile
        prof = cProfile.Profile()
        prof.enable()
    t0, c0 = time.perf_counter(), time.process_time()
    engine = Engine(config)
    restart_s, restart_cpu_s = time.perf_counter() - t0, time.process_time() - c0
    if prof is not None:
        prof.disable()
        import pstats
        pstats.Stats(prof, stream=sys.stderr).sort_stats("tottime").print_stats(15)
    with engine.catalog.lock:
        indexed = len(engine.catalog)
    meta = (rss_anon() - base) / max(1, indexed)
    engine.close(flush=False)
    return {"indexed": indexed, "restart_s": round(restart_s, 2), "restart_cpu_s": round(restart_cpu_s, 2),
            "rss_anon_per_block": round(meta, 1), "load": os.getloadavg()}


class Bench:
    def __init__(self, config: Config, block_bytes: int) -> None:
        self.config = config
        self.block_bytes = block_bytes
        self.elems = block_bytes // 2  # bf16
        self.shape = (2, 2, 16, 1, self.elems // 64) if self.elems % 64 == 0 else (self.elems,)
        self.payload = memoryview(os.urandom(block_bytes * BATCH))
        self.engine = self.open()
        self.count = 0  # blocks parked by populate: keys 0 .. count-1
        self.fresh = 1 << 40  # keys of the timed parks, apart from the population's

    def open(self) -> Engine:
        e = Engine(self.config)
        e.start()
        return e

    def park(self, keys: list[str]) -> None:
        """What one ``park_batch`` RPC makes the daemon do (inline transport)."""
        meta = torch.empty(self.shape, dtype=torch.bfloat16, device="meta")
        header = pb.ParkHeader(seq_id="")
        for k in keys:
            bh = _header(k, [meta])
            bh.attrs.update({"layout": LAYOUT})
            header.blocks.append(bh)
        spec = _spec(pb.ParkHeader.FromString(header.SerializeToString()))  # what the servicer receives
        e = self.engine
        r = e.reserve(spec, inline=True, tier="host")
        n = len(keys) * self.block_bytes
        e.write_chunk(r.lease_id, 0, self.payload[:n])
        e.commit(r.lease_id, n)

    def populate(self, upto: int) -> float:
        t0 = time.perf_counter()
        while self.count < upto:
            n = min(BATCH, upto - self.count)
            self.park([key(i) for i in range(self.count, self.count + n)])
            self.count += n
        return time.perf_counter() - t0

    def ops(self, n: int, rng: random.Random) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
        """``n`` timed operations of each kind: wall times, and this thread's CPU times
        (a wall time far above its CPU time waited: on a lock, or for a core)."""
        e = self.engine
        wall: dict[str, list[float]] = {"park": [], "lookup": [], "restore": [], "drop": [], "make_room": []}
        cpu: dict[str, list[float]] = {op: [] for op in wall}

        def timed(op: str, fn: Callable[[], None]) -> None:
            c0, t0 = time.thread_time(), time.perf_counter()
            fn()
            wall[op].append(time.perf_counter() - t0)
            cpu[op].append(time.thread_time() - c0)

        def restore(k: str) -> None:
            h = e.acquire([k], inline_max=1 << 20)
            got = sum(len(v) for _, views in e.iter_chunks(h, 1 << 20) for v in views)
            if h.lease_id:
                e.release(h.lease_id)
            assert got == self.block_bytes

        def drop(k: str) -> None:
            assert e.drop(k)

        def lookup(ks: list[str]) -> None:
            assert all(e.present(ks))

        def make_room() -> None:
            # What a park that finds its tier full does under the index lock before it
            # demotes: choose one slot's worth of victims, and ask whether moves are in
            # flight. (Both once scanned every indexed block.)
            with e.catalog.lock:
                assert e.catalog.demotion_plan("host", None, SLOT)
                e.catalog.busy()

        parked = []
        for _ in range(n):
            k = key(self.fresh)
            self.fresh += 1
            timed("park", lambda: self.park([k]))
            parked.append(k)
        for _ in range(n):
            ks = [key(rng.randrange(self.count)) for _ in range(LOOKUP_KEYS)]
            timed("lookup", lambda: lookup(ks))
        for _ in range(n):
            k = key(rng.randrange(self.count))
            timed("restore", lambda: restore(k))
        for k in parked:
            timed("drop", lambda: drop(k))
        for _ in range(n):
            timed("make_room", make_room)
        return wall, cpu


class GcWatch:
    """Full (generation 2) collections and their pauses: with millions of live index
    objects each one walks them all, which shows up in the p99 of whatever it lands on."""

    def __init__(self) -> None:
        self.pauses: list[float] = []
        self._t0 = 0.0
        gc.callbacks.append(self._cb)

    def _cb(self, phase: str, info: dict[str, int]) -> None:
        if info.get("generation") != 2:
            return
        if phase == "start":
            self._t0 = time.perf_counter()
        else:
            self.pauses.append(time.perf_counter() - self._t0)

    def take(self) -> dict[str, float]:
        out = {"full_gcs": len(self.pauses), "longest_ms": round(max(self.pauses, default=0.0) * 1e3, 1)}
        self.pauses = []
        return out


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def top_sites(snap_before: tracemalloc.Snapshot, n: int) -> list[str]:
    stats = tracemalloc.take_snapshot().compare_to(snap_before, "lineno")
    return [f"{s.size_diff / 1e6:8.1f} MB {s.count_diff:>9} blocks  {s.traceback[0]}" for s in stats[:n]]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="10k,100k,1M", help="comma-separated block counts (k/M suffixes)")
    ap.add_argument("--ops", type=int, default=1000, help="timed operations of each kind per size")
    ap.add_argument("--block-bytes", type=int, default=1024)
    ap.add_argument("--tracemalloc", action="store_true", help="also trace Python allocations (slower)")
    ap.add_argument("--profile-restart", action="store_true", help="cProfile the restart's index rebuild")
    ap.add_argument("--no-restart", action="store_true")
    ap.add_argument("--no-dirty-bounds", action="store_true",
                    help="write_back's dirty bounds off: the stop writes every block (the old behaviour)")
    ap.add_argument("--dir", default=None, help="where LMDB goes (default: a temp dir; the arena goes to /dev/shm)")
    ap.add_argument("--json", default=str(HERE / "results" / "scale.json"))
    ap.add_argument("--arena-blocks", type=int, default=0,
                    help="size the host arena for this many blocks (default: all of them); fewer makes parks spill "
                         "to disk, through demotion")
    ap.add_argument("--restart-child", nargs=3, metavar=("ROOT", "SHM", "CAPACITY_BLOCKS"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.restart_child:
        root, shm, cap = args.restart_child
        cfg = make_config(Path(root), Path(shm), int(cap), args.block_bytes, args.arena_blocks)
        print("RESULT " + json.dumps(restart_child(cfg, args.profile_restart)), flush=True)
        return 0
    sizes = sorted(parse_count(s) for s in args.sizes.split(","))
    rng = random.Random(1)
    root = Path(tempfile.mkdtemp(prefix="kvpark-scale-", dir=args.dir))
    shm = Path(tempfile.mkdtemp(prefix="kvpark-scale-", dir="/dev/shm" if os.path.isdir("/dev/shm") else root))
    result: dict[str, Any] = {
        "block_bytes": args.block_bytes, "slot_size": SLOT, "ops": args.ops, "sizes": {},
        "python": platform.python_version(), "load_before": os.getloadavg(),
    }
    cap = sizes[-1] + args.ops + BATCH
    try:
        b = Bench(make_config(root, shm, cap, args.block_bytes, args.arena_blocks, not args.no_dirty_bounds),
                  args.block_bytes)
        base = rss_anon()
        snap = None
        if args.tracemalloc:
            tracemalloc.start()
            snap = tracemalloc.take_snapshot()
        watch = GcWatch()
        for n in sizes:
            fill_s = b.populate(n)
            meta = (rss_anon() - base) / n
            watch.take()
            row: dict[str, Any] = {"populate_s": round(fill_s, 2), "rss_anon_per_block": round(meta, 1)}
            if snap is not None:
                row["traced_per_block"] = round(tracemalloc.get_traced_memory()[0] / n, 1)
            ru0 = resource.getrusage(resource.RUSAGE_SELF)
            times, cpu = b.ops(args.ops, rng)
            ru1 = resource.getrusage(resource.RUSAGE_SELF)
            row["gc_during_ops"] = watch.take()
            row["preempted_during_ops"] = ru1.ru_nivcsw - ru0.ru_nivcsw  # involuntary context switches
            for op, xs in times.items():
                row[op] = {"p50_us": round(pct(xs, 0.5) * 1e6, 1), "p99_us": round(pct(xs, 0.99) * 1e6, 1),
                           "p99_cpu_us": round(pct(cpu[op], 0.99) * 1e6, 1)}
            with b.engine.catalog.lock:
                assert len(b.engine.catalog) == n
            result["sizes"][n] = row
            print(f"{n:>9} blocks: populate {fill_s:7.1f} s, metadata {meta:7.1f} B/block (RssAnon)"
                  + (f", {row['traced_per_block']:.1f} B/block traced" if snap is not None else "")
                  + f"; full GCs during the ops: {row['gc_during_ops']}", flush=True)
            for op in times:
                print(f"           {op:8s} p50 {row[op]['p50_us']:8.1f} us   p99 {row[op]['p99_us']:9.1f} us"
                      f"   (p99 of its CPU time {row[op]['p99_cpu_us']:8.1f} us)", flush=True)
            print(f"           involuntary context switches during the ops: {row['preempted_during_ops']}",
                  flush=True)
        if snap is not None:
            result["top_sites"] = top_sites(snap, 15)
            print("\n".join(["top allocation sites (growth):", *result["top_sites"]]))
        n = sizes[-1]
        # A daemon that has run a while: write-back has caught up with the dirty bounds
        # (nothing past one), so the stop drains only what they leave memory-only.
        with b.engine.catalog.lock:
            result["dirty_after_ops"] = b.engine.catalog.dirty.sequences
        t0 = time.perf_counter()
        while True:
            with b.engine.catalog.lock:
                dirty = b.engine.catalog.dirty.sequences
                if not b.engine.catalog.dirty.over(time.monotonic()) or time.perf_counter() - t0 > 900:
                    break
            time.sleep(0.2)
        result["writeback_wait_s"] = round(time.perf_counter() - t0, 2)
        result["dirty_at_stop"] = dirty
        if b.engine.catalog.dirty.enabled:
            print(f"{result['dirty_after_ops']} sequence(s) memory-only after the ops; write-back caught up with "
                  f"the dirty bounds {result['writeback_wait_s']:.1f} s later; {dirty} left memory-only", flush=True)
        # The index once quiet: every record nobody holds made a row (the maintenance
        # pass does this within seconds; done here at once), garbage collected. RssAnon
        # keeps what the allocator has not given back; the traced size is what is live.
        t0 = time.perf_counter()
        for _ in range(64):  # each pass looks at every queued id once, up to its budget
            if maintenance.freeze_idle(b.engine) < maintenance.FREEZE_PER_PASS:
                break
        gc.collect()
        with b.engine.catalog.lock:
            rows = len(b.engine.catalog.rows) if b.engine.catalog.rows is not None else 0
        result["settled"] = {"rows": rows, "freeze_s": round(time.perf_counter() - t0, 2),
                             "rss_anon_per_block": round((rss_anon() - base) / n, 1)}
        if snap is not None:
            result["settled"]["traced_per_block"] = round(tracemalloc.get_traced_memory()[0] / n, 1)
        print(f"settled: {rows} of {n} blocks are rows ({result['settled']['freeze_s']:.1f} s to freeze the rest); "
              f"metadata {result['settled']['rss_anon_per_block']:.1f} B/block (RssAnon)"
              + (f", {result['settled']['traced_per_block']:.1f} B/block traced" if snap is not None else ""),
              flush=True)
        if snap is not None:
            result["top_sites_settled"] = top_sites(snap, 12)
            tracemalloc.stop()
            print("\n".join(["top allocation sites (settled):", *result["top_sites_settled"]]))
        t0 = time.perf_counter()
        b.engine.close(flush=not args.no_restart)
        flush_s = time.perf_counter() - t0
        if not args.no_restart:
            # A fresh process, as after a real restart: its RSS growth is the rebuilt index alone.
            cmd = [sys.executable, __file__, "--block-bytes", str(args.block_bytes), "--arena-blocks", str(args.arena_blocks),
                   "--restart-child", str(root), str(shm), str(cap)] + (["--profile-restart"] * args.profile_restart)
            out = subprocess.run(cmd, check=True, capture_output=True, text=True)
            sys.stderr.write(out.stderr)
            child = json.loads(next(l for l in out.stdout.splitlines() if l.startswith("RESULT "))[7:])
            result["restart"] = {"blocks": n, "flush_s": round(flush_s, 2), **child}
            print(f"restart at {n} blocks: flush {flush_s:.1f} s, then in a fresh process: rebuild "
                  f"{child['restart_s']:.2f} s, {child['restart_cpu_s']:.2f} s of CPU ({child['indexed']} indexed, "
                  f"load average {child['load'][0]:.1f}), metadata "
                  f"{child['rss_anon_per_block']:.1f} B/block", flush=True)
            assert child["indexed"] == n, f"restart indexed {child['indexed']} of {n} blocks"
        small, big = sizes[0], sizes[-1]
        if big != small:
            result["p50_ratio_largest_vs_smallest"] = {
                op: round(result["sizes"][big][op]["p50_us"] / result["sizes"][small][op]["p50_us"], 2)
                for op in ("park", "lookup", "restore", "drop", "make_room")}
            print(f"p50 at {big} / p50 at {small}: {result['p50_ratio_largest_vs_smallest']}")
        result["load_after"] = os.getloadavg()
    finally:
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)
    write_json(args.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
