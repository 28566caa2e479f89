"""The wire contract and the few types both sides of it share.

Modules:
- ``kvpark.proto.v1``: generated protobuf/gRPC code for ``kvpark/v1/kvpark.proto`` (never edited by hand).
- ``kvpark.proto.errors``: the one error hierarchy, mapped to gRPC status codes.
- ``kvpark.proto.layout``: tensor metadata, dtype table, payload layout and layout fingerprint.
- ``kvpark.proto.types``: ``SeqInfo``/``TierStat``/``Stat`` dataclasses returned to users.
- ``kvpark.proto.wire``: hand-rolled encoding of the hot ``DataChunk`` messages.
- ``kvpark.proto.convert``: protobuf <-> dataclass conversions (used by the servicer and client only).
"""

VERSION = "0.1.0"

# gRPC channel/server options shared by both ends: room for 16 MiB chunks plus framing,
# and compression off (KV bytes do not compress and it costs CPU). The HTTP/2 lookahead
# was measured at 64 KiB and 8 MiB with no consistent difference (bench/inline_tuning.py),
# so gRPC's default stays.
GRPC_OPTIONS: list[tuple[str, int]] = [
    ("grpc.max_send_message_length", 64 << 20),
    ("grpc.max_receive_message_length", 64 << 20),
    ("grpc.default_compression_algorithm", 0),
]
