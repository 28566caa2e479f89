"""Protobuf <-> dataclass conversions. Only the servicer and the client import this.

Primitives: ``meta_to_pb``/``meta_from_pb``, ``info_to_pb``/``info_from_pb``,
``stat_to_pb``/``stat_from_pb``. ``info_to_pb(info, packed=True)`` carries the tensors
as ``packed_tensors`` (``kvpark.proto.packed``); ``info_from_pb`` reads either form.
"""

from __future__ import annotations

from . import packed as packing
from .layout import TensorMeta
from .types import RemoteStat, SeqInfo, Stat, TenantStat, TierStat
from .v1 import kvpark_pb2 as pb


def meta_to_pb(m: TensorMeta) -> pb.TensorMeta:
    return pb.TensorMeta(dtype=m.dtype, shape=list(m.shape), nbytes=m.nbytes)


def meta_from_pb(m: pb.TensorMeta) -> TensorMeta:
    return TensorMeta(m.dtype, tuple(m.shape), m.nbytes)


def info_to_pb(i: SeqInfo, packed: bool = False) -> pb.SeqInfo:
    return pb.SeqInfo(
        seq_id=i.seq_id,
        nbytes=i.nbytes,
        tier=i.tier,
        tensors=[] if packed else [meta_to_pb(m) for m in i.tensors],
        packed_tensors=packing.pack_metas(i.tensors) if packed else b"",
        priority=i.priority,
        created_at=i.created_at,
        last_access=i.last_access,
        num_blocks=i.num_blocks,
        attrs=i.attrs,
        refs=list(i.refs),
        shared=i.shared,
        refcount=i.refcount,
        pinned=i.pinned,
        expires_at=i.expires_at,
        xxh3=list(i.xxh3),
    )


def info_from_pb(p: pb.SeqInfo) -> SeqInfo:
    tensors = packing.unpack(p.packed_tensors) if p.packed_tensors else tuple(meta_from_pb(m) for m in p.tensors)
    return SeqInfo(
        seq_id=p.seq_id,
        nbytes=p.nbytes,
        tier=p.tier,
        num_tensors=len(tensors),
        tensors=tensors,
        priority=p.priority,
        created_at=p.created_at,
        last_access=p.last_access,
        num_blocks=p.num_blocks,
        attrs=dict(p.attrs),
        refs=tuple(p.refs),
        shared=p.shared,
        refcount=p.refcount,
        pinned=p.pinned,
        expires_at=p.expires_at,
        xxh3=tuple(p.xxh3),
    )


def stat_to_pb(s: Stat) -> pb.StatResponse:
    return pb.StatResponse(
        tiers=[
            pb.TierStat(
                name=name,
                capacity_bytes=t.capacity_bytes,
                used_bytes=t.used_bytes,
                blocks=t.blocks,
                sequences=t.sequences,
                evictions=t.evictions,
                state=t.state,
            )
            for name, t in s.tiers.items()
        ],
        sequences=s.sequences,
        leases=s.leases,
        damaged=s.damaged,
        remote=None if s.remote is None else pb.RemoteStat(
            state=s.remote.state, errors=s.remote.errors, refused=s.remote.refused, data_loss=s.remote.data_loss,
            bytes_written=s.remote.bytes_written, bytes_read=s.remote.bytes_read, outages=s.remote.outages,
            pending_writes=s.remote.pending_writes, sequences=s.remote.sequences,
        ),
        tenants=[pb.TenantStat(name=t.name, sequences=t.sequences, used_bytes=t.used, quota_bytes=t.quota)
                 for t in s.tenants],
        pinned_bytes=s.pinned,
    )


def stat_from_pb(p: pb.StatResponse) -> Stat:
    r = p.remote
    return Stat(
        tiers={t.name: TierStat(t.capacity_bytes, t.used_bytes, t.blocks, t.sequences, t.evictions, t.state)
               for t in p.tiers},
        sequences=p.sequences,
        leases=p.leases,
        remote=RemoteStat(r.state, r.errors, r.refused, r.data_loss, r.bytes_written, r.bytes_read, r.outages,
                          r.pending_writes, r.sequences) if p.HasField("remote") else None,
        damaged=p.damaged,
        tenants=tuple(TenantStat(t.name, t.sequences, dict(t.used_bytes), dict(t.quota_bytes)) for t in p.tenants),
        pinned=dict(p.pinned_bytes),
    )
