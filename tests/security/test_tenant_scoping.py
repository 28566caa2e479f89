"""Attacks on what one tenant can make the daemon do to, or tell about, another (issue
23's minor items): flush, stat, leases, and the token file itself."""

from __future__ import annotations

import secrets
from pathlib import Path
from typing import Any, Callable

import grpc
import torch

from kvpark.client import Client
from kvpark.daemon.server import Daemon
from kvpark.daemon.tenants import SEP
from kvpark.proto.v1 import kvpark_pb2 as pb

from ..daemon.test_arena_safety import serve
from ..daemon.test_tenants import TOKENS, tenants

MiB = 1 << 20


def _md(who: str) -> list[tuple[str, str]]:
    return [("authorization", f"Bearer {TOKENS[who]}")]


def _unary(ch: grpc.Channel, name: str, resp: Any) -> Callable[..., Any]:
    return ch.unary_unary(f"/kvpark.v1.KVPark/{name}", request_serializer=lambda m: m.SerializeToString(),
                          response_deserializer=resp.FromString)


def test_flush_writes_only_the_calling_tenants_sequences(daemon: Callable[..., Daemon]) -> None:
    d = daemon(**tenants(), **{"policy.write": "write_back"})
    with Client(d.address, token=TOKENS["alice"]) as a, Client(d.address, token=TOKENS["bob"]) as b:
        a.park("a1", [torch.ones(1024)])
        a.park("a2", [torch.ones(2048)])
        b.park("b1", [torch.ones(1024)])
        assert b.flush() == 1
        assert d.engine is not None
        with d.engine.catalog.lock:
            on_disk = {s.seq_id: s.on_disk for s in d.engine.catalog.sequences()}
        assert on_disk == {"bob" + SEP + "b1": True, "alice" + SEP + "a1": False, "alice" + SEP + "a2": False}
        assert a.flush() == 2


def test_stat_shows_a_tenant_only_its_own_counts_and_the_tiers_totals(daemon: Callable[..., Daemon]) -> None:
    d = daemon(**tenants())
    with Client(d.address, token=TOKENS["alice"]) as a, Client(d.address, token=TOKENS["bob"]) as b, \
            grpc.insecure_channel(d.address) as ch:
        quiet = b.stat()
        for i in range(3):
            a.park(f"a{i}", [torch.ones(MiB // 4)])
        # alice holds a reservation open, too.
        hdr = pb.ParkHeader(seq_id="open", nbytes=MiB, tensors=[pb.TensorMeta(dtype="uint8", shape=[MiB],
                                                                              nbytes=MiB)])
        _unary(ch, "Reserve", pb.ReserveResponse)(pb.ReserveRequest(header=hdr, tier="host"), metadata=_md("alice"),
                                                  timeout=30)
        busy = b.stat()
        # Nothing of alice's activity shows in bob's counts...
        assert (busy.sequences, busy.leases) == (quiet.sequences, quiet.leases) == (0, 0)
        assert {t: s.sequences for t, s in busy.tiers.items()} == {t: 0 for t in busy.tiers}
        # ...while the tiers' totals (how full the daemon is) are everyone's.
        assert busy.tiers["host"].used_bytes > quiet.tiers["host"].used_bytes
        (row,) = busy.tenants
        assert row.name == "bob" and row.sequences == 0
        mine = a.stat()
        assert (mine.sequences, mine.leases, mine.tiers["host"].sequences) == (3, 1, 3)
        b.park("b0", [torch.ones(16)])
        assert b.stat().sequences == 1


def test_stat_counts_a_tenants_own_sequences_on_disk(daemon: Callable[..., Daemon]) -> None:
    """A tenant's ``stat()`` says how many of its own sequences have a disk copy (the disk
    tier's ``sequences``), counting each one, and none of another tenant's. Write-back,
    flushed by hand, so what is on disk is exactly what each tenant flushed."""
    # No dirty bound (0): nothing is written behind the test's back, however slow the machine.
    d = daemon(**tenants(), **{"policy.write": "write_back", "policy.max_dirty_s": 0})
    with Client(d.address, token=TOKENS["alice"]) as a, Client(d.address, token=TOKENS["bob"]) as b:
        for i in range(3):
            a.park(f"a{i}", [torch.ones(1024 * (i + 1))])
        b.park("b0", [torch.ones(1024)])
        assert a.stat().tiers["disk"].sequences == 0  # nothing written yet
        assert a.flush() == 3
        assert a.stat().tiers["disk"].sequences == 3
        assert b.stat().tiers["disk"].sequences == 0  # alice's disk copies are not bob's
        assert b.flush() == 1
        assert b.stat().tiers["disk"].sequences == 1
        assert a.stat().tiers["disk"].sequences == 3


def test_a_foreign_lease_is_answered_exactly_as_a_nonexistent_one(daemon: Callable[..., Daemon]) -> None:
    d = daemon(**tenants())
    with grpc.insecure_channel(d.address) as ch:
        hdr = pb.ParkHeader(seq_id="x", nbytes=MiB, tensors=[pb.TensorMeta(dtype="uint8", shape=[MiB], nbytes=MiB)])
        real = _unary(ch, "Reserve", pb.ReserveResponse)(pb.ReserveRequest(header=hdr, tier="host"),
                                                         metadata=_md("alice"), timeout=30).lease_id
        fake = secrets.token_hex(len(real) // 2)
        assert len(fake) == len(real) and fake != real

        def answer(lease_id: str) -> list[Any]:
            out: list[Any] = []
            for name, req, resp in (("Commit", pb.CommitRequest(lease_id=lease_id), pb.SeqInfo),
                                    ("Window", pb.WindowRequest(lease_id=lease_id, index=0), pb.WindowResponse),
                                    ("Release", pb.ReleaseRequest(lease_id=lease_id), pb.ReleaseResponse)):
                try:
                    out.append(_unary(ch, name, resp)(req, metadata=_md("carol"), timeout=30))
                except grpc.RpcError as e:
                    out.append((name, e.code(), e.details().replace(lease_id, "<id>"),
                                tuple(e.trailing_metadata() or ())))
            return out

        assert answer(real) == answer(fake)
        # And alice's reservation is untouched by all of it.
        info = _unary(ch, "Commit", pb.SeqInfo)(pb.CommitRequest(lease_id=real), metadata=_md("alice"), timeout=30)
        assert info.seq_id == "x" and info.nbytes == MiB


def test_a_token_file_open_to_group_or_others_refuses_start_up(tmp_path: Path) -> None:
    (tmp_path / "shm").mkdir()
    token = tmp_path / "alice.token"
    token.write_text("alice-secret-token\n")
    for mode in (0o644, 0o640, 0o604):
        token.chmod(mode)
        r = serve(tmp_path, f"tiers.host.shm_dir={tmp_path / 'shm'}", "tiers.host.capacity=16MiB",
                  "metrics.listen=", f"tenants.alice.token_file={token}", timeout=30)
        assert r.returncode == 2, r.stderr
        lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
        assert len(lines) == 1 and "token_file" in lines[0] and f"{mode:04o}" in lines[0], r.stderr
        assert "Traceback" not in r.stderr and "alice-secret-token" not in r.stderr
