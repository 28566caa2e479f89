"""The storage mediums and the pure policies that place data on them.

Modules:
- ``kvpark.tiers.arena``: fixed-slot allocator with granule-packed tails (exact accounting).
- ``kvpark.tiers.shm``: the shared-memory file that backs the host arena.
- ``kvpark.tiers.private``: daemon-private memory (no file, never shared) behind the private tier.
- ``kvpark.tiers.disk``: the LMDB disk store (checksummed block records + manifests).
- ``kvpark.tiers.remote``: the Redis / Redis Cluster store below disk (chunked, verified
  records + manifests, shared across daemons); ``kvpark.tiers.breaker``: its circuit breaker;
  ``kvpark.tiers.resp``: its values sent in pieces and replies read into place.
- ``kvpark.tiers.policy``: pure eviction/placement decisions over sequence metadata.
"""
