"""Cold rows: typed columns for the parked sequences nobody is using.

Most of a million parked blocks sit still: nobody reads, moves, leases or writes them.
As objects each held a ``Seq``, its ``Manifest``, a ``TierMap``, an ``Allocation``,
a generation int and timestamp floats: about 450 bytes of Python objects besides its
id. The catalog keeps such a block as a row number instead (``catalog.py``), makes its
``Seq`` again (``thaw``) the moment anyone looks it up, and puts a ``Seq`` back into a
row (``freeze``) once nothing but the index holds it. A row is ~60 bytes of columns.

Only what a quiet sequence holds fits in a row: its generation, times and shared
``Form``, at most one memory copy, the disk and remote flags, the read and promotion
counts. A sequence with anything else (a reader, a copy in flight, a move lock held,
a dirty clock, a TTL deadline, two memory copies, counts past 32 bits) cannot be
frozen: ``freeze`` returns None and the caller keeps the ``Seq``. A copy's full slots
are kept aside (``_big``): a small block has none, and a column of them would cost
every row 8 bytes.

Not thread-safe: the catalog calls it under the index lock.

Primitives:
- ``Rows(slot_sizes)``: ``slot_sizes`` maps each memory tier to its allocator's slot size.
- ``freeze(seq) -> int | None``: the row now holding ``seq``'s state, or None.
- ``thaw(row, seq_id) -> Seq``: a ``Seq`` equal to the one frozen; the row is freed.
  ``view(row, seq_id)``: the same, the row kept (a detached copy, to read only).
- ``add(manifest, on_disk, on_remote) -> int``: a row for a sequence with no memory
  copy (a start-up's index rebuild makes no ``Seq`` at all).
- Reads without a thaw: ``id_of``, ``gen``, ``form``, ``on_disk``, ``on_remote``, ``has(row, tier)``,
  ``alloc(row) -> (tier, Allocation) | None``, ``meta(row, seq_id, tier)``.
- ``__len__``: rows in use.
"""

from __future__ import annotations

from array import array

from kvpark.tiers import policy
from kvpark.tiers.arena import Allocation
from kvpark.tiers.disk import Form, Manifest

from .model import MEM_TIERS, Seq, TierMap

DISK = "disk"
_ON_DISK, _ON_REMOTE = 1, 2  # ``_state`` bits; the memory copy's tier is ``_state >> 2``
_TIER_CODE = {t: i + 1 for i, t in enumerate(MEM_TIERS)}  # 0: no memory copy
_CODE_TIER = {i: t for t, i in _TIER_CODE.items()}
_U32 = 1 << 32
_I63 = 1 << 63


class Rows:
    def __init__(self, slot_sizes: dict[str, int]) -> None:
        self._slot_size = dict(slot_sizes)
        self._gen = array("q")
        self._created = array("d")
        self._last = array("d")
        self._form: list[Form | None] = []
        # The id, the very string the index keys by: a thaw gives the ``Seq`` that one, so
        # whatever keeps its id afterwards (an eviction entry) keeps no second copy.
        self._ids: list[str] = []
        self._state = bytearray()
        self._access = array("I")
        self._promotions = array("I")
        self._tail = array("q")  # the memory copy's packed tail (``Allocation.packed_tail``)
        self._big: dict[int, tuple[int, ...]] = {}  # row -> its copy's full slots, where it has any
        self._free: list[int] = []

    def __len__(self) -> int:
        return len(self._form) - len(self._free)

    def _take(self) -> int:
        if self._free:
            return self._free.pop()
        row = len(self._form)
        for col in (self._gen, self._created, self._last, self._access, self._promotions, self._tail):
            col.append(0)
        self._form.append(None)
        self._ids.append("")
        self._state.append(0)
        return row

    def _put(self, row: int, m: Manifest, state: int) -> None:
        self._gen[row] = m.gen
        self._created[row] = m.created_at
        self._last[row] = m.last_access
        self._form[row] = m.form
        self._ids[row] = m.seq_id
        self._state[row] = state

    def add(self, m: Manifest, on_disk: bool, on_remote: bool = False) -> int | None:
        if not 0 <= m.gen < _I63 or m.__class__ is not Manifest or m.expires_at is not None:
            return None
        state = (_ON_DISK if on_disk else 0) | (_ON_REMOTE if on_remote else 0)
        if self._free:
            row = self._free.pop()
            self._put(row, m, state)
            self._access[row] = self._promotions[row] = self._tail[row] = 0
            return row
        # Appended in place (a restart adds a million rows and frees none).
        row = len(self._form)
        self._gen.append(m.gen)
        self._created.append(m.created_at)
        self._last.append(m.last_access)
        self._access.append(0)
        self._promotions.append(0)
        self._tail.append(0)
        self._form.append(m.form)
        self._ids.append(m.seq_id)
        self._state.append(state)
        return row

    def freeze(self, seq: Seq) -> int | None:
        """The row for ``seq``'s state, or None when a row cannot hold it (see the module
        docstring). The caller must hold the only reference to ``seq`` besides the index's."""
        m = seq.manifest
        if (seq.__class__ is not Seq or m.__class__ is not Manifest or m.expires_at is not None
                or seq.dropped or seq.moving
                or seq._readers is not None or seq.dirty_since
                or (seq._move_lock is not None and seq._move_lock.locked())
                or not 0 <= seq.access_count < _U32 or not 0 <= seq.promotions < _U32 or not 0 <= m.gen < _I63):
            return None
        res = seq.res
        code, alloc = 0, None
        for t in MEM_TIERS:
            a = res.get(t)
            if a is None:
                continue
            if alloc is not None or a.slot_size != self._slot_size.get(t) or not 0 <= a.packed_tail < _I63:
                return None
            code, alloc = _TIER_CODE[t], a
        row = self._take()
        self._put(row, m, (_ON_DISK if seq.on_disk else 0) | (_ON_REMOTE if seq.on_remote else 0) | code << 2)
        self._access[row] = seq.access_count
        self._promotions[row] = seq.promotions
        self._tail[row] = alloc.packed_tail if alloc is not None else 0
        if alloc is not None and alloc.full_slots:
            self._big[row] = alloc.full_slots
        return row

    def _manifest(self, row: int, seq_id: str) -> Manifest:
        form = self._form[row]
        assert form is not None, f"row {row} is free"
        sid = self._ids[row]
        assert sid == seq_id, f"row {row} holds {sid!r}, not {seq_id!r}"
        return Manifest.of(sid, self._gen[row], self._created[row], self._last[row], None, form)

    def alloc(self, row: int) -> tuple[str, Allocation] | None:
        """The memory copy a row holds, as ``(tier, allocation)``; None without one."""
        code = self._state[row] >> 2
        if not code:
            return None
        t = _CODE_TIER[code]
        return t, Allocation.packed(self._slot_size[t], self._big.get(row, ()), self._tail[row])

    def view(self, row: int, seq_id: str) -> Seq:
        """A ``Seq`` equal to the row's, the row kept: a detached copy to read (a listing,
        a victim's eligibility), never to index, hold or compare by identity."""
        state = self._state[row]
        held = self.alloc(row)
        seq = Seq(self._manifest(row, seq_id), TierMap({held[0]: held[1]}) if held else None,
                  on_disk=bool(state & _ON_DISK), on_remote=bool(state & _ON_REMOTE))
        seq.access_count = self._access[row]
        seq.promotions = self._promotions[row]
        return seq

    def thaw(self, row: int, seq_id: str) -> Seq:
        seq = self.view(row, seq_id)
        self.free(row)
        return seq

    def free(self, row: int) -> None:
        assert self._form[row] is not None, f"row {row} freed twice"
        self._form[row] = None
        self._ids[row] = ""
        self._big.pop(row, None)
        self._free.append(row)

    # ------------------------------------------------------------------ reads without a thaw

    def id_of(self, row: int) -> str:
        return self._ids[row]

    def gen(self, row: int) -> int:
        return self._gen[row]

    def form(self, row: int) -> Form:
        f = self._form[row]
        assert f is not None, f"row {row} is free"
        return f

    def on_disk(self, row: int) -> bool:
        return bool(self._state[row] & _ON_DISK)

    def on_remote(self, row: int) -> bool:
        return bool(self._state[row] & _ON_REMOTE)

    def has(self, row: int, tier: str) -> bool:
        """A copy in ``tier`` (a memory tier, or ``disk``). Rows are never dropped versions."""
        if tier == DISK:
            return bool(self._state[row] & _ON_DISK)
        return _CODE_TIER.get(self._state[row] >> 2) == tier

    def meta(self, row: int, seq_id: str, tier: str) -> policy.SeqMeta:
        """What the eviction policies see of a row's copy in ``tier`` (as
        ``evict_order.meta`` of its ``Seq``: the same values, so the same keys)."""
        form = self.form(row)
        if tier == DISK:
            size = form.nbytes
        else:
            held = self.alloc(row)
            assert held is not None and held[0] == tier, f"row {row} has no copy in {tier}"
            size = held[1].charged
        return policy.SeqMeta(seq_id, size, self._last[row], form.priority, self._access[row],
                              self._created[row], self._promotions[row])
