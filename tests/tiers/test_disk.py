"""LMDB disk tier: records verified on every read, atomic replace, manifests rebuild the index."""

from pathlib import Path

import lmdb
import pytest

from kvpark.proto.errors import DataLoss
from kvpark.proto.layout import TensorMeta, fingerprint
from kvpark.tiers.disk import HEADER, DiskStore, Manifest, block_key


def manifest(seq_id: str, gen: int, nbytes: int, bs: int = 1024) -> Manifest:
    metas = (TensorMeta("uint8", (nbytes,), nbytes),)
    return Manifest(seq_id, gen, metas, nbytes, bs, fingerprint(metas), priority=2, created_at=1.0, last_access=2.0)


def payload(m: Manifest, fill: int) -> list[memoryview]:
    return [memoryview(bytes([fill + i]) * n) for i, n in enumerate(m.block_lengths)]


def read_all(store: DiskStore, m: Manifest) -> bytes:
    with store.read_txn() as r:
        return b"".join(bytes(r.read_block(m, i, n)) for i, n in enumerate(m.block_lengths))


def test_write_read_and_reload(tmp_path: Path) -> None:
    s = DiskStore(str(tmp_path), 1 << 20)
    m = manifest("seq", 1, 2500)
    s.write(m, payload(m, 10), sync=True)
    assert read_all(s, m) == b"\x0a" * 1024 + b"\x0b" * 1024 + b"\x0c" * 452
    s.close()
    s2 = DiskStore(str(tmp_path), 1 << 20)
    (back,), bad = s2.load_manifests()
    assert bad == [] and back == m
    assert read_all(s2, back)[:1] == b"\x0a"
    s2.close()


def corrupt(path: Path, key: bytes, at: int) -> None:
    env = lmdb.open(str(path), max_dbs=4)
    db = env.open_db(b"blocks")
    with env.begin(write=True) as txn:
        raw = bytearray(txn.get(key, db=db))
        raw[at] ^= 0x01
        txn.put(key, bytes(raw), db=db)
    env.close()


@pytest.mark.parametrize("where", ["payload", "checksum", "fingerprint", "length"])
def test_any_flipped_byte_is_data_loss(tmp_path: Path, where: str) -> None:
    s = DiskStore(str(tmp_path), 1 << 20)
    m = manifest("seq", 1, 3000)
    s.write(m, payload(m, 1), sync=True)
    s.close()
    at = {"payload": HEADER.size + 77, "checksum": 31, "fingerprint": 9, "length": 17}[where]
    corrupt(tmp_path, block_key("seq", 1, 1), at)
    s = DiskStore(str(tmp_path), 1 << 20)
    with pytest.raises(DataLoss, match="block 1"):
        read_all(s, m)
    s.close()


def test_replace_is_atomic_and_removes_the_old_generation(tmp_path: Path) -> None:
    s = DiskStore(str(tmp_path), 1 << 20)
    old = manifest("seq", 1, 3000)
    s.write(old, payload(old, 1))
    new = manifest("seq", 2, 1500)
    s.write(new, payload(new, 50), replace=old)
    (back,), _ = s.load_manifests()
    assert back.gen == 2
    with s.read_txn() as r, pytest.raises(DataLoss, match="missing"):
        r.read_block(old, 0, 1024)
    assert read_all(s, new)[:1] == b"\x32"
    s.delete(new)
    assert s.load_manifests() == ([], [])
    s.close()


def test_bad_manifest_is_reported_not_fatal(tmp_path: Path) -> None:
    s = DiskStore(str(tmp_path), 1 << 20)
    m = manifest("ok", 1, 10)
    s.write(m, payload(m, 0))
    with s.env.begin(write=True) as txn:
        txn.put(b"broken", b"{not json", db=s._manifests)
    good, bad = s.load_manifests()
    assert [g.seq_id for g in good] == ["ok"] and len(bad) == 1 and bad[0].startswith("broken")
    s.close()


def test_staged_writes_are_invisible_until_committed_and_cleaned_after_a_crash(tmp_path: Path) -> None:
    from kvpark.proto.errors import ResourceExhausted

    s = DiskStore(str(tmp_path), 10_000)
    # 1. Charged up front; a sequence past the capacity is refused naming the sizes.
    with pytest.raises(ResourceExhausted, match=r"cannot take a sequence of 19.5 KiB: 0 B of 9.8 KiB used"):
        s.stage_begin(manifest("huge", 1, 20_000))
    m = manifest("seq", 2, 3000)
    s.stage_begin(m)
    assert (s.used, s.staged) == (3000, 3000)
    s.stage_blocks(m, 0, payload(m, 1)[:2])
    s.stage_blocks(m, 2, payload(m, 1)[2:])
    assert s.load_manifests()[0] == [] and read_all(s, m)  # blocks are there, the manifest is not
    # 2. A newer generation on disk wins over an older staged one; its blocks go.
    newer = manifest("other", 9, 100)
    s.write(newer, payload(newer, 5))
    old = manifest("other", 3, 1500)
    s.stage_begin(old)
    s.stage_blocks(old, 0, payload(old, 7))
    assert not s.stage_commit(old)
    assert s.used == 3100 and s.staged == 3000
    # 3. A "crash" with one park staged: the next open deletes its blocks.
    s.close()
    s = DiskStore(str(tmp_path), 10_000)
    manifests, _ = s.load_manifests()
    assert [x.seq_id for x in manifests] == ["other"] and s.used == 100
    with pytest.raises(DataLoss, match="missing"):
        read_all(s, m)
    # 4. Committed, it is a sequence like any other.
    s.stage_begin(m)
    s.stage_blocks(m, 0, payload(m, 3))
    assert s.stage_commit(m, sync=True) and s.staged == 0
    s.close()
    s = DiskStore(str(tmp_path), 10_000)
    assert sorted(x.seq_id for x in s.load_manifests()[0]) == ["other", "seq"]
    assert read_all(s, m)[:1] == b"\x03"
    s.close()


@pytest.mark.parametrize("extra", [
    {},
    {"pinned": True},
    {"expires_at": 1.8e9 + 0.25},
    {"refs": ("blk-a", "blk-b")},
    {"shared": True, "attrs": {"layout": "L1"}},
    {"attrs": {"k": "v", "layout": "L2"}, "data_gen": 7 << 24 | 3, "pinned": True, "expires_at": 2e9},
])
def test_manifest_round_trips_every_field(extra: dict) -> None:
    """A restart rebuilds the index from decoded manifests: every field a manifest was
    written with comes back, whichever of them are set."""
    metas = (TensorMeta("bfloat16", (2, 16, 8), 512), TensorMeta("uint8", (100,), 100))
    m = Manifest("seq-\u241f1", 5 << 24 | 9, metas, 612, 256, fingerprint(metas), priority=3,
                 created_at=1.7e9, last_access=1.7e9 + 5, **extra)
    back = Manifest.decode(m.encode())
    assert back == m
    for name in ("pinned", "expires_at", "refs", "shared", "attrs", "data_gen", "priority", "block_size"):
        assert getattr(back, name) == getattr(m, name), name
    # What every block of one model shares is one object, decoded or made here.
    assert back.tensors is Manifest.decode(m.encode()).tensors


def _rotted(good: Manifest) -> list[bytes]:
    """Manifest records a start must skip as rotted: each is JSON a disk could hold."""
    import json

    base = json.loads(good.encode())
    out = []
    for change in ({"gen": float("inf")}, {"created_at": 10 ** 400}, {"tensors": [[]]},
                   {"extra": {"attrs": None}}, {"extra": {"expires_at": 10 ** 400}},
                   {"extra": {"data_gen": float("-inf")}}, {"extra": {"refs": 5}}, {"nbytes": "x"}):
        out.append(json.dumps({**base, **change}).encode())
    out.append(b"[" * 100_000 + b"]" * 100_000)  # nested past the decoder's recursion limit
    out.append(b"\xff\xfe not utf-8")
    return out


@pytest.mark.parametrize("index", range(10))
def test_a_rotted_manifest_is_a_decode_error_a_start_skips(index: int) -> None:
    raw = _rotted(manifest("seq", 1, 100))[index]
    with pytest.raises((ValueError, KeyError, TypeError)):
        Manifest.decode(raw)


def test_a_start_skips_rotted_manifests_and_keeps_the_rest(tmp_path: Path) -> None:
    s = DiskStore(str(tmp_path), 1 << 20)
    m = manifest("seq", 1, 2500)
    s.write(m, payload(m, 10), sync=True)
    s.close()
    env = lmdb.open(str(tmp_path), max_dbs=4)
    with env.begin(write=True) as txn:
        db = env.open_db(b"manifests", txn=txn)
        for i, raw in enumerate(_rotted(m)):
            txn.put(f"rot{i}".encode(), raw, db=db)
    env.close()
    s2 = DiskStore(str(tmp_path), 1 << 20)
    good, bad = s2.load_manifests()
    assert good == [m] and len(bad) == len(_rotted(m))
    assert read_all(s2, m)[:1] == b"\x0a"
    s2.close()


def test_held_answers_as_a_dict_of_id_and_generation_would() -> None:
    """``Held`` packs one generation per id into an int and keeps the rest aside: every
    answer must be what a plain ``{(id, gen): nbytes}`` gives, through random holds,
    replaces, pops and sizes too large to pack."""
    import random

    from kvpark.tiers.disk import Held

    rng = random.Random(7)
    held, model = Held(), {}
    ids = [f"s{i}" for i in range(6)]
    for step in range(20_000):
        key = (rng.choice(ids), rng.choice((1, 2, 3, (1 << 63) + 5)))
        op = rng.random()
        if op < 0.5:
            n = rng.choice((0, 1, 4096, (1 << 48) - 1, 1 << 48, 1 << 60))
            held[key] = n
            model[key] = n
        elif op < 0.8:
            assert held.pop(key, 0) == model.pop(key, 0), (step, key)
        else:
            assert (key in held) == (key in model), (step, key)
        assert held.get(key, None) == model.get(key), (step, key)
        assert len(held) == len(model)
    assert sorted(held) == sorted(model)
