from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TensorMeta(_message.Message):
    __slots__ = ("dtype", "shape", "nbytes")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    nbytes: int
    def __init__(self, dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., nbytes: _Optional[int] = ...) -> None: ...

class HelloRequest(_message.Message):
    __slots__ = ("client_version",)
    CLIENT_VERSION_FIELD_NUMBER: _ClassVar[int]
    client_version: str
    def __init__(self, client_version: _Optional[str] = ...) -> None: ...

class ArenaInfo(_message.Message):
    __slots__ = ("path", "size", "slot_size", "hostname", "boot_id")
    PATH_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    SLOT_SIZE_FIELD_NUMBER: _ClassVar[int]
    HOSTNAME_FIELD_NUMBER: _ClassVar[int]
    BOOT_ID_FIELD_NUMBER: _ClassVar[int]
    path: str
    size: int
    slot_size: int
    hostname: str
    boot_id: str
    def __init__(self, path: _Optional[str] = ..., size: _Optional[int] = ..., slot_size: _Optional[int] = ..., hostname: _Optional[str] = ..., boot_id: _Optional[str] = ...) -> None: ...

class DeviceInfo(_message.Message):
    __slots__ = ("device", "size", "ipc_handle", "uuid")
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    IPC_HANDLE_FIELD_NUMBER: _ClassVar[int]
    UUID_FIELD_NUMBER: _ClassVar[int]
    device: str
    size: int
    ipc_handle: bytes
    uuid: str
    def __init__(self, device: _Optional[str] = ..., size: _Optional[int] = ..., ipc_handle: _Optional[bytes] = ..., uuid: _Optional[str] = ...) -> None: ...

class HelloResponse(_message.Message):
    __slots__ = ("server_version", "transports", "chunk_size", "max_seq_id_len", "arena", "lease_ttl_s", "device", "data_channel", "features", "instance", "disk")
    SERVER_VERSION_FIELD_NUMBER: _ClassVar[int]
    TRANSPORTS_FIELD_NUMBER: _ClassVar[int]
    CHUNK_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_SEQ_ID_LEN_FIELD_NUMBER: _ClassVar[int]
    ARENA_FIELD_NUMBER: _ClassVar[int]
    LEASE_TTL_S_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    DATA_CHANNEL_FIELD_NUMBER: _ClassVar[int]
    FEATURES_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_FIELD_NUMBER: _ClassVar[int]
    DISK_FIELD_NUMBER: _ClassVar[int]
    server_version: str
    transports: _containers.RepeatedScalarFieldContainer[str]
    chunk_size: int
    max_seq_id_len: int
    arena: ArenaInfo
    lease_ttl_s: float
    device: DeviceInfo
    data_channel: DataChannelInfo
    features: _containers.RepeatedScalarFieldContainer[str]
    instance: str
    disk: DiskInfo
    def __init__(self, server_version: _Optional[str] = ..., transports: _Optional[_Iterable[str]] = ..., chunk_size: _Optional[int] = ..., max_seq_id_len: _Optional[int] = ..., arena: _Optional[_Union[ArenaInfo, _Mapping]] = ..., lease_ttl_s: _Optional[float] = ..., device: _Optional[_Union[DeviceInfo, _Mapping]] = ..., data_channel: _Optional[_Union[DataChannelInfo, _Mapping]] = ..., features: _Optional[_Iterable[str]] = ..., instance: _Optional[str] = ..., disk: _Optional[_Union[DiskInfo, _Mapping]] = ...) -> None: ...

class DiskInfo(_message.Message):
    __slots__ = ("path",)
    PATH_FIELD_NUMBER: _ClassVar[int]
    path: str
    def __init__(self, path: _Optional[str] = ...) -> None: ...

class DataChannelInfo(_message.Message):
    __slots__ = ("address", "tls", "max_frame")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    TLS_FIELD_NUMBER: _ClassVar[int]
    MAX_FRAME_FIELD_NUMBER: _ClassVar[int]
    address: str
    tls: bool
    max_frame: int
    def __init__(self, address: _Optional[str] = ..., tls: _Optional[bool] = ..., max_frame: _Optional[int] = ...) -> None: ...

class ParkHeader(_message.Message):
    __slots__ = ("seq_id", "tensors", "nbytes", "priority", "overwrite", "pinned", "ttl_s", "refs", "shared", "attrs", "blocks", "packed_tensors", "xxh3")
    class AttrsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    OVERWRITE_FIELD_NUMBER: _ClassVar[int]
    PINNED_FIELD_NUMBER: _ClassVar[int]
    TTL_S_FIELD_NUMBER: _ClassVar[int]
    REFS_FIELD_NUMBER: _ClassVar[int]
    SHARED_FIELD_NUMBER: _ClassVar[int]
    ATTRS_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PACKED_TENSORS_FIELD_NUMBER: _ClassVar[int]
    XXH3_FIELD_NUMBER: _ClassVar[int]
    seq_id: str
    tensors: _containers.RepeatedCompositeFieldContainer[TensorMeta]
    nbytes: int
    priority: int
    overwrite: bool
    pinned: bool
    ttl_s: float
    refs: _containers.RepeatedScalarFieldContainer[str]
    shared: bool
    attrs: _containers.ScalarMap[str, str]
    blocks: _containers.RepeatedCompositeFieldContainer[ParkHeader]
    packed_tensors: bytes
    xxh3: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, seq_id: _Optional[str] = ..., tensors: _Optional[_Iterable[_Union[TensorMeta, _Mapping]]] = ..., nbytes: _Optional[int] = ..., priority: _Optional[int] = ..., overwrite: _Optional[bool] = ..., pinned: _Optional[bool] = ..., ttl_s: _Optional[float] = ..., refs: _Optional[_Iterable[str]] = ..., shared: _Optional[bool] = ..., attrs: _Optional[_Mapping[str, str]] = ..., blocks: _Optional[_Iterable[_Union[ParkHeader, _Mapping]]] = ..., packed_tensors: _Optional[bytes] = ..., xxh3: _Optional[_Iterable[int]] = ...) -> None: ...

class DataChunk(_message.Message):
    __slots__ = ("offset", "data")
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    offset: int
    data: bytes
    def __init__(self, offset: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class ParkCommit(_message.Message):
    __slots__ = ("nbytes",)
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    nbytes: int
    def __init__(self, nbytes: _Optional[int] = ...) -> None: ...

class ParkRequest(_message.Message):
    __slots__ = ("header", "chunk", "commit")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    COMMIT_FIELD_NUMBER: _ClassVar[int]
    header: ParkHeader
    chunk: DataChunk
    commit: ParkCommit
    def __init__(self, header: _Optional[_Union[ParkHeader, _Mapping]] = ..., chunk: _Optional[_Union[DataChunk, _Mapping]] = ..., commit: _Optional[_Union[ParkCommit, _Mapping]] = ...) -> None: ...

class ParkSmallRequest(_message.Message):
    __slots__ = ("header", "data")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    header: ParkHeader
    data: bytes
    def __init__(self, header: _Optional[_Union[ParkHeader, _Mapping]] = ..., data: _Optional[bytes] = ...) -> None: ...

class GetRequest(_message.Message):
    __slots__ = ("seq_id", "seq_ids", "expect_layout", "max_bytes")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    EXPECT_LAYOUT_FIELD_NUMBER: _ClassVar[int]
    MAX_BYTES_FIELD_NUMBER: _ClassVar[int]
    seq_id: str
    seq_ids: _containers.RepeatedScalarFieldContainer[str]
    expect_layout: str
    max_bytes: int
    def __init__(self, seq_id: _Optional[str] = ..., seq_ids: _Optional[_Iterable[str]] = ..., expect_layout: _Optional[str] = ..., max_bytes: _Optional[int] = ...) -> None: ...

class GetResponse(_message.Message):
    __slots__ = ("info", "data", "too_large")
    INFO_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    TOO_LARGE_FIELD_NUMBER: _ClassVar[int]
    info: SeqInfo
    data: bytes
    too_large: bool
    def __init__(self, info: _Optional[_Union[SeqInfo, _Mapping]] = ..., data: _Optional[bytes] = ..., too_large: _Optional[bool] = ...) -> None: ...

class RestoreRequest(_message.Message):
    __slots__ = ("seq_id", "seq_ids", "expect_layout")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    EXPECT_LAYOUT_FIELD_NUMBER: _ClassVar[int]
    seq_id: str
    seq_ids: _containers.RepeatedScalarFieldContainer[str]
    expect_layout: str
    def __init__(self, seq_id: _Optional[str] = ..., seq_ids: _Optional[_Iterable[str]] = ..., expect_layout: _Optional[str] = ...) -> None: ...

class RestoreHeader(_message.Message):
    __slots__ = ("info",)
    INFO_FIELD_NUMBER: _ClassVar[int]
    info: SeqInfo
    def __init__(self, info: _Optional[_Union[SeqInfo, _Mapping]] = ...) -> None: ...

class RestoreResponse(_message.Message):
    __slots__ = ("header", "chunk")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    header: RestoreHeader
    chunk: DataChunk
    def __init__(self, header: _Optional[_Union[RestoreHeader, _Mapping]] = ..., chunk: _Optional[_Union[DataChunk, _Mapping]] = ...) -> None: ...

class Segment(_message.Message):
    __slots__ = ("offset", "length")
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    offset: int
    length: int
    def __init__(self, offset: _Optional[int] = ..., length: _Optional[int] = ...) -> None: ...

class ReserveRequest(_message.Message):
    __slots__ = ("header", "tier", "data_channel", "release")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    DATA_CHANNEL_FIELD_NUMBER: _ClassVar[int]
    RELEASE_FIELD_NUMBER: _ClassVar[int]
    header: ParkHeader
    tier: str
    data_channel: bool
    release: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, header: _Optional[_Union[ParkHeader, _Mapping]] = ..., tier: _Optional[str] = ..., data_channel: _Optional[bool] = ..., release: _Optional[_Iterable[str]] = ...) -> None: ...

class ReserveResponse(_message.Message):
    __slots__ = ("lease_id", "segments", "expires_in_s", "window_size", "token", "instance")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    SEGMENTS_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_IN_S_FIELD_NUMBER: _ClassVar[int]
    WINDOW_SIZE_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    segments: _containers.RepeatedCompositeFieldContainer[Segment]
    expires_in_s: float
    window_size: int
    token: bytes
    instance: str
    def __init__(self, lease_id: _Optional[str] = ..., segments: _Optional[_Iterable[_Union[Segment, _Mapping]]] = ..., expires_in_s: _Optional[float] = ..., window_size: _Optional[int] = ..., token: _Optional[bytes] = ..., instance: _Optional[str] = ...) -> None: ...

class WindowRequest(_message.Message):
    __slots__ = ("lease_id", "index", "instance")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    index: int
    instance: str
    def __init__(self, lease_id: _Optional[str] = ..., index: _Optional[int] = ..., instance: _Optional[str] = ...) -> None: ...

class WindowResponse(_message.Message):
    __slots__ = ("segments", "instance")
    SEGMENTS_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_FIELD_NUMBER: _ClassVar[int]
    segments: _containers.RepeatedCompositeFieldContainer[Segment]
    instance: str
    def __init__(self, segments: _Optional[_Iterable[_Union[Segment, _Mapping]]] = ..., instance: _Optional[str] = ...) -> None: ...

class CommitRequest(_message.Message):
    __slots__ = ("lease_id", "packed", "instance")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    PACKED_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    packed: bool
    instance: str
    def __init__(self, lease_id: _Optional[str] = ..., packed: _Optional[bool] = ..., instance: _Optional[str] = ...) -> None: ...

class AcquireRequest(_message.Message):
    __slots__ = ("seq_id", "tier", "seq_ids", "expect_layout", "inline_max", "packed", "data_channel", "disk", "release")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    EXPECT_LAYOUT_FIELD_NUMBER: _ClassVar[int]
    INLINE_MAX_FIELD_NUMBER: _ClassVar[int]
    PACKED_FIELD_NUMBER: _ClassVar[int]
    DATA_CHANNEL_FIELD_NUMBER: _ClassVar[int]
    DISK_FIELD_NUMBER: _ClassVar[int]
    RELEASE_FIELD_NUMBER: _ClassVar[int]
    seq_id: str
    tier: str
    seq_ids: _containers.RepeatedScalarFieldContainer[str]
    expect_layout: str
    inline_max: int
    packed: bool
    data_channel: bool
    disk: bool
    release: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, seq_id: _Optional[str] = ..., tier: _Optional[str] = ..., seq_ids: _Optional[_Iterable[str]] = ..., expect_layout: _Optional[str] = ..., inline_max: _Optional[int] = ..., packed: _Optional[bool] = ..., data_channel: _Optional[bool] = ..., disk: _Optional[bool] = ..., release: _Optional[_Iterable[str]] = ...) -> None: ...

class DiskPart(_message.Message):
    __slots__ = ("seq_id", "key_gen", "fingerprint", "nbytes", "block_size")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    KEY_GEN_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    seq_id: str
    key_gen: int
    fingerprint: int
    nbytes: int
    block_size: int
    def __init__(self, seq_id: _Optional[str] = ..., key_gen: _Optional[int] = ..., fingerprint: _Optional[int] = ..., nbytes: _Optional[int] = ..., block_size: _Optional[int] = ...) -> None: ...

class AcquireResponse(_message.Message):
    __slots__ = ("lease_id", "info", "segments", "expires_in_s", "data", "inlined", "window_size", "token", "instance", "disk_parts")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    INFO_FIELD_NUMBER: _ClassVar[int]
    SEGMENTS_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_IN_S_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    INLINED_FIELD_NUMBER: _ClassVar[int]
    WINDOW_SIZE_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_FIELD_NUMBER: _ClassVar[int]
    DISK_PARTS_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    info: SeqInfo
    segments: _containers.RepeatedCompositeFieldContainer[Segment]
    expires_in_s: float
    data: bytes
    inlined: bool
    window_size: int
    token: bytes
    instance: str
    disk_parts: _containers.RepeatedCompositeFieldContainer[DiskPart]
    def __init__(self, lease_id: _Optional[str] = ..., info: _Optional[_Union[SeqInfo, _Mapping]] = ..., segments: _Optional[_Iterable[_Union[Segment, _Mapping]]] = ..., expires_in_s: _Optional[float] = ..., data: _Optional[bytes] = ..., inlined: _Optional[bool] = ..., window_size: _Optional[int] = ..., token: _Optional[bytes] = ..., instance: _Optional[str] = ..., disk_parts: _Optional[_Iterable[_Union[DiskPart, _Mapping]]] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("lease_id",)
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    def __init__(self, lease_id: _Optional[str] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: bool
    def __init__(self, released: _Optional[bool] = ...) -> None: ...

class PrefetchRequest(_message.Message):
    __slots__ = ("seq_id", "tier", "wait", "timeout_s")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    WAIT_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    seq_id: str
    tier: str
    wait: bool
    timeout_s: float
    def __init__(self, seq_id: _Optional[str] = ..., tier: _Optional[str] = ..., wait: _Optional[bool] = ..., timeout_s: _Optional[float] = ...) -> None: ...

class PrefetchResponse(_message.Message):
    __slots__ = ("tier",)
    TIER_FIELD_NUMBER: _ClassVar[int]
    tier: str
    def __init__(self, tier: _Optional[str] = ...) -> None: ...

class LookupRequest(_message.Message):
    __slots__ = ("seq_ids", "acquire", "tokens_per_block")
    SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    ACQUIRE_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_BLOCK_FIELD_NUMBER: _ClassVar[int]
    seq_ids: _containers.RepeatedScalarFieldContainer[str]
    acquire: LookupAcquire
    tokens_per_block: int
    def __init__(self, seq_ids: _Optional[_Iterable[str]] = ..., acquire: _Optional[_Union[LookupAcquire, _Mapping]] = ..., tokens_per_block: _Optional[int] = ...) -> None: ...

class LookupAcquire(_message.Message):
    __slots__ = ("skip", "max_ids", "tier", "expect_layout", "inline_max")
    SKIP_FIELD_NUMBER: _ClassVar[int]
    MAX_IDS_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    EXPECT_LAYOUT_FIELD_NUMBER: _ClassVar[int]
    INLINE_MAX_FIELD_NUMBER: _ClassVar[int]
    skip: int
    max_ids: int
    tier: str
    expect_layout: str
    inline_max: int
    def __init__(self, skip: _Optional[int] = ..., max_ids: _Optional[int] = ..., tier: _Optional[str] = ..., expect_layout: _Optional[str] = ..., inline_max: _Optional[int] = ...) -> None: ...

class LookupResponse(_message.Message):
    __slots__ = ("prefix", "present", "acquired")
    PREFIX_FIELD_NUMBER: _ClassVar[int]
    PRESENT_FIELD_NUMBER: _ClassVar[int]
    ACQUIRED_FIELD_NUMBER: _ClassVar[int]
    prefix: int
    present: _containers.RepeatedScalarFieldContainer[bool]
    acquired: AcquireResponse
    def __init__(self, prefix: _Optional[int] = ..., present: _Optional[_Iterable[bool]] = ..., acquired: _Optional[_Union[AcquireResponse, _Mapping]] = ...) -> None: ...

class DropRequest(_message.Message):
    __slots__ = ("seq_id",)
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    seq_id: str
    def __init__(self, seq_id: _Optional[str] = ...) -> None: ...

class DropResponse(_message.Message):
    __slots__ = ("dropped",)
    DROPPED_FIELD_NUMBER: _ClassVar[int]
    dropped: bool
    def __init__(self, dropped: _Optional[bool] = ...) -> None: ...

class InfoRequest(_message.Message):
    __slots__ = ("seq_id",)
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    seq_id: str
    def __init__(self, seq_id: _Optional[str] = ...) -> None: ...

class SeqInfo(_message.Message):
    __slots__ = ("seq_id", "nbytes", "tier", "tensors", "priority", "created_at", "last_access", "num_blocks", "attrs", "refs", "shared", "refcount", "pinned", "expires_at", "packed_tensors", "xxh3")
    class AttrsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    LAST_ACCESS_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    ATTRS_FIELD_NUMBER: _ClassVar[int]
    REFS_FIELD_NUMBER: _ClassVar[int]
    SHARED_FIELD_NUMBER: _ClassVar[int]
    REFCOUNT_FIELD_NUMBER: _ClassVar[int]
    PINNED_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_AT_FIELD_NUMBER: _ClassVar[int]
    PACKED_TENSORS_FIELD_NUMBER: _ClassVar[int]
    XXH3_FIELD_NUMBER: _ClassVar[int]
    seq_id: str
    nbytes: int
    tier: str
    tensors: _containers.RepeatedCompositeFieldContainer[TensorMeta]
    priority: int
    created_at: float
    last_access: float
    num_blocks: int
    attrs: _containers.ScalarMap[str, str]
    refs: _containers.RepeatedScalarFieldContainer[str]
    shared: bool
    refcount: int
    pinned: bool
    expires_at: float
    packed_tensors: bytes
    xxh3: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, seq_id: _Optional[str] = ..., nbytes: _Optional[int] = ..., tier: _Optional[str] = ..., tensors: _Optional[_Iterable[_Union[TensorMeta, _Mapping]]] = ..., priority: _Optional[int] = ..., created_at: _Optional[float] = ..., last_access: _Optional[float] = ..., num_blocks: _Optional[int] = ..., attrs: _Optional[_Mapping[str, str]] = ..., refs: _Optional[_Iterable[str]] = ..., shared: _Optional[bool] = ..., refcount: _Optional[int] = ..., pinned: _Optional[bool] = ..., expires_at: _Optional[float] = ..., packed_tensors: _Optional[bytes] = ..., xxh3: _Optional[_Iterable[int]] = ...) -> None: ...

class PinRequest(_message.Message):
    __slots__ = ("seq_id", "pinned")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    PINNED_FIELD_NUMBER: _ClassVar[int]
    seq_id: str
    pinned: bool
    def __init__(self, seq_id: _Optional[str] = ..., pinned: _Optional[bool] = ...) -> None: ...

class FlushRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class FlushResponse(_message.Message):
    __slots__ = ("written",)
    WRITTEN_FIELD_NUMBER: _ClassVar[int]
    written: int
    def __init__(self, written: _Optional[int] = ...) -> None: ...

class ListRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListResponse(_message.Message):
    __slots__ = ("sequences",)
    SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    sequences: _containers.RepeatedCompositeFieldContainer[SeqInfo]
    def __init__(self, sequences: _Optional[_Iterable[_Union[SeqInfo, _Mapping]]] = ...) -> None: ...

class StatRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TierStat(_message.Message):
    __slots__ = ("name", "capacity_bytes", "used_bytes", "blocks", "sequences", "evictions", "state")
    NAME_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    name: str
    capacity_bytes: int
    used_bytes: int
    blocks: int
    sequences: int
    evictions: int
    state: str
    def __init__(self, name: _Optional[str] = ..., capacity_bytes: _Optional[int] = ..., used_bytes: _Optional[int] = ..., blocks: _Optional[int] = ..., sequences: _Optional[int] = ..., evictions: _Optional[int] = ..., state: _Optional[str] = ...) -> None: ...

class RemoteStat(_message.Message):
    __slots__ = ("state", "errors", "refused", "data_loss", "bytes_written", "bytes_read", "outages", "pending_writes", "sequences")
    STATE_FIELD_NUMBER: _ClassVar[int]
    ERRORS_FIELD_NUMBER: _ClassVar[int]
    REFUSED_FIELD_NUMBER: _ClassVar[int]
    DATA_LOSS_FIELD_NUMBER: _ClassVar[int]
    BYTES_WRITTEN_FIELD_NUMBER: _ClassVar[int]
    BYTES_READ_FIELD_NUMBER: _ClassVar[int]
    OUTAGES_FIELD_NUMBER: _ClassVar[int]
    PENDING_WRITES_FIELD_NUMBER: _ClassVar[int]
    SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    state: str
    errors: int
    refused: int
    data_loss: int
    bytes_written: int
    bytes_read: int
    outages: int
    pending_writes: int
    sequences: int
    def __init__(self, state: _Optional[str] = ..., errors: _Optional[int] = ..., refused: _Optional[int] = ..., data_loss: _Optional[int] = ..., bytes_written: _Optional[int] = ..., bytes_read: _Optional[int] = ..., outages: _Optional[int] = ..., pending_writes: _Optional[int] = ..., sequences: _Optional[int] = ...) -> None: ...

class TenantStat(_message.Message):
    __slots__ = ("name", "sequences", "used_bytes", "quota_bytes")
    class UsedBytesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class QuotaBytesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    NAME_FIELD_NUMBER: _ClassVar[int]
    SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    QUOTA_BYTES_FIELD_NUMBER: _ClassVar[int]
    name: str
    sequences: int
    used_bytes: _containers.ScalarMap[str, int]
    quota_bytes: _containers.ScalarMap[str, int]
    def __init__(self, name: _Optional[str] = ..., sequences: _Optional[int] = ..., used_bytes: _Optional[_Mapping[str, int]] = ..., quota_bytes: _Optional[_Mapping[str, int]] = ...) -> None: ...

class StatResponse(_message.Message):
    __slots__ = ("tiers", "sequences", "leases", "remote", "tenants", "damaged", "pinned_bytes")
    class PinnedBytesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    TIERS_FIELD_NUMBER: _ClassVar[int]
    SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    LEASES_FIELD_NUMBER: _ClassVar[int]
    REMOTE_FIELD_NUMBER: _ClassVar[int]
    TENANTS_FIELD_NUMBER: _ClassVar[int]
    DAMAGED_FIELD_NUMBER: _ClassVar[int]
    PINNED_BYTES_FIELD_NUMBER: _ClassVar[int]
    tiers: _containers.RepeatedCompositeFieldContainer[TierStat]
    sequences: int
    leases: int
    remote: RemoteStat
    tenants: _containers.RepeatedCompositeFieldContainer[TenantStat]
    damaged: int
    pinned_bytes: _containers.ScalarMap[str, int]
    def __init__(self, tiers: _Optional[_Iterable[_Union[TierStat, _Mapping]]] = ..., sequences: _Optional[int] = ..., leases: _Optional[int] = ..., remote: _Optional[_Union[RemoteStat, _Mapping]] = ..., tenants: _Optional[_Iterable[_Union[TenantStat, _Mapping]]] = ..., damaged: _Optional[int] = ..., pinned_bytes: _Optional[_Mapping[str, int]] = ...) -> None: ...
