"""Kill -9 torture: client processes park, overwrite and drop while the daemon is SIGKILLed.

``tests/daemon/test_torture.py`` runs a bounded version; ``bench/torture.py`` long ones.
Both drive ``Torture`` and print its ``Tally`` as ``kills, acked, verified, lost, corrupt,
phantom``.

How it works:
- A ``kvpark serve`` subprocess on a unix socket (the same address after every restart)
  with ``policy.write = "write_through"`` over one data directory.
- ``workers`` client processes (``python -m tests.daemon.torture worker ...``), each with
  ids of its own, park (always ``overwrite=True``, a new version each time; half of the
  versions start with one of the worker's shared prefix blocks, created in the same
  commit when missing) and drop at random. A worker appends to its log *after* a call returns: ``ack park ID V``,
  ``ack drop ID``; a call that failed with a typed refusal from a live daemon is
  ``failed ...`` (the old state stands); one cut off by the kill is ``unknown ...`` (old or
  new state, never a mix). Then the worker pauses until the next round.
- The content of version ``V`` of ``ID`` is derived from ``(ID, V)`` (``payload``) and
  carries ``V`` in its first tensor, so any restored sequence can be checked bit for bit.
- Each round: resume the workers, SIGKILL the daemon after a random time, wait until
  every worker has paused, look into the dead daemon's LMDB for block records that no
  manifest owns (a partly visible write), restart, check the accounting (``stat`` vs the
  sum of ``list``), then restore every id and compare with what the logs allow.

Counts (``Tally``): ``acked`` acknowledged operations; ``verified`` restores that were
bit-exact and a state the logs allow; ``lost`` an acknowledged effect missing (an acked
park absent or older, an acked drop undone); ``corrupt`` bytes that match no version (or
a restore that raised ``DataLoss``); ``phantom`` an id or version no client ever sent;
``orphans`` block records without a manifest; ``accounting`` ``stat``/``list`` mismatches.

Primitives: ``payload(seq_id, version, max_bytes)``, ``refs_of``, ``block_payload``,
``restored`` (what a restore of a version returns), ``Tally``, ``Torture(root, ...)``
with ``run(kills, run_s) -> Tally``, and the worker entry point ``main``.
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import subprocess
import sys
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
KiB = 1 << 10
# Refusals a live daemon sends: the operation did not happen. Anything else (the daemon
# gone mid-call: UNAVAILABLE, a deadline, a cut stream) leaves the outcome unknown.
REFUSALS = ("AlreadyExists", "NotFound", "InvalidArgument", "ResourceExhausted", "FailedPrecondition",
            "LayoutMismatch")


BLOCKS_PER_WORKER = 2


def refs_of(seq_id: str, version: int) -> list[str]:
    """The shared (prefix) block version ``version`` of ``seq_id`` starts with, if any: one
    of its worker's few blocks, so blocks are shared between ids and versions."""
    r = random.Random(zlib.crc32(seq_id.encode()) * 31 + version)
    worker = seq_id.split("-", 1)[0]
    return [f"{worker}-b{r.randrange(BLOCKS_PER_WORKER)}"] if r.random() < 0.5 else []


def block_payload(block_id: str) -> list[torch.Tensor]:
    """A shared block's content: a function of its id alone (content-addressed)."""
    g = torch.Generator().manual_seed(zlib.crc32(block_id.encode()))
    return [torch.randint(0, 256, (int(torch.randint(KiB, 64 * KiB, (1,), generator=g)),), dtype=torch.uint8,
                          generator=g)]


def restored(seq_id: str, version: int, max_bytes: int) -> list[torch.Tensor]:
    """What a restore of that version returns: its blocks' tensors, then its own."""
    return [t for b in refs_of(seq_id, version) for t in block_payload(b)] + payload(seq_id, version, max_bytes)


def payload(seq_id: str, version: int, max_bytes: int) -> list[torch.Tensor]:
    """Version ``version`` of ``seq_id``: a tag tensor ``[crc(id), version]`` and random bytes."""
    key = zlib.crc32(seq_id.encode())
    g = torch.Generator().manual_seed(key * 1_000_003 + version)
    n = int(torch.randint(KiB, max_bytes + 1, (1,), generator=g))
    body = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)
    tail = torch.randn(int(torch.randint(1, 64, (1,), generator=g)), 16, generator=g).to(torch.bfloat16)
    return [torch.tensor([key, version], dtype=torch.int64), body, tail]


# ------------------------------------------------------------------ worker process


def _worker(args: argparse.Namespace) -> int:
    from kvpark.client import Client, KVParkError

    root = Path(args.dir)
    log = open(root / f"w{args.worker}.log", "a", buffering=1)  # one line per write
    rng = random.Random(args.seed * 7919 + args.worker)
    ids = [f"w{args.worker}-s{k}" for k in range(args.keys)]
    version = 0
    done_round = 0
    while True:
        while True:  # wait for the next round (or the end)
            if (root / "stop").exists():
                return 0
            r = int((root / "round").read_text() or 0)
            if r > done_round:
                break
            time.sleep(0.02)
        done_round = r
        try:
            c = Client(args.address, timeout=30.0, transport=args.transport)
        except KVParkError:  # killed before we got in: nothing sent this round
            log.write(f"paused {r}\n")
            continue
        while True:
            sid = rng.choice(ids)
            if rng.random() < 0.75:
                version += 1
                op, what = "park", f"park {sid} {version}"
            else:
                op, what = "drop", f"drop {sid}"
            try:
                if op == "park":
                    refs = refs_of(sid, version)  # a new block is created in the same commit
                    c.park(sid, payload(sid, version, args.max_bytes), overwrite=True, refs=refs,
                           new_blocks={b: block_payload(b) for b in refs})
                else:
                    c.drop(sid)
            except KVParkError as e:
                if type(e).__name__ in REFUSALS:
                    log.write(f"failed {what} {type(e).__name__}\n")
                    continue
                log.write(f"unknown {what}\n")
                break
            log.write(f"ack {what}\n")
        try:
            c.close()
        except Exception:  # noqa: BLE001 - a channel to a dead daemon; nothing to keep
            pass
        log.write(f"paused {r}\n")


# ------------------------------------------------------------------ controller


@dataclass
class Tally:
    kills: int = 0
    acked: int = 0
    verified: int = 0
    lost: int = 0
    corrupt: int = 0
    phantom: int = 0
    orphans: int = 0
    accounting: int = 0
    problems: list[str] = field(default_factory=list)

    COLUMNS = ("kills", "acked", "verified", "lost", "corrupt", "phantom")

    @property
    def clean(self) -> bool:
        return not (self.lost or self.corrupt or self.phantom or self.orphans or self.accounting)

    def table(self) -> str:
        cols = [*self.COLUMNS, "orphans", "accounting"]
        vals = [str(getattr(self, c)) for c in cols]
        widths = [max(len(c), len(v)) for c, v in zip(cols, vals)]
        line = lambda xs: "  ".join(x.rjust(w) for x, w in zip(xs, widths))  # noqa: E731
        return line(cols) + "\n" + line(vals)


class Torture:
    """The controller: one daemon subprocess (restarted after each kill) and its workers."""

    def __init__(self, root: Path, *, workers: int = 3, keys: int = 6, max_bytes: int = 512 * KiB,
                 seed: int = 0, transports: tuple[str, ...] = ("auto", "inline")) -> None:
        self.root = root
        self.root.mkdir(parents=True, exist_ok=True)
        (root / "shm").mkdir(exist_ok=True)
        self.address = f"unix://{root / 'kvpark.sock'}"
        self.data = root / "disk"
        self.n_workers, self.keys, self.max_bytes, self.seed = workers, keys, max_bytes, seed
        self.transports = transports
        self.rng = random.Random(seed)
        self.tally = Tally()
        self.daemon: subprocess.Popen | None = None
        self.workers: list[subprocess.Popen] = []
        self.allowed: dict[str, set[int | None]] = {}  # id -> states the logs allow
        self.issued: dict[str, set[int]] = {}  # id -> every version any client sent
        self._offsets: dict[int, int] = {}
        self.round = 0

    # -------------------------------------------------------------- processes

    def start_daemon(self, timeout: float = 60.0) -> None:
        errlog = open(self.root / "daemon.log", "a")
        start = errlog.tell()
        cmd = [
            sys.executable, "-m", "kvpark.daemon.cli", "serve",
            "--listen", self.address, "--data-dir", str(self.data),
            "--set", "policy.write=write_through",
            "--set", "tiers.device.enabled=false",
            "--set", "tiers.host.capacity=32MiB",
            "--set", f"tiers.host.shm_dir={self.root / 'shm'}",
            "--set", "tiers.disk.capacity=512MiB",
            "--set", "server.grace_s=1",
            "--set", "metrics.listen=",
        ]
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVPARK")}
        self.daemon = subprocess.Popen(cmd, stderr=errlog, stdout=subprocess.DEVNULL, env=env)
        errlog.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with open(self.root / "daemon.log") as f:
                f.seek(start)
                if "listening on" in f.read():
                    return
            if self.daemon.poll() is not None:
                break
            time.sleep(0.05)
        raise RuntimeError(f"daemon did not start; see {self.root / 'daemon.log'}")

    def kill_daemon(self) -> None:
        assert self.daemon is not None
        self.daemon.send_signal(signal.SIGKILL)
        self.daemon.wait(30)
        self.tally.kills += 1

    def start_workers(self) -> None:
        (self.root / "round").write_text("0")
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
        env = {k: v for k, v in env.items() if not k.startswith("KVPARK")}
        for w in range(self.n_workers):
            cmd = [sys.executable, "-m", "tests.daemon.torture", "worker", "--dir", str(self.root),
                   "--worker", str(w), "--seed", str(self.seed), "--keys", str(self.keys),
                   "--max-bytes", str(self.max_bytes), "--address", self.address,
                   "--transport", self.transports[w % len(self.transports)]]
            self.workers.append(subprocess.Popen(cmd, cwd=REPO, env=env))
            for k in range(self.keys):
                self.allowed[f"w{w}-s{k}"] = {None}
                self.issued[f"w{w}-s{k}"] = set()

    def stop(self) -> int | None:
        """Stop the workers, then the daemon gracefully; its exit code (None if none ran)."""
        (self.root / "stop").write_text("")
        for p in self.workers:
            try:
                p.wait(60)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self.workers = []
        rc = None
        if self.daemon is not None and self.daemon.poll() is None:
            self.daemon.send_signal(signal.SIGTERM)
            try:
                rc = self.daemon.wait(60)
            except subprocess.TimeoutExpired:
                self.daemon.kill()
                rc = self.daemon.wait()
        return rc

    # -------------------------------------------------------------- rounds

    def _wait_paused(self, r: int, timeout: float = 120.0) -> None:
        logs = [self.root / f"w{w}.log" for w in range(self.n_workers)]
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if all(p.exists() and f"paused {r}\n" in p.read_text() for p in logs):
                return
            dead = [p.args for p in self.workers if p.poll() is not None]
            if dead:
                raise RuntimeError(f"a worker exited: {dead}")
            time.sleep(0.05)
        raise RuntimeError(f"workers did not pause after round {r} within {timeout} s")

    def _read_logs(self) -> None:
        """Fold the new log lines into ``allowed`` (per id, workers own their ids)."""
        for w in range(self.n_workers):
            with open(self.root / f"w{w}.log") as f:
                f.seek(self._offsets.get(w, 0))
                lines = f.read().splitlines()
                self._offsets[w] = f.tell()
            for line in lines:
                kind, *rest = line.split()
                if kind == "paused":
                    continue
                op, sid = rest[0], rest[1]
                new: int | None = int(rest[2]) if op == "park" else None
                if new is not None:
                    self.issued[sid].add(new)
                if kind == "ack":
                    self.tally.acked += 1
                    self.allowed[sid] = {new}
                elif kind == "unknown":
                    self.allowed[sid] = self.allowed[sid] | {new}
                # "failed": refused by a live daemon, the old state stands

    def orphan_blocks(self, strict: bool = False) -> int:
        """Block records of the (dead or stopped) daemon's LMDB that no manifest owns.

        An overwrite deletes the version it replaced after its own publish (a read lease
        may still read it: ``docs/protocol.md``), so a kill between the two leaves the old
        version's records under an id whose manifest is newer. Those are garbage the next
        start sweeps, not a write that is partly visible, and count only with ``strict``
        (after a clean stop, when nothing may be left)."""
        import lmdb

        from kvpark.tiers import envs
        from kvpark.tiers.disk import Manifest

        envs.close(str(self.data))  # this process's grant reader, if it has one: one environment each
        env = lmdb.open(str(self.data), max_dbs=4, readonly=True, lock=False)
        try:
            blocks, manifests = env.open_db(b"blocks", create=False), env.open_db(b"manifests", create=False)
            with env.begin() as txn:
                ms = [Manifest.decode(v) for _, v in txn.cursor(db=manifests)]
                owned = {(m.seq_id, m.key_gen) for m in ms}
                newest = {m.seq_id: m.gen for m in ms}
                n = 0
                for key, _ in txn.cursor(db=blocks):
                    k = bytes(key)  # seq_id | 0x00 | key gen (u64 BE) | index (u32 BE)
                    sid, gen = k[:-13].decode(), int.from_bytes(k[-12:-4], "big")
                    replaced = sid in newest and gen < newest[sid]
                    n += (sid, gen) not in owned and (strict or not replaced)
                return n
        finally:
            env.close()

    def verify(self) -> None:
        from kvpark.client import Client, DataLoss, NotFound

        t = self.tally
        with Client(self.address, timeout=60.0) as c:
            infos = {i.seq_id: i for i in c.list()}
            st = c.stat()
            # Accounting, before any restore promotes a copy: every sequence is on disk
            # only, and the disk tier's bytes are exactly the sum of the sequences'.
            # A sequence's nbytes counts the blocks it references; the disk holds them once.
            disk_sum = sum(i.nbytes - sum(infos[r].nbytes for r in i.refs if r in infos) for i in infos.values())
            checks = [
                (st.sequences == len(infos), f"stat.sequences {st.sequences} != {len(infos)} listed"),
                (st.tiers["disk"].used_bytes == disk_sum, f"disk used {st.tiers['disk'].used_bytes} != {disk_sum}"),
                (st.tiers["host"].used_bytes == 0, f"host used {st.tiers['host'].used_bytes} after a restart"),
                (st.leases == 0, f"{st.leases} leases after a restart"),
                (all(i.tier == "disk" for i in infos.values()), "a sequence not on disk after a restart"),
            ]
            for ok, why in checks:
                if not ok:
                    t.accounting += 1
                    t.problems.append(f"round {self.round}: {why}")
            blocks = {f"w{w}-b{j}" for w in range(self.n_workers) for j in range(BLOCKS_PER_WORKER)}
            for sid in sorted(set(infos) - set(self.allowed)):
                if sid in blocks and infos[sid].shared:
                    # A shared block: whole, or not there. (One no sequence uses any more,
                    # left by a kill between a drop and its block's delete, is reaped later.)
                    try:
                        ok = all(torch.equal(a, b) for a, b in zip(c.restore(sid), block_payload(sid)))
                    except DataLoss:
                        ok = False
                    except NotFound:
                        continue
                    t.verified += ok
                    if not ok:
                        t.corrupt += 1
                        t.problems.append(f"round {self.round}: shared block {sid} differs")
                    continue
                t.phantom += 1
                t.problems.append(f"round {self.round}: unknown id {sid!r} listed")
            for sid, allowed in sorted(self.allowed.items()):
                seen: int | None = None
                if sid in infos:
                    try:
                        out = c.restore(sid)
                        seen = int(out[-3][1])  # its own tensors come last: tag, body, tail
                        if seen not in self.issued[sid]:
                            t.phantom += 1
                            t.problems.append(f"round {self.round}: {sid} version {seen} never sent")
                            c.drop(sid)
                            seen = None
                        else:
                            want = restored(sid, seen, self.max_bytes)
                            if len(out) != len(want) or not all(torch.equal(a, b) for a, b in zip(out, want)):
                                raise DataLoss("bytes differ")
                    except NotFound:
                        seen = None  # listed, then gone: counted below as absent
                    except DataLoss as e:
                        t.corrupt += 1
                        t.problems.append(f"round {self.round}: {sid}: {e}")
                        c.drop(sid)
                        self.allowed[sid] = {None}
                        continue
                if seen in allowed:
                    t.verified += seen is not None
                else:
                    t.lost += 1
                    t.problems.append(f"round {self.round}: {sid} is {seen}, the logs allow {sorted(allowed, key=str)}")
                self.allowed[sid] = {seen}  # resolved: what the next round starts from

    def run(self, kills: int, run_s: tuple[float, float] = (0.3, 1.5)) -> Tally:
        self.start_daemon()
        self.start_workers()
        try:
            for _ in range(kills):
                self.round += 1
                (self.root / "round").write_text(str(self.round))
                time.sleep(self.rng.uniform(*run_s))
                self.kill_daemon()
                self._wait_paused(self.round)
                self._read_logs()
                orphans = self.orphan_blocks()
                if orphans:
                    self.tally.orphans += orphans
                    self.tally.problems.append(f"round {self.round}: {orphans} block record(s) without a manifest")
                self.start_daemon()
                self.verify()
        finally:
            rc = self.stop()
        if rc not in (0, None):
            self.tally.problems.append(f"the daemon exited {rc} on SIGTERM")
        elif rc == 0:
            # A clean stop leaves nothing behind: the replaced versions a kill left were
            # swept at a start, and every delete since ran.
            left = self.orphan_blocks(strict=True)
            if left:
                self.tally.orphans += left
                self.tally.problems.append(f"after the clean stop: {left} block record(s) without a manifest")
        return self.tally


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tests.daemon.torture")
    sub = ap.add_subparsers(dest="cmd", required=True)
    w = sub.add_parser("worker")
    w.add_argument("--dir", required=True)
    w.add_argument("--worker", type=int, required=True)
    w.add_argument("--seed", type=int, default=0)
    w.add_argument("--keys", type=int, default=6)
    w.add_argument("--max-bytes", type=int, default=512 * KiB)
    w.add_argument("--address", required=True)
    w.add_argument("--transport", default="auto")
    args = ap.parse_args(argv)
    return _worker(args)


if __name__ == "__main__":
    sys.exit(main())
