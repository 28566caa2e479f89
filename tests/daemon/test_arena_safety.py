"""The host arena never faults: its memory is reserved at start or the daemon refuses.

Real tmpfs mounts where the machine allows them (CI runs as root); where it does not,
the capacity-beyond-the-file-system case still runs on /dev/shm.
"""

from __future__ import annotations

import fcntl
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Callable, Iterator

import pytest

from kvpark.daemon.server import Daemon
from kvpark.proto.errors import StartupError
from kvpark.tiers.shm import free_bytes

from ..conftest import make_config

MiB = 1 << 20


@pytest.fixture
def tmpfs(tmp_path: Path) -> Iterator[Callable[[int], Path]]:
    """``make(size_bytes) -> Path``: a real tmpfs of that size (skips where mounting is not allowed)."""
    mounted: list[Path] = []

    def make(size: int) -> Path:
        d = tmp_path / f"tmpfs{len(mounted)}"
        d.mkdir()
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(d)],
                           capture_output=True, text=True)
        if r.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here ({r.stderr.strip() or r.returncode}); "
                        "test_capacity_beyond_the_shm_file_system_refuses_start covers the refusal")
        mounted.append(d)
        return d

    yield make
    for d in mounted:
        subprocess.run(["umount", "-l", str(d)], capture_output=True)


def serve(tmp_path: Path, *sets: str, timeout: float = 60.0) -> subprocess.CompletedProcess:
    """Run ``kvpark serve`` expecting it to refuse to start (it would otherwise block)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVPARK")}
    # No metrics endpoint: its default port is fixed, and another daemon on this machine may
    # hold it, which would refuse the start before the check under test.
    args = [sys.executable, "-m", "kvpark.daemon.cli", "serve", "--listen", "127.0.0.1:0",
            "--data-dir", str(tmp_path / "disk"), "--set", "metrics.listen="]
    for s in sets:
        args += ["--set", s]
    return subprocess.run(args, capture_output=True, text=True, env=env, timeout=timeout)


def test_missing_shm_dir_refuses_start_with_one_line_and_exit_2(tmp_path: Path) -> None:
    r = serve(tmp_path, f"tiers.host.shm_dir={tmp_path / 'typo'}", "tiers.host.capacity=16MiB")
    assert r.returncode == 2, r.stderr
    assert "does not exist" in r.stderr and "typo" in r.stderr
    assert "Traceback" not in r.stderr
    assert not (tmp_path / "typo").exists(), "shm_dir is never created silently"


def test_explicit_capacity_beyond_a_small_tmpfs_refuses_start(tmpfs: Callable[[int], Path], tmp_path: Path) -> None:
    shm = tmpfs(16 * MiB)
    r = serve(tmp_path, f"tiers.host.shm_dir={shm}", "tiers.host.capacity=64MiB")
    assert r.returncode == 2, r.stderr
    line = next(l for l in r.stderr.splitlines() if "cannot start" in l)
    # Names the directory, its free space, the size wanted and the fixes.
    for part in (str(shm), "MiB free", "64 MiB", "tiers.host.capacity", "--shm-size"):
        assert part in line, (part, line)
    assert "Traceback" not in r.stderr
    assert os.listdir(shm) == [], "nothing left behind"


def test_capacity_beyond_the_shm_file_system_refuses_start(tmp_path: Path) -> None:
    # Works without mount rights: ask /dev/shm for more than its whole size, which the
    # kernel refuses up front (no page is allocated first).
    st = os.statvfs("/dev/shm")
    total = st.f_blocks * st.f_frsize
    if total == 0:
        pytest.skip("/dev/shm has no size limit here: asking beyond it would allocate real memory")
    cfg = make_config(tmp_path, **{"tiers.host.shm_dir": "/dev/shm", "tiers.host.capacity": str(total + (1 << 30))})
    before = set(os.listdir("/dev/shm"))
    with pytest.raises(StartupError, match="cannot hold"):
        Daemon(cfg).start()
    assert {n for n in os.listdir("/dev/shm") if "kvpark" in n} <= before


def test_auto_capacity_fits_a_small_tmpfs_and_a_full_arena_never_faults(tmpfs: Callable[[int], Path],
                                                                         tmp_path: Path) -> None:
    shm = tmpfs(48 * MiB)
    cfg = make_config(tmp_path, **{"tiers.host.shm_dir": str(shm), "tiers.host.capacity": "auto",
                                   "tiers.device.enabled": "false"})
    assert cfg.host_capacity <= free_bytes(str(shm)), "auto sizes the arena down to what fits"
    assert cfg.host_capacity >= 32 * MiB
    with Daemon(cfg) as d:
        # Step: a separate client process maps the arena and fills it through shm; a page
        # the tmpfs could not supply would kill it with SIGBUS.
        code = (
            "import sys, torch\n"
            "from kvpark.client import Client, ResourceExhausted\n"
            "with Client(sys.argv[1], transport='shm') as c:\n"
            "    n = 0\n"
            "    for i in range(200):\n"
            "        t = torch.full((1 << 20,), i % 251, dtype=torch.uint8)\n"
            "        try:\n"
            "            c.park(f's{i}', [t])\n"
            "        except ResourceExhausted:\n"
            "            break\n"
            "        n += 1\n"
            "    for i in range(n):\n"
            "        assert int(c.restore(f's{i}')[0][0]) == i % 251\n"
            "    print(n)\n"
        )
        r = subprocess.run([sys.executable, "-c", code, d.address], capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, f"client exited {r.returncode} (SIGBUS is {-signal.SIGBUS}):\n{r.stderr[-3000:]}"
        assert int(r.stdout) >= cfg.host_capacity // MiB, "more than the arena holds was parked (spilled to disk)"


def test_auto_capacity_below_the_floor_refuses_with_the_fixes(tmpfs: Callable[[int], Path], tmp_path: Path) -> None:
    shm = tmpfs(8 * MiB)
    r = serve(tmp_path, f"tiers.host.shm_dir={shm}")
    assert r.returncode == 2, r.stderr
    assert "cannot hold" in r.stderr and "--shm-size" in r.stderr
    assert "does not fit" in r.stderr  # the auto sizing said what it tried


def test_stale_arenas_are_found_by_lock_never_by_pid(tmp_path: Path) -> None:
    shm = tmp_path / "shm"
    shm.mkdir()
    # A file whose pid is alive (ours) but which nobody holds: stale.
    stale = shm / f"kvpark-{os.getpid()}-aaaaaaaaaaaa.arena"
    stale.write_bytes(b"x")
    # A file whose pid does not exist here but which is held: a live daemon in another
    # PID namespace sharing this directory.
    held = shm / "kvpark-4194303-bbbbbbbbbbbb.arena"
    held.write_bytes(b"y")
    fd = os.open(held, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        first = Daemon(make_config(tmp_path, **{"tiers.device.enabled": "false"})).start()
        try:
            assert not stale.exists()
            assert held.exists()
            mine = [p for p in shm.glob("kvpark-*.arena") if p != held]
            assert len(mine) == 1
            # Step: a second daemon (another data dir) on the same shm dir leaves the
            # first one's arena alone: it is locked.
            cfg2 = make_config(tmp_path, **{"tiers.disk.path": str(tmp_path / "disk2"),
                                            "tiers.device.enabled": "false"})
            with Daemon(cfg2):
                assert mine[0].exists() and held.exists()
            assert mine[0].exists()
        finally:
            first.stop(0.5)
    finally:
        os.close(fd)
    assert held.exists()
    assert not mine[0].exists(), "the arena file is removed on stop"
