"""The LMDB disk tier: checksummed block records plus sequence manifests.

Layout (one LMDB environment, named sub-databases):
- ``blocks``: key ``seq_id utf-8 | 0x00 | key generation (u64 BE) | block index (u32 BE)``
  (the key generation is the manifest's ``key_gen``: its generation, or for a windowed
  park the generation its blocks were staged under, ``data_gen``);
  value ``RecordHeader`` (32 bytes) + payload. The header carries magic ``KVPB``, a
  format version, the layout fingerprint, the payload length and its xxh3-64 checksum.
- ``manifests``: key ``seq_id``; value JSON ``Manifest`` (tensors, sizes, block size,
  priority, timestamps, generation). A restart rebuilds the index from this sub-database
  alone, without touching payloads.
- ``meta``: the store's format version.
- ``tombs``: remote copies dropped here and not yet deleted from Redis (``tombs.py``).
- ``staging``: key ``seq_id utf-8 | 0x00 | generation (u64 BE)`` of a sequence being
  written window by window (see below); empty value. Opening the store deletes the
  blocks of every generation still listed here (a daemon that died mid-park).

Each sequence is written (blocks + manifest, and removal of the generation it replaces)
in one write transaction, so a crash leaves either the old or the new sequence, never a
mix. Every read verifies header, length, fingerprint and checksum and raises
``DataLoss`` on any mismatch.

Primitives:
- ``Manifest``: a sequence's typed disk record (tensors, sizes, generation, priority,
  timestamps, pin/TTL/refs/shared/attrs/data_gen; the last six travel in the JSON
  ``extra`` map). ``gen`` orders and names a version; ``key_gen`` keys its block records.
  Slotted and small: id, generation, times and TTL deadline are its own, the rest one
  ``Form`` (a named tuple) shared by the manifests that agree on it (``interning.py``),
  read and written through properties; ``replace(**changes)`` copies. ``decode`` shares
  the tensor tuples, attrs dicts and sizes too, so a restart with a million blocks
  holds one copy of each.
- ``DiskStore(path, capacity, writemap)``; ``close()`` (after every open ``read_txn``, at
  most ``CLOSE_WAIT_S``); ``sync()`` (the fsync seam), ``fsync()`` (it, typed). The engine takes a
  ``disk_factory`` with this signature, so tests inject a subclass that records syncs,
  slows writes down or raises faults (the fault-injection seam). One daemon per directory:
  a second one is refused (a ``flock`` on ``kvpark.lock``).
- The store owns its accounting: ``capacity``, ``used`` (payload bytes of the
  generations it holds, kept in a ``Held``: one packed int per id) and
  ``holds(manifest)``. A write that would pass ``capacity``
  raises ``ResourceExhausted`` before touching LMDB.
- ``block_count(nbytes, block_size)``: how many block records a payload takes.
- ``load_manifests() -> list[Manifest]`` (records that fail to parse are reported, not
  fatal); ``load_manifests_in(chunk)``: the same a chunk at a time.
- ``write(manifest, blocks, replace=None, sync=False) -> bool``: ``blocks`` are memoryviews.
- ``write_many([Write, ...], sync=False) -> list[bool]``: several sequences in one
  transaction and at most one fsync (a batch park). A write whose generation is older
  than the manifest already stored under its id is skipped (False): generations order
  commits, drops and demotions without a lock around the I/O.
- ``delete(manifest)``: its generation's blocks, and its manifest if still current.
- ``release(manifest, keep=False)``: stop charging its generation, its records left for a
  later ``delete`` (a retired copy a read lease still reads; ``keep``: kept from
  ``sweep_orphans`` too until that ``delete`` or ``unkeep``; ``kept``: which).
- ``take_replaced(m)``, ``settle(ms)``, ``revert(refused, previous, pinned)``: a synced
  write, and every ``stage_commit``, remembers the manifest its transaction replaced until
  its commit settles; a refused one (fsync or publish failed) is undone: its blocks go and
  that manifest comes back (if its generation is still held and whole), with the pin
  ``pinned()`` reads inside the undo's transaction (a pin acknowledged meanwhile found
  the refused manifest current and wrote nothing).
- ``unpublish(manifest)``: delete its manifest if still current, in its own transaction,
  and leave its block records to a later ``delete``. A retired copy is gone from LMDB's
  view at once, so a crash before its records go never brings it back.
- ``Write.live`` (and ``write(..., live=)``): asked inside the write transaction; False
  skips the write (its version was retired while its bytes were read).
- ``scan() -> Scan``: every manifest, block record and staged generation in LMDB
  (invariant checks on a quiet store).
- ``read_txn()``: a read transaction whose ``read_block`` returns zero-copy verified views.
  ``ReadTxn(txn, db)`` with no hooks is how a client reads a disk grant's records (the
  same checks). The store's environment is this process's one environment on its
  directory (``envs.py``): a client of this process reads grants through it.
- ``reader_check() -> int``: free the LMDB reader slots of processes that died inside a
  read transaction (a client killed mid disk-grant read).
- ``sweep_orphans() -> int``: delete block records no manifest (or staged write) owns.
- ``lock_dir(path) -> fd``: the data directory's exclusive lock (one daemon, or one
  offline tool such as ``compact.py``, per directory).
  ``DiskStore.on_corrupt`` (optional) is called for every record that fails verification;
  ``damaged`` counts the held generations that did (until dropped or replaced).
- ``update_manifest(m, sync=False) -> bool``: rewrite one generation's manifest (a pin).
- Staged writes, for a sequence too large to hold in memory at once (``daemon/window.py``):
  ``stage_begin(m)`` charges ``m.nbytes`` against ``capacity`` (``ResourceExhausted``
  naming the sizes when it does not fit) and lists the generation in ``staging``;
  ``stage_blocks(m, first, views)`` writes checksummed blocks ``first..`` (each window in
  its own transaction: invisible, there is no manifest yet); ``stage_commit(m, replace,
  sync) -> bool`` publishes the manifest ``m`` (its generation taken at commit, its
  ``data_gen`` the staged one) (and removes ``replace``'s blocks) in one
  transaction, False when a newer generation won (the staged blocks are deleted);
  ``stage_abort(m)`` deletes what was staged. ``staged``: bytes charged to staged writes.

Thread safety: LMDB serialises write transactions itself; the accounting has its own
small lock, never held across I/O.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import struct
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator, NamedTuple, Sequence

import lmdb
import xxhash

from kvpark.proto.digests import HASH_ATTR
from kvpark.proto.errors import DataLoss, ResourceExhausted, StartupError, Unavailable
from kvpark.proto.layout import TensorMeta
from kvpark.proto.sizes import human

from . import envs, interning

log = logging.getLogger(__name__)

CLOSE_WAIT_S = 10.0  # how long close() waits for read transactions still open
MAGIC = b"KVPB"
FORMAT_VERSION = 1
HEADER = struct.Struct("<4sBBHQQQ")  # magic, version, flags, reserved, fingerprint, length, checksum
_KEY_TAIL = struct.Struct(">QI")


def block_count(nbytes: int, block_size: int) -> int:
    """Disk blocks of a payload of ``nbytes`` (``len(Manifest.block_lengths)``, without the list)."""
    return -(-nbytes // block_size)


def checksum(view: memoryview | bytes) -> int:
    return xxhash.xxh3_64_intdigest(view)


class Form(NamedTuple):
    """What a manifest holds besides its identity and its clock: shared (interned) by the
    many manifests that have the same, since a million blocks of one model differ only
    in id, generation and times (``Manifest``). Immutable: a manifest that changes one
    of these takes a new one."""

    tensors: tuple[TensorMeta, ...]
    nbytes: int
    block_size: int
    fingerprint: int
    priority: int = 0
    pinned: bool = False
    refs: tuple[str, ...] = ()  # shared blocks this sequence's payload starts with
    shared: bool = False  # a reference-counted shared block
    attrs: dict[str, str] = {}  # never changed in place (interned dicts are shared)
    # The generation the block records are keyed by, when it is not ``gen``: a windowed
    # park stages its blocks before its commit takes the generation (0: ``gen``).
    data_gen: int = 0


def _form(*fields: object) -> Form:
    """The shared ``Form`` of these fields; one of its own when it cannot be shared: refs
    and digests are each sequence's own (interning them would only churn the table)."""
    f = Form(*fields)  # type: ignore[arg-type]
    if f.refs or f.data_gen or len(f.attrs) > 8 or HASH_ATTR in f.attrs:
        return f
    return interning.form(f, (*f[:8], tuple(f.attrs.items()), f.data_gen))


def _form_field(name: str) -> property:
    index = Form._fields.index(name)

    def get(self: "Manifest") -> object:
        return self._f[index]

    def put(self: "Manifest", value: object) -> None:
        self._f = _form(*self._f[:index], value, *self._f[index + 1:])

    return property(get, put, doc=f"``Form.{name}``")


class Manifest:
    """A sequence's typed disk record. Slotted and small: its id, generation, times and
    TTL deadline are its own; the rest is a shared ``Form`` (a million blocks of one
    model hold one), read and written through properties of the same names. Compared by
    value (every field); not hashable (it changes: ``last_access``, ``pinned``)."""

    __slots__ = ("seq_id", "gen", "created_at", "last_access", "expires_at", "_f")

    def __init__(self, seq_id: str, gen: int, tensors: tuple[TensorMeta, ...], nbytes: int, block_size: int,
                 fingerprint: int, priority: int = 0, created_at: float = 0.0, last_access: float = 0.0,
                 pinned: bool = False, expires_at: float | None = None, refs: tuple[str, ...] = (),
                 shared: bool = False, attrs: dict[str, str] | None = None, data_gen: int = 0) -> None:
        self.seq_id = seq_id
        self.gen = gen
        self.created_at = created_at
        self.last_access = last_access
        self.expires_at = expires_at  # wall-clock TTL deadline
        self._f = _form(tensors, nbytes, block_size, fingerprint, priority, pinned, refs, shared,
                        interning.attrs({}) if attrs is None else attrs, data_gen)

    tensors = _form_field("tensors")
    nbytes = _form_field("nbytes")
    block_size = _form_field("block_size")
    fingerprint = _form_field("fingerprint")
    priority = _form_field("priority")
    pinned = _form_field("pinned")
    refs = _form_field("refs")
    shared = _form_field("shared")
    attrs = _form_field("attrs")
    data_gen = _form_field("data_gen")

    def _fields(self) -> tuple:
        return (self.seq_id, self.gen, self.created_at, self.last_access, self.expires_at, *self._f)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Manifest):
            return NotImplemented
        return self._fields() == other._fields()

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        f = self._f
        return (f"Manifest(seq_id={self.seq_id!r}, gen={self.gen}, nbytes={f.nbytes}, block_size={f.block_size}, "
                f"fingerprint={f.fingerprint:#x}, priority={f.priority}, pinned={f.pinned}, "
                f"expires_at={self.expires_at}, refs={f.refs}, shared={f.shared}, attrs={f.attrs}, "
                f"data_gen={f.data_gen}, tensors={len(f.tensors)})")

    @classmethod
    def of(cls, seq_id: str, gen: int, created_at: float, last_access: float, expires_at: float | None,
           form: Form) -> "Manifest":
        """A manifest from its own fields and an existing ``Form`` (the index's columns
        keep a form each and rebuild the manifest from them: no re-interning)."""
        m = object.__new__(cls)
        m.seq_id, m.gen, m.created_at, m.last_access, m.expires_at, m._f = (
            seq_id, gen, created_at, last_access, expires_at, form)
        return m

    @property
    def form(self) -> Form:
        """Everything but the id, generation, times and deadline (shared: do not change it)."""
        return self._f

    def replace(self, **changes: object) -> "Manifest":
        """A copy with ``changes`` (field names as in the constructor)."""
        kw: dict = {"seq_id": self.seq_id, "gen": self.gen, "created_at": self.created_at,
                    "last_access": self.last_access, "expires_at": self.expires_at, **self._f._asdict()}
        unknown = set(changes) - set(kw)
        if unknown:
            raise TypeError(f"Manifest has no field(s) {sorted(unknown)}")
        kw.update(changes)
        return Manifest(**kw)

    @property
    def key_gen(self) -> int:
        return self.data_gen or self.gen

    @property
    def block_lengths(self) -> list[int]:
        full, tail = divmod(self.nbytes, self.block_size)
        return [self.block_size] * full + ([tail] if tail else [])

    def _extra(self) -> dict:
        extra: dict = {}
        if self.refs:
            extra["refs"] = list(self.refs)
        if self.shared:
            extra["shared"] = True
        if self.attrs:
            extra["attrs"] = dict(self.attrs)
        if self.pinned:
            extra["pinned"] = True
        if self.expires_at:
            extra["expires_at"] = self.expires_at
        if self.data_gen and self.data_gen != self.gen:
            extra["data_gen"] = self.data_gen
        return extra

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
                "extra": self._extra(),
            },
            separators=(",", ":"),
        ).encode()

    @staticmethod
    def decode(raw: bytes) -> "Manifest":
        """The manifest ``raw`` encodes. A record that is not one raises ``ValueError``,
        ``KeyError`` or ``TypeError`` (what a start skips as rotted), never anything else:
        a number too large for a float or a field of the wrong shape must not stop a
        restart."""
        try:
            return Manifest._decode(raw)
        except (OverflowError, IndexError, RecursionError, AttributeError) as e:
            raise ValueError(f"undecodable manifest: {type(e).__name__}: {e}") from None

    @staticmethod
    def _decode(raw: bytes) -> "Manifest":
        # A restart decodes every manifest: the plain decoder (no encoding sniffing), and
        # what a million blocks share (layouts, attrs, sizes) as one object each.
        text = str(raw, "utf-8")
        d, end = _JSON.raw_decode(text)
        if end != len(text) and text[end:].strip():
            raise ValueError(f"manifest has extra data after its JSON (at {end})")
        if not isinstance(d, dict):
            raise TypeError("a manifest is a JSON object")
        if d.get("v") != FORMAT_VERSION:
            raise ValueError(f"manifest format version {d.get('v')} (this build reads {FORMAT_VERSION})")
        tensors, fp = interning.layout_json(d["tensors"])
        stored_fp = int(d["fingerprint"])
        created_at = float(d.get("created_at", 0.0))
        last_access = float(d.get("last_access", 0.0))
        # Every field in one constructor call: a field set afterwards makes (and interns)
        # a new ``Form`` each time, six per manifest, which was most of a restart's time.
        extra = dict(d.get("extra") or {})
        attrs = dict(extra.get("attrs", {}))  # not an object (null, a number): TypeError, as ever
        return Manifest(
            d["seq_id"], int(d["gen"]), tensors, interning.number(int(d["nbytes"])),
            interning.number(int(d["block_size"])), fp if fp == stored_fp else stored_fp, int(d.get("priority", 0)),
            created_at, created_at if last_access == created_at else last_access,
            pinned=bool(extra.get("pinned", False)),
            expires_at=float(extra["expires_at"]) if extra.get("expires_at") else None,
            refs=tuple(extra.get("refs", ())), shared=bool(extra.get("shared", False)),
            attrs=interning.attrs_json(attrs) if attrs else interning.attrs({}),
            data_gen=int(extra.get("data_gen", 0)),
        )


_JSON = json.JSONDecoder()


@dataclass(frozen=True)
class Write:
    """One sequence for ``write_many``: its manifest, block views, and the generation it replaces."""

    manifest: Manifest
    blocks: Sequence[memoryview]
    replace: Manifest | None = None
    # Asked inside the write transaction, just before the put: False skips the write (the
    # version was retired while its bytes were read). A retirement either comes before
    # this check, or finds the generation held and deletes the manifest in a transaction
    # that LMDB orders after this one (``unpublish``).
    live: Callable[[], bool] | None = None


def _readable(raw: bytes | None) -> Manifest | None:
    """The manifest in ``raw``; None when there is none or it cannot be decoded (rotten
    bytes): a start skips such a manifest (``load_manifests``), so it is no version of
    its id, and no write or delete may fail on it for ever (an untyped error each time)."""
    if raw is None:
        return None
    try:
        return Manifest.decode(raw)
    except (ValueError, KeyError, TypeError):
        return None


def block_key(seq_id: str, gen: int, index: int) -> bytes:
    return seq_id.encode() + b"\x00" + _KEY_TAIL.pack(gen, index)


class Scan(NamedTuple):
    """What the store holds, read from LMDB itself (``DiskStore.scan``)."""

    manifests: dict[str, Manifest]  # seq_id -> its current manifest
    records: dict[tuple[str, int], set[int]]  # (seq_id, key generation) -> block indexes stored
    staged: set[tuple[str, int]]  # (seq_id, key generation) of windowed parks under way


def _usable_dir(path: str) -> None:
    """Create the data directory if needed; a path that cannot be a writable directory
    is a configuration that cannot work (``StartupError``: one line, exit code 2)."""
    try:
        os.makedirs(path, exist_ok=True)
        if not os.access(path, os.W_OK | os.X_OK):
            raise PermissionError(errno.EACCES, "not writable by this user", path)
    except OSError as e:
        raise StartupError(
            f"tiers.disk.path {path!r} cannot be the data directory: {e.strerror or e}; "
            "give a writable directory (--data-dir or tiers.disk.path)"
        ) from None


def lock_dir(path: str) -> int:
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

    def __init__(self, txn: lmdb.Transaction, db: lmdb._Database,
                 on_corrupt: Callable[[], None] | None = None,
                 on_damaged: Callable[[Manifest], None] | None = None) -> None:
        self._txn = txn
        self._db = db
        self._on_corrupt = on_corrupt
        self._on_damaged = on_damaged

    def _corrupt(self, m: Manifest, message: str) -> DataLoss:
        if self._on_corrupt is not None:
            self._on_corrupt()
        if self._on_damaged is not None:
            self._on_damaged(m)
        return DataLoss(message)

    def read_block(self, m: Manifest, index: int, length: int) -> memoryview:
        key = block_key(m.seq_id, m.key_gen, index)
        raw = self._txn.get(key, db=self._db)
        where = f"sequence {m.seq_id!r} block {index}"
        if raw is None:
            raise DataLoss(f"{where}: record missing from the disk tier")
        view = memoryview(raw)
        if len(view) < HEADER.size:
            raise self._corrupt(m, f"{where}: record truncated ({len(view)} bytes)")
        magic, version, _flags, _res, fp, ln, ck = HEADER.unpack_from(view)
        if magic != MAGIC or version != FORMAT_VERSION:
            raise self._corrupt(m, f"{where}: bad record header (magic {magic!r}, version {version})")
        if fp != m.fingerprint:
            raise self._corrupt(m, f"{where}: layout fingerprint {fp:#x} != manifest {m.fingerprint:#x}")
        payload = view[HEADER.size :]
        if ln != length or len(payload) != length:
            raise self._corrupt(m, f"{where}: length {len(payload)} (header {ln}) != expected {length}")
        if checksum(payload) != ck:
            raise self._corrupt(m, f"{where}: checksum mismatch")
        return payload


_SIZE_BITS = 48  # payload bytes below 256 TiB share one int with the generation (``Held``)
_SIZE_MASK = (1 << _SIZE_BITS) - 1


class Held:
    """``(seq_id, gen) -> payload bytes`` for every generation the store holds, as a dict
    would answer (``get``, ``in``, ``[key] = n``, ``pop``, iteration over the keys).

    A million parked blocks each hold one generation, and a dict keyed by
    ``(id, generation)`` tuples cost ~130 bytes each (the tuple, its generation int, the
    entry). Kept instead as ``seq_id -> gen << 48 | nbytes``: one int per id, the id
    string the index's own. A second generation of one id (a replace under way, a staged
    write) is kept aside under its tuple. Every key is in exactly one of the two."""

    __slots__ = ("_one", "_more")

    def __init__(self) -> None:
        self._one: dict[str, int] = {}
        self._more: dict[tuple[str, int], int] = {}

    def get(self, key: tuple[str, int], default: int | None = 0) -> int | None:
        v = self._one.get(key[0])
        if v is not None and v >> _SIZE_BITS == key[1]:
            return v & _SIZE_MASK
        return self._more.get(key, default)

    def __contains__(self, key: tuple[str, int]) -> bool:
        return self.get(key, None) is not None

    def __setitem__(self, key: tuple[str, int], n: int) -> None:
        sid, gen = key
        assert gen >= 0 and n >= 0, key
        v = self._one.get(sid)
        if v is not None and v >> _SIZE_BITS == gen or (v is None and key not in self._more):
            if n >> _SIZE_BITS == 0:
                self._one[sid] = gen << _SIZE_BITS | n
                return
            self._one.pop(sid, None)  # too large to pack: aside with the others
        self._more[key] = n

    def pop(self, key: tuple[str, int], default: int = 0) -> int:
        v = self._one.get(key[0])
        if v is not None and v >> _SIZE_BITS == key[1]:
            del self._one[key[0]]
            return v & _SIZE_MASK
        return self._more.pop(key, default)

    def __iter__(self) -> Iterator[tuple[str, int]]:
        for sid, v in self._one.items():
            yield sid, v >> _SIZE_BITS
        yield from self._more

    def __len__(self) -> int:
        return len(self._one) + len(self._more)


class DiskStore:
    def __init__(self, path: str, capacity: int, writemap: bool = False) -> None:
        _usable_dir(path)
        self.path = path
        self.capacity = capacity
        # Called once per record that fails verification (a metrics counter); never for a
        # record that is simply missing (a sequence dropped under a reader).
        self.on_corrupt: Callable[[], None] | None = None
        self._acct = threading.Lock()
        self._held = Held()  # (seq_id, gen) -> payload bytes stored
        self._used = 0  # sum of _held
        # Generations held whose record failed verification on a read: every read of them
        # is DataLoss until they are dropped or replaced (``damaged``, shown by ``stat``).
        self._damaged: set[tuple[str, int]] = set()
        self._staged: dict[tuple[str, int], int] = {}  # staged generations (also in _held)
        # (seq_id, key generation) whose manifest ``unpublish`` deleted and whose block
        # records a reader still reads: ``sweep_orphans`` leaves them to ``delete``.
        self._kept: set[tuple[str, int]] = set()
        # (id, generation) of a write whose fsync has not returned -> the manifest its
        # transaction replaced (``revert`` puts it back if the fsync fails).
        self._replaced: dict[tuple[str, int], Manifest] = {}
        self._readers_cv = threading.Condition(threading.Lock())
        self._readers = 0  # read_txn()s open: close() waits for them
        self._closing = False
        self._lock_fd = lock_dir(path)
        data_file = os.path.join(path, "data.mdb")
        existing = os.path.getsize(data_file) if os.path.exists(data_file) else 0
        # Headroom over the payload capacity for LMDB pages, headers and manifests,
        # so our accounting, not MDB_MAP_FULL, is what says "full". Small records need
        # the most: a million 1 KiB KV blocks under random (content-hash) keys filled
        # ~2.4x their payload in half-full B-tree pages plus a manifest each. The map is
        # address space (and a sparse file under writemap), not disk.
        map_size = max(capacity * 3 + (64 << 20), existing)
        try:
            # One environment per directory per process: a client of this process that
            # reads the files directly (disk grants) reads through this one from now on.
            with envs.owning(path) as publish:
                self.env = lmdb.open(
                    path,
                    map_size=map_size,
                    max_dbs=6,  # blocks, manifests, meta, staging, tombs (``tombs.py``), stubs (``stubs.py``)
                    subdir=True,
                    writemap=writemap,
                    sync=False,  # durability points call sync() explicitly (write policy)
                    metasync=False,
                    readahead=False,
                    max_readers=1024,
                    lock=True,
                )
                self._blocks = self.env.open_db(b"blocks")
                # What a direct reader in this process reads through: counted like
                # ``read_txn``, with no corruption hooks (a record a client finds bad is
                # read again by the daemon, which counts it then). Kept, so ``disown``
                # withdraws this very callable.
                self._direct = self._raw_read
                publish(self._direct)
        except BaseException:
            os.close(self._lock_fd)
            raise
        self._manifests = self.env.open_db(b"manifests")
        meta = self.env.open_db(b"meta")
        self._staging = self.env.open_db(b"staging")
        with self.env.begin(write=True) as txn:
            v = txn.get(b"format", db=meta)
            if v is None:
                txn.put(b"format", str(FORMAT_VERSION).encode(), db=meta)
            elif int(v) != FORMAT_VERSION:
                raise RuntimeError(f"disk tier at {path} has format {int(v)}; this build reads {FORMAT_VERSION}")
        self._clean_staging()
        self.env.sync(True)

    def _clean_staging(self) -> None:
        """Delete the blocks of every generation a dead daemon left staged (never published)."""
        with self.env.begin(write=True) as txn:
            left = [bytes(k) for k, _ in txn.cursor(db=self._staging)]
            for prefix in left:
                cur = txn.cursor(db=self._blocks)
                keys = []
                if cur.set_range(prefix):
                    for k in cur.iternext(keys=True, values=False):
                        if not bytes(k).startswith(prefix):
                            break
                        keys.append(bytes(k))
                for k in keys:
                    txn.delete(k, db=self._blocks)
                txn.delete(prefix, db=self._staging)
        if left:
            log.warning("disk tier: deleted %d unfinished windowed park(s) left by a previous run", len(left))

    def close(self) -> None:
        """Sync and close, once every ``read_txn`` has ended (at most ``CLOSE_WAIT_S``).

        A reader may outlive the server's drain: a gRPC handler past its grace, a data
        channel GET past its join, stalled on a slow disk. Its views point into LMDB's
        map, so closing under it would unmap them (a crash, or bytes from freed memory).
        One still reading after the wait keeps the environment (and the directory lock)
        open until the process exits, logged; new read transactions are refused."""
        deadline = time.monotonic() + CLOSE_WAIT_S
        with self._readers_cv:
            self._closing = True
            while self._readers and (left := deadline - time.monotonic()) > 0:
                self._readers_cv.wait(left)
            stuck = self._readers
        self.env.sync(True)
        if stuck:
            log.error("disk tier at %s: %d read(s) still running %.0f s after close began (a stalled disk?); "
                      "the environment stays open until the process exits", self.path, stuck, CLOSE_WAIT_S)
            return
        self.env.close()
        envs.disown(self.path, self._direct)
        os.close(self._lock_fd)  # releases the directory lock

    def sync(self) -> None:
        # Every durability point goes through here (writes and deletes with sync=True
        # too, through ``fsync``), so an injected store that overrides it sees each fsync.
        self.env.sync(True)

    def fsync(self) -> None:
        """``sync``, with a failure typed like a failed write (UNAVAILABLE), never an
        untyped INTERNAL: what every durability point calls."""
        try:
            self.sync()
        except lmdb.Error as e:
            raise self._write_error(e) from None

    def load_manifests(self) -> tuple[list[Manifest], list[str]]:
        good: list[Manifest] = []
        bad: list[str] = []
        for g, b in self.load_manifests_in(1 << 62):
            good += g
            bad += b
        return good, bad

    def load_manifests_in(self, chunk: int = 4096) -> Iterator[tuple[list[Manifest], list[str]]]:
        """``load_manifests`` a chunk at a time, each held (charged) before it is yielded:
        a restart that indexes each chunk as it comes keeps no million manifests alive at
        once, and what one chunk's decoding leaves behind is reused by the next (the
        rebuilt index is not left scattered among their freed remains)."""
        good: list[Manifest] = []
        bad: list[str] = []
        with self.env.begin(db=self._manifests) as txn:
            for key, raw in txn.cursor():
                try:
                    good.append(Manifest.decode(raw))
                except (ValueError, KeyError, TypeError) as e:
                    bad.append(f"{bytes(key).decode(errors='replace')}: {e}")
                if len(good) >= chunk:
                    yield self._charge(good), bad
                    good, bad = [], []
        if good or bad:
            yield self._charge(good), bad

    def _charge(self, good: list[Manifest]) -> list[Manifest]:
        with self._acct:
            for m in good:
                self._hold((m.seq_id, m.gen), m.nbytes)
        return good

    def scan(self) -> Scan:
        """Every manifest, block record and staged generation in LMDB (a full scan: for
        invariant checks on a quiet store, never on a serving path)."""
        manifests: dict[str, Manifest] = {}
        records: dict[tuple[str, int], set[int]] = {}
        staged: set[tuple[str, int]] = set()
        tail = 1 + _KEY_TAIL.size
        with self.env.begin() as txn:
            for _, raw in txn.cursor(db=self._manifests):
                m = Manifest.decode(raw)
                manifests[m.seq_id] = m
            for k in txn.cursor(db=self._blocks).iternext(keys=True, values=False):
                k = bytes(k)
                gen, index = _KEY_TAIL.unpack(k[-_KEY_TAIL.size:])
                records.setdefault((k[:-tail].decode(), gen), set()).add(index)
            for k in txn.cursor(db=self._staging).iternext(keys=True, values=False):
                k = bytes(k)
                staged.add((k[:-9].decode(), struct.unpack(">Q", k[-8:])[0]))
        return Scan(manifests, records, staged)

    @property
    def used(self) -> int:
        """Payload bytes of every generation the store holds (written, not yet deleted)."""
        with self._acct:
            return self._used

    def _hold(self, key: tuple[str, int], n: int) -> None:
        # REQUIRES: self._acct held.
        self._used += n - self._held.get(key, 0)
        self._held[key] = n

    def _forget(self, key: tuple[str, int]) -> None:
        # REQUIRES: self._acct held.
        self._used -= self._held.pop(key, 0)
        self._damaged.discard(key)
        self._replaced.pop(key, None)

    def _mark_damaged(self, m: Manifest) -> None:
        with self._acct:
            if (m.seq_id, m.gen) in self._held:
                self._damaged.add((m.seq_id, m.gen))

    @property
    def damaged(self) -> int:
        """Held generations whose record failed verification on a read since start."""
        with self._acct:
            return len(self._damaged)

    def unkeep(self, m: Manifest) -> None:
        """Stop keeping ``m``'s records from the sweep (another holder owns them now)."""
        with self._acct:
            self._kept.discard((m.seq_id, m.key_gen))

    @property
    def kept(self) -> set[tuple[str, int]]:
        """(id, key generation) of the records ``release(keep=True)`` keeps from the sweep."""
        with self._acct:
            return set(self._kept)

    def holds(self, m: Manifest) -> bool:
        with self._acct:
            return (m.seq_id, m.gen) in self._held

    def write(
        self,
        m: Manifest,
        blocks: Sequence[memoryview],
        replace: Manifest | None = None,
        sync: bool = False,
        live: Callable[[], bool] | None = None,
    ) -> bool:
        return self.write_many([Write(m, blocks, replace, live)], sync=sync)[0]

    def write_many(self, writes: Sequence[Write], sync: bool = False) -> list[bool]:
        """Write every sequence in one transaction; at most one fsync. False: a newer generation won."""
        for w in writes:
            if len(w.blocks) != len(w.manifest.block_lengths):
                raise ValueError(f"{len(w.blocks)} block views for {len(w.manifest.block_lengths)} blocks")
        fresh = self._reserve(writes)
        done = [False] * len(writes)
        replaced: dict[tuple[str, int], Manifest] = {}
        try:
            with self.env.begin(write=True) as txn:
                for k, w in enumerate(writes):
                    done[k] = self._put(txn, w, replaced)
        except lmdb.Error as e:
            self._unreserve(fresh)
            raise self._write_error(e) from None
        except BaseException:
            self._unreserve(fresh)
            raise
        with self._acct:
            for k, w in enumerate(writes):
                key = (w.manifest.seq_id, w.manifest.gen)
                if not done[k]:
                    if key in fresh:
                        self._forget(key)
                elif w.replace is not None and w.replace.gen != w.manifest.gen:
                    self._forget((w.replace.seq_id, w.replace.gen))
        if sync and any(done):
            with self._acct:
                self._replaced.update(replaced)  # for ``revert`` until the commit ``settle``s
            self.fsync()
        return done

    def _write_error(self, e: BaseException) -> BaseException:
        """A failed write transaction as the typed error the caller sends on: a full map
        is RESOURCE_EXHAUSTED; anything else LMDB reports (a read-only or failing file
        system: EROFS, EIO, ENOSPC) is UNAVAILABLE, never an untyped INTERNAL."""
        if isinstance(e, lmdb.MapFullError):
            return ResourceExhausted(f"disk tier full at {self.path} (LMDB map)")
        if isinstance(e, lmdb.Error):
            log.error("disk tier at %s: write failed: %s", self.path, e)
            return Unavailable(f"the disk tier at {self.path} cannot be written: {e}")
        return e

    def _reserve(self, writes: Sequence[Write]) -> set[tuple[str, int]]:
        """Charge the new generations against ``capacity`` up front (all or nothing)."""
        with self._acct:
            fresh = {(w.manifest.seq_id, w.manifest.gen): w.manifest.nbytes for w in writes}
            fresh = {k: n for k, n in fresh.items() if k not in self._held}
            freed = sum(self._held.get((w.replace.seq_id, w.replace.gen), 0) for w in writes
                        if w.replace is not None and w.replace.gen != w.manifest.gen)
            used = self._used
            need = sum(fresh.values())
            if used - freed + need > self.capacity:
                raise ResourceExhausted(f"disk tier full: {human(used)} of {human(self.capacity)} used, the write "
                                        f"needs {human(need)}")
            for k, n in fresh.items():
                self._hold(k, n)
            return set(fresh)

    def _unreserve(self, keys: set[tuple[str, int]]) -> None:
        with self._acct:
            for k in keys:
                self._forget(k)

    def _put(self, txn: lmdb.Transaction, w: Write, replaced: dict[tuple[str, int], Manifest]) -> bool:
        m = w.manifest
        cur = _readable(txn.get(m.seq_id.encode(), db=self._manifests))
        if cur is not None and cur.gen > m.gen:
            return False  # a later commit of this id is already on disk: this one is stale
        if w.live is not None and not w.live():
            return False  # retired while we read its bytes: never published
        for i, view in enumerate(w.blocks):
            assert len(view) == m.block_lengths[i]
            head = HEADER.pack(MAGIC, FORMAT_VERSION, 0, 0, m.fingerprint, len(view), checksum(view))
            txn.put(block_key(m.seq_id, m.key_gen, i), b"".join((head, view)), db=self._blocks)
        if w.replace is not None and w.replace.gen != m.gen:
            self._delete_blocks(txn, w.replace)
        if cur is not None and cur.gen != m.gen:
            replaced[(m.seq_id, m.gen)] = cur  # what ``revert`` puts back if this write is refused
        txn.put(m.seq_id.encode(), m.encode(), db=self._manifests)
        return True

    def _delete_blocks(self, txn: lmdb.Transaction, m: Manifest) -> None:
        for i in range(len(m.block_lengths)):
            txn.delete(block_key(m.seq_id, m.key_gen, i), db=self._blocks)

    def update_manifest(self, m: Manifest, sync: bool = False) -> bool:
        """Rewrite the manifest of generation ``m.gen`` (a pin changed); False if that
        generation is no longer the one on disk."""
        try:
            with self.env.begin(write=True) as txn:
                cur = _readable(txn.get(m.seq_id.encode(), db=self._manifests))
                if cur is None or cur.gen != m.gen:
                    return False
                txn.put(m.seq_id.encode(), m.encode(), db=self._manifests)
        except lmdb.Error as e:
            raise self._write_error(e) from None
        if sync:
            self.fsync()
        return True

    def delete(self, m: Manifest, sync: bool = False) -> None:
        try:
            with self._acct:
                self._kept.discard((m.seq_id, m.key_gen))
            with self.env.begin(write=True) as txn:
                self._delete_blocks(txn, m)
                cur = _readable(txn.get(m.seq_id.encode(), db=self._manifests))
                if cur is not None and cur.gen == m.gen:
                    txn.delete(m.seq_id.encode(), db=self._manifests)
        except lmdb.Error as e:
            raise self._write_error(e) from None
        finally:
            # Forgotten even when the delete failed: the caller has already let go of the
            # generation, so the accounting follows the index. Its record stays on disk
            # and is found again at the next start (the drop was never acknowledged).
            with self._acct:
                self._forget((m.seq_id, m.gen))
        if sync:
            self.fsync()

    def take_replaced(self, m: Manifest) -> Manifest | None:
        """The manifest ``m``'s synced write replaced (its commit not yet settled), taken."""
        with self._acct:
            return self._replaced.pop((m.seq_id, m.gen), None)

    def settle(self, ms: Sequence[Manifest]) -> None:
        """These commits are answered: nothing of theirs will be reverted."""
        with self._acct:
            for m in ms:
                self._replaced.pop((m.seq_id, m.gen), None)

    def revert(self, m: Manifest, previous: Manifest | None, sync: bool = False,
               pinned: Callable[[], bool] | None = None) -> None:
        """Undo a refused write of ``m`` (its transaction committed; its fsync or its
        publish failed): its blocks go, and where its manifest is still the current one,
        ``previous`` (what its transaction replaced: ``take_replaced``) comes back if that
        generation is still held here (not deleted, not retired under a reader) and all its
        records are there; else the manifest goes too. One transaction. ``pinned``, asked
        inside it, is that generation's pin now: a pin acknowledged while ``m``'s manifest
        was current updated nothing on disk (``update_manifest``), and ``previous`` is as
        ``m``'s write found it."""
        key = (m.seq_id, m.gen)
        try:
            with self.env.begin(write=True) as txn:
                self._delete_blocks(txn, m)
                name = m.seq_id.encode()
                cur = _readable(txn.get(name, db=self._manifests))
                if cur is not None and cur.gen == m.gen:
                    with self._acct:
                        live = previous is not None and (previous.seq_id, previous.gen) in self._held and (
                            previous.seq_id, previous.key_gen) not in self._kept
                    whole = live and previous is not None and all(
                        txn.get(block_key(previous.seq_id, previous.key_gen, i), db=self._blocks) is not None
                        for i in range(len(previous.block_lengths)))
                    if whole and previous is not None:
                        if pinned is not None and pinned() != previous.pinned:
                            previous = previous.replace(pinned=not previous.pinned)
                        txn.put(name, previous.encode(), db=self._manifests)
                    else:
                        txn.delete(name, db=self._manifests)
        except lmdb.Error as e:
            raise self._write_error(e) from None
        finally:
            with self._acct:
                self._forget(key)  # as in ``delete``: the caller let go of it
        if sync:
            self.fsync()

    def release(self, m: Manifest, keep: bool = False) -> None:
        """Let go of generation ``m.gen``'s charge now; its records stay until ``delete``
        (a retired copy that a read still reads: the accounting follows the index).
        ``keep``: ``sweep_orphans`` leaves them alone too, even once ``unpublish`` has
        deleted their manifest."""
        with self._acct:
            if keep:
                self._kept.add((m.seq_id, m.key_gen))
            self._forget((m.seq_id, m.gen))

    def unpublish(self, m: Manifest, sync: bool = False) -> None:
        """Delete generation ``m.gen``'s manifest if it is still the one on disk; its block
        records stay for a later ``delete`` (a reader holding ``m`` may read them: see
        ``release(keep=True)``). A restart after this never indexes the version again, and
        its start-up sweep deletes the records no manifest owns."""
        try:
            with self.env.begin(write=True) as txn:
                cur = _readable(txn.get(m.seq_id.encode(), db=self._manifests))
                if cur is not None and cur.gen == m.gen:
                    txn.delete(m.seq_id.encode(), db=self._manifests)
        except lmdb.Error as e:
            raise self._write_error(e) from None
        if sync:
            self.fsync()

    # ------------------------------------------------------------------ staged writes

    @staticmethod
    def _stage_key(m: Manifest) -> bytes:
        return m.seq_id.encode() + b"\x00" + struct.pack(">Q", m.key_gen)  # the prefix of its block keys

    @property
    def staged(self) -> int:
        """Bytes charged to staged writes not yet published or aborted."""
        with self._acct:
            return sum(self._staged.values())

    def stage_begin(self, m: Manifest) -> None:
        key = (m.seq_id, m.key_gen)
        with self._acct:
            if m.nbytes > self.capacity or self._used + m.nbytes > self.capacity:
                raise ResourceExhausted(
                    f"disk tier cannot take a sequence of {human(m.nbytes)}: {human(self._used)} of "
                    f"{human(self.capacity)} used")
            self._hold(key, m.nbytes)
            self._staged[key] = m.nbytes
        try:
            with self.env.begin(write=True) as txn:
                txn.put(self._stage_key(m), b"", db=self._staging)
        except BaseException as e:
            with self._acct:
                self._forget(key)
                self._staged.pop(key, None)
            if isinstance(e, lmdb.Error):
                raise self._write_error(e) from None
            raise

    def stage_blocks(self, m: Manifest, first: int, blocks: Sequence[memoryview]) -> None:
        lengths = m.block_lengths
        try:
            with self.env.begin(write=True) as txn:
                for i, view in enumerate(blocks, first):
                    if len(view) != lengths[i]:
                        raise ValueError(f"block {i}: {len(view)} bytes, expected {lengths[i]}")
                    head = HEADER.pack(MAGIC, FORMAT_VERSION, 0, 0, m.fingerprint, len(view), checksum(view))
                    txn.put(block_key(m.seq_id, m.key_gen, i), b"".join((head, view)), db=self._blocks)
        except lmdb.Error as e:
            raise self._write_error(e) from None

    def stage_commit(self, m: Manifest, replace: Manifest | None = None, sync: bool = False) -> bool:
        key = (m.seq_id, m.key_gen)  # charged under the generation it was staged as
        try:
            with self.env.begin(write=True) as txn:
                prev = _readable(txn.get(m.seq_id.encode(), db=self._manifests))
                won = prev is None or prev.gen <= m.gen
                if won:
                    if replace is not None and replace.gen != m.gen:
                        self._delete_blocks(txn, replace)
                    txn.put(m.seq_id.encode(), m.encode(), db=self._manifests)
                else:
                    self._delete_blocks(txn, m)
                txn.delete(self._stage_key(m), db=self._staging)
        except lmdb.Error as e:
            raise self._write_error(e) from None
        with self._acct:
            self._staged.pop(key, None)
            if not won:
                self._forget(key)
            else:
                # Held from now on as the version it published: the generation of its commit.
                n = self._held.pop(key, 0)
                self._used -= n
                self._hold((m.seq_id, m.gen), n)
            if won and replace is not None and replace.gen != m.gen:
                self._forget((replace.seq_id, replace.gen))
            if won and prev is not None and prev.gen != m.gen:
                # For ``revert`` until the commit ``settle``s, synced or not: a windowed park
                # is on disk before its publish, which may still refuse it (write_back too).
                self._replaced[(m.seq_id, m.gen)] = prev
        if sync:
            self.fsync()
        return won

    def stage_abort(self, m: Manifest) -> None:
        try:
            with self.env.begin(write=True) as txn:
                self._delete_blocks(txn, m)
                txn.delete(self._stage_key(m), db=self._staging)
        except lmdb.Error as e:
            raise self._write_error(e) from None
        finally:
            # As in ``delete``: the caller lets go either way; staged blocks a failed abort
            # leaves behind are deleted at the next start (``_clean_staging``).
            with self._acct:
                self._staged.pop((m.seq_id, m.key_gen), None)
                self._forget((m.seq_id, m.key_gen))

    # ------------------------------------------------------------------ orphans

    def sweep_orphans(self) -> int:
        """Delete block records no manifest owns and no staged write is filling; returns
        how many generations went. A crash can leave them: a generation whose manifest
        a newer one replaced before its own delete ran (the delete is a separate
        transaction). Runs without the engine's locks (the maintenance thread, once per
        start): the candidates come from one read snapshot, and each is checked again in
        the write transaction that deletes it, so a write published since is never
        touched (its blocks and its manifest go in one transaction; a staged write
        records itself before its first block)."""
        found: list[bytes] = []  # block key prefixes: seq_id | 0x00 | generation
        with self._acct:
            held = set(self._held)  # generations the store holds (a manifest, or a write under way)
            held |= self._kept  # records a reader reads after their manifest went (``unpublish``)
        with self.env.begin() as txn:
            last = b""
            for k in txn.cursor(db=self._blocks).iternext(keys=True, values=False):
                prefix = k[:-4]
                if prefix == last:
                    continue
                last = prefix
                key = (prefix[:-9].decode(errors="replace"), struct.unpack(">Q", prefix[-8:])[0])
                if key not in held and not self._owned(txn, prefix):
                    found.append(prefix)
        if not found:
            return 0
        done = 0
        with self.env.begin(write=True) as txn:
            for prefix in found:
                if self._owned(txn, prefix):
                    continue
                cur = txn.cursor(db=self._blocks)
                keys = []
                if cur.set_range(prefix):
                    for k in cur.iternext(keys=True, values=False):
                        if bytes(k[:len(prefix)]) != prefix or len(k) != len(prefix) + 4:
                            break
                        keys.append(bytes(k))
                for k in keys:
                    txn.delete(k, db=self._blocks)
                done += 1
        log.warning("disk tier: deleted the blocks of %d generation(s) no manifest owned (left by a crash)", done)
        return done

    def _owned(self, txn: lmdb.Transaction, prefix: bytes) -> bool:
        """Whether the blocks under ``prefix`` belong to a manifest or a staged write."""
        if txn.get(prefix, db=self._staging) is not None:
            return True
        cur = _readable(txn.get(prefix[:-9], db=self._manifests))
        return cur is not None and cur.key_gen == struct.unpack(">Q", prefix[-8:])[0]

    @contextmanager
    def read_txn(self) -> Iterator[ReadTxn]:
        """A read transaction (zero-copy views); counted, so ``close`` waits it out."""
        with self._raw_read() as (txn, db):
            yield ReadTxn(txn, db, self.on_corrupt, self._mark_damaged)

    @contextmanager
    def _raw_read(self) -> Iterator[tuple[lmdb.Transaction, lmdb._Database]]:
        with self._readers_cv:
            if self._closing:
                raise Unavailable(f"the disk tier at {self.path} is closing")
            self._readers += 1
        try:
            with self.env.begin(buffers=True) as txn:
                yield txn, self._blocks
        finally:
            with self._readers_cv:
                self._readers -= 1
                self._readers_cv.notify_all()

    def reader_check(self) -> int:
        """Free the reader slots of processes that died inside a read transaction (a
        client killed mid disk-grant read): a stale slot would pin old pages for ever."""
        try:
            return self.env.reader_check()
        except lmdb.Error:
            return 0
