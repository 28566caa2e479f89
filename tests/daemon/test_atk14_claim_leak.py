"""Fresh-eyes attack on 4f5a4df: ``Deletes.delete_all(seqs, claimed=True)`` releases each
claim in a ``finally`` per sequence, but catches only ``KVParkError``: an untyped error
from one delete (here ``Manifest.decode`` of a manifest that rotted on disk raises
``ValueError`` inside ``DiskStore.delete``) leaves the loop, and every later sequence of
the batch keeps its claim forever and is never deleted. Their ids then answer
UNAVAILABLE to every question of absence (``settle`` waits ``SETTLE_WAIT_S`` for a delete
that will never be tried), although nothing is wrong with them."""

from __future__ import annotations

from typing import Callable

import pytest
import torch

from kvpark.client import Client
from kvpark.daemon.server import Daemon
from kvpark.proto.errors import KVParkError

from .disk_seams import crash_image


def full(n: int, v: int) -> torch.Tensor:
    return torch.full((n,), v, dtype=torch.uint8)


def test_an_untyped_failure_deleting_one_version_never_leaves_its_orphans_unavailable_forever(
        daemon: Callable[..., Daemon], tmp_path) -> None:
    """write_through. "p" references shared block "b" (its only user). p's manifest in LMDB
    is damaged (bit rot: not JSON any more). A drop of p retires p and b and claims both;
    the delete of p raises ``ValueError`` (decoding the damaged manifest), which
    ``delete_all`` does not catch: b's claim is never released and b's delete never runs.
    Every later ``present(["b"])`` waits 10 s and answers UNAVAILABLE, forever. (Were the
    claim merely released, ``present`` would answer False with b's manifest still in
    LMDB: the crash image after the answers must not hold b either.)"""
    d = daemon(**{"policy.write": "write_through", "policy.flush_on_shutdown": "false"})
    eng = d.engine
    assert eng is not None
    with Client(d.address) as c:
        c.park("p", [full(4096, 1)], refs=["b"], new_blocks={"b": [full(4096, 2)]})
        with eng.disk.env.begin(write=True) as txn:  # p's manifest rots on disk
            txn.put(b"p", b"\xff not a manifest", db=eng.disk._manifests)
        with pytest.raises(KVParkError):
            c.drop("p", timeout=30)  # the damaged manifest: an error is fair here
        answers = []
        for _ in range(2):
            try:
                answers.append(c.present(["b"], timeout=30))
            except KVParkError as e:
                answers.append(e)
        image = crash_image(eng.disk, str(tmp_path / "crash"))
    d.stop(0.5)
    d2 = daemon(**{"tiers.disk.path": image, "policy.flush_on_shutdown": "false"})
    with Client(d2.address) as c3:
        after = c3.present(["b"])
    assert answers == [[False], [False]], (
        f"b (nothing wrong with it; dropped with p) answers present(b) = {answers}: a claim left by "
        "delete_all after p's untyped failure keeps b 'being deleted' forever")
    assert after == [False], f"present(b) answered {answers}; after a SIGKILL then present(b)={after}"
