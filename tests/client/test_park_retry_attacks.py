"""Attacks on "a retried create meets itself" (client/same.py): every test states the
promise; a failure is a break. Real daemons only."""

from __future__ import annotations

import threading
import time
from typing import Callable

import numpy as np
import pytest
import torch

from kvpark.client import AlreadyExists, Client, KVParkError, ResourceExhausted
from kvpark.client.client import _header
from kvpark.client import verify as verifying
from kvpark.daemon.server import Daemon
from kvpark.proto.errors import DeadlineExceeded

from ..conftest import wait_until
from ..daemon.test_tenants import TOKENS, tenants

KiB, MiB = 1 << 10, 1 << 20


def blob(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(x.dtype == y.dtype and x.shape == y.shape
                                    and torch.equal(x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8))
                                    for x, y in zip(a, b))


# --------------------------------------------------------------- 1. trusted digests

@pytest.mark.parametrize("retry_verify", [False, True])
def test_stored_digests_that_do_not_match_the_stored_bytes_are_not_taken_for_them(
        daemon: Callable[..., Daemon], retry_verify: bool) -> None:
    """A version whose digests are not its bytes' (a writer whose buffer changed between
    hashing and sending, or any client speaking the protocol) must not make a retry of
    *other* bytes succeed: the id never holds the retry's bytes."""
    d = daemon()
    mine, theirs = [blob(256 * KiB, 1)], [blob(256 * KiB, 2)]
    with Client(d.address, verify=False) as w:
        h = _header("s", theirs)
        h.xxh3.extend(verifying.digests(mine))  # the daemon never checks these against the bytes
        w._park(h, [t.view(torch.uint8) for t in theirs])
        assert same(w.restore("s"), theirs)
    with Client(d.address, verify=retry_verify) as c:
        with pytest.raises(AlreadyExists):
            got = c.park("s", mine)
            pytest.fail(f"park reported success ({got}) while 's' holds other bytes: "
                        f"restore -> same as mine? {same(Client(d.address).restore('s'), mine)}")


# --------------------------------------------------------------- 2. odd tensors

@pytest.mark.parametrize("verify", [False, True])
@pytest.mark.parametrize("kind", ["empty", "empty+data", "bool", "fp8", "complex", "noncontig", "numpy",
                                  "numpy_ro", "negzero"])
def test_odd_tensors_retry_is_success_or_already_exists(daemon: Callable[..., Daemon], kind: str,
                                                        verify: bool) -> None:
    d = daemon()
    base = torch.randn(64, 33)
    ts: list = {
        "empty": [torch.empty(0, dtype=torch.int8), torch.empty(0, 5)],
        "empty+data": [torch.empty(0, 7), base],
        "bool": [torch.rand(1000) > 0.5],
        "fp8": [base.to(torch.float8_e4m3fn)],
        "complex": [torch.randn(100, dtype=torch.complex64)],
        "noncontig": [base.t()],
        "numpy": [base.numpy()],
        "numpy_ro": [np.frombuffer(base.numpy().tobytes(), dtype=np.float32)],
        "negzero": [torch.zeros(100)],
    }[kind]
    with Client(d.address, verify=verify) as c:
        first = c.park("s", ts)
        again = c.park("s", [t.copy() if isinstance(t, np.ndarray) else t.clone() for t in ts])
        assert again.created_at == first.created_at
        # Same layout, different bytes: never success.
        if kind == "negzero":
            other = [-torch.zeros(100)]  # 0.0 vs -0.0: equal as floats, different bytes
        elif kind == "bool":
            other = [~ts[0]]
        elif kind == "noncontig":
            other = [base.t().contiguous() + 1]
        elif kind.startswith("empty"):
            other = None
        else:
            # A writable copy first: torch warns on a view of a read-only array.
            t0 = torch.as_tensor(np.array(ts[0]) if isinstance(ts[0], np.ndarray) else ts[0]).clone()
            t0.reshape(-1).view(torch.uint8)[0] ^= 1
            other = [t0]
        if other is not None:
            with pytest.raises(AlreadyExists):
                c.park("s", other)
        if kind == "noncontig":  # the same logical tensor, contiguous now: same park
            assert c.park("s", [base.t().contiguous()]).created_at == first.created_at
        assert c.stat().leases == 0


@pytest.mark.parametrize("verify", [False])  # verify=True hashes before any RPC: fails the same before the change
def test_meta_tensors_meeting_a_parked_id_raise_a_typed_error(daemon: Callable[..., Daemon], verify: bool) -> None:
    """Big enough to take the reserve path: AlreadyExists comes before any byte is read,
    and the compare then reads the caller's 'meta' tensors."""
    d = daemon()
    with Client(d.address, verify=verify, transport="shm") as c:
        c.park("s", [torch.zeros(MiB, dtype=torch.uint8)])
        with Client(d.address, transport="shm", verify=True) as v:  # a version with digests too
            v.park("v", [torch.zeros(MiB, dtype=torch.uint8)])
        for sid in ("s", "v"):
            try:
                c.park(sid, [torch.zeros(MiB, dtype=torch.uint8, device="meta")])
            except KVParkError:
                pass
            except Exception as e:  # noqa: BLE001
                pytest.fail(f"park({sid!r}, meta tensors): untyped {type(e).__name__}: {e}")
            else:
                pytest.fail("park of meta tensors reported success")


# --------------------------------------------------------------- 3. huge (windowed)

@pytest.mark.parametrize("verify", [False, True])
def test_a_windowed_park_larger_than_the_host_tier_retries_into_itself(daemon: Callable[..., Daemon],
                                                                      verify: bool) -> None:
    d = daemon(**{"tiers.host.capacity": "4MiB"})
    ts = [blob(6 * MiB, 3), blob(3 * MiB, 4)]
    with Client(d.address, verify=verify) as c:
        first = c.park("big", ts)
        assert c.park("big", [t.clone() for t in ts]).created_at == first.created_at
        flipped = [ts[0], ts[1].clone()]
        flipped[1][-1] ^= 1
        with pytest.raises(AlreadyExists):
            c.park("big", flipped)
        early = [ts[0].clone(), ts[1]]
        early[0][0] ^= 1  # mismatch in the first window: the restore is closed half read
        with pytest.raises(AlreadyExists):
            c.park("big", early)
        assert wait_until(lambda: c.stat().leases == 0, 2.0), c.stat()


def test_concurrent_windowed_parks_of_the_same_bytes_all_succeed(daemon: Callable[..., Daemon]) -> None:
    """protocol.md: 'with the same bytes every one of them succeeds with the one version'."""
    d = daemon(**{"tiers.host.capacity": "4MiB"})
    ts = [blob(6 * MiB, 5)]
    results: list[object] = [None] * 3
    go = threading.Barrier(3)

    def park(i: int) -> None:
        with Client(d.address) as c:
            go.wait()
            try:
                results[i] = c.park("w", [ts[0].clone()])
            except Exception as e:  # noqa: BLE001
                results[i] = e

    th = [threading.Thread(target=park, args=(i,)) for i in range(3)]
    for t in th:
        t.start()
    for t in th:
        t.join(120)
    assert all(not isinstance(r, BaseException) for r in results), results
    assert len({r.created_at for r in results}) == 1  # type: ignore[union-attr]


# --------------------------------------------------------------- 4. deadline and leases

def test_the_compare_respects_the_deadline_and_leaks_no_lease(daemon: Callable[..., Daemon]) -> None:
    d = daemon(**{"tiers.host.capacity": "4MiB", "leases.ttl_s": 30.0})
    ts = [blob(MiB, i) for i in range(40)]  # 40 MiB on disk, read back tensor by tensor
    with Client(d.address, verify=False) as c:
        c.park("big", ts)
        t0 = time.monotonic()
        c.park("big", ts)
        full = time.monotonic() - t0
        budget = max(0.05, full / 4)
        try:
            c.park("big", ts, timeout=budget)
        except DeadlineExceeded:
            pass  # cut short, as meant (a machine fast enough to finish is no failure)
        # The release of the compare's read lease went out after the deadline, unwaited.
        assert wait_until(lambda: c.stat().leases == 0, 3.0), f"lease left after timeout: {c.stat()}"


# --------------------------------------------------------------- 5. concurrent writers

@pytest.mark.parametrize("verify", [False, True])
@pytest.mark.parametrize("where", ["memory", "disk"])
def test_a_retry_racing_overwrites_only_ever_returns_a_version_that_held_its_bytes(
        daemon: Callable[..., Daemon], verify: bool, where: str) -> None:
    d = daemon(**{"tiers.host.capacity": "4MiB" if where == "disk" else "64MiB"})
    n = 3 * MiB if where == "disk" else 512 * KiB
    A, B = [blob(n, 10), blob(4 * KiB, 11)], [blob(n, 12), blob(4 * KiB, 13)]
    with Client(d.address, verify=verify) as c:
        c.park("s", A)
    versions: dict[float, str] = {}
    stop = threading.Event()
    errors: list[BaseException] = []
    crowded: list[tuple[str, BaseException]] = []
    with Client(d.address, verify=verify) as c:
        versions[c.info("s").created_at] = "A"

    def writer() -> None:
        try:
            with Client(d.address, verify=not verify) as w:
                i = 0
                while not stop.is_set():
                    which = "B" if i % 2 == 0 else "A"
                    try:
                        info = w.park("s", B if which == "B" else A, overwrite=True)
                    except ResourceExhausted as e:  # host space held by the compare's lease
                        crowded.append(("writer", e))
                        continue
                    versions[info.created_at] = which
                    if i % 3 == 2:
                        try:
                            w.drop("s")
                        except KVParkError:
                            pass
                    i += 1
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    th = threading.Thread(target=writer)
    th.start()
    wins: list[float] = []
    try:
        with Client(d.address, verify=verify) as c:
            deadline = time.monotonic() + 6
            while time.monotonic() < deadline:
                try:
                    info = c.park("s", A)
                    wins.append(info.created_at)
                except AlreadyExists:
                    pass
                except ResourceExhausted as e:
                    crowded.append(("retry", e))
                except KVParkError as e:
                    errors.append(e)
    finally:
        stop.set()
        th.join(60)
    assert not errors, errors[:3]
    assert wins
    bad = [w for w in wins if versions.get(w, "A") != "A"]
    assert not bad, f"{len(bad)} of {len(wins)} successes returned a version holding B"
    print(f"wins={len(wins)} versions={len(versions)} crowded={[(w, str(e)[:80]) for w, e in crowded[:3]]} "
          f"n_crowded={len(crowded)}")
    with Client(d.address) as c:
        assert wait_until(lambda: c.stat().leases == 0, 3.0), c.stat()
    assert d.engine is not None
    d.engine.check_invariants()


def test_ttl_expiry_during_the_compare_is_typed(daemon: Callable[..., Daemon]) -> None:
    d = daemon(**{"tiers.host.capacity": "4MiB"})
    ts = [blob(MiB, i) for i in range(12)]
    with Client(d.address) as c:
        for k in range(6):
            c.park(f"t{k}", ts, ttl_s=0.3 + 0.05 * k)
            time.sleep(0.25)
            try:
                info = c.park(f"t{k}", ts)
                assert info.nbytes == 12 * MiB
            except AlreadyExists:
                pass
            assert same(c.restore(f"t{k}"), ts) if c.present([f"t{k}"])[0] else True
        assert wait_until(lambda: c.stat().leases == 0, 3.0)


def test_a_retry_with_other_settings_is_not_the_same_park(daemon: Callable[..., Daemon]) -> None:
    """The same bytes parked with another TTL, pin or priority are another park: a
    success would hand back a version that expires, or is demoted, unlike the caller's."""
    d = daemon()
    ts = [blob(64 * KiB, 20)]
    with Client(d.address) as c:
        first = c.park("s", ts, ttl_s=30.0, priority=3)
        for kw in ({"pinned": True, "ttl_s": 30.0, "priority": 3}, {"priority": 3}, {"ttl_s": 60.0, "priority": 3},
                   {"ttl_s": 30.0}):
            with pytest.raises(AlreadyExists):
                c.park("s", ts, **kw)
        assert c.park("s", ts, ttl_s=30.0, priority=3).created_at == first.created_at


# --------------------------------------------------------------- 6. tenants

def test_a_tenant_retry_never_meets_another_tenants_version(daemon: Callable[..., Daemon]) -> None:
    d = daemon(**tenants())
    ts = [blob(512 * KiB, 30)]
    with Client(d.address, token=TOKENS["alice"]) as a, Client(d.address, token=TOKENS["bob"]) as b:
        ia = a.park("x", ts)
        time.sleep(0.01)
        ib = b.park("x", ts)  # a create in bob's namespace, not alice's version
        assert ib.created_at != ia.created_at
        guess = [ts[0].clone()]
        guess[0][0] ^= 1
        with pytest.raises(AlreadyExists):
            b.park("x", guess)
        assert a.restore("x") and b.stat().leases == 0 and a.stat().leases == 0


def test_the_compare_restore_stays_within_the_tenants_host_quota(daemon: Callable[..., Daemon]) -> None:
    d = daemon(**tenants(**{"bob.quota": {"host": "2MiB"}}))
    with Client(d.address, token=TOKENS["bob"]) as b:
        for i in range(6):
            b.park(f"b{i}", [blob(MiB, i)])
        for i in range(6):
            try:
                b.park(f"b{i}", [blob(MiB, i)])
            except KVParkError as e:
                pytest.fail(f"retry of b{i}: {type(e).__name__}: {e}")
            (row,) = b.stat().tenants
            assert row.used["host"] <= 2 * MiB, row
            assert b.stat().leases == 0
        assert d.engine is not None
        d.engine.check_invariants()


def test_a_layerwise_restore_cut_by_its_deadline_leaves_no_lease(daemon: Callable[..., Daemon]) -> None:
    """The same for a plain restore: its release, past the deadline, is sent unwaited
    (before: skipped, and the lease held its slots until leases.ttl_s)."""
    d = daemon(**{"tiers.host.capacity": "4MiB", "leases.ttl_s": 30.0})
    ts = [blob(MiB, i) for i in range(40)]
    with Client(d.address, verify=False) as c:
        c.park("big", ts)
        t0 = time.monotonic()
        assert len(c.restore("big")) == 40
        budget = max(0.02, (time.monotonic() - t0) / 4)
        try:
            with c.rpc.deadline(budget):
                r = c.restore("big", layerwise=True)
                try:
                    for _ in r:
                        pass
                finally:
                    r.close()
        except DeadlineExceeded:
            pass  # cut short, as meant (a machine fast enough to finish is no failure)
        assert wait_until(lambda: c.stat().leases == 0, 3.0), f"lease left: {c.stat()}"
        # The slots are free for others now, not at leases.ttl_s:
        c.park("other", [blob(3 * MiB, 99)])
