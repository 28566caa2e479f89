"""Load: many client processes park, restore, prefetch and drop under memory pressure.

``tests/daemon/test_load.py`` runs a bounded version; ``bench/load.py`` longer ones and
prints ops/s and p50/p99 latency per call.

How it works:
- One daemon, in the controller's process (so ``Engine.check_invariants()`` can be called
  at the end), with small host and disk tiers: demotions and disk evictions are constant.
  A handler on the ``kvpark.mover`` logger records every sequence the disk tier evicted
  as its only copy (so dropped), with the time.
- ``clients`` processes (``python -m tests.daemon.load client ...``), each with ids of
  its own, so each knows exactly which version of each id it last parked. They start
  together (a barrier) and run for ``seconds``: park (sizes from 1 KiB to a few MiB, each
  a new version, its content derived from id and version), restore (must be bit-exact,
  or ``NotFound`` once evicted), prefetch to host (with and without waiting) and drop.
  Every call has a deadline (``DEADLINE_S``); one that passes it is a hang.
- At the end each client reports its counts, latencies, what it holds, and what it found
  gone. The controller checks: no call passed its deadline, no unexpected error, no
  wrong bytes; every sequence a client holds restores bit-exact, or is gone only because
  the disk evicted it after its last park began; nothing dropped or never parked is
  present; ``stat`` agrees with ``list`` and the engine's invariants hold.

Primitives: ``payload(seq_id, version, size)``, ``LoadResult`` (``table()``), and
``run_load(root, clients, seconds, ...) -> LoadResult``; the client entry point ``main``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import subprocess
import sys
import threading
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[2]
KiB, MiB = 1 << 10, 1 << 20
DEADLINE_S = 60.0  # per call: far above any honest wait on two busy cores
OPS = ("park", "restore", "prefetch", "drop")


def size_of(rng: random.Random, max_bytes: int) -> int:
    """Mixed sizes: mostly small, some medium, a few large."""
    r = rng.random()
    if r < 0.6:
        return rng.randint(KiB, 64 * KiB)
    if r < 0.93:
        return rng.randint(64 * KiB, max(64 * KiB, max_bytes // 4))
    return rng.randint(max_bytes // 2, max_bytes)


def payload(seq_id: str, version: int, size: int) -> list[torch.Tensor]:
    key = zlib.crc32(seq_id.encode())
    g = torch.Generator().manual_seed(key * 1_000_003 + version)
    return [torch.tensor([key, version, size], dtype=torch.int64),
            torch.randint(0, 256, (size,), dtype=torch.uint8, generator=g)]


# ------------------------------------------------------------------ client process


def _client(a: argparse.Namespace) -> int:
    from kvpark.client import Client, KVParkError, NotFound, ResourceExhausted

    root = Path(a.dir)
    rng = random.Random(a.seed * 104_729 + a.client)
    ids = [f"c{a.client}-s{k}" for k in range(a.keys)]
    held: dict[str, tuple[int, int, float]] = {}  # id -> (version, size, when its park began)
    lat: dict[str, list[float]] = {op: [] for op in OPS}
    counts: dict[str, dict[str, int]] = {op: {} for op in OPS}
    gone: list[tuple[str, float]] = []  # (id, when the park of the version found gone began)
    errors: list[str] = []
    version = 0
    c = Client(a.address, timeout=DEADLINE_S, transport=a.transport)
    (root / f"ready{a.client}").write_text("")
    while not (root / "go").exists():
        time.sleep(0.01)
    start = time.monotonic()
    end = start + a.seconds
    while time.monotonic() < end:
        sid = rng.choice(ids)
        op = rng.choices(OPS, weights=(4, 4, 1, 1))[0]
        outcome = "ok"
        t0 = time.perf_counter()
        try:
            if op == "park":
                version += 1
                size = size_of(rng, a.max_bytes)
                began = time.time()
                data = payload(sid, version, size)
                t0 = time.perf_counter()  # the call, not making the payload
                c.park(sid, data, overwrite=True)
                held[sid] = (version, size, began)
            elif op == "restore":
                out = c.restore(sid)
                if sid not in held:
                    errors.append(f"restore {sid}: present, but dropped or never parked")
                else:
                    v, size, _ = held[sid]
                    want = payload(sid, v, size)
                    if len(out) != 2 or not all(torch.equal(x, y) for x, y in zip(out, want)):
                        errors.append(f"restore {sid}: wrong bytes (expected version {v})")
            elif op == "prefetch":
                c.prefetch(sid, tier="host", wait=rng.random() < 0.5)
            else:
                c.drop(sid)
                held.pop(sid, None)
        except NotFound:
            outcome = "not_found"
            if sid in held and op in ("restore", "prefetch"):
                gone.append((sid, held.pop(sid)[2]))
        except ResourceExhausted:
            outcome = "resource_exhausted"  # memory pressure: allowed, nothing stored
        except KVParkError as e:
            outcome = type(e).__name__
            errors.append(f"{op} {sid}: {type(e).__name__}: {e}")
            if op in ("park", "drop"):
                held.pop(sid, None)  # unknown outcome: checked no further
        lat[op].append(time.perf_counter() - t0)
        counts[op][outcome] = counts[op].get(outcome, 0) + 1
    elapsed = time.monotonic() - start  # the last call may run past ``end``
    c.close()
    result = {"elapsed": elapsed, "lat": lat, "counts": counts, "held": {k: list(v) for k, v in held.items()}, "gone": gone,
              "errors": errors, "ids": ids}
    (root / f"result{a.client}.json").write_text(json.dumps(result))
    return 0


# ------------------------------------------------------------------ controller


def pct(xs: list[float], p: float) -> float:
    if not xs:
        return float("nan")
    s = sorted(xs)
    return s[min(len(s) - 1, int(p / 100 * len(s)))]


@dataclass
class LoadResult:
    seconds: float = 0.0
    clients: int = 0
    lat: dict[str, list[float]] = field(default_factory=lambda: {op: [] for op in OPS})
    counts: dict[str, dict[str, int]] = field(default_factory=lambda: {op: {} for op in OPS})
    verified: int = 0  # held sequences restored bit-exact at the end
    evicted: int = 0  # held sequences gone at the end or during the run, each matched to a disk eviction
    problems: list[str] = field(default_factory=list)

    def table(self) -> str:
        lines = [f"{self.clients} clients, {self.seconds:.1f} s",
                 f"{'call':<9}{'calls':>8}{'ops/s':>9}{'p50 ms':>9}{'p99 ms':>9}  outcomes"]
        for op in OPS:
            xs = self.lat[op]
            outs = ", ".join(f"{k} {v}" for k, v in sorted(self.counts[op].items()))
            lines.append(f"{op:<9}{len(xs):>8}{len(xs) / self.seconds if self.seconds else 0:>9.1f}"
                         f"{pct(xs, 50) * 1e3:>9.2f}{pct(xs, 99) * 1e3:>9.2f}  {outs}")
        total = sum(len(v) for v in self.lat.values())
        lines.append(f"{'all':<9}{total:>8}{total / self.seconds if self.seconds else 0:>9.1f}")
        lines.append(f"end: {self.verified} held sequence(s) restored bit-exact, {self.evicted} evicted by the disk "
                     f"tier (each matched to its eviction), {len(self.problems)} problem(s)")
        return "\n".join(lines)


class _Evictions(logging.Handler):
    """Records ``evicted 'ID' from disk (its only copy: dropped)`` with its time."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.seen_lock = threading.Lock()  # not `lock`: logging.Handler holds that one around emit()
        self.dropped: dict[str, list[float]] = {}

    def emit(self, record: logging.LogRecord) -> None:
        if record.msg == "evicted %r from disk%s" and record.args and record.args[1]:  # type: ignore[index]
            with self.seen_lock:
                self.dropped.setdefault(str(record.args[0]), []).append(record.created)  # type: ignore[index]


def run_load(root: Path, *, clients: int = 16, seconds: float = 15.0, keys: int = 6, max_bytes: int = 2 * MiB,
             host: str = "8MiB", disk: str = "48MiB", seed: int = 0, overrides: dict[str, Any] | None = None,
             start_timeout: float = 300.0) -> LoadResult:
    from kvpark.client import Client, NotFound
    from kvpark.daemon.config import load
    from kvpark.daemon.server import Daemon

    root.mkdir(parents=True, exist_ok=True)
    (root / "shm").mkdir(exist_ok=True)
    cfg = {
        "server.listen": "127.0.0.1:0", "server.grace_s": 1.0, "metrics.listen": "",
        "tiers.device.enabled": "false", "tiers.host.capacity": host, "tiers.host.shm_dir": str(root / "shm"),
        "tiers.disk.path": str(root / "disk"), "tiers.disk.capacity": disk,
        **(overrides or {}),
    }
    mover_log = logging.getLogger("kvpark.mover")
    ev = _Evictions()
    old_level = mover_log.level
    mover_log.addHandler(ev)
    mover_log.setLevel(logging.DEBUG)
    d = Daemon(load(env={}, overrides=cfg)).start()
    res = LoadResult(clients=clients)
    procs: list[subprocess.Popen] = []
    try:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
        env = {k: v for k, v in env.items() if not k.startswith("KVPARK")}
        for i in range(clients):
            cmd = [sys.executable, "-m", "tests.daemon.load", "client", "--dir", str(root), "--client", str(i),
                   "--seed", str(seed), "--keys", str(keys), "--max-bytes", str(max_bytes),
                   "--seconds", str(seconds), "--address", d.address,
                   "--transport", ("auto", "inline")[i % 2]]
            procs.append(subprocess.Popen(cmd, cwd=REPO, env=env))
        # Barrier: the clock starts when every client has connected (imports take a while).
        deadline = time.monotonic() + start_timeout
        while not all((root / f"ready{i}").exists() for i in range(clients)):
            if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
                raise RuntimeError("load clients did not start")
            time.sleep(0.05)
        (root / "go").write_text("")
        for p in procs:
            # Each client stops starting calls after ``seconds``; a call in flight then has
            # its own deadline. Past both, something hangs.
            rc = p.wait(timeout=seconds + 2 * DEADLINE_S)
            if rc != 0:
                res.problems.append(f"client exited {rc}")
        results = [json.loads((root / f"result{i}.json").read_text()) for i in range(clients)]
        res.seconds = max(r["elapsed"] for r in results)  # the window the calls ran in
        for r in results:
            for op in OPS:
                res.lat[op] += r["lat"][op]
                for k, v in r["counts"][op].items():
                    res.counts[op][k] = res.counts[op].get(k, 0) + v
            res.problems += r["errors"]
        # Timeouts are in the clients' errors already (DeadlineExceeded): none may occur.

        def evicted_after(sid: str, began: float) -> bool:
            with ev.seen_lock:
                return any(t >= began for t in ev.dropped.get(sid, []))

        with Client(d.address, timeout=DEADLINE_S) as c:
            infos = {i.seq_id: i for i in c.list()}
            st = c.stat()
            for r in results:
                for sid, began in r["gone"]:
                    if evicted_after(sid, began):
                        res.evicted += 1
                    else:
                        res.problems.append(f"{sid}: found gone during the run, never evicted")
                for sid in r["ids"]:
                    if sid not in r["held"]:
                        if sid in infos:
                            res.problems.append(f"{sid}: dropped (or never parked), yet present")
                        continue
                    v, size, began = r["held"][sid]
                    try:
                        out = c.restore(sid)
                    except NotFound:
                        if evicted_after(sid, began):
                            res.evicted += 1
                        else:
                            res.problems.append(f"{sid}: acknowledged version {v} is gone, never evicted")
                        continue
                    if all(torch.equal(x, y) for x, y in zip(out, payload(sid, v, size))) and len(out) == 2:
                        res.verified += 1
                    else:
                        res.problems.append(f"{sid}: wrong bytes at the end (expected version {v})")
            known = {sid for r in results for sid in r["ids"]}
            res.problems += [f"{sid}: present, no client parked it" for sid in set(infos) - known]
            if st.sequences != len(infos):
                res.problems.append(f"stat.sequences {st.sequences} != {len(infos)} listed")
        assert d.engine is not None
        try:
            d.engine.check_invariants()
        except AssertionError as e:
            res.problems.append(f"invariants: {e}")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        d.stop(0.5)
        mover_log.removeHandler(ev)
        mover_log.setLevel(old_level)
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tests.daemon.load")
    sub = ap.add_subparsers(dest="cmd", required=True)
    w = sub.add_parser("client")
    w.add_argument("--dir", required=True)
    w.add_argument("--client", type=int, required=True)
    w.add_argument("--seed", type=int, default=0)
    w.add_argument("--keys", type=int, default=6)
    w.add_argument("--max-bytes", type=int, default=2 * MiB)
    w.add_argument("--seconds", type=float, default=10.0)
    w.add_argument("--address", required=True)
    w.add_argument("--transport", default="auto")
    return _client(ap.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
