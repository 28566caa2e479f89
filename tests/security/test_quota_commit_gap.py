"""A tenant's park between its write lease's end and its publish still counts toward its
quota: neither an open reservation nor an indexed sequence in that gap, it was invisible
to the next park's admission, which then took the tenant past its quota (2.5 MiB against
2 MiB, once, in a busy run of the concurrent-parks test).
"""

from __future__ import annotations

import threading
from typing import Callable

from kvpark.client import Client
from kvpark.daemon.server import Daemon

from ..daemon.test_integrity_maintenance import GatedDisk, gate  # noqa: F401 - the fixture
from ..daemon.test_tenants import TOKENS, blob, tenants

MiB = 1 << 20


def test_a_park_in_its_commit_gap_counts_toward_the_quota(daemon: Callable[..., Daemon], gate) -> None:  # noqa: F811
    d = daemon(disk_factory=GatedDisk, **tenants(**{"alice.quota": {"host": "2MiB"}}),
               **{"policy.write": "write_through"})
    # The first park stops in its disk write: after its lease ended, before its publish.
    gate.arm(lambda kind, arg: kind == "write" and "first" in str(arg))
    errors: list[BaseException] = []

    def first() -> None:
        with Client(d.address, token=TOKENS["alice"]) as a:
            try:
                a.park("first", [blob(3 * MiB // 2, 1)])
            except BaseException as e:  # noqa: BLE001 - surfaced below
                errors.append(e)

    t = threading.Thread(target=first)
    t.start()
    try:
        assert gate.entered.wait(30)
        with Client(d.address, token=TOKENS["alice"]) as a:
            # In the gap: 1.5 MiB of alice's is on its way in. A 1 MiB park must make room
            # (demoting "first" once it is there) or be refused, never land beside it.
            done = threading.Event()

            def second() -> None:
                try:
                    a.park("second", [blob(MiB, 2)])
                except BaseException as e:  # noqa: BLE001 - a refusal is a right answer too
                    errors.append(e)
                done.set()

            s = threading.Thread(target=second)
            s.start()
            done.wait(5)  # admitted wrongly, it lands now, while the first is held
    finally:
        gate.gate.set()
        t.join(60)
    s.join(60)
    with Client(d.address, token=TOKENS["alice"]) as a:
        st = a.stat().tenants[0]
        assert st.used["host"] <= 2 * MiB, (st.used, errors)
    d.engine.check_invariants()
