"""Generated protobuf and gRPC modules for kvpark.v1 (do not edit)."""
