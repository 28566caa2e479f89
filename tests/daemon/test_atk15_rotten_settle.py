"""Fresh-eyes attack 15 on the "absence is durable when it is answered" change
(4f5a4df..f59e3ec): ``Deletes.settle`` catches only ``KVParkError`` around its unpublish.

A dropped version whose manifest rotted on disk (bit rot: not a manifest any more) fails
its drop's delete with an untyped ``ValueError`` (``Manifest.decode``); since 8deb81b that
is queued and the drop answers UNAVAILABLE. From then on every answer of absence for the
id runs ``settle``, whose ``DiskStore.unpublish`` decodes the same rotten bytes and raises
``ValueError`` again: it leaves ``settle`` untyped, so ``present``, a prefix ``lookup``
naming the id, ``restore``, ``info`` and ``drop`` answer INTERNAL, on every call, forever
(the maintenance retry meets the same error each pass and never clears the entry).
Before the change ``present`` answered ``[False]``, and a restart skips an unreadable
manifest (``load_manifests``), so that answer was durable all along; docs/protocol.md
promises UNAVAILABLE ("ask again") when absence cannot be made durable, never INTERNAL.
"""

from __future__ import annotations

from typing import Callable

import pytest
import torch

from kvpark.client import Client
from kvpark.daemon.server import Daemon
from kvpark.proto.errors import KVParkError, NotFound, Unavailable

from .disk_seams import crash_image


def full(n: int, v: int) -> torch.Tensor:
    return torch.full((n,), v, dtype=torch.uint8)


def _answer(call: Callable[[], object]) -> object:
    try:
        return call()
    except KVParkError as e:
        return e


def test_a_dropped_id_whose_manifest_rotted_never_answers_internal_to_every_question_of_absence(
        daemon: Callable[..., Daemon], tmp_path) -> None:
    d = daemon(**{"policy.write": "write_through", "policy.flush_on_shutdown": "false"})
    eng = d.engine
    assert eng is not None
    with Client(d.address) as c:
        c.park("p", [full(4096, 1)])
        c.park("q", [full(4096, 2)])
        with eng.disk.env.begin(write=True) as txn:  # p's manifest rots on disk
            txn.put(b"p", b"\xff not a manifest", db=eng.disk._manifests)
        first = _answer(lambda: c.drop("p", timeout=30))  # a rotten manifest is no version: dropped
        assert first is True or isinstance(first, Unavailable), first
        for _ in range(3):
            eng.deletes.retry()  # maintenance passes
        answers = {
            "present": _answer(lambda: c.present(["p"], timeout=30)),
            "lookup": _answer(lambda: c.lookup(["q", "p"], timeout=30)),
            "info": _answer(lambda: c.info("p", timeout=30)),
            "restore": _answer(lambda: c.restore("p", timeout=30)),
            "drop": _answer(lambda: c.drop("p", timeout=30)),
        }
        image = crash_image(eng.disk, str(tmp_path / "crash"))
    d.stop(0.5)
    d2 = daemon(**{"tiers.disk.path": image, "policy.flush_on_shutdown": "false"})
    with Client(d2.address) as c2:
        after = c2.present(["p"])
    assert after == [False], f"after a crash present(p)={after}"
    untyped = {k: v for k, v in answers.items()
               if isinstance(v, KVParkError) and not isinstance(v, (Unavailable, NotFound))}
    assert not untyped, (
        f"p was dropped (its rotten manifest is skipped at any restart: present(p)={after} there); the live "
        f"daemon answers {answers}: settle's unpublish raised ValueError, which it does not catch "
        "(only KVParkError), so every question about p fails INTERNAL, for ever")
