"""Every bad input gives its typed error at the client, before anything is sent, and
the daemon stays up."""

from __future__ import annotations

from typing import Callable

import numpy as np
import pytest
import torch

from kvpark.client import Client, InvalidArgument
from kvpark.daemon.server import Daemon


@pytest.mark.parametrize("transport", ["shm", "inline"])
def test_bad_inputs_are_invalid_argument(daemon: Callable[..., Daemon], transport: str) -> None:
    d = daemon()
    x = torch.arange(8, dtype=torch.float32)
    with Client(d.address, transport=transport) as c:
        c.park("good", [x])
        bad_calls = {
            "ints": lambda: c.park("x", [1, 2, 3]),
            "nested": lambda: c.park("x", [[1.0, 2.0], [3.0]]),
            "none": lambda: c.park("x", [x, None]),
            "a bare tensor": lambda: c.park("x", x),
            "object array": lambda: c.park("x", [np.array([object()], dtype=object)]),
            "batch nested": lambda: c.park_batch({"x": [[1]]}),
            "batch not a mapping": lambda: c.park_batch([("x", [x])]),  # type: ignore[arg-type]
            "new_blocks": lambda: c.park("x", [x], refs=["b"], new_blocks={"b": [3]}),
            "into shape": lambda: c.restore("good", into=[torch.empty(9)]),
            "into dtype": lambda: c.restore("good", into=[torch.empty(8, dtype=torch.int32)]),
            "into count": lambda: c.restore("good", into=[x.clone(), x.clone()]),
            "into numpy": lambda: c.restore("good", into=[np.empty(8, np.float32)]),
            "into a tensor": lambda: c.restore("good", into=torch.empty(8)),  # type: ignore[arg-type]
            "into_flat": lambda: c.restore_many(["good"], into_flat=bytearray(32)),  # type: ignore[arg-type]
            "timeout": lambda: c.stat(timeout=-1),
        }
        for name, call in bad_calls.items():
            with pytest.raises(InvalidArgument):
                call()
            assert not c.present(["x"])[0], name  # nothing was half-stored
        # The daemon is up, nothing leaked, and the good sequence is intact.
        assert torch.equal(c.restore("good")[0], x)
        assert c.stat().leases == 0
    d.engine.check_invariants()


def test_numpy_arrays_are_accepted(daemon: Callable[..., Daemon]) -> None:
    d = daemon()
    a = np.arange(300_000, dtype=np.float16).reshape(3, -1)  # above one round trip
    b = np.asfortranarray(np.arange(12, dtype=np.int64).reshape(3, 4))  # not C-contiguous
    ro = np.arange(5, dtype=np.float32)
    ro.flags.writeable = False
    with Client(d.address) as c:
        c.park("np", [a, b, ro])
        out = c.restore("np")
    assert np.array_equal(out[0].numpy(), a)
    assert np.array_equal(out[1].numpy(), b)
    assert np.array_equal(out[2].numpy(), ro)


def test_prefetch_defaults_to_the_fastest_tier_the_daemon_has(daemon: Callable[..., Daemon]) -> None:
    d = daemon()  # no device tier
    with Client(d.address) as c:
        c.park("p", [torch.zeros(4)])
        assert c.prefetch("p", wait=True) == "host"


def test_tokens_per_block_takes_every_uint32_and_nothing_else(daemon: Callable[..., Daemon]) -> None:
    """A lookup's ``tokens_per_block`` is a protobuf uint32: every value in [0, 2**32)
    goes through, and anything else is refused typed before a call is made."""
    d = daemon()
    with Client(d.address) as c:
        c.park("b0", [torch.ones(8)])
        for n in (0, 1, 33, 4096, 2**32 - 1):
            assert c.lookup(["b0", "b1"], tokens_per_block=n) == 1
            assert c.lookup_acquire(["b0"], tokens_per_block=n)[0] == 1
        for bad in (-1, 2**32, True, 16.0):
            with pytest.raises(InvalidArgument, match=r"tokens_per_block must be an int in \[0, 2\*\*32\)"):
                c.lookup(["b0"], tokens_per_block=bad)  # type: ignore[arg-type]


def test_attrs_are_bounded_by_their_entries_and_each_entrys_bytes(daemon: Callable[..., Daemon]) -> None:
    """At most 64 attrs, each key and value together at most 4096 bytes: exactly at the
    bounds is stored, one past either is refused typed and nothing is stored."""
    d = daemon()
    x = [torch.ones(4)]
    with Client(d.address) as c:
        c.park("edge", x, attrs={"k" * 100: "v" * 3996, **{f"a{i}": "" for i in range(63)}})
        assert len(c.info("edge").attrs["k" * 100]) == 3996
        for attrs in ({"k" * 100: "v" * 3997}, {"k" * 96: "v" * 4001}, {f"a{i}": "" for i in range(65)}):
            with pytest.raises(InvalidArgument, match="attrs: at most 64 entries of at most 4096 bytes each"):
                c.park("x", x, attrs=attrs)
            assert c.present(["x"]) == [False]
