"""Tenants on a real daemon: bearer tokens on every RPC, one namespace per tenant, quotas
per tier that only ever move the tenant's own data, and the data paths a tenant may use."""

from __future__ import annotations

import hashlib
from typing import Any, Callable

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvpark.client import Client
from kvpark.daemon.server import Daemon
from kvpark.proto.errors import (
    ERROR_KEY,
    LeaseExpired,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
    TransportUnavailable,
    Unauthenticated,
)
from kvpark.proto.v1 import kvpark_pb2 as pb

MiB = 1 << 20
TOKENS = {"alice": "alice-secret-token", "bob": "bob-secret-token", "carol": "carol-secret-token"}


def _sha(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def tenants(**extra: Any) -> dict[str, Any]:
    """alice and carol trusted_local, bob not; ``extra`` adds keys ("alice.quota" = {...})."""
    out: dict[str, Any] = {}
    for name, token in TOKENS.items():
        out[f"tenants.{name}.token_sha256"] = _sha(token)
    out["tenants.alice.trusted_local"] = True
    out["tenants.carol.trusted_local"] = True
    out.update({f"tenants.{k}": v for k, v in extra.items()})
    return out


def blob(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)


def _raw(channel: grpc.Channel, name: str, kind: str) -> Callable[..., Any]:
    path = f"/kvpark.v1.KVPark/{name}"
    ident = lambda b: b  # noqa: E731 - bytes straight through: the request need not even parse
    return getattr(channel, kind)(path, request_serializer=ident, response_deserializer=ident)


def _call(stub: Callable[..., Any], kind: str, metadata: list[tuple[str, str]]) -> grpc.RpcError | None:
    """The error an empty request gets (None: the call succeeded)."""
    try:
        if kind == "unary_unary":
            stub(b"", metadata=metadata, timeout=10)
        elif kind == "unary_stream":
            list(stub(b"", metadata=metadata, timeout=10))
        else:
            stub(iter([b""]), metadata=metadata, timeout=10)
    except grpc.RpcError as e:
        return e
    return None


def test_every_rpc_without_a_valid_token_is_unauthenticated_and_health_stays_open(
        daemon: Callable[..., Daemon]) -> None:
    d = daemon(**tenants())
    methods = pb.DESCRIPTOR.services_by_name["KVPark"].methods
    with grpc.insecure_channel(d.address) as ch:
        # Every method of the service, as declared: an RPC added later is covered here too.
        for m in methods:
            kind = ("stream_" if m.client_streaming else "unary_") + ("stream" if m.server_streaming else "unary")
            stub = _raw(ch, m.name, kind)
            for md in ([], [("authorization", "Bearer wrong-token")], [("authorization", TOKENS["alice"])],
                       [("authorization", "Bearer " + _sha(TOKENS["alice"]))]):
                err = _call(stub, kind, md)
                assert err is not None and err.code() == grpc.StatusCode.UNAUTHENTICATED, (m.name, md, err)
                assert (ERROR_KEY, "Unauthenticated") in (err.trailing_metadata() or ()), m.name
                assert TOKENS["alice"] not in (err.details() or "")
            # With the token the call reaches its handler (an empty request is its own error).
            err = _call(stub, kind, [("authorization", f"Bearer {TOKENS['alice']}")])
            assert err is None or err.code() != grpc.StatusCode.UNAUTHENTICATED, m.name
        health = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
        assert health.status == health_pb2.HealthCheckResponse.SERVING
    with pytest.raises(Unauthenticated):
        Client(d.address, token="")
    with pytest.raises(Unauthenticated):
        Client(d.address, token="not-a-tenant")
    assert d.engine is not None and d.engine.list() == []  # nothing was stored by any of it
    assert 'kvpark_errors_total{code="UNAUTHENTICATED"}' in d.metrics.render().decode()


def test_the_token_comes_from_KVPARK_TOKEN(daemon: Callable[..., Daemon], monkeypatch: pytest.MonkeyPatch) -> None:
    d = daemon(**tenants())
    monkeypatch.setenv("KVPARK_TOKEN", TOKENS["bob"])
    with Client(d.address) as c:
        c.park("x", [torch.ones(4)])
    with Client(d.address, token=TOKENS["alice"]) as a:
        assert a.present(["x"]) == [False]


def test_two_tenants_with_the_same_ids_never_see_each_other(daemon: Callable[..., Daemon]) -> None:
    d = daemon(**tenants())
    a, b = Client(d.address, token=TOKENS["alice"]), Client(d.address, token=TOKENS["bob"])
    with a, b:
        # 1. Same id, different bytes: two sequences.
        a.park("chat-1", [blob(3000, 1)])
        b.park("chat-1", [blob(5000, 2)])
        assert torch.equal(a.restore("chat-1")[0], blob(3000, 1))
        assert torch.equal(b.restore("chat-1")[0], blob(5000, 2))
        # 2. Replies name ids as the tenant sent them.
        assert a.info("chat-1").seq_id == "chat-1" and a.info("chat-1").nbytes == 3000
        # 3. A prefix block of alice's is hers alone: no hit, no presence, no reference for bob.
        a.park("chat-2", [blob(100, 3)], refs=["blk-0"], new_blocks={"blk-0": [blob(1000, 4)]})
        assert a.info("chat-2").refs == ("blk-0",)
        assert a.lookup(["blk-0", "chat-2"]) == 2
        assert b.present(["blk-0", "chat-2"]) == [False, False] and b.lookup(["blk-0"]) == 0
        with pytest.raises(NotFound) as e:
            b.park("chat-3", [blob(100, 5)], refs=["blk-0"])
        assert "alice" not in str(e.value)
        for call in (lambda: b.info("chat-2"), lambda: b.restore("chat-2"), lambda: b.prefetch("chat-2", tier="host"),
                     lambda: b.pin("chat-2")):
            with pytest.raises(NotFound):
                call()
        # 4. Lists, drops: each tenant's own only.
        assert sorted(i.seq_id for i in a.list()) == ["blk-0", "chat-1", "chat-2"]
        assert [i.seq_id for i in b.list()] == ["chat-1"]
        assert not b.drop("chat-2")
        assert b.drop("chat-1")
        assert torch.equal(a.restore("chat-1")[0], blob(3000, 1))
        _, out = a.restore_many(["chat-2"])
        assert torch.equal(torch.cat([t.flatten() for t in out]), torch.cat([blob(1000, 4), blob(100, 3)]))
        # 5. Bob's own block of the same name is a different block.
        b.park("chat-4", [blob(10, 6)], refs=["blk-0"], new_blocks={"blk-0": [blob(1000, 7)]})
        _, out = b.restore_many(["chat-4"])
        assert torch.equal(out[0].flatten(), blob(1000, 7))
    d.engine.check_invariants()


def test_a_tenant_cannot_commit_release_or_window_another_tenants_reservation(daemon: Callable[..., Daemon]) -> None:
    d = daemon(**tenants())
    with Client(d.address, token=TOKENS["alice"]) as a, Client(d.address, token=TOKENS["carol"]) as c:
        head = pb.ParkHeader(seq_id="s", tensors=[pb.TensorMeta(dtype="uint8", shape=[64], nbytes=64)], nbytes=64)
        r = a.rpc.call(a.rpc.reserve, pb.ReserveRequest(header=head, tier="host"))
        with pytest.raises(LeaseExpired):
            c.rpc.call(c.rpc.commit, pb.CommitRequest(lease_id=r.lease_id))
        with pytest.raises(LeaseExpired):
            c.rpc.call(c.rpc.window, pb.WindowRequest(lease_id=r.lease_id, index=0))
        # Released as a lease that never was: nothing happens to alice's.
        assert not c.rpc.call(c.rpc.release, pb.ReleaseRequest(lease_id=r.lease_id)).released
        assert a.rpc.call(a.rpc.commit, pb.CommitRequest(lease_id=r.lease_id)).seq_id == "s"
        assert c.present(["s"]) == [False]


def test_an_untrusted_tenant_gets_inline_only_and_cannot_reserve_the_arena(daemon: Callable[..., Daemon]) -> None:
    d = daemon(**tenants())
    with Client(d.address, token=TOKENS["alice"]) as a, Client(d.address, token=TOKENS["bob"]) as b:
        assert a.transport == "shm" and a.server.arena.path
        assert b.transport == "inline"
        assert list(b.server.transports) == ["inline"] and b.server.arena.path == "" and not b.server.device.ipc_handle
        head = pb.ParkHeader(seq_id="s", tensors=[pb.TensorMeta(dtype="uint8", shape=[64], nbytes=64)], nbytes=64)
        with pytest.raises(PermissionDenied):
            b.rpc.call(b.rpc.reserve, pb.ReserveRequest(header=head, tier="host"))
        b.park("s", [blob(64, 1)])
        with pytest.raises(PermissionDenied):
            b.rpc.call(b.rpc.acquire, pb.AcquireRequest(seq_id="s", tier="host"))
        assert torch.equal(b.restore("s")[0], blob(64, 1))
    with pytest.raises(TransportUnavailable):
        Client(d.address, token=TOKENS["bob"], transport="shm")


def _tiers(c: Client) -> dict[str, str]:
    return {i.seq_id: i.tier for i in c.list()}


def test_host_quota_demotes_the_tenants_own_coldest_and_never_anothers(daemon: Callable[..., Daemon]) -> None:
    d = daemon(**tenants(**{"alice.quota": {"host": "3MiB"}}), **{"metrics.tenant_labels": True})
    with Client(d.address, token=TOKENS["alice"]) as a, Client(d.address, token=TOKENS["bob"]) as b:
        for i in range(2):
            b.park(f"b{i}", [blob(MiB, 100 + i)])
        for i in range(5):
            a.park(f"a{i}", [blob(MiB, i)])
        # Alice holds at most 3 MiB of host memory: her two oldest went down to disk.
        st = a.stat().tenants
        assert [t.name for t in st] == ["alice"] and st[0].quota == {"host": 3 * MiB}
        assert st[0].used["host"] <= 3 * MiB and st[0].used["disk"] == 5 * MiB and st[0].sequences == 5
        assert _tiers(a) == {"a0": "disk", "a1": "disk", "a2": "host", "a3": "host", "a4": "host"}
        # bob's are where they were (bob is not trusted_local: in the private tier)
        assert _tiers(b) == {"b0": "private", "b1": "private"}
        for i in range(5):
            assert torch.equal(a.restore(f"a{i}")[0], blob(MiB, i))
        for i in range(2):
            assert torch.equal(b.restore(f"b{i}")[0], blob(MiB, 100 + i))
        # Bob has no quota: his own row says so.
        (bs,) = b.stat().tenants
        assert bs.name == "bob" and bs.quota == {} and bs.used["host"] == 2 * MiB
    # The operator's /metrics has every tenant's row (metrics.tenant_labels).
    text = d.metrics.render().decode()
    assert 'kvpark_tenant_quota_bytes{tenant="alice",tier="host"} 3.145728e+06' in text
    assert 'kvpark_tenant_used_bytes{tenant="bob",tier="host"} 2.097152e+06' in text
    d.engine.check_invariants()


@pytest.mark.parametrize("who", ["alice", "bob"])  # shm (trusted_local) and inline
def test_a_park_larger_than_the_host_tier_counts_against_disk_not_host(daemon: Callable[..., Daemon],
                                                                       who: str) -> None:
    # It streams to disk through windows and never occupies the host tier, so a host
    # quota smaller than it must not refuse it.
    d = daemon(**tenants(**{f"{who}.quota": {"host": "4MiB", "disk": "64MiB"}}))
    with Client(d.address, token=TOKENS[who]) as c:
        c.park("huge", [blob(24 * MiB, 7)])  # the host tier is 16 MiB
        (st,) = c.stat().tenants
        assert st.used["host"] == 0 and st.used["disk"] == 24 * MiB
        assert torch.equal(c.restore("huge")[0], blob(24 * MiB, 7))
    d.engine.check_invariants()


def test_disk_quota_drops_the_tenants_own_coldest_then_refuses_naming_the_quota(
        daemon: Callable[..., Daemon]) -> None:
    d = daemon(**tenants(**{"alice.quota": {"disk": "4MiB"}}), **{"policy.write": "write_through"})
    with Client(d.address, token=TOKENS["alice"]) as a, Client(d.address, token=TOKENS["bob"]) as b:
        b.park("b0", [blob(MiB, 100)])
        for i in range(6):
            a.park(f"a{i}", [blob(MiB, i)])
        assert sorted(_tiers(a)) == ["a2", "a3", "a4", "a5"]
        (st,) = a.stat().tenants
        assert st.used["disk"] == 4 * MiB and st.sequences == 4
        with pytest.raises(NotFound):
            a.restore("a0")
        for i in range(2, 6):
            assert torch.equal(a.restore(f"a{i}")[0], blob(MiB, i))
        # Pinned sequences cannot make room: the park fails, naming the tenant and its quota.
        for i in range(2, 6):
            a.pin(f"a{i}")
        with pytest.raises(ResourceExhausted, match=r"tenant 'alice' is over its disk quota \(4194304 bytes\)"):
            a.park("a6", [blob(MiB, 6)])
        with pytest.raises(ResourceExhausted, match=r"tenant 'alice'.*larger than its whole disk quota"):
            a.park("huge", [blob(5 * MiB, 7)])
        assert sorted(_tiers(a)) == ["a2", "a3", "a4", "a5"]
        assert torch.equal(b.restore("b0")[0], blob(MiB, 100))  # never touched for alice
        # An overwrite replaces its own old bytes: no room needed for them.
        a.park("a5", [blob(MiB, 55)], overwrite=True, pinned=True)
        assert torch.equal(a.restore("a5")[0], blob(MiB, 55))
    d.engine.check_invariants()


def test_ownership_survives_a_restart(daemon: Callable[..., Daemon]) -> None:
    cfg = {**tenants(), "policy.write": "write_through"}
    d = daemon(**cfg)
    with Client(d.address, token=TOKENS["alice"]) as a, Client(d.address, token=TOKENS["bob"]) as b:
        a.park("chat-1", [blob(2000, 1)])
        b.park("chat-1", [blob(3000, 2)])
        a.park("only-alice", [blob(10, 3)])
    d.stop(0.5)
    d = daemon(**cfg)
    with Client(d.address, token=TOKENS["alice"]) as a, Client(d.address, token=TOKENS["bob"]) as b:
        assert torch.equal(a.restore("chat-1")[0], blob(2000, 1))
        assert torch.equal(b.restore("chat-1")[0], blob(3000, 2))
        assert [i.seq_id for i in b.list()] == ["chat-1"]
        assert b.present(["only-alice"]) == [False]
        assert a.stat().tenants[0].sequences == 2


def test_an_open_daemon_keeps_plain_ids(daemon: Callable[..., Daemon]) -> None:
    d = daemon()
    with Client(d.address, token="ignored-when-open") as c:
        c.park("chat-1", [torch.ones(3)])
        assert c.stat().tenants == ()
        assert c.server.max_seq_id_len == 256
    assert [i.seq_id for i in d.engine.list()] == ["chat-1"]  # no namespace on disk or in the index


def test_a_cancelled_restore_stream_of_a_tenant_frees_its_lease(daemon: Callable[..., Daemon]) -> None:
    from ..conftest import wait_until

    # Far larger than gRPC's flow-control window, so the daemon cannot have sent it all
    # (and ended the lease) before the test looks.
    d = daemon(**tenants(), **{"tiers.host.capacity": "64MiB"})
    with Client(d.address, token=TOKENS["bob"]) as b:
        b.park("big", [blob(48 * MiB, 1)])
    with grpc.insecure_channel(d.address) as ch:
        stub = ch.unary_stream("/kvpark.v1.KVPark/Restore", request_serializer=lambda m: m.SerializeToString(),
                               response_deserializer=lambda x: x)
        call = stub(pb.RestoreRequest(seq_id="big"), metadata=[("authorization", f"Bearer {TOKENS['bob']}")],
                    timeout=30)
        next(call)  # the header: the read lease is held now
        assert d.engine is not None and d.engine.leases.count == 1
        call.cancel()
    assert wait_until(lambda: d.engine.leases.count == 0)
    d.engine.check_invariants()


def test_device_quota_demotes_to_host_on_the_cpu_stand_in(daemon: Callable[..., Daemon]) -> None:
    # alice: trusted_local (an untrusted tenant never holds device memory), parking inline.
    dev = {"tiers.device.enabled": "true", "tiers.device.device": "cpu", "tiers.device.capacity": "8MiB",
           "policy.restore_to": "device"}  # inline parks land on the device only then
    d = daemon(**tenants(**{"alice.quota": {"device": "2MiB"}}), **dev)
    with Client(d.address, token=TOKENS["alice"], transport="inline") as b, \
            Client(d.address, token=TOKENS["carol"]) as c:
        c.park("c0", [blob(MiB, 50)])
        for i in range(4):
            b.park(f"b{i}", [blob(MiB, i)])  # inline parks land on the device tier (restore_to)
        tiers = _tiers(b)
        assert sum(t == "device" for t in tiers.values()) <= 2 and tiers["b3"] == "device"
        assert b.stat().tenants[0].used["device"] <= 2 * MiB
        for i in range(4):
            assert torch.equal(b.restore(f"b{i}")[0], blob(MiB, i))
        assert torch.equal(c.restore("c0")[0], blob(MiB, 50))
        # Its device copies pinned, bob's next inline park lands on host, as with no room.
        for sid, t in _tiers(b).items():
            if t == "device":
                b.pin(sid)
        assert b.park("b9", [blob(MiB, 9)]).tier == "host"
    d.engine.check_invariants()


def test_concurrent_parks_of_one_tenant_stay_within_its_quota(daemon: Callable[..., Daemon]) -> None:
    from ..conftest import run_threads

    d = daemon(**tenants(**{"alice.quota": {"host": "2MiB"}}))
    peak: list[int] = []

    def worker(w: int) -> Callable[[], None]:
        def run() -> None:
            with Client(d.address, token=TOKENS["alice"]) as a:  # shm: reserve, write, commit
                for i in range(5):
                    a.park(f"w{w}-{i}", [blob(512 << 10, w * 10 + i)])
                    peak.append(a.stat().tenants[0].used["host"])
        return run

    assert run_threads([worker(w) for w in range(4)]) == []
    assert max(peak) <= 2 * MiB
    with Client(d.address, token=TOKENS["alice"]) as a:
        for w in range(4):
            for i in range(5):
                assert torch.equal(a.restore(f"w{w}-{i}")[0], blob(512 << 10, w * 10 + i))
    d.engine.check_invariants()


def test_an_open_reservation_counts_toward_the_quota(daemon: Callable[..., Daemon]) -> None:
    d = daemon(**tenants(**{"alice.quota": {"host": "2MiB"}}))
    with Client(d.address, token=TOKENS["alice"]) as a:
        n = 3 * MiB // 2
        head = pb.ParkHeader(seq_id="pending", tensors=[pb.TensorMeta(dtype="uint8", shape=[n], nbytes=n)], nbytes=n)
        r = a.rpc.call(a.rpc.reserve, pb.ReserveRequest(header=head, tier="host"))
        with pytest.raises(ResourceExhausted, match="tenant 'alice' is over its host quota"):
            a.park("next", [blob(MiB, 1)])
        a.rpc.release_quietly(r.lease_id)
        a.park("next", [blob(MiB, 1)])  # the aborted reservation no longer counts
    d.engine.check_invariants()
