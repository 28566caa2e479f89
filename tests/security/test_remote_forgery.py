"""Attack: a forged chunk in Redis (issue 23 F6), on real daemons sharing one namespace.

Without a key the remote tier's integrity is a checksum: anyone who can write to the
Redis rewrites a chunk with a recomputed xxh3 and it is served, to the tenant, as its own
KV (the documented behaviour, pinned here). With ``tiers.remote.key_file`` every value is
sealed with AES-256-GCM: a Redis reader sees no KV bytes, and a forged, altered or moved
value is DATA_LOSS and deleted, never served."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import pytest
import redis
import torch
import xxhash

from kvpark.client import Client
from kvpark.daemon.server import Daemon
from kvpark.daemon.tenants import SEP
from kvpark.proto.errors import DataLoss, NotFound
from kvpark.tiers.remote import CHUNK_HEADER, encode_chunk

from ..conftest import wait_until
from ..daemon.test_remote_tier import _new_ns, _own_dirs, _remote, _synced
from ..daemon.test_tenants import TOKENS, tenants
from ..redis_servers import RedisServer


def _pair(daemon: Callable[..., Daemon], srv: RedisServer, tmp_path: Path, **remote: object) -> tuple[Daemon, Daemon,
                                                                                                      str]:
    ns = _new_ns()
    a = daemon(**tenants(), **_remote(srv.url, ns, **remote), **_own_dirs(tmp_path, "a"))
    b = daemon(**tenants(), **_remote(srv.url, ns, **remote), **_own_dirs(tmp_path, "b"))
    return a, b, ns


def _chunk_key(r: redis.Redis, ns: str) -> bytes:
    keys = [k for k in r.scan_iter(f"{ns}:*".encode()) if b":v:" in k and f"alice{SEP}chat-1:".encode() in k]
    assert len(keys) == 1, keys
    return keys[0]


def forge_chunk(raw: bytes, payload: bytes) -> bytes:
    """A plain chunk rewritten with ``payload`` and its recomputed xxh3: what anyone who can
    write to Redis can do without a key."""
    head = list(CHUNK_HEADER.unpack_from(raw))
    head[-2], head[-1] = len(payload), xxhash.xxh3_64_intdigest(payload)
    return CHUNK_HEADER.pack(*head) + payload


def _key_file(tmp_path: Path, name: str, key: bytes) -> str:
    p = tmp_path / name
    p.write_text(key.hex())
    p.chmod(0o600)
    return str(p)


SECRET = torch.arange(64 << 10, dtype=torch.int64).to(torch.uint8)
EVIL = torch.full((64 << 10,), 0x41, dtype=torch.uint8)


def test_without_a_key_a_forged_chunk_with_a_recomputed_checksum_is_served(
        daemon: Callable[..., Daemon], redis_server: RedisServer, tmp_path: Path) -> None:
    a, b, ns = _pair(daemon, redis_server, tmp_path)
    r = redis.Redis(port=redis_server.port)
    with Client(a.address, token=TOKENS["alice"]) as ca, Client(b.address, token=TOKENS["alice"]) as cb:
        ca.park("chat-1", [SECRET])
        assert wait_until(lambda: _synced(ca), timeout=30)
        key = _chunk_key(r, ns)
        assert bytes(SECRET.numpy()) in r.get(key)  # a Redis reader reads the KV
        r.set(key, forge_chunk(r.get(key), bytes(EVIL.numpy())))
        # The documented no-key behaviour: served as alice's own KV.
        assert torch.equal(cb.restore("chat-1")[0], EVIL)


def test_with_a_key_a_forged_chunk_is_data_loss_and_deleted(
        daemon: Callable[..., Daemon], redis_server: RedisServer, tmp_path: Path) -> None:
    kf = _key_file(tmp_path, "remote.key", bytes(range(32)))
    a, b, ns = _pair(daemon, redis_server, tmp_path, key_file=kf)
    r = redis.Redis(port=redis_server.port)
    with Client(a.address, token=TOKENS["alice"]) as ca, Client(b.address, token=TOKENS["alice"]) as cb:
        ca.park("chat-1", [SECRET])
        assert wait_until(lambda: _synced(ca), timeout=30)
        key = _chunk_key(r, ns)
        raw = r.get(key)
        assert raw[:4] == b"KVPX" and bytes(SECRET.numpy())[:4096] not in raw  # a Redis reader learns nothing
        # What a Redis writer can make without the key: a well-formed plain chunk.
        gen = int(key.rsplit(b":", 2)[1])
        fp = int(key.split(b":v:")[1].split(b":")[0], 16)
        r.set(key, encode_chunk(0, fp, gen, bytes(EVIL.numpy())))
        with pytest.raises(DataLoss):
            cb.restore("chat-1")
        assert r.exists(key) == 0
        assert not [k for k in r.scan_iter(f"{ns}:*".encode()) if b"chat-1" in k]  # the sequence is gone
        assert cb.stat().remote.data_loss == 1
        with pytest.raises(NotFound):
            cb.info("chat-1")
        # The daemon that parked it still serves its own local copy, untouched.
        assert torch.equal(ca.restore("chat-1")[0], SECRET)


def test_rotation_serves_values_sealed_with_the_old_key(
        daemon: Callable[..., Daemon], redis_server: RedisServer, tmp_path: Path) -> None:
    old, new = _key_file(tmp_path, "old.key", bytes(32)), _key_file(tmp_path, "new.key", bytes(range(1, 33)))
    ns = _new_ns()
    a = daemon(**tenants(), **_remote(redis_server.url, ns, key_file=old), **_own_dirs(tmp_path, "a"))
    b = daemon(**tenants(), **_remote(redis_server.url, ns, key_file=new, old_key_files=[old]),
               **_own_dirs(tmp_path, "b"))
    c = daemon(**tenants(), **_remote(redis_server.url, ns, key_file=new), **_own_dirs(tmp_path, "c"))
    with Client(a.address, token=TOKENS["alice"]) as ca:
        ca.park("chat-1", [SECRET])
        assert wait_until(lambda: _synced(ca), timeout=30)
    with Client(b.address, token=TOKENS["alice"]) as cb:
        assert torch.equal(cb.restore("chat-1")[0], SECRET)
        assert wait_until(lambda: b.engine.remote.store.stats().resealed >= 2, timeout=10)
    with Client(c.address, token=TOKENS["alice"]) as cc:  # re-sealed: the new key alone reads it
        assert torch.equal(cc.restore("chat-1")[0], SECRET)
