"""Remote-only versions on disk: what this daemon moved out to the remote tier, so the
index after a restart still knows them.

A disk eviction to the remote tier deletes the version's local records; the index keeps
it as a version only Redis holds. Without a record of that on disk, a restart forgot it:
an overwrite of the id then published over nothing, and the old version stayed in Redis,
untombstoned, to be adopted back after a drop of the new one (a dropped id back with
bytes the client had replaced). A stub is written before the local records go; at start
each stub indexes its version again as remote-only, as the index held it before.

One named sub-database (``stubs``) in the disk tier's LMDB environment: key the id
(utf-8; the index holds one version per id), value that version's ``Manifest.encode()``.
Written without an fsync, like the delete it precedes. A stub outlives its version in
two harmless ways: a crash between the stub and the delete (the same generation is on
disk at start: nothing to adopt), or a failed removal (its version is tombstoned: the
start removes it then).

Primitives: ``Stubs(env)``; ``put(m)``, ``remove(m)`` (generation-exact), ``load() ->
list[Manifest]`` (unreadable records are logged and deleted). Write errors are the
caller's to type (``lmdb.Error``).
"""

from __future__ import annotations

import lmdb

from .disk import Manifest
from .tombs import load_db


class Stubs:
    def __init__(self, env: lmdb.Environment) -> None:
        self._env = env
        self._db = env.open_db(b"stubs")

    def put(self, m: Manifest) -> None:
        with self._env.begin(write=True) as txn:
            txn.put(m.seq_id.encode(), m.encode(), db=self._db)

    def remove(self, m: Manifest) -> None:
        """Delete the stub of ``m``'s id if it is ``m``'s generation (a newer eviction's
        stub of the id stays)."""
        key = m.seq_id.encode()
        with self._env.begin(write=True) as txn:
            v = txn.get(key, db=self._db)
            if v is not None and _gen(bytes(v)) in (m.gen, None):
                txn.delete(key, db=self._db)

    def load(self) -> list[Manifest]:
        return load_db(self._env, self._db, "remote-only stub")


def _gen(raw: bytes) -> int | None:
    try:
        return Manifest.decode(raw).gen
    except Exception:  # noqa: BLE001 - a rotten stub: removed by any removal of its id
        return None
