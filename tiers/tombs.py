"""Remote tombstones on disk: the versions this daemon dropped or replaced whose copies in
the remote tier it has not yet seen deleted.

A drop is acknowledged before Redis has deleted the copy (that runs in the background, and
Redis may be down for a while). Until the delete lands, a local miss must not adopt the
dropped version back from Redis. The daemon keeps the tombstones in memory
(``daemon/remote_tier.py``); this store keeps them across a restart, so a daemon killed
before a delete landed still refuses that version and retries the delete when it starts.

One named sub-database (``tombs``) in the disk tier's LMDB environment: key ``seq_id
utf-8 | 0x00 | generation (u64 BE)``, value the version's ``Manifest.encode()`` (the
delete needs its block lengths). Written without an fsync, like a drop: a committed LMDB
transaction survives the daemon's death, which is what a tombstone must outlive.

Primitives: ``Tombs(env)``; ``add(manifests)``, ``remove(manifests)``, ``load() ->
list[Manifest]`` (unreadable records are logged and deleted); ``load_db(env, db, what)``,
that load for any sub-database of manifests. Write errors are the caller's to type
(``lmdb.Error``).
"""

from __future__ import annotations

import logging
import struct
from typing import Sequence

import lmdb

from .disk import Manifest

_GEN = struct.Struct(">Q")
log = logging.getLogger(__name__)


def _key(m: Manifest) -> bytes:
    return m.seq_id.encode() + b"\x00" + _GEN.pack(m.gen)


class Tombs:
    def __init__(self, env: lmdb.Environment) -> None:
        self._env = env
        self._db = env.open_db(b"tombs")

    def add(self, manifests: Sequence[Manifest]) -> None:
        if manifests:
            with self._env.begin(write=True) as txn:
                for m in manifests:
                    txn.put(_key(m), m.encode(), db=self._db)

    def remove(self, manifests: Sequence[Manifest]) -> None:
        if manifests:
            with self._env.begin(write=True) as txn:
                for m in manifests:
                    txn.delete(_key(m), db=self._db)

    def load(self) -> list[Manifest]:
        """The tombstones stored; one that does not parse is logged and deleted (it can
        name no delete to finish), never a reason not to start."""
        return load_db(self._env, self._db, "remote tombstone")


def load_db(env: lmdb.Environment, db: object, what: str) -> list[Manifest]:
    """The manifests stored as the values of ``db``; a record that does not parse is
    logged (as ``what``) and deleted, as ``DiskStore.load_manifests`` skips one."""
    out, bad = [], []
    with env.begin() as txn:
        for k, v in txn.cursor(db=db):
            try:
                out.append(Manifest.decode(bytes(v)))
            except Exception as e:  # noqa: BLE001 - any damage: skipped
                bad.append(bytes(k))
                log.error("%s %r unreadable, deleted: %s", what, bytes(k)[:80], e)
    if bad:
        with env.begin(write=True) as txn:
            for k in bad:
                txn.delete(k, db=db)
    return out
