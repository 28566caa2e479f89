"""The LMDB disk tier: checksummed block records plus sequence manifests.

Layout (one LMDB environment, three named sub-databases):
- ``blocks``: key ``seq_id utf-8 | 0x00 | generation (u64 BE) | block index (u32 BE)``;
  value ``RecordHeader`` (32 bytes) + payload. The header carries magic ``KVPB``, a
  format version, the layout fingerprint, the payload length and its xxh3-64 checksum.
- ``manifests``: key ``seq_id``; value JSON ``Manifest`` (tensors, sizes, block size,
  priority, timestamps, generation). A restart rebuilds the index from this sub-database
  alone, without touching payloads.
- ``meta``: the store's format version.

Each sequence is written (blocks + manifest, and removal of the generation it replaces)
in one write transaction, so a crash leaves either the old or the new sequence, never a
mix. Every read verifies header, length, fingerprint and checksum and raises
``DataLoss`` on any mismatch.

Primitives:
- ``DiskStore(path, capacity, writemap)``; ``close()``; ``sync()``. The engine takes a
  ``disk_factory`` with this signature, so tests inject a subclass that records syncs,
  slows writes down or raises faults (the fault-injection seam). One daemon per directory:
  a second one is refused (a ``flock`` on ``kvpark.lock``).
- ``load_manifests() -> list[Manifest]`` (records that fail to parse are reported, not fatal).
- ``write(manifest, blocks, replace=None, sync=False)``: ``blocks`` are memoryviews.
- ``delete(manifest)``.
- ``read_txn()``: a read transaction whose ``read_block`` returns zero-copy verified views.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import struct
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator, Sequence

import lmdb
import xxhash

from kvpark.proto.errors import DataLoss, ResourceExhausted
from kvpark.proto.layout import TensorMeta

log = logging.getLogger(__name__)

MAGIC = b"KVPB"
FORMAT_VERSION = 1
HEADER = struct.Struct("<4sBBHQQQ")  # magic, version, flags, reserved, fingerprint, length, checksum
_KEY_TAIL = struct.Struct(">QI")


def checksum(view: memoryview | bytes) -> int:
    return xxhash.xxh3_64_intdigest(view)


@dataclass
class Manifest:
    seq_id: str
    gen: int
    tensors: tuple[TensorMeta, ...]
    nbytes: int
    block_size: int
    fingerprint: int
    priority: int = 0
    created_at: float = 0.0
    last_access: float = 0.0
    extra: dict = field(default_factory=dict)

    @property
    def block_lengths(self) -> list[int]:
        full, tail = divmod(self.nbytes, self.block_size)
        return [self.block_size] * full + ([tail] if tail else [])

    def encode(self) -> bytes:
        return json.dumps(
            {
                "v": FORMAT_VERSION,
                "seq_id": self.seq_id,
                "gen": self.gen,
                "tensors": [m.to_json() for m in self.tensors],
                "nbytes": self.nbytes,
                "block_size": self.block_size,
                "fingerprint": self.fingerprint,
                "priority": self.priority,
                "created_at": self.created_at,
                "last_access": self.last_access,
                "extra": self.extra,
            },
            separators=(",", ":"),
        ).encode()

    @staticmethod
    def decode(raw: bytes) -> "Manifest":
        d = json.loads(raw)
        if d.get("v") != FORMAT_VERSION:
            raise ValueError(f"manifest format version {d.get('v')} (this build reads {FORMAT_VERSION})")
        return Manifest(
            seq_id=d["seq_id"],
            gen=int(d["gen"]),
            tensors=tuple(TensorMeta.from_json(t) for t in d["tensors"]),
            nbytes=int(d["nbytes"]),
            block_size=int(d["block_size"]),
            fingerprint=int(d["fingerprint"]),
            priority=int(d.get("priority", 0)),
            created_at=float(d.get("created_at", 0.0)),
            last_access=float(d.get("last_access", 0.0)),
            extra=dict(d.get("extra", {})),
        )


def block_key(seq_id: str, gen: int, index: int) -> bytes:
    return seq_id.encode() + b"\x00" + _KEY_TAIL.pack(gen, index)


def _lock_dir(path: str) -> int:
    """Hold an exclusive lock on the data directory for this process's lifetime.

    LMDB itself lets several processes share an environment, but each kvpark daemon keeps
    its own index of what is stored: a second daemon on the same directory would corrupt
    the first one's view. The lock is released by ``close`` or when the process dies.
    """
    fd = os.open(os.path.join(path, "kvpark.lock"), os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        raise OSError(f"disk tier {path} is in use by another kvpark daemon (pid {holder})") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, str(os.getpid()).encode(), 0)
    return fd


class ReadTxn:
    """A read transaction; views it returns are valid until the ``with`` block ends."""

    def __init__(self, txn: lmdb.Transaction, db: lmdb._Database) -> None:
        self._txn = txn
        self._db = db

    def read_block(self, m: Manifest, index: int, length: int) -> memoryview:
        key = block_key(m.seq_id, m.gen, index)
        raw = self._txn.get(key, db=self._db)
        where = f"sequence {m.seq_id!r} block {index}"
        if raw is None:
            raise DataLoss(f"{where}: record missing from the disk tier")
        view = memoryview(raw)
        if len(view) < HEADER.size:
            raise DataLoss(f"{where}: record truncated ({len(view)} bytes)")
        magic, version, _flags, _res, fp, ln, ck = HEADER.unpack_from(view)
        if magic != MAGIC or version != FORMAT_VERSION:
            raise DataLoss(f"{where}: bad record header (magic {magic!r}, version {version})")
        if fp != m.fingerprint:
            raise DataLoss(f"{where}: layout fingerprint {fp:#x} != manifest {m.fingerprint:#x}")
        payload = view[HEADER.size :]
        if ln != length or len(payload) != length:
            raise DataLoss(f"{where}: length {len(payload)} (header {ln}) != expected {length}")
        if checksum(payload) != ck:
            raise DataLoss(f"{where}: checksum mismatch")
        return payload


class DiskStore:
    def __init__(self, path: str, capacity: int, writemap: bool = False) -> None:
        os.makedirs(path, exist_ok=True)
        self.path = path
        self.capacity = capacity
        self._lock_fd = _lock_dir(path)
        data_file = os.path.join(path, "data.mdb")
        existing = os.path.getsize(data_file) if os.path.exists(data_file) else 0
        # Headroom over the payload capacity for LMDB pages, headers and manifests,
        # so our accounting, not MDB_MAP_FULL, is what says "full".
        map_size = max(capacity + capacity // 8 + (64 << 20), existing)
        self.env = lmdb.open(
            path,
            map_size=map_size,
            max_dbs=4,
            subdir=True,
            writemap=writemap,
            sync=False,  # durability points call sync() explicitly (write policy)
            metasync=False,
            readahead=False,
            max_readers=1024,
            lock=True,
        )
        self._blocks = self.env.open_db(b"blocks")
        self._manifests = self.env.open_db(b"manifests")
        meta = self.env.open_db(b"meta")
        with self.env.begin(write=True) as txn:
            v = txn.get(b"format", db=meta)
            if v is None:
                txn.put(b"format", str(FORMAT_VERSION).encode(), db=meta)
            elif int(v) != FORMAT_VERSION:
                raise RuntimeError(f"disk tier at {path} has format {int(v)}; this build reads {FORMAT_VERSION}")
        self.env.sync(True)

    def close(self) -> None:
        self.env.sync(True)
        self.env.close()
        os.close(self._lock_fd)  # releases the directory lock

    def sync(self) -> None:
        # Every durability point goes through here (writes and deletes with sync=True
        # too), so an injected store that overrides it sees each fsync.
        self.env.sync(True)

    def load_manifests(self) -> tuple[list[Manifest], list[str]]:
        good, bad = [], []
        with self.env.begin(db=self._manifests) as txn:
            for key, raw in txn.cursor():
                try:
                    good.append(Manifest.decode(raw))
                except (ValueError, KeyError, TypeError) as e:
                    bad.append(f"{bytes(key).decode(errors='replace')}: {e}")
        return good, bad

    def write(
        self,
        m: Manifest,
        blocks: Sequence[memoryview],
        replace: Manifest | None = None,
        sync: bool = False,
    ) -> None:
        lengths = m.block_lengths
        if len(blocks) != len(lengths):
            raise ValueError(f"{len(blocks)} block views for {len(lengths)} blocks")
        try:
            with self.env.begin(write=True) as txn:
                for i, view in enumerate(blocks):
                    assert len(view) == lengths[i]
                    head = HEADER.pack(MAGIC, FORMAT_VERSION, 0, 0, m.fingerprint, len(view), checksum(view))
                    txn.put(block_key(m.seq_id, m.gen, i), b"".join((head, view)), db=self._blocks)
                if replace is not None and replace.gen != m.gen:
                    self._delete_blocks(txn, replace)
                txn.put(m.seq_id.encode(), m.encode(), db=self._manifests)
        except lmdb.MapFullError:
            raise ResourceExhausted(f"disk tier full at {self.path} (LMDB map)") from None
        if sync:
            self.sync()

    def _delete_blocks(self, txn: lmdb.Transaction, m: Manifest) -> None:
        for i in range(len(m.block_lengths)):
            txn.delete(block_key(m.seq_id, m.gen, i), db=self._blocks)

    def delete(self, m: Manifest, sync: bool = False) -> None:
        with self.env.begin(write=True) as txn:
            self._delete_blocks(txn, m)
            cur = txn.get(m.seq_id.encode(), db=self._manifests)
            if cur is not None and Manifest.decode(cur).gen == m.gen:
                txn.delete(m.seq_id.encode(), db=self._manifests)
        if sync:
            self.sync()

    def touch(self, m: Manifest) -> None:
        """Rewrite only the manifest (priority/last_access); blocks are untouched."""
        with self.env.begin(write=True) as txn:
            txn.put(m.seq_id.encode(), m.encode(), db=self._manifests)

    @contextmanager
    def read_txn(self) -> Iterator[ReadTxn]:
        with self.env.begin(buffers=True) as txn:
            yield ReadTxn(txn, self._blocks)
