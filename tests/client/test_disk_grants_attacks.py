"""Attacks on disk grants (``client/disk_reads.py``, ``tiers/envs.py``)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

from kvpark.client import Client

from ..conftest import wait_until

MiB = 1 << 20


def blob(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)


# A client process with two threads reading disk grants through its own read-only
# environment (its daemon in another process). Thread 1 stops inside its read, a verified
# view of a record in hand; the daemon's data file grows past the map that environment
# opened with (any parking does that: a read-only env maps max(10 MiB, the data's size at
# open)); thread 2's grant then meets MapResizedError and ``envs.reading`` calls
# ``set_mapsize(0)``, which unmaps and remaps the environment under thread 1's views.
CHILD = textwrap.dedent("""
    import sys, threading, time, pathlib, torch
    from kvpark.client import Client, disk_reads

    addr, tmp = sys.argv[1], pathlib.Path(sys.argv[2])
    from kvpark.tiers import envs
    if sys.argv[3] == "small":  # a mapping just twice the file: the growth below passes it
        envs.READER_MAP = 0
    agains = []
    class Again(envs.Again):
        def __init__(self, *a):
            agains.append(a)
            super().__init__(*a)
    envs.Again = Again
    def blob(n, seed):
        g = torch.Generator().manual_seed(seed)
        return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)

    import os, numpy as np
    def wait_for(flag, timeout=60.0):
        # The parent's step, by a deadline: a parent that failed leaves no child behind.
        deadline = time.monotonic() + timeout
        while not flag.exists():
            if time.monotonic() > deadline:
                print("gave up waiting for", flag.name, flush=True)
                os._exit(4)
            time.sleep(0.01)
    def where(addr):
        # (file, file offset) that virtual address addr maps, from /proc/self/maps
        for line in open("/proc/self/maps"):
            f = line.split()
            lo, hi = (int(x, 16) for x in f[0].split("-"))
            if lo <= addr < hi:
                return (f[5] if len(f) > 5 else "", addr - lo + int(f[2], 16))
        return None

    real = disk_reads.ReadTxn.read_block
    state = {"paused": False}
    class Pausing(disk_reads.ReadTxn):
        def read_block(self, m, index, length):
            view = real(self, m, index, length)
            if threading.current_thread().name == "one" and not state["paused"]:
                state["paused"] = True
                addr = np.frombuffer(view, np.uint8).ctypes.data
                before = where(addr)
                (tmp / "held").touch()
                wait_for(tmp / "go")
                if where(addr) != before:  # touching the view now faults (or reads other bytes)
                    print("view of", m.seq_id, "block", index, "was", before, "now", where(addr), flush=True)
                    os._exit(3)
            return view
    disk_reads.ReadTxn = Pausing

    errors = []
    def restore(sid, seed, n):
        try:
            with Client(addr, transport="shm") as c:
                (out,) = c.restore(sid)
                if not torch.equal(out, blob(n, seed)):
                    errors.append(f"{sid}: wrong bytes")
        except BaseException as e:
            errors.append(f"{sid}: {e!r}")

    one = threading.Thread(target=restore, args=("a", 1, 4 << 20), name="one")
    one.start()
    wait_for(tmp / "grown")
    restore("b", 2, 2 << 20)  # thread "main": its begin() meets MapResizedError
    (tmp / "go").touch()
    one.join()
    if (sys.argv[3] == "small") != bool(agains):
        errors.append(f"mapping {sys.argv[3]}: {len(agains)} reads told to ask again")
    print("errors:", errors)
    sys.exit(1 if errors else 0)
""")


@pytest.mark.parametrize("mapping", ["default", "small"])
def test_a_map_resize_under_a_concurrent_grant_read_must_not_crash_the_client(proc, tmp_path, mapping) -> None:
    cfg = ("--set", "policy.promote_on_restore=false")
    p = proc(*cfg)
    with Client(p.address) as c:
        c.park("a", [blob(4 * MiB, 1)])
        c.park("b", [blob(2 * MiB, 2)])
        c.flush()
    assert p.terminate() == 0
    p = proc(*cfg)  # "a" and "b" on disk only
    child = subprocess.Popen([sys.executable, "-c", CHILD, p.address, str(tmp_path), mapping])
    try:
        assert wait_until(lambda: (tmp_path / "held").exists(), timeout=60)
        with Client(p.address) as c:  # ordinary traffic grows the data file past 10 MiB
            for i in range(4):
                c.park(f"g{i}", [blob(4 * MiB, 10 + i)])
            c.flush()
        (tmp_path / "grown").touch()
        rc = child.wait(120)
    finally:
        if child.poll() is None:
            child.kill()
    assert rc == 0, f"the client process died with {rc} (negative: killed by that signal)"


def _txnid(path: str) -> int:
    """The last committed transaction id of the environment at ``path`` (another process)."""
    code = (f"import lmdb; e = lmdb.open({path!r}, readonly=True, lock=False, max_dbs=8); "
            f"print(e.info()['last_txnid'])")
    return int(subprocess.check_output([sys.executable, "-c", code]).decode())


def _bump(path: str) -> None:
    """One more (empty in effect) write transaction on the environment at ``path``."""
    code = (f"import lmdb; e = lmdb.open({path!r}, max_dbs=8)\n"
            f"with e.begin(write=True) as t: t.put(b'\\x00atk', b''); t.delete(b'\\x00atk')\n")
    subprocess.check_call([sys.executable, "-c", code])


def test_a_compaction_while_a_client_holds_its_reader_environment_keeps_every_sequence(proc, tmp_path) -> None:
    """``kvpark compact`` renames a fresh data.mdb in; lock.mdb stays. A client process that
    still holds its reader environment (open since a disk grant) keeps a shared lock on
    lock.mdb, so the next daemon is not LMDB's first opener and does not reset the lock
    file: its transactions take the old file's transaction id from there and pick the new
    file's meta page by that id's parity."""
    path = str(tmp_path / "disk")
    cfg = ("--set", "policy.promote_on_restore=false")
    seqs = {f"s{i}": blob(MiB, 20 + i) for i in range(6)}
    p = proc(*cfg)
    with Client(p.address) as c:
        for sid, t in seqs.items():
            c.park(sid, [t])
        c.flush()
        c.park("junk", [blob(MiB, 99)])
        c.flush()
        c.drop("junk")
        c.flush()
    assert p.terminate() == 0
    p = proc(*cfg)
    with Client(p.address, transport="shm") as c:
        assert torch.equal(c.restore("s0")[0], seqs["s0"])  # a disk grant: this process's reader env
        assert p.terminate() == 0
        if _txnid(path) % 2:  # one more transaction: an even id, which picks the copy's meta page 0
            _bump(path)
        assert _txnid(path) % 2 == 0
        out = subprocess.run([sys.executable, "-m", "kvpark.daemon.cli", "compact", "--data-dir", path],
                             capture_output=True, text=True)
        assert out.returncode == 0, out.stdout + out.stderr
        p = proc(*cfg)
        with Client(p.address) as fresh:
            assert fresh.present(list(seqs)) == [True] * len(seqs)
            for sid, t in seqs.items():
                assert torch.equal(fresh.restore(sid)[0], t)
