"""Kill -9 torture, bounded: a few SIGKILLs of a ``write_through`` daemon under client load.

The harness is ``tests/daemon/torture.py`` (``bench/torture.py`` runs long versions). Real
processes throughout: a ``kvpark serve`` subprocess on a unix socket, restarted after each
kill, and client processes that park, overwrite and drop and log what was acknowledged.
After every restart each acknowledged state restores bit-exact, no block record is left
without its manifest, nothing unsent appears, and ``stat`` agrees with ``list``.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from .torture import Torture

pytestmark = pytest.mark.slow
KILLS = int(os.environ.get("KVPARK_TORTURE_KILLS", "3"))


def test_sigkill_loses_nothing_acknowledged(tmp_path: Path) -> None:
    t = Torture(tmp_path, workers=3, keys=5, seed=int(os.environ.get("KVPARK_TORTURE_SEED", "1")))
    tally = t.run(kills=KILLS, run_s=(0.5, 1.5))
    print("\n" + tally.table())
    assert tally.clean, "\n".join(tally.problems)
    assert not tally.problems, "\n".join(tally.problems)
    assert tally.kills == KILLS
    # The run did something worth checking: acknowledged parks, verified after restarts.
    assert tally.acked > 0 and tally.verified > 0, tally.table()
