"""A windowed overwrite refused at its publish undoes exactly its own write, under
write_back too: ``stage_commit`` remembers the manifest it replaced even without an
fsync, so the undo puts back the manifest of the version that stays indexed (an
acknowledged, flushed park), never deletes it. Found by a fresh-eyes attack."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import pytest
import torch

from kvpark.client import Client, KVParkError
from kvpark.daemon.server import Daemon


SMALL = {"tiers.host.capacity": "4MiB"}
BIG = 5 * (1 << 20) + 1


def full(n: int, v: int) -> torch.Tensor:
    return torch.full((n,), v, dtype=torch.uint8)


@pytest.mark.parametrize("write", ["write_back", "write_through"])
def test_windowed_overwrite_of_an_in_use_shared_block_keeps_the_blocks_manifest_on_disk(
        daemon: Callable[..., Daemon], tmp_path: Path, write: str) -> None:
    """write_back. Shared block "B" (referenced by "p") is flushed to disk. A windowed
    overwrite of "B" stages, commits its manifest over B's (no fsync: nothing recorded
    for ``revert``), then ``publish_commit`` refuses it (a shared block in use). The
    undo is ``revert(final, None)``: it deletes the current manifest and puts nothing
    back, so B (acknowledged, indexed on disk) has no manifest in LMDB."""
    d = daemon(**SMALL, **{"policy.write": write})
    eng = d.engine
    assert eng is not None
    with Client(d.address, transport="inline") as c:
        c.park("p", [full(4096, 7)], refs=["B"], new_blocks={"B": [full(4096, 3)]})
        c.flush()
        with pytest.raises(KVParkError) as ei:
            c.park("B", [full(BIG, 9)], overwrite=True)
        print("refused:", ei.value)
        path = eng.disk.path
        try:
            eng.check_invariants()
            invariant = ""
        except AssertionError as e:
            invariant = str(e)
        assert [int(t[0]) for t in c.restore("p")] == [3, 7]
        # Memory pressure: B's memory copy goes (its disk copy is the index's).
        demoted = eng.mover.demote("B", "host")
        try:
            live = [int(t[0]) for t in c.restore("p")]
        except Exception as e:  # noqa: BLE001
            live = repr(e)
    d.stop(0.5)  # a clean stop (flush_on_shutdown as configured)
    d2 = daemon(**{"tiers.disk.path": path, **SMALL, "policy.write": write})
    with Client(d2.address, transport="inline") as c2:
        present = c2.present(["p", "B"])
        got = [int(t[0]) for t in c2.restore("p")] if present[0] else None
    assert live == [3, 7] and not invariant and present == [True, True] and got == [3, 7], \
        f"restore of p after demote(B)={demoted}: {live}; invariants: {invariant!r}; after a clean restart present(p, B)={present}, p restores {got}"
