"""The compact index: a restart rebuilds the same index, and the shared metadata stays apart.

The index keeps a million blocks by sharing what they repeat (layouts, attrs: see
``kvpark.tiers.interning``), slotted records, per-tier maps and lazily made locks and
reader counts (``kvpark.daemon.model``). These tests pin what that must not change:
what ``list``/``restore`` return before and after a restart, and that blocks of
different layouts never share metadata.
"""

import dataclasses
import random
from typing import Callable

import torch

from kvpark.client import Client
from kvpark.client.paged import park_blocks
from kvpark.daemon.model import Seq, TierMap
from kvpark.daemon.server import Daemon
from kvpark.tiers.disk import Manifest

LAYOUTS = [  # (dtype, per-block shape, attrs): two connector-like layouts of 1 KiB blocks, one of 2 KiB
    (torch.bfloat16, (2, 2, 16, 1, 8), {"layout": "vllm:a:bf16"}),
    (torch.float32, (2, 2, 16, 1, 4), {"layout": "vllm:b:f32"}),
    (torch.float16, (2, 2, 16, 2, 8), {"layout": "vllm:c:f16", "owner": "t1"}),
]


def block(i: int) -> list[torch.Tensor]:
    dtype, shape, _ = LAYOUTS[i % len(LAYOUTS)]
    g = torch.Generator().manual_seed(i)
    return [torch.randn(shape, generator=g).to(dtype)]


def key(i: int) -> str:
    return f"kvblk-{i:032x}"


def test_a_restart_rebuilds_the_same_index_of_many_blocks(daemon: Callable[..., Daemon]) -> None:
    n = 360
    d = daemon(**{"tiers.host.slot_size": "64KiB"})
    with Client(d.address) as c:
        # 1. Connector-shaped blocks, one park_batch per layout chunk, layouts interleaved.
        for lo in range(0, n, 60):
            for lay in range(len(LAYOUTS)):
                ids = [i for i in range(lo, lo + 60) if i % len(LAYOUTS) == lay]
                c.park_batch({key(i): block(i) for i in ids}, attrs=LAYOUTS[lay][2], priority=lay)
        # 2. A paged sequence over shared blocks, a pinned one and one with a (long) TTL.
        kv = [torch.randn(2, 8, 16, 1, 8).to(torch.bfloat16) for _ in range(2)]
        park_blocks(c, "chat", kv, list(range(5)), num_tokens=70, tokens=list(range(70)))
        c.park("pinned", block(1), pinned=True, attrs={"k": "v"})
        c.park("ttl", block(2), ttl_s=3600)
        before = {s.seq_id: s for s in c.list()}
    d.engine.check_invariants()  # type: ignore[union-attr]
    d.stop()  # flushes everything to disk

    # 3. A new daemon on the same directory rebuilds the index from the manifests alone.
    d2 = daemon(**{"tiers.host.slot_size": "64KiB"})
    with Client(d2.address) as c:
        after = {s.seq_id: s for s in c.list()}
        assert set(after) == set(before) and len(after) >= n + 4
        for sid, s in before.items():
            assert dataclasses.replace(after[sid], tier="", last_access=0.0) == \
                dataclasses.replace(s, tier="", last_access=0.0), sid
            assert after[sid].tier == "disk"
        for i in random.Random(0).sample(range(n), 40):
            (back,) = c.restore(key(i))
            assert back.dtype == block(i)[0].dtype and torch.equal(back, block(i)[0]), i
    eng = d2.engine
    assert eng is not None
    eng.check_invariants()
    # 4. Blocks of one layout share one tensor tuple and one attrs dict; layouts stay apart.
    with eng.catalog.lock:
        for lay, (dtype, shape, attrs) in enumerate(LAYOUTS):
            mine = [eng.catalog.get(key(i)).manifest for i in range(lay, n, len(LAYOUTS))]
            assert len({id(m.tensors) for m in mine}) == 1 and len({id(m.attrs) for m in mine}) == 1
            assert mine[0].tensors[0].shape == shape and mine[0].attrs == attrs
            assert len({m.fingerprint for m in mine}) == 1


def test_tier_map_behaves_like_a_dict_of_tiers() -> None:
    rng = random.Random(3)
    m: TierMap[int] = TierMap()
    ref: dict[str, int] = {}
    for _ in range(500):
        t = rng.choice(("device", "host"))
        op = rng.randrange(4)
        if op == 0:
            m[t] = ref[t] = rng.randrange(0, 5)
        elif op == 1 and t in ref:
            assert m.pop(t) == ref.pop(t)
        elif op == 2:
            assert m.get(t, -1) == ref.get(t, -1)
        else:
            m.clear()
            ref.clear()
        assert (t in m) == (t in ref) and len(m) == len(ref) and bool(m) == bool(ref)
        assert dict(m.items()) == ref and set(m) == set(ref)
        assert list(m) == [x for x in ("device", "host") if x in ref]  # fastest tier first
    try:
        m["disk"] = 1
        raise AssertionError("a TierMap took a key that is not a memory tier")
    except KeyError:
        pass


def test_readers_are_counted_per_tier_and_shared_when_none() -> None:
    m = Manifest("s", 1, (), 0, 64 << 10, 0)
    a, b = Seq(manifest=m), Seq(manifest=m)
    assert a.readers is b.readers and not a.readers  # nobody reads either: one shared empty map
    a.add_reader("host")
    a.add_reader("host")
    a.add_reader("device")
    assert dict(a.readers.items()) == {"host": 2, "device": 1} and not b.readers
    a.drop_reader("host")
    a.drop_reader("device")
    assert dict(a.readers.items()) == {"host": 1}
    a.drop_reader("host")
    assert a.readers is b.readers
    a.add_reader("disk")  # a windowed restore leases the disk records
    assert dict(a.readers.items()) == {"disk": 1}
    a.drop_reader("disk")
    assert a.readers is b.readers
    try:
        b.readers["host"] = 1  # type: ignore[index]
        raise AssertionError("the shared empty readers map was changed")
    except TypeError:
        pass
    assert a.move_lock is a.move_lock and a.move_lock is not b.move_lock
