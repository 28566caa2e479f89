"""End-to-end verification (``Client(verify=True)`` / ``KVPARK_VERIFY=1``).

Round trips on every data path; the digests kept on every tier (host, disk after a
restart, remote through another daemon) and through composites; and a corruption the daemon cannot see (bytes changed
in the host arena behind its back) is ``DataLoss`` under verify, while a plain client
gets the changed bytes back (the gap verify closes).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import lmdb
import pytest
import torch

from kvpark.client import Client
from kvpark.client.verify import ENV, digest
from kvpark.daemon.server import Daemon
from kvpark.proto import convert, digests
from kvpark.proto.errors import DataLoss, InvalidArgument
from kvpark.proto.layout import TensorMeta
from kvpark.proto.v1 import kvpark_pb2 as pb
from kvpark.tiers.disk import HEADER, Manifest, block_key, checksum

from ..conftest import wait_until
from ..daemon.test_remote_tier import _new_ns, _own_dirs, _remote, _synced

KiB, MiB = 1 << 10, 1 << 20

# transport name -> (Client transport, daemon overrides)
PATHS: dict[str, tuple[str, dict[str, str]]] = {
    "shm": ("shm", {}),
    "inline-datachannel": ("inline", {"server__data_channel": "true"}),
    "inline-grpc": ("inline", {"server__data_channel": "false"}),
}
# small: the one-message path (ParkSmall/Get, or inline in Acquire); large: the streamed
# or leased path; windowed: larger than the host tier (16 MiB in the tests' config).
SIZES = {"small": 4 * KiB, "large": 2 * MiB, "windowed": 24 * MiB}


def tensors(total: int, n: int = 4, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    per = total // n
    return [torch.randint(0, 256, (per,), dtype=torch.uint8, generator=g) for _ in range(n)]


def corrupt_host_copy(d: Daemon, seq_id: str) -> None:
    """Flip one byte of ``seq_id``'s host-arena copy without the daemon knowing (as a
    stray write by another local process would)."""
    assert d.engine is not None
    with d.engine.catalog.lock:
        seq = d.engine.catalog.find(seq_id)
        assert seq is not None and "host" in seq.res, seq_id
        off, n = seq.res["host"].extents[-1]
        d.engine.arena.tensor[off + n - 1] ^= 0xFF


def corrupt_disk_record(disk_dir: Path, seq_id: str, block: int) -> None:
    """Flip one byte of a stopped daemon's disk record and fix up the record's own
    checksum, so the daemon's read check passes (a bit flip before the checksum was
    taken, or a bug that wrote the wrong bytes, looks just like this)."""
    env = lmdb.open(str(disk_dir), max_dbs=4, map_size=1 << 30)
    blocks, manifests = env.open_db(b"blocks"), env.open_db(b"manifests")
    with env.begin(write=True) as txn:
        m = Manifest.decode(txn.get(seq_id.encode(), db=manifests))
        key = block_key(seq_id, m.key_gen, block)
        raw = bytearray(txn.get(key, db=blocks))
        magic, version, flags, res, fp, ln, _ = HEADER.unpack_from(raw)
        raw[HEADER.size + 7] ^= 0x40
        HEADER.pack_into(raw, 0, magic, version, flags, res, fp, ln, checksum(bytes(raw[HEADER.size:])))
        txn.put(key, bytes(raw), db=blocks)
    env.close()


@pytest.mark.parametrize("size", list(SIZES))
@pytest.mark.parametrize("path", list(PATHS))
def test_verified_round_trip_on_every_transport(daemon: Callable[..., Daemon], path: str, size: str) -> None:
    transport, overrides = PATHS[path]
    d = daemon(**overrides)
    ts = tensors(SIZES[size])
    with Client(d.address, transport=transport, verify=True) as c:
        c.park("s", ts)
        assert c.info("s").xxh3 == tuple(digest(t) for t in ts)
        assert digests.HASH_ATTR not in c.info("s").attrs
        assert all(torch.equal(a, b) for a, b in zip(c.restore("s"), ts))
        into = [torch.empty_like(t) for t in ts]
        c.restore("s", into=into)
        assert all(torch.equal(a, b) for a, b in zip(into, ts))
        flat = torch.empty(sum(t.numel() for t in ts), dtype=torch.uint8)
        c.restore_many(["s"], into_flat=flat)
        assert torch.equal(flat, torch.cat(ts))
        assert [i for i, _ in c.restore("s", layerwise=True)] == list(range(len(ts)))


@pytest.mark.parametrize("size", ["small", "large"])
@pytest.mark.parametrize("path", list(PATHS))
def test_a_corruption_the_daemon_cannot_see_is_data_loss_under_verify(
        daemon: Callable[..., Daemon], path: str, size: str) -> None:
    transport, overrides = PATHS[path]
    d = daemon(**overrides)
    ts = tensors(SIZES[size])
    with Client(d.address, transport=transport, verify=True) as c, \
            Client(d.address, transport=transport) as plain:
        c.park("s", ts)
        corrupt_host_copy(d, "s")
        # The gap verify closes: the daemon serves the changed bytes as good ones.
        got = plain.restore("s")
        assert not torch.equal(got[-1], ts[-1])
        with pytest.raises(DataLoss, match="digest"):
            c.restore("s")
        with pytest.raises(DataLoss):
            c.restore("s", into=[torch.empty_like(t) for t in ts])
        with pytest.raises(DataLoss):
            c.restore_many(["s"], into_flat=torch.empty(sum(t.numel() for t in ts), dtype=torch.uint8))
        with pytest.raises(DataLoss):
            list(c.restore("s", layerwise=True))


@pytest.mark.parametrize("path", list(PATHS))
def test_a_disk_record_with_a_fixed_up_checksum_is_data_loss_under_verify(
        daemon: Callable[..., Daemon], tmp_path: Path, path: str) -> None:
    transport, overrides = PATHS[path]
    d = daemon(**overrides)
    ts = tensors(SIZES["windowed"])  # larger than the host tier: restored window by window from disk
    with Client(d.address, transport=transport, verify=True) as c:
        c.park("s", ts)
        assert c.info("s").tier == "disk"
    d.stop(0.5)
    corrupt_disk_record(tmp_path / "disk", "s", 1)
    d2 = daemon(**overrides)
    with Client(d2.address, transport=transport, verify=True) as c, \
            Client(d2.address, transport=transport) as plain:
        got = plain.restore("s")  # the daemon's own check passes: the gap verify closes
        assert sum(not torch.equal(a, b) for a, b in zip(got, ts)) == 1
        with pytest.raises(DataLoss, match="digest"):
            c.restore("s")
        with pytest.raises(DataLoss, match="digest"):
            c.restore_many(["s"], into_flat=torch.empty(sum(t.numel() for t in ts), dtype=torch.uint8))


def test_a_leased_grant_is_checked(daemon: Callable[..., Daemon]) -> None:
    d = daemon()
    ts = tensors(SIZES["large"])
    flat = torch.empty(sum(t.numel() for t in ts), dtype=torch.uint8)
    with Client(d.address, transport="shm", verify=True) as c:
        c.park("s", ts)
        _, grant = c.lookup_acquire(["s"])
        assert grant is not None and not grant.inlined
        c.restore_grant(grant, into_flat=flat)
        assert torch.equal(flat, torch.cat(ts))
        corrupt_host_copy(d, "s")
        _, grant = c.lookup_acquire(["s"])
        assert grant is not None
        with pytest.raises(DataLoss):
            c.restore_grant(grant, into_flat=flat)


def test_an_inline_grant_is_checked(daemon: Callable[..., Daemon]) -> None:
    d = daemon()
    ts = tensors(SIZES["small"])
    flat = torch.empty(sum(t.numel() for t in ts), dtype=torch.uint8)
    with Client(d.address, transport="shm", verify=True) as c:
        c.park("s", ts)
        corrupt_host_copy(d, "s")
        _, grant = c.lookup_acquire(["s"])
        assert grant is not None and grant.inlined
        with pytest.raises(DataLoss):
            c.restore_grant(grant, into_flat=flat)


def test_digests_survive_disk_and_a_restart(daemon: Callable[..., Daemon], tmp_path: Any) -> None:
    d = daemon()
    ts = tensors(SIZES["large"])
    with Client(d.address, transport="shm", verify=True) as c:
        c.park("s", ts, attrs={"layout": "x"})
        assert c.flush() == 1
    d.stop(0.5)
    d2 = daemon()
    with Client(d2.address, transport="shm", verify=True) as c:
        info = c.info("s")
        assert info.tier == "disk" and info.attrs == {"layout": "x"}
        assert info.xxh3 == tuple(digest(t) for t in ts)
        assert all(torch.equal(a, b) for a, b in zip(c.restore("s"), ts))


def test_composites_check_each_part_that_carries_digests(daemon: Callable[..., Daemon]) -> None:
    d = daemon()
    blk, own, other = tensors(64 * KiB, 2, 1), tensors(64 * KiB, 2, 2), tensors(64 * KiB, 2, 3)
    with Client(d.address, transport="shm", verify=True) as c, Client(d.address, transport="shm") as plain:
        c.park("s", own, refs=["B"], new_blocks={"B": blk})
        plain.park("p", other)  # parked without verify: its tensors are not checked
        assert c.info("s").xxh3 == tuple(digest(t) for t in blk + own)
        assert plain.restore("s")[0].equal(blk[0])
        info, got = c.restore_many(["s", "p"])
        assert info.xxh3[4:] == (0, 0) and all(torch.equal(a, b) for a, b in zip(got, blk + own + other))
        c.park_batch({"x": own, "y": other})
        assert c.info("y").xxh3 == tuple(digest(t) for t in other)
        corrupt_host_copy(d, "B")
        with pytest.raises(DataLoss):
            c.restore("s")


def test_a_sequence_parked_without_verify_restores_under_verify(daemon: Callable[..., Daemon]) -> None:
    d = daemon()
    ts = tensors(SIZES["large"])
    with Client(d.address, transport="shm") as plain, Client(d.address, transport="shm", verify=True) as c:
        plain.park("s", ts)
        assert c.info("s").xxh3 == ()
        assert all(torch.equal(a, b) for a, b in zip(c.restore("s"), ts))


def test_the_digest_attr_is_reserved(daemon: Callable[..., Daemon]) -> None:
    d = daemon()
    with Client(d.address, transport="shm") as c:
        with pytest.raises(InvalidArgument, match="reserved"):
            c.park("s", tensors(4 * KiB), attrs={digests.HASH_ATTR: "00" * 8})
        with pytest.raises(InvalidArgument, match="reserved"):
            c.park_batch({"a": tensors(4 * KiB)}, attrs={digests.HASH_ATTR: "00" * 8})
        assert c.present(["s", "a"]) == [False, False]


def test_verify_is_read_from_the_environment(daemon: Callable[..., Daemon], monkeypatch: pytest.MonkeyPatch) -> None:
    d = daemon()
    monkeypatch.setenv(ENV, "1")
    with Client(d.address, transport="shm") as c:
        assert c.verify
        c.park("s", tensors(4 * KiB))
        assert c.info("s").xxh3
    with Client(d.address, transport="shm", verify=False) as c:
        assert not c.verify


def test_digests_travel_with_the_remote_copy(tmp_path: Path, daemon: Callable[..., Daemon],
                                             redis_server: Any) -> None:
    ns = _new_ns()
    a = daemon(**_own_dirs(tmp_path, "a"), **_remote(redis_server.url, ns))
    b = daemon(**_own_dirs(tmp_path, "b"), **_remote(redis_server.url, ns))
    ts = tensors(SIZES["large"])
    with Client(a.address, transport="shm", verify=True) as ca, Client(b.address, transport="shm", verify=True) as cb:
        ca.park("s", ts)
        assert wait_until(lambda: _synced(ca), timeout=30)
        info = cb.info("s")  # b has never seen it: its manifest comes from Redis
        assert info.tier == "remote" and info.xxh3 == tuple(digest(t) for t in ts)
        assert all(torch.equal(x, y) for x, y in zip(cb.restore("s"), ts))


def test_a_park_with_digests_not_one_per_tensor_is_invalid(daemon: Callable[..., Daemon]) -> None:
    d = daemon()
    ts = tensors(4 * KiB, 2)
    with Client(d.address, transport="shm") as c:
        header = pb.ParkHeader(seq_id="s", tensors=[convert.meta_to_pb(TensorMeta.of(t)) for t in ts],
                               nbytes=sum(t.numel() for t in ts), xxh3=[digest(ts[0])])
        data = b"".join(t.numpy().tobytes() for t in ts)
        with pytest.raises(InvalidArgument, match="digests"):
            c.rpc.call(c.rpc.park_small, pb.ParkSmallRequest(header=header, data=data))
        assert c.present(["s"]) == [False]
