"""Disk accounting after one failed disk call: the store charges exactly what the index
holds on disk, and nothing stays charged as staged, whichever call failed.

Found by the history checker ("invariants: disk: store holds X bytes, the index Y" with
EIO and map-full faults); each case fails ONE call through the ``disk_factory`` seam.
"""

from __future__ import annotations

from typing import Callable

import lmdb
import pytest
import torch

from kvpark.client import Client, ResourceExhausted, Unavailable
from kvpark.daemon.server import Daemon
from kvpark.tiers.disk import DiskStore, Manifest

MiB = 1 << 20


def full(n: int, v: int) -> torch.Tensor:
    return torch.full((n,), v, dtype=torch.uint8)


def _error(kind: str) -> lmdb.Error:
    return lmdb.MapFullError("mdb_txn_commit: MDB_MAP_FULL") if kind == "map_full" else \
        lmdb.Error("mdb_txn_commit: Input/output error")


class _FailsStageCommit(DiskStore):
    """The next ``stage_commit`` fails as its write transaction would (nothing written)."""

    armed = ""

    def stage_commit(self, m: Manifest, replace: Manifest | None = None, sync: bool = False) -> bool:
        if _FailsStageCommit.armed:
            kind, _FailsStageCommit.armed = _FailsStageCommit.armed, ""
            raise self._write_error(_error(kind))
        return super().stage_commit(m, replace, sync)


def _accounted(d: Daemon) -> None:
    e = d.engine
    assert e is not None
    assert e.disk.staged == 0, f"{e.disk.staged} bytes still charged as staged"
    e.check_invariants()


@pytest.mark.parametrize("kind", ["eio", "map_full"])
@pytest.mark.parametrize("overwrite", [False, True])
def test_a_windowed_park_whose_stage_commit_fails_leaves_nothing_charged(
        daemon: Callable[..., Daemon], kind: str, overwrite: bool) -> None:
    d = daemon(disk_factory=_FailsStageCommit, **{"tiers.host.capacity": "4MiB"})
    with Client(d.address, transport="inline") as c:
        if overwrite:
            c.park("w", [full(5 * MiB + 1, 1)])
        _FailsStageCommit.armed = kind
        with pytest.raises((Unavailable, ResourceExhausted)):
            c.park("w", [full(5 * MiB + 1, 2)], overwrite=True)
        _accounted(d)
        if overwrite:
            assert int(c.restore("w")[0][0]) == 1
        c.park("w", [full(5 * MiB + 1, 3)], overwrite=True)
        assert int(c.restore("w")[0][0]) == 3
        _accounted(d)
