"""Attack: an open daemon and a tenant's daemon share one Redis and namespace (issue 23 F5).

Before key spaces, both wrote ``NS:m:<id>``: a tenant's keys differed from an open
daemon's only by the separator inside the id, so whatever could write an id holding it
(an older open daemon, which did not refuse the separator) wrote straight into the
tenant's sequences. Now a tenant's keys live under ``NS:t:<tenant>:`` and an open
daemon's under ``NS:o:``: the open daemon can neither restore the tenant's sequences nor
plant into them, and keys in the old layout are never read for a tenant's ids."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import pytest
import redis
import torch

from kvpark.client import Client
from kvpark.daemon.server import Daemon
from kvpark.daemon.tenants import SEP
from kvpark.proto.errors import InvalidArgument, NotFound
from kvpark.tiers.remote import decode_manifest, encode_chunk, encode_manifest

from ..conftest import wait_until
from ..daemon.test_remote_tier import _new_ns, _own_dirs, _remote, _synced
from ..daemon.test_tenants import TOKENS, tenants
from ..redis_servers import RedisServer


def _scan(srv: RedisServer, ns: str) -> list[str]:
    return srv.cli("--scan", "--pattern", f"{ns}:*").split()


def test_an_open_daemon_can_neither_restore_nor_plant_into_a_tenants_remote_key_space(
        daemon: Callable[..., Daemon], redis_server: RedisServer, tmp_path: Path) -> None:
    ns = _new_ns()
    owned = daemon(**tenants(), **_remote(redis_server.url, ns), **_own_dirs(tmp_path, "owned"))
    open_ = daemon(**_remote(redis_server.url, ns), **_own_dirs(tmp_path, "open"))
    secret, mine = torch.full((4096,), 7, dtype=torch.uint8), torch.full((4096,), 9, dtype=torch.uint8)
    with Client(owned.address, token=TOKENS["alice"]) as alice, Client(open_.address) as anon:
        alice.park("chat-1", [secret])
        anon.park("other", [mine])
        assert wait_until(lambda: _synced(alice) and _synced(anon), timeout=30)

        # The raw keys: alice's under t:alice:, the open daemon's under o:, nothing else.
        keys = _scan(redis_server, ns)
        theirs = [k for k in keys if SEP in k]
        assert theirs and all(k.startswith(f"{ns}:t:alice:") for k in theirs), keys
        assert all(k.startswith(f"{ns}:o:") for k in keys if SEP not in k), keys

        # Restore: the open daemon cannot name alice's id, and its own "chat-1" is not hers.
        with pytest.raises(InvalidArgument):
            anon.restore("alice" + SEP + "chat-1")
        with pytest.raises(NotFound):
            anon.restore("chat-1")
        assert anon.present(["chat-1"]) == [False]

        # Plant: the open daemon's own "planted" lands in its key space only.
        anon.park("planted", [mine])
        assert wait_until(lambda: _synced(anon), timeout=30)
        assert alice.present(["planted"]) == [False]

    with Client(owned.address, token=TOKENS["alice"]) as alice:
        assert torch.equal(alice.restore("chat-1")[0], secret)


def test_keys_an_older_open_daemon_planted_under_a_tenants_ids_are_never_served(
        daemon: Callable[..., Daemon], redis_server: RedisServer, tmp_path: Path) -> None:
    """An open daemon of an older build accepted "alice<SEP>legacy" and wrote it in the
    layout of the time (``NS:m:<id>``): alice's daemon never reads that layout for her ids."""
    ns = _new_ns()
    owned = daemon(**tenants(), **_remote(redis_server.url, ns), **_own_dirs(tmp_path, "owned"))
    secret, mine = torch.full((4096,), 7, dtype=torch.uint8), torch.full((4096,), 9, dtype=torch.uint8)
    with Client(owned.address, token=TOKENS["alice"]) as alice:
        alice.park("chat-1", [secret])
        assert wait_until(lambda: _synced(alice), timeout=30)
        keys = _scan(redis_server, ns)
        r = redis.Redis(port=redis_server.port)
        mkey = next(k for k in keys if k.endswith(f":m:alice{SEP}chat-1"))
        m, chunk = decode_manifest(r.get(mkey))
        sid = "alice" + SEP + "legacy"
        r.set(f"{ns}:v:{m.fingerprint:016x}:{sid}:{m.gen}:0",
              encode_chunk(0, m.fingerprint, m.gen, bytes(mine.numpy())))
        r.set(f"{ns}:m:{sid}", encode_manifest(m.replace(seq_id=sid), chunk))
        assert alice.present(["legacy"]) == [False]
        with pytest.raises(NotFound):
            alice.restore("legacy")
