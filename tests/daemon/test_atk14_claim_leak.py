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
from .test_retry_exception import flaky  # noqa: F401 (fixture)


def full(n: int, v: int) -> torch.Tensor:
    return torch.full((n,), v, dtype=torch.uint8)


def test_an_untyped_failure_deleting_one_version_never_leaves_its_orphans_unavailable_forever(
        daemon: Callable[..., Daemon], flaky, tmp_path) -> None:
    """write_through. "x" references shared block "b" (its only user). A drop of x retires
    x and b and claims both; the delete of x raises an untyped ``OSError`` (from below
    LMDB), which ``delete_all`` did not catch: b's claim was never released and b's
    delete never ran, so every later ``present(["b"])`` waited 10 s and answered
    UNAVAILABLE, for ever. (Were the claim merely released, ``present`` would answer
    False with b's manifest still in LMDB: the crash image after the answers must not
    hold b either.) First written with a rotten manifest as the untyped failure; a
    rotten manifest is no version now (``tiers/disk.py``, ``_readable``), so the failure
    is injected below LMDB instead."""
    d = daemon(disk_factory=flaky, **{"policy.write": "write_through", "policy.flush_on_shutdown": "false"})
    eng = d.engine
    assert eng is not None
    with Client(d.address) as c:
        c.park("x", [full(4096, 1)], refs=["b"], new_blocks={"b": [full(4096, 2)]})
        flaky.odd = True  # the next delete of x's records raises OSError, once
        with pytest.raises(KVParkError):
            c.drop("x", timeout=30)  # an error is fair here (UNAVAILABLE: queued)
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
        f"b (nothing wrong with it; dropped with x) answers present(b) = {answers}: a claim left by "
        "delete_all after x's untyped failure keeps b 'being deleted' forever")
    assert after == [False], f"present(b) answered {answers}; after a SIGKILL then present(b)={after}"
