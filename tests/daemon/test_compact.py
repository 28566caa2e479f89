"""`kvpark compact`: the disk tier's LMDB file shrinks to its live pages offline, what
stays restores bit-exact afterwards, and a running daemon's directory is refused."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable

import torch

from kvpark.client import Client
from kvpark.daemon.cli import main as daemon_main
from kvpark.daemon.server import Daemon

from ..conftest import make_config

MiB = 1 << 20


def test_compact_shrinks_the_file_and_keeps_every_sequence(tmp_path: Path, capsys) -> None:
    cfg = make_config(tmp_path, **{"policy.write": "write_through"})
    keep = {f"k{i}": torch.full((MiB,), i, dtype=torch.uint8) for i in range(3)}
    with Daemon(cfg) as d, Client(d.address) as c:
        for i in range(40):
            c.park(f"x{i}", [torch.full((MiB,), 100 + i % 50, dtype=torch.uint8)])
        for sid, t in keep.items():
            c.park(sid, [t])
        for i in range(40):
            assert c.drop(f"x{i}")
    data = os.path.join(cfg.tiers.disk.path, "data.mdb")
    before = os.path.getsize(data)
    assert daemon_main(["compact", "--data-dir", cfg.tiers.disk.path]) == 0
    out = capsys.readouterr().out
    after = os.path.getsize(data)
    assert after < before / 4, (before, after)
    assert f"{before / 2**20:.1f} MiB -> {after / 2**20:.1f} MiB" in out
    assert not os.path.exists(os.path.join(cfg.tiers.disk.path, "compact.tmp"))
    # Everything kept is there after a restart on the compacted file, bit-exact.
    with Daemon(cfg) as d, Client(d.address) as c:
        assert sorted(s.seq_id for s in c.list()) == sorted(keep)
        for sid, t in keep.items():
            assert torch.equal(c.restore(sid)[0], t)
        d.engine.check_invariants()  # type: ignore[union-attr]


def test_compact_refuses_a_directory_a_daemon_holds(daemon: Callable[..., Daemon], capsys) -> None:
    d = daemon()
    rc = daemon_main(["compact", "--data-dir", d.config.tiers.disk.path])
    err = capsys.readouterr().err
    assert rc == 2 and "in use by another kvpark daemon" in err and "stop the daemon first" in err
    with Client(d.address) as c:  # the daemon is untouched
        c.park("ok", [torch.ones(4)])


def test_compact_of_a_directory_without_a_disk_tier_is_refused(tmp_path: Path, capsys) -> None:
    assert daemon_main(["compact", "--data-dir", str(tmp_path)]) == 2
    assert "no disk tier here" in capsys.readouterr().err
