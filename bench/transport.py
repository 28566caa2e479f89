#!/usr/bin/env python
"""Transport benchmark: kvpark shm / inline against memcpy, a bare gRPC stream and Redis.

Measured in one run, on (a) one 256 MiB uint8 tensor and (b) 256 tensors of 1 MiB:

- ``copy_ limit``: single-thread ``torch`` ``copy_`` into preallocated tensors of the same
  sizes (``torch.set_num_threads(1)``); the ceiling for the shm transport. It is measured
  at the start and again at the end (first runs on a cold machine can read ~15% low) and
  the row keeps both passes' samples. An extra info row gives ``copy_`` at torch's
  default thread count (measured once, at the start).
- ``kvpark shm`` / ``kvpark inline``: ``Client.park`` and ``Client.restore(into=...)``
  against a daemon started in this process (``--servers process``: a ``kvpark serve``
  subprocess instead). ``kvpark inline`` moves its bytes on the daemon's data channel;
  ``kvpark inline over gRPC`` is the same client with the channel unused (the fallback).
- ``bare socket``: one loopback TCP connection served by a thread in this script,
  ``sendmsg`` of memoryviews one way and ``recv_into`` preallocated memory the other:
  the ceiling of the data channel.
- ``lmcache_server``: LMCache's simple CPU server, driven with its own wire messages by
  ``bench/lmcache_peer.py`` under the interpreter given by ``--lmcache-python`` (default
  ``$KVPARK_LMCACHE_PYTHON``; LMCache pins its own torch, so it lives in a venv of its
  own). Skipped, with a note, when not given or not importable.
- ``bare gRPC``: a tiny gRPC server in this script (generic handler, identity
  serializers, same channel options as kvpark): a stream_unary upload and a
  unary_stream download of the same bytes in 1 MiB messages built from memoryviews
  (``bytes(view[o:o + 1 MiB])``). The receiving side copies every message into a
  preallocated buffer, as kvpark does, so this is the ceiling for the inline transport.
- ``redis``: Redis 7 through redis-py + hiredis, SET / GET of the same bytes (one key
  for case a, one key per tensor in one pipeline for case b). The script starts
  ``redis-server`` on a free 127.0.0.1 port with persistence off and stops it at the
  end; without ``redis-server`` on PATH those rows are skipped. The redis-py client reads
  its socket 1 MiB at a time (``socket_read_size``; the 64 KiB default is slower on large
  values). "GET + copy into dst" also lands the bytes in the preallocated tensors, like
  ``restore(into=...)``; the target ratio uses plain GET, the stricter baseline.
- control plane: p50 / p99 latency of a 1-block park (4 KiB tensor, overwrite=True) and
  restore(into=...) over shm and inline, against a 1-byte unary echo on the bare server
  (the target's baseline). Info rows: the bare server's stream_unary / unary_stream with
  the message pattern of a 1-block inline park (header, chunk, commit) and restore.

Every throughput row is repeated ``--reps`` times after ``--warmup`` untimed runs; the
table shows the best run and the median in parentheses, ratios use the best. Sequences
are dropped (Redis keys deleted) between repetitions, outside the timed region, so the
host tier never spills. GB/s means 1e9 bytes per second.

Usage: ``python bench/transport.py [--quick] [--json PATH] [--reps N] [--servers process]``.
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Sequence

import grpc
import numpy as np
import torch

from _common import write_json  # bench/ is on sys.path when a script here runs

from kvpark.client.benchkit import (CHUNK, MiB, REDIS_READ_SIZE, BareClient, BareServicer, BareSocket, RedisServer,
                                    cpu_model, latencies, pct, same, start_bare_server, timed, touch)

HERE = Path(__file__).resolve().parent
CP_BLOCK = 4096  # the control-plane rows' 1-block tensor
CP_HEADER = b"h" * 64  # about the size of a 1-tensor ParkHeader / RestoreHeader message
CP_COMMIT = b"c" * 8

TARGETS = {
    "shm_vs_copy": 0.9,  # shm park and restore >= 0.9x the single-thread copy_ limit
    "inline_vs_socket": 0.8,  # inline (data channel) park/restore >= 0.8x a bare loopback socket
    "inline_vs_lmcache": 1.5,  # inline park/restore >= 1.5x LMCache's lmcache_server
    "inline_vs_redis": 1.5,  # inline park/restore >= 1.5x Redis SET/GET
    "p50_vs_unary": 2.0,  # 1-block park/restore p50 <= 2x a bare gRPC unary round trip
}


def serve_bare_forever(size_a: int, n_b: int) -> None:
    """``--serve-bare``: the bare server as a separate process (for ``--servers process``)."""
    s = BareServicer(max(size_a, n_b * MiB))
    a = np.random.default_rng(1).integers(0, 256, size_a, dtype=np.uint8)
    b = [np.random.default_rng(2 + i).integers(0, 256, MiB, dtype=np.uint8) for i in range(n_b)]
    one = np.zeros(CP_BLOCK, dtype=np.uint8)
    s.sources = {"a": [memoryview(a)], "b": [memoryview(x) for x in b],
                 "cp": [memoryview(CP_HEADER), memoryview(one)]}
    server, address = start_bare_server(s)
    print(f"BARE {address}", flush=True)
    try:
        sys.stdin.read()  # the parent closes our stdin to stop us
    finally:
        server.stop(0)


# --------------------------------------------------------------------------- servers


class Servers:
    """The kvpark daemon and the bare gRPC server, in this process or as subprocesses."""

    def __init__(self, mode: str, size_a: int, n_b: int) -> None:
        self.mode = mode
        self.tmp = tempfile.mkdtemp(prefix="kvpark-bench-")
        shm_root = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else self.tmp
        self.shm_dir = tempfile.mkdtemp(prefix="kvpark-bench-shm-", dir=shm_root)
        self.daemon: Any = None
        self.bare_server: grpc.Server | None = None
        self.bare: BareServicer | None = None
        self.procs: list[subprocess.Popen] = []
        overrides = {
            "server.listen": "127.0.0.1:0",
            "tiers.host.capacity": "1GiB",
            "tiers.host.shm_dir": self.shm_dir,
            "tiers.disk.path": os.path.join(self.tmp, "disk"),
            "tiers.disk.capacity": "4GiB",
            "policy.flush_on_shutdown": "false",  # everything is dropped; nothing to flush
            # Host transports only: no device pool (on a GPU machine "auto" would add one
            # and inline parks / restores could land there).
            "tiers.device.enabled": "false",
            "metrics.listen": "",  # a bench daemon next to a running one must not fight over the port
        }
        if mode == "inprocess":
            from kvpark.daemon.config import load
            from kvpark.daemon.server import Daemon

            cfg = load(env={}, overrides=overrides)
            self.daemon = Daemon(cfg).start()
            self.kvpark_address = self.daemon.address
            self.bare = BareServicer(max(size_a, n_b * MiB))
            self.bare_server, self.bare_address = start_bare_server(self.bare)
        else:
            # Info level: the daemon logs "listening on ADDRESS" there.
            cmd = [sys.executable, "-m", "kvpark.daemon.cli", "serve", "--log-level", "info"]
            for k, v in overrides.items():
                cmd += ["--set", f"{k}={v}"]
            env = {k: v for k, v in os.environ.items() if not k.startswith("KVPARK")}
            p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
            self.procs.append(p)
            self.kvpark_address = self._wait_line(p, p.stderr, r"listening on (\S+)")
            q = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--serve-bare",
                                  "--size-a", str(size_a), "--n-b", str(n_b)],
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            self.procs.append(q)
            self.bare_address = self._wait_line(q, q.stdout, r"BARE (\S+)")

    @staticmethod
    def _wait_line(p: subprocess.Popen, stream: Any, pattern: str, timeout: float = 120.0) -> str:
        deadline = time.monotonic() + timeout
        seen = []
        while time.monotonic() < deadline:
            line = stream.readline()
            if not line:
                break
            seen.append(line)
            m = re.search(pattern, line)
            if m:
                threading.Thread(target=lambda: [None for _ in stream], daemon=True).start()  # keep draining
                return m.group(1)
        p.kill()
        raise RuntimeError("server did not start:\n" + "".join(seen))

    def close(self) -> None:
        if self.daemon is not None:
            self.daemon.stop(1.0)
        if self.bare_server is not None:
            self.bare_server.stop(0)
        for p in self.procs:
            if p.stdin is not None:
                p.stdin.close()
            else:
                p.terminate()
        for p in self.procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        shutil.rmtree(self.shm_dir, ignore_errors=True)
        shutil.rmtree(self.tmp, ignore_errors=True)


# --------------------------------------------------------------------------- main


def lmcache_rows(args: argparse.Namespace, n: int, record: Any, checks: list[str]) -> str:
    """Case b against ``lmcache_server`` (1 MiB chunks), run by bench/lmcache_peer.py under
    the LMCache venv's python; returns a note when the rows are skipped."""
    if not args.lmcache_python:
        return "lmcache_server rows skipped (no --lmcache-python / $KVPARK_LMCACHE_PYTHON)"
    try:
        p = subprocess.run([args.lmcache_python, str(HERE / "lmcache_peer.py"), "--n", str(n), "--reps",
                            str(args.reps), "--warmup", str(args.warmup)], capture_output=True, text=True,
                           timeout=900)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"lmcache_server rows skipped ({e})"
    if p.returncode != 0:
        return f"lmcache_server rows skipped (exit {p.returncode}: {p.stderr.strip().splitlines()[-1:]})"
    import json

    got = json.loads(p.stdout.strip().splitlines()[-1])
    record("lmcache_server put", "b", got["put_s"], note=f"lmcache {got['version']}")
    record("lmcache_server get (into)", "b", got["get_s"], note=f"lmcache {got['version']}")
    if not got.get("bytes_ok"):
        checks.append("lmcache_server: restored bytes differ")
    print("  done: lmcache_server", flush=True)
    return ""


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="64 MiB / 64 x 1 MiB instead of 256 MiB / 256 x 1 MiB")
    ap.add_argument("--json", default=str(HERE / "results" / "transport.json"), help="where to write the JSON")
    ap.add_argument("--reps", type=int, default=5, help="timed repetitions per row (default 5)")
    ap.add_argument("--warmup", type=int, default=1, help="untimed runs before each row (default 1)")
    ap.add_argument("--lat-iters", type=int, default=300, help="iterations per latency row (default 300)")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch intra-op threads for every row, kvpark's client copies included (default 1)")
    ap.add_argument("--servers", choices=("inprocess", "process"), default="inprocess",
                    help="run the kvpark daemon and the bare gRPC server in this process (default) or as "
                         "subprocesses")
    ap.add_argument("--no-redis", action="store_true", help="skip the Redis rows")
    ap.add_argument("--lmcache-python", default=os.environ.get("KVPARK_LMCACHE_PYTHON", ""),
                    help="python of a venv with LMCache installed (default $KVPARK_LMCACHE_PYTHON); none: skip")
    ap.add_argument("--serve-bare", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--size-a", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--n-b", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)

    if args.serve_bare:
        serve_bare_forever(args.size_a, args.n_b)
        return 0

    from kvpark.client import Client

    size_a = (64 if args.quick else 256) * MiB
    n_b = 64 if args.quick else 256
    default_threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)

    gen = torch.Generator().manual_seed(0)
    src_a = [torch.randint(0, 256, (size_a,), dtype=torch.uint8, generator=gen)]
    src_b = [torch.randint(0, 256, (MiB,), dtype=torch.uint8, generator=gen) for _ in range(n_b)]
    dst_a = [torch.empty_like(t) for t in src_a]
    dst_b = [torch.empty_like(t) for t in src_b]
    touch(dst_a + dst_b)
    cases = {
        "a": dict(label=f"{size_a // MiB} MiB x1", src=src_a, dst=dst_a, nbytes=size_a),
        "b": dict(label=f"1 MiB x{n_b}", src=src_b, dst=dst_b, nbytes=n_b * MiB),
    }

    rows: list[dict[str, Any]] = []  # throughput rows
    checks: list[str] = []

    def record(name: str, case: str, times: list[float], note: str = "") -> None:
        nb = cases[case]["nbytes"]
        row = dict(row=name, case=case, nbytes=nb, times_s=times, note=note)
        for r_ in rows:  # a second pass of the same row (the copy_ limit) adds its samples
            if r_["row"] == name and r_["case"] == case:
                row = r_
                row["times_s"] = r_["times_s"] + times
                break
        else:
            rows.append(row)
        row["best_gbps"] = nb / min(row["times_s"]) / 1e9
        row["median_gbps"] = nb / statistics.median(row["times_s"]) / 1e9

    def row_copy(threads: int, name: str) -> None:
        torch.set_num_threads(threads)
        try:
            for case, c in cases.items():
                pairs = list(zip(c["dst"], c["src"]))

                def run() -> None:
                    for d, s in pairs:
                        d.copy_(s)

                record(name, case, timed(run, args.reps, args.warmup))
        finally:
            torch.set_num_threads(args.threads)

    print(f"kvpark transport benchmark: case a = {cases['a']['label']}, case b = {cases['b']['label']}; "
          f"reps={args.reps} warmup={args.warmup}; torch threads={args.threads}; servers={args.servers}",
          flush=True)

    row_copy(1, "copy_ limit (1 thread)")
    if default_threads != 1:
        row_copy(default_threads, f"copy_ ({default_threads} threads, info)")

    servers = Servers(args.servers, size_a, n_b)
    redis_srv = None
    lat: list[dict[str, Any]] = []
    try:
        # ---------------------------------------------------------------- kvpark
        for transport in ("shm", "inline"):
            with Client(servers.kvpark_address, transport=transport) as c:
                assert c.transport == transport
                for case, cs in cases.items():
                    sid = f"bench-{transport}-{case}"
                    src, dst = cs["src"], cs["dst"]
                    record(f"kvpark {transport} park", case,
                           timed(lambda: c.park(sid, src), args.reps, args.warmup, after=lambda: c.drop(sid)))
                    c.park(sid, src)
                    touch(dst)
                    t = timed(lambda: c.restore(sid, into=dst), args.reps, args.warmup)
                    record(f"kvpark {transport} restore(into)", case, t)
                    if not same(src, dst):
                        checks.append(f"kvpark {transport} case {case}: restored bytes differ")
                    c.drop(sid)
                    print(f"  done: kvpark {transport} case {case}", flush=True)
                if transport == "inline":
                    c._transport.channel = None  # type: ignore[attr-defined]  # the gRPC fallback
                    for case, cs in cases.items():
                        sid = f"bench-grpc-{case}"
                        src, dst = cs["src"], cs["dst"]
                        record("kvpark inline over gRPC park", case,
                               timed(lambda: c.park(sid, src), args.reps, args.warmup, after=lambda: c.drop(sid)))
                        c.park(sid, src)
                        record("kvpark inline over gRPC restore(into)", case,
                               timed(lambda: c.restore(sid, into=dst), args.reps, args.warmup))
                        c.drop(sid)

        # ---------------------------------------------------------------- bare socket
        bs = BareSocket(max(size_a, n_b * MiB))
        try:
            for case, cs in cases.items():
                src, dst = cs["src"], cs["dst"]
                views = [memoryview(t.numpy()) for t in src]
                record("bare socket upload", case, timed(lambda: bs.upload(views), args.reps, args.warmup))
                if not np.array_equal(bs.sink[: cs["nbytes"]], np.concatenate([t.numpy() for t in src])):
                    checks.append(f"bare socket upload case {case}: bytes differ")
                bs.sources = views
                touch(dst)
                dviews = [memoryview(t.numpy()) for t in dst]
                record("bare socket download", case, timed(lambda: bs.download(dviews), args.reps, args.warmup))
                if not same(src, dst):
                    checks.append(f"bare socket download case {case}: bytes differ")
            print("  done: bare socket", flush=True)
        finally:
            bs.close()

        # ---------------------------------------------------------------- bare gRPC
        bc = BareClient(servers.bare_address)
        try:
            bc.echo(b"x")
            for case, cs in cases.items():
                src, dst = cs["src"], cs["dst"]
                views = [memoryview(t.numpy()) for t in src]
                dviews = [memoryview(t.numpy()) for t in dst]
                record("bare gRPC upload (stream)", case, timed(lambda: bc.upload(views), args.reps, args.warmup))
                if servers.bare is not None:
                    servers.bare.sources[case] = views
                    if servers.bare.received != cs["nbytes"] or not np.array_equal(
                            servers.bare.sink[: cs["nbytes"]], np.concatenate([t.numpy() for t in src])):
                        checks.append(f"bare upload case {case}: sink bytes differ")
                touch(dst)
                record("bare gRPC download (stream)", case,
                       timed(lambda: bc.download(case, dviews), args.reps, args.warmup))
                if servers.bare is not None and not same(src, dst):
                    checks.append(f"bare download case {case}: bytes differ")
                print(f"  done: bare gRPC case {case}", flush=True)

            # ------------------------------------------------------------ control plane
            one = torch.randint(0, 256, (CP_BLOCK,), dtype=torch.uint8, generator=gen)
            one_dst = torch.zeros_like(one)
            lat.append(dict(row="bare gRPC unary echo (1 B)",
                            us=latencies(lambda: bc.echo(b"x"), args.lat_iters, 30)))
            # The same message pattern as a 1-block inline park (header, 4 KiB chunk, commit)
            # and restore (header, 4 KiB chunk) on the bare streams: what gRPC streaming
            # itself costs before kvpark does anything.
            cp_up = [memoryview(CP_HEADER), memoryview(one.numpy()), memoryview(CP_COMMIT)]
            cp_down = [memoryview(bytearray(len(CP_HEADER))), memoryview(one_dst.numpy())]
            if servers.bare is not None:
                servers.bare.sources["cp"] = [memoryview(CP_HEADER), memoryview(one.numpy())]
            lat.append(dict(row="bare gRPC stream_unary (3 msgs, 4 KiB)",
                            us=latencies(lambda: bc.upload(cp_up), args.lat_iters, 30)))
            lat.append(dict(row="bare gRPC unary_stream (2 msgs, 4 KiB)",
                            us=latencies(lambda: bc.download("cp", cp_down), args.lat_iters, 30)))
            for transport in ("shm", "inline"):
                with Client(servers.kvpark_address, transport=transport) as c:
                    sid = f"bench-cp-{transport}"
                    lat.append(dict(row=f"kvpark {transport} park 1 block (4 KiB)",
                                    us=latencies(lambda: c.park(sid, [one], overwrite=True), args.lat_iters, 30)))
                    lat.append(dict(row=f"kvpark {transport} restore 1 block (4 KiB)",
                                    us=latencies(lambda: c.restore(sid, into=[one_dst]), args.lat_iters, 30)))
                    if not torch.equal(one, one_dst):
                        checks.append(f"kvpark {transport} 1-block restore differs")
                    c.drop(sid)
            lat.append(dict(row="bare gRPC unary echo (1 B), again",
                            us=latencies(lambda: bc.echo(b"x"), args.lat_iters, 30)))
            print("  done: control plane", flush=True)
        finally:
            bc.close()
    finally:
        servers.close()

    # The copy_ limit again, now that the machine is warm: the limit row holds both passes'
    # samples, so the shm ratios are taken against the better of the two.
    row_copy(1, "copy_ limit (1 thread)")

    # -------------------------------------------------------------------- redis
    redis_note = ""
    if args.no_redis:
        redis_note = "Redis rows skipped (--no-redis)"
    else:
        redis_srv = RedisServer()
        if not redis_srv.ok:
            redis_note = redis_srv.skip_reason
            print(f"NOTE: {redis_note}", flush=True)
        else:
            try:
                r = redis_srv.client
                for case, cs in cases.items():
                    src, dst = cs["src"], cs["dst"]
                    keys = [f"bench:{case}:{i}" for i in range(len(src))]
                    views = [memoryview(t.numpy()) for t in src]
                    dnps = [t.numpy() for t in dst]

                    def set_all() -> None:
                        if len(keys) == 1:
                            r.set(keys[0], views[0])
                        else:
                            p = r.pipeline(transaction=False)
                            for k, v in zip(keys, views):
                                p.set(k, v)
                            p.execute()

                    def get_all() -> list[bytes]:
                        if len(keys) == 1:
                            return [r.get(keys[0])]
                        p = r.pipeline(transaction=False)
                        for k in keys:
                            p.get(k)
                        return p.execute()

                    def get_into() -> None:
                        for d, b in zip(dnps, get_all()):
                            d[:] = np.frombuffer(b, dtype=np.uint8)

                    record("redis SET", case, timed(set_all, args.reps, args.warmup, after=lambda: r.delete(*keys)))
                    set_all()
                    record("redis GET", case, timed(get_all, args.reps, args.warmup))
                    touch(dst)
                    record("redis GET + copy into dst", case, timed(get_into, args.reps, args.warmup))
                    if not same(src, dst):
                        checks.append(f"redis case {case}: bytes differ")
                    r.delete(*keys)
                    print(f"  done: redis case {case}", flush=True)
            finally:
                redis_srv.close()

    # -------------------------------------------------------------------- LMCache
    lmcache_note = lmcache_rows(args, cases["b"]["nbytes"] // MiB, record, checks)

    # -------------------------------------------------------------------- report
    def best(name: str, case: str) -> float | None:
        for r_ in rows:
            if r_["row"] == name and r_["case"] == case:
                return r_["best_gbps"]
        return None

    def p50(name: str) -> float | None:
        for l_ in lat:
            if l_["row"] == name:
                return pct(l_["us"], 50)
        return None

    ratios: list[dict[str, Any]] = []

    def ratio(label: str, num: float | None, den: float | None, target: float | None, higher_is_better: bool,
              case: str = "") -> None:
        if num is None or den is None or den == 0:
            value, verdict = None, "n/a"
        else:
            value = num / den
            if target is None:
                verdict = "info"
            else:
                verdict = "MET" if (value >= target if higher_is_better else value <= target) else "MISSED"
        ratios.append(dict(ratio=label, case=case, value=value, target=target,
                           target_op=">=" if higher_is_better else "<=", verdict=verdict))

    lim = "copy_ limit (1 thread)"
    for case in cases:
        for op in ("park", "restore(into)"):
            ratio(f"shm {op} / copy_ limit", best(f"kvpark shm {op}", case), best(lim, case),
                  TARGETS["shm_vs_copy"], True, case)
        ratio("inline park / redis SET", best("kvpark inline park", case), best("redis SET", case),
              TARGETS["inline_vs_redis"], True, case)
        ratio("inline restore(into) / redis GET", best("kvpark inline restore(into)", case), best("redis GET", case),
              TARGETS["inline_vs_redis"], True, case)
        ratio("inline restore(into) / redis GET+copy", best("kvpark inline restore(into)", case),
              best("redis GET + copy into dst", case), None, True, case)
        ratio("inline park / bare socket upload", best("kvpark inline park", case),
              best("bare socket upload", case), TARGETS["inline_vs_socket"], True, case)
        ratio("inline restore(into) / bare socket download", best("kvpark inline restore(into)", case),
              best("bare socket download", case), TARGETS["inline_vs_socket"], True, case)
        ratio("inline park / lmcache_server put", best("kvpark inline park", case),
              best("lmcache_server put", case), TARGETS["inline_vs_lmcache"], True, case)
        ratio("inline restore(into) / lmcache_server get", best("kvpark inline restore(into)", case),
              best("lmcache_server get (into)", case), TARGETS["inline_vs_lmcache"], True, case)
        ratio("inline over gRPC park / bare gRPC upload", best("kvpark inline over gRPC park", case),
              best("bare gRPC upload (stream)", case), None, True, case)
        ratio("inline park / bare gRPC upload", best("kvpark inline park", case),
              best("bare gRPC upload (stream)", case), None, True, case)
        ratio("inline restore(into) / bare gRPC download", best("kvpark inline restore(into)", case),
              best("bare gRPC download (stream)", case), None, True, case)
    unary = p50("bare gRPC unary echo (1 B)")
    for transport in ("shm", "inline"):
        for op in ("park", "restore"):
            ratio(f"{transport} {op} 1-block p50 / bare unary p50", p50(f"kvpark {transport} {op} 1 block (4 KiB)"),
                  unary, TARGETS["p50_vs_unary"], False)
    ratio("inline park 1-block p50 / bare stream_unary p50", p50("kvpark inline park 1 block (4 KiB)"),
          p50("bare gRPC stream_unary (3 msgs, 4 KiB)"), None, False)
    ratio("inline restore 1-block p50 / bare unary_stream p50", p50("kvpark inline restore 1 block (4 KiB)"),
          p50("bare gRPC unary_stream (2 msgs, 4 KiB)"), None, False)

    out: list[str] = []
    w = 38
    out.append("")
    out.append(f"Throughput, GB/s (1e9 B/s): best of {args.reps} (median in parentheses); torch threads = "
               f"{args.threads} unless the row says otherwise; servers {args.servers}")
    out.append(f"(copy_ limit: {2 * args.reps} samples, measured before and after the other rows)")
    out.append(f"{'row':<{w}}{cases['a']['label']:>20}{cases['b']['label']:>20}")
    names: list[str] = []
    for r_ in rows:
        if r_["row"] not in names:
            names.append(r_["row"])
    for name in names:
        cells = []
        for case in cases:
            m = [r_ for r_ in rows if r_["row"] == name and r_["case"] == case]
            cells.append(f"{m[0]['best_gbps']:7.2f} ({m[0]['median_gbps']:6.2f})" if m else "-")
        out.append(f"{name:<{w}}{cells[0]:>20}{cells[1]:>20}")
    for note in (redis_note, lmcache_note):
        if note:
            out.append(f"({note})")
    out.append("")
    out.append(f"Control-plane latency, microseconds ({args.lat_iters} iterations after 30 warm-up)")
    out.append(f"{'row':<{w}}{'p50':>10}{'p99':>10}{'mean':>10}")
    for l_ in lat:
        out.append(f"{l_['row']:<{w}}{pct(l_['us'], 50):10.1f}{pct(l_['us'], 99):10.1f}"
                   f"{statistics.fmean(l_['us']):10.1f}")
    out.append("")
    out.append("Ratios (best-of-N throughput; p50 latency) and targets")
    out.append(f"{'ratio':<52}{'case':>6}{'value':>9}{'target':>10}  verdict")
    for r_ in ratios:
        v = "-" if r_["value"] is None else f"{r_['value']:.3f}"
        t = "" if r_["target"] is None else f"{r_['target_op']} {r_['target']:g}"
        out.append(f"{r_['ratio']:<52}{r_['case']:>6}{v:>9}{t:>10}  {r_['verdict']}")
    out.append("")
    out.append("Targets: shm park and restore >= 0.9x the single-thread copy_ limit; inline park/restore >= 0.8x "
               "a bare loopback socket and >= 1.5x LMCache's lmcache_server (1 MiB chunks; case b) and >= 1.5x "
               "Redis SET/GET; 1-block park/restore p50 <= 2x a bare gRPC unary round trip.")
    if checks:
        out.append("CORRECTNESS PROBLEMS: " + "; ".join(checks))
    print("\n".join(out), flush=True)

    result = dict(
        meta=dict(
            cpu=cpu_model(), cpus=os.cpu_count(), python=platform.python_version(), torch=torch.__version__,
            grpc=grpc.__version__, redis_server=redis_srv.version if redis_srv is not None else "",
            redis_hiredis_parser=redis_srv.hiredis if redis_srv is not None else False,
            torch_threads=args.threads, torch_default_threads=default_threads, servers=args.servers,
            reps=args.reps, warmup=args.warmup, statistic="best of reps (median also given)",
            gb="1e9 bytes", case_a=cases["a"]["label"], case_b=cases["b"]["label"], chunk=CHUNK,
            quick=args.quick, redis_note=redis_note, lmcache_note=lmcache_note, redis_socket_read_size=REDIS_READ_SIZE, timestamp=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        ),
        throughput=rows,
        latency=[dict(row=l_["row"], p50_us=pct(l_["us"], 50), p99_us=pct(l_["us"], 99),
                      mean_us=statistics.fmean(l_["us"]), iters=len(l_["us"])) for l_ in lat],
        ratios=ratios,
        targets=TARGETS,
        checks=checks,
    )
    write_json(args.json, result)
    return 1 if checks else 0


if __name__ == "__main__":
    sys.exit(main())
