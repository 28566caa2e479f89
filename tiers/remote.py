"""The remote tier: sequences and prefix blocks in Redis (standalone or Redis Cluster).

Redis is the distributed engine; this module only lays kvpark's records over it, so that
any daemon pointed at the same Redis and namespace finds what another one wrote.

Keys (``NS`` = namespace; ``{``, ``}`` and ``%`` in names are %-escaped so no name can pin
keys to one cluster slot). The key space is derived from the id itself: a tenant's
sequence has the internal id ``<tenant><TENANT_SEP><id>`` and lives under ``NS:t:<tenant>:``
(``:`` in the tenant escaped too); an id without the separator (an open daemon's) lives
under ``NS:o:``. No key of one space is a key of the other, whatever the ids. ``S`` below
is that space segment:
- ``NS:S:m:<seq_id>``: the manifest: ``MANIFEST_HEADER`` (magic ``KVPM``, version, chunk
  size, length, xxh3-64 of the JSON) + ``Manifest.encode()``. Written after every chunk,
  so a reader that finds a manifest finds its data.
- ``NS:S:v:<fingerprint hex>:<seq_id>:<gen>:<i>``: chunk ``i`` of the payload:
  ``CHUNK_HEADER`` (magic ``KVPR``, version, flags, chunk index, layout fingerprint,
  generation, length, xxh3-64 of the payload) + payload. The payload is cut into
  ``chunk_size`` pieces across block boundaries (large values, few commands), and
  each key hashes to its own cluster slot, so a large sequence spreads over the nodes.
- The legacy layout (before key spaces: ``NS:m:<seq_id>``, ``NS:v:...``) is still read
  for ids without the separator and without a key: a manifest miss falls back to it, its
  chunks are read where its manifest was found, a delete removes a version in both
  layouts, and a put of the id deletes the legacy manifest it replaces. Never for a
  tenant's ids (an open daemon of an older build could plant legacy keys under them),
  and never with a key (the legacy layout only held plain values).

With keys (``RemoteOptions.keys``, the first one current) every value above is sealed:
``SEAL_HEADER`` (magic ``KVPX``, version, kind, key id = sha256(key)[:8], random 96-bit
nonce) + AES-256-GCM of the plain value, with the header and the value's Redis key as
associated data, so a value moved to another key (another id, generation, index or
namespace) does not open. A read opens with whichever configured key the id names; a
plain value, an unknown key id or a value that does not authenticate is ``DataLoss``
(deleted, like a checksum failure). A value sealed with an old key is served and
re-sealed with the current key in the background (a compare-and-set, so a newer write or
a delete meanwhile wins; at most ``reseal_bytes`` queued). Without keys a Redis writer can
replace any value with one whose checksum it recomputed, and it is served.

Every chunk is verified (header, index, fingerprint, generation, length, checksum)
before a byte of it is served; a mismatch deletes the sequence from Redis and raises
``DataLoss``. A chunk that is not there at all (expired, evicted by Redis, dropped under
the reader) is ``NotFound``, not damage: that generation's remains are deleted, nothing
is counted as data loss. Chunks travel in pipelines of about ``pipeline_bytes``, ``inflight`` of
them at once, each on its own pooled connection. Plain values go out without being joined
and come back straight into the caller's buffers (``tiers/resp.py``: one copy, the
kernel's); sealed ones through redis-py's parser, since the cipher needs the whole value.

Every call goes through a circuit breaker (``tiers/breaker.py``): a Redis that is down,
slow or resharding makes calls fail within ``timeout_s`` with ``Unavailable`` or
``DeadlineExceeded``; after a few failures calls are refused at once for a cool-down,
then one probe goes out, and a success resumes the tier. State and counters are in
``stats()``.

Primitives:
- ``RemoteOptions``: url, cluster, namespace, ttl_s, timeout_s, chunk_size,
  pipeline_bytes, inflight, breaker settings; max_pending (the daemon's copy queue);
  keys (AES-256-GCM, current first; empty = plain values), reseal_bytes.
- ``RemoteStore(opts)``: ``put(manifest, blocks)``;
  ``get_manifest(seq_id) -> Manifest | None``; ``get_manifests(ids)``;
  ``read(manifest) -> bytearray`` / ``read_into(manifest, out)`` /
  ``read_blocks_into(manifest, outs)`` (one view per block)
  (``NotFound`` when the sequence is gone or replaced in Redis);
  ``delete(manifest)``; ``exists(seq_ids) -> list[bool]``;
  ``copy_state(manifest) -> WHOLE | REPLACED | GONE`` (what Redis holds of
  that generation; a whole one gets a fresh TTL);
  ``ping()``; ``stats() -> RemoteStats``; ``close()``.
- ``chunk_plan(block_lengths, chunk_size) -> list[(offset, length)]``;
  ``slices(views, offset, length)``: the pieces of block views a chunk covers. Pure.
- ``chunk_head`` / ``encode_chunk`` / ``verify_chunk`` / ``check_head`` / ``verify_pieces``,
  ``encode_manifest`` / ``decode_manifest``: pure.
- ``Sealer(keys)``: ``seal(kind, redis_key, plain)``, ``open(kind, redis_key, raw) ->
  (plain, sealed with an old key)``; ``key_id(key)``.
- ``require_client()``: the Redis client package, or a ``StartupError`` naming the extra.
"""

from __future__ import annotations

import hashlib
import logging
import os
import struct
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Sequence, TypeVar

import xxhash

from kvpark.proto.errors import DataLoss, DeadlineExceeded, NotFound, StartupError, Unavailable
from kvpark.tiers.breaker import Breaker
from kvpark.tiers.disk import Manifest
from kvpark.tiers.resp import Pieces, Unparsed, read_bulks_into, serializer_class

log = logging.getLogger(__name__)

CHUNK_MAGIC = b"KVPR"
MANIFEST_MAGIC = b"KVPM"
FORMAT_VERSION = 1
# magic, version, flags, reserved, chunk index, fingerprint, generation, length, xxh3-64
CHUNK_HEADER = struct.Struct("<4sBBHIQQQQ")
# magic, version, reserved, chunk size, length of the JSON, xxh3-64 of the JSON
MANIFEST_HEADER = struct.Struct("<4sBBHIQQ")

T = TypeVar("T")

# What joins a tenant's name to each id it uses (the daemon's ``NS_SEP``): the remote key
# space is derived from it, so a tenant's sequences and an open daemon's never share keys.
TENANT_SEP = "\u241f"

# A sealed value (with a key): magic, version, kind, reserved, key id, 96-bit nonce; then
# AES-256-GCM of the plain value (chunk or manifest, header included) and its 16-byte tag.
# The associated data is this header plus the value's Redis key.
SEAL_MAGIC = b"KVPX"
SEAL_VERSION = 1
SEAL_HEADER = struct.Struct("<4sBBH8s12s")
SEAL_CHUNK, SEAL_MANIFEST = 1, 2
KEY_BYTES = 32

# copy_state(): what Redis holds of one generation of a sequence
WHOLE, REPLACED, GONE = "whole", "replaced", "gone"


POOL_HEADROOM = 64  # connections beyond the pipelines' and evictions': the daemon's other callers

@dataclass(frozen=True)
class RemoteOptions:
    url: str = "redis://127.0.0.1:6379/0"
    cluster: bool = False
    namespace: str = "kvpark"
    ttl_s: float = 0.0  # 0 = keys never expire
    timeout_s: float = 2.0  # per remote operation (connect, and every socket read/write)
    chunk_size: int = 4 << 20  # largest value written; blocks larger than this are split
    pipeline_bytes: int = 16 << 20  # payload bytes per pipeline
    inflight: int = 4  # pipelines in flight at once
    # Not the store's either: sequences the daemon's disk eviction moves at once (each one
    # a caller of its own); the connection pool makes room for them.
    evict_parallel: int = 4
    breaker_failures: int = 3
    breaker_cooldown_s: float = 5.0
    # Not the store's: the daemon's bound on write_through copies queued for Redis
    # (daemon/remote_tier.py); past it a copy is skipped, the local copy stays.
    max_pending: int = 1024
    # AES-256-GCM keys (32 bytes each): the first seals every value written, all of them
    # open what is read. Empty: values are plain (checksummed, not authenticated).
    keys: tuple[bytes, ...] = ()
    # Bytes of old-key values queued for re-sealing at most (past it a read re-queues later).
    reseal_bytes: int = 64 << 20


@dataclass(frozen=True)
class RemoteStats:
    state: str  # breaker: "closed" (healthy), "open" (degraded, failing fast), "half_open"
    errors: int  # failed calls (timeouts, refused connections, cluster errors)
    refused: int  # calls refused by the open breaker without touching Redis
    data_loss: int  # values that failed verification (and were deleted)
    bytes_written: int
    bytes_read: int
    outages: int  # times the breaker opened
    resealed: int = 0  # values sealed with an old key, re-sealed with the current one
    # pipelines read in place (tiers/resp.py) that were read again the ordinary way: a
    # cluster's redirect or unreachable node, a value of another size or type
    reread: int = 0

    @property
    def degraded(self) -> bool:
        return self.state != "closed"


def require_client() -> Any:
    """The redis package, or a start-up error naming the optional extra to install."""
    try:
        import redis
    except ImportError:
        raise StartupError(
            "tiers.remote is configured but the Redis client is not installed: "
            "pip install 'kvpark[remote]'"
        ) from None
    return redis


def connection_class(url: str) -> type:
    """A redis-py connection class for ``url`` that packs commands in Python.

    redis-py packs commands with hiredis when it is installed, and hiredis copies every
    argument into one buffer: SET of 4 MiB values measured ~0.4-0.8 GB/s that way, against
    ~1.8 GB/s with redis-py's own packer, which hands large values to ``sendall`` as they
    are (docs/BENCHMARKS.md). Replies are still parsed by hiredis.
    """
    redis = require_client()
    scheme = url.split("://", 1)[0]
    base = {"rediss": redis.SSLConnection, "unix": redis.UnixDomainSocketConnection}.get(scheme, redis.Connection)

    class LargeValueConnection(base):  # type: ignore[misc, valid-type]
        def _construct_command_packer(self, packer: Any) -> Any:
            return packer or serializer_class()(self._buffer_cutoff, self.encoder.encode)

    return LargeValueConnection


def checksum(view: memoryview | bytes) -> int:
    return xxhash.xxh3_64_intdigest(view)


def _esc(name: str) -> str:
    # A "{...}" in a key is a cluster hash tag: it would put every chunk of a sequence on
    # one slot (one node). Escaped, each key hashes whole.
    return name.replace("%", "%25").replace("{", "%7B").replace("}", "%7D")


def chunk_plan(block_lengths: Sequence[int], chunk_size: int) -> list[tuple[int, int]]:
    """(payload offset, length) of every chunk: the payload cut every ``chunk_size``
    bytes, across block boundaries. (1 MiB values measured ~20% slower to SET than
    4 MiB ones: fewer, larger values.)"""
    total = sum(block_lengths)
    return [(off, min(chunk_size, total - off)) for off in range(0, total, chunk_size)]


def slices(views: Sequence[memoryview], offset: int, length: int) -> list[memoryview]:
    """The pieces of ``views`` (laid end to end) that cover ``[offset, offset + length)``."""
    out: list[memoryview] = []
    pos = 0
    end = offset + length
    for v in views:
        n = len(v)
        if pos + n > offset and pos < end:
            lo, hi = max(offset, pos) - pos, min(end, pos + n) - pos
            out.append(v[lo:hi])
        pos += n
        if pos >= end:
            break
    return out


def chunk_head(index: int, fingerprint: int, gen: int, pieces: Sequence[memoryview | bytes]) -> bytes:
    """The header of a chunk whose payload is ``pieces`` laid end to end (one xxh3 pass)."""
    h = xxhash.xxh3_64()
    for p in pieces:
        h.update(p)
    n = sum(len(p) for p in pieces)
    return CHUNK_HEADER.pack(CHUNK_MAGIC, FORMAT_VERSION, 0, 0, index, fingerprint, gen, n, h.intdigest())


def encode_chunk(index: int, fingerprint: int, gen: int, payload: memoryview | bytes | Sequence[memoryview]) -> bytes:
    """Header + payload as one value; ``payload`` may be several pieces (one copy: the join)."""
    pieces = [payload] if isinstance(payload, (bytes, bytearray, memoryview)) else list(payload)
    return b"".join((chunk_head(index, fingerprint, gen, pieces), *pieces))


def check_head(head: memoryview | bytes, index: int, fingerprint: int, gen: int) -> tuple[int, int]:
    """(payload length, payload checksum) that a chunk's header states, or ``DataLoss``
    naming what is wrong with it (magic, version, index, generation, fingerprint)."""
    where = f"chunk {index}"
    magic, version, _flags, _res, idx, fp, g, ln, ck = CHUNK_HEADER.unpack_from(head)
    if magic != CHUNK_MAGIC or version != FORMAT_VERSION:
        raise DataLoss(f"{where}: bad header (magic {magic!r}, version {version})")
    if idx != index or g != gen:
        raise DataLoss(f"{where}: header says chunk {idx} of generation {g}, expected {index} of {gen}")
    if fp != fingerprint:
        raise DataLoss(f"{where}: layout fingerprint {fp:#x} != manifest {fingerprint:#x}")
    return ln, ck


def verify_pieces(head: memoryview | bytes, pieces: Sequence[memoryview], index: int, fingerprint: int,
                  gen: int) -> None:
    """A chunk read in place, its header in ``head`` and its payload already in ``pieces``
    (as long as the plan says): ``DataLoss`` unless the header is right and the payload
    matches its checksum."""
    ln, ck = check_head(head, index, fingerprint, gen)
    length = sum(len(p) for p in pieces)
    if ln != length:
        raise DataLoss(f"chunk {index}: header says {ln} bytes, the manifest {length}")
    h = xxhash.xxh3_64()
    for p in pieces:
        h.update(p)
    if h.intdigest() != ck:
        raise DataLoss(f"chunk {index}: checksum mismatch")


def verify_chunk(raw: bytes | None, index: int, fingerprint: int, gen: int, length: int) -> memoryview:
    """The payload of a chunk, or ``DataLoss`` naming what is wrong."""
    where = f"chunk {index}"
    if raw is None:
        raise DataLoss(f"{where}: missing from the remote tier (expired or evicted by Redis)")
    view = memoryview(raw)
    if len(view) < CHUNK_HEADER.size:
        raise DataLoss(f"{where}: truncated ({len(view)} bytes)")
    ln, ck = check_head(view, index, fingerprint, gen)
    payload = view[CHUNK_HEADER.size:]
    if ln != length or len(payload) != length:
        raise DataLoss(f"{where}: length {len(payload)} (header {ln}) != expected {length}")
    if checksum(payload) != ck:
        raise DataLoss(f"{where}: checksum mismatch")
    return payload


def _wrong_type(e: Exception) -> bool:
    # redis-py raises a plain ResponseError whose message starts with the error code.
    return str(e).startswith("WRONGTYPE")


def encode_manifest(m: Manifest, chunk_size: int) -> bytes:
    body = m.encode()
    return MANIFEST_HEADER.pack(MANIFEST_MAGIC, FORMAT_VERSION, 0, 0, chunk_size, len(body), checksum(body)) + body


def decode_manifest(raw: bytes) -> tuple[Manifest, int]:
    """(manifest, chunk size), or ``DataLoss``."""
    if len(raw) < MANIFEST_HEADER.size:
        raise DataLoss(f"manifest truncated ({len(raw)} bytes)")
    magic, version, _r1, _r2, chunk, ln, ck = MANIFEST_HEADER.unpack_from(raw)
    body = memoryview(raw)[MANIFEST_HEADER.size:]
    if magic != MANIFEST_MAGIC or version != FORMAT_VERSION:
        raise DataLoss(f"manifest: bad header (magic {magic!r}, version {version})")
    if ln != len(body) or checksum(body) != ck:
        raise DataLoss("manifest: checksum mismatch")
    try:
        return Manifest.decode(bytes(body)), chunk
    except (ValueError, KeyError, TypeError) as e:
        raise DataLoss(f"manifest: {e}") from None


def key_id(key: bytes) -> bytes:
    """The 8 bytes that name a key in a sealed value's header: sha256(key)[:8]."""
    return hashlib.sha256(key).digest()[:8]


class Sealer:
    """AES-256-GCM over remote values. ``keys[0]`` seals; every key opens what it sealed
    (picked by the key id in the header). The associated data is the header and the Redis
    key, so a value moved to another key (another id, generation, chunk index or
    namespace) does not open."""

    def __init__(self, keys: Sequence[bytes]) -> None:
        try:
            from cryptography.hazmat.primitives.ciphers.aead import AESGCM
        except ImportError:
            raise StartupError("tiers.remote.key_file is set but the cryptography package is not installed: "
                               "pip install 'kvpark[remote]'") from None
        if not keys or any(len(k) != KEY_BYTES for k in keys):
            raise ValueError(f"remote tier keys are {KEY_BYTES} bytes each")
        self.current = key_id(keys[0])
        self._aead = {key_id(k): AESGCM(bytes(k)) for k in reversed(keys)}

    def seal(self, kind: int, rkey: str, plain: bytes) -> bytes | memoryview:
        head = SEAL_HEADER.pack(SEAL_MAGIC, SEAL_VERSION, kind, 0, self.current, os.urandom(12))
        aead, ad = self._aead[self.current], head + rkey.encode()
        if not hasattr(aead, "encrypt_into"):  # cryptography < 45
            return head + aead.encrypt(head[-12:], plain, ad)
        # Straight into the value: no copy of a ciphertext to prepend the header.
        out = bytearray(len(head) + len(plain) + 16)
        out[:len(head)] = head
        aead.encrypt_into(head[-12:], plain, ad, memoryview(out)[len(head):])
        return memoryview(out)

    def open(self, kind: int, rkey: str, raw: bytes | memoryview) -> tuple[bytes, bool]:
        """(plain value, whether it was sealed with an old key), or ``DataLoss``."""
        view = memoryview(raw)
        if len(view) < SEAL_HEADER.size + 16 or bytes(view[:4]) != SEAL_MAGIC:
            raise DataLoss("not sealed with the remote tier's key (a plain or foreign value)")
        head = bytes(view[:SEAL_HEADER.size])
        _magic, version, k, _r, kid, nonce = SEAL_HEADER.unpack(head)
        if version != SEAL_VERSION or k != kind:
            raise DataLoss(f"sealed value of version {version}, kind {k} (expected {SEAL_VERSION}, {kind})")
        aead = self._aead.get(kid)
        if aead is None:
            raise DataLoss(f"sealed with an unknown key (id {kid.hex()})")
        from cryptography.exceptions import InvalidTag

        try:
            plain = aead.decrypt(nonce, view[SEAL_HEADER.size:], head + rkey.encode())
        except InvalidTag:
            raise DataLoss("does not authenticate (altered, forged, or moved from another key)") from None
        return plain, kid != self.current


# Re-seal: replace the value only if Redis still holds the one that was read (TTL kept).
_CAS = ("if redis.call('GET', KEYS[1]) == ARGV[1] then "
        "return redis.call('SET', KEYS[1], ARGV[2], 'KEEPTTL') end return 0")


class RemoteStore:
    def __init__(self, opts: RemoteOptions, clock: Callable[[], float] | None = None) -> None:
        self._redis = require_client()
        self.opts = opts
        self.breaker = Breaker(opts.breaker_failures, opts.breaker_cooldown_s,
                               **({"clock": clock} if clock else {}))
        self._client: Any = None
        self._client_lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max(1, opts.inflight), thread_name_prefix="kvpark-remote")
        self._stat_lock = threading.Lock()
        self._errors = self._refused = self._data_loss = 0
        self._written = self._read = 0
        self._base = _esc(opts.namespace) + ":"
        self._sealer = Sealer(opts.keys) if opts.keys else None
        # Values sealed with an old key are re-sealed with the current one in the background.
        self._reseal_pool = (ThreadPoolExecutor(1, thread_name_prefix="kvpark-remote-reseal")
                             if len(opts.keys) > 1 else None)
        self._reseal_queued = self._resealed = self._reread = 0

    # -- keys --------------------------------------------------------------------

    def _space(self, seq_id: str, legacy: bool) -> str:
        """A tenant's sequence (``<tenant><TENANT_SEP><id>``) lives under ``NS:t:<tenant>:``,
        an open daemon's under ``NS:o:``: no key of one can be a key of the other. ``legacy``:
        the layout before key spaces (``NS:`` alone), read only as a fallback."""
        if legacy:
            return self._base
        tenant, sep, _ = seq_id.partition(TENANT_SEP)
        return self._base + (f"t:{_esc(tenant).replace(':', '%3A')}:" if sep else "o:")

    def manifest_key(self, seq_id: str, legacy: bool = False) -> str:
        return f"{self._space(seq_id, legacy)}m:{_esc(seq_id)}"

    def chunk_key(self, m: Manifest, index: int, legacy: bool = False) -> str:
        return f"{self._space(m.seq_id, legacy)}v:{m.fingerprint:016x}:{_esc(m.seq_id)}:{m.gen}:{index}"

    def _legacy(self, seq_id: str) -> bool:
        """Whether ``seq_id`` may be read from the legacy layout: an open daemon's id, and no
        key. Never a tenant's id: an open daemon of an older build (which did not refuse the
        separator) could still plant legacy keys under a tenant's ids. Never with a key: the
        legacy layout only ever held plain values, which a keyed tier refuses."""
        return self._sealer is None and TENANT_SEP not in seq_id

    def _layouts(self, seq_id: str) -> tuple[bool, ...]:
        return (False, True) if self._legacy(seq_id) else (False,)

    # -- sealing -----------------------------------------------------------------

    def _seal(self, kind: int, rkey: str, plain: bytes) -> bytes | memoryview:
        return plain if self._sealer is None else self._sealer.seal(kind, rkey, plain)

    def _open(self, kind: int, rkey: str, raw: bytes) -> bytes:
        """The plain value under ``rkey``, or ``DataLoss`` (with a key: not sealed, sealed
        with an unknown key, or not authentic for this key)."""
        if self._sealer is None:
            return raw
        try:
            plain, old = self._sealer.open(kind, rkey, raw)
        except DataLoss as e:
            raise DataLoss(f"{'manifest' if kind == SEAL_MANIFEST else 'value'} {rkey!r}: {e.message}") from None
        if old:
            self._reseal_later(kind, rkey, raw, plain)
        return plain

    def _decode_manifest(self, rkey: str, raw: bytes) -> tuple[Manifest, int]:
        return decode_manifest(self._open(SEAL_MANIFEST, rkey, raw))

    def _reseal_later(self, kind: int, rkey: str, raw: bytes, plain: bytes) -> None:
        """Re-seal a value read under an old key with the current one, in the background,
        if Redis still holds exactly ``raw`` there (a compare-and-set: a newer write or a
        delete meanwhile wins). Past ``reseal_bytes`` queued it is skipped: a later read
        queues it again."""
        pool, sealer, n = self._reseal_pool, self._sealer, len(raw)
        if pool is None or sealer is None:
            return
        with self._stat_lock:
            if self._reseal_queued + n > self.opts.reseal_bytes:
                return
            self._reseal_queued += n

        def run() -> None:
            try:
                new = sealer.seal(kind, rkey, plain)
                if self._call("re-seal", lambda c: c.eval(_CAS, 1, rkey, raw, new)):
                    with self._stat_lock:
                        self._resealed += 1
            except (Unavailable, DeadlineExceeded) as e:
                log.debug("remote tier: re-sealing %s failed: %s", rkey, e)
            except Exception:  # the background thread must never die
                log.exception("remote tier: re-sealing %s failed", rkey)
            finally:
                with self._stat_lock:
                    self._reseal_queued -= n

        try:
            pool.submit(run)
        except RuntimeError:  # closed
            with self._stat_lock:
                self._reseal_queued -= n

    # -- the client and the breaker ----------------------------------------------

    def _connect(self) -> Any:
        with self._client_lock:
            if self._client is None:
                redis = self._redis
                o = self.opts
                common = dict(socket_timeout=o.timeout_s, socket_connect_timeout=o.timeout_s,
                              # Made as needed, so a roomy bound costs nothing: every
                              # caller at once (the pipelines, the eviction's moves, each
                              # gRPC handler reading remote) gets one, never "Too many
                              # connections" in place of Redis's answer.
                              max_connections=o.inflight * 2 + o.evict_parallel + POOL_HEADROOM,
                              connection_class=connection_class(o.url))
                from redis.backoff import NoBackoff
                from redis.retry import Retry

                if o.cluster:
                    from redis.cluster import RedisCluster

                    # Two more attempts: a MOVED/ASK during resharding or a failover is
                    # followed by a refreshed slot map, which is not a failure.
                    self._client = RedisCluster.from_url(o.url, retry=Retry(NoBackoff(), 2), **common)
                else:
                    # No silent retries: the breaker decides when to try again.
                    self._client = redis.Redis.from_url(o.url, retry=Retry(NoBackoff(), 0), **common)
            return self._client

    def _call(self, what: str, fn: Callable[[Any], T]) -> T:
        """Run ``fn(client)`` under the breaker, mapping Redis failures to typed errors."""
        redis = self._redis
        if not self.breaker.allow():
            with self._stat_lock:
                self._refused += 1
            raise Unavailable(f"remote tier degraded (circuit open): {what} not attempted")
        try:
            out = fn(self._connect())
        except DataLoss:
            self._ok()  # Redis answered; the value was bad
            raise
        except redis.exceptions.MaxConnectionsError as e:
            # Our own bound, not Redis failing: no breaker failure (it would fail every
            # caller fast for the cooldown while Redis is fine).
            self.breaker.abandon()
            raise Unavailable(f"remote tier: {what}: every connection is in use ({e})") from None
        except (redis.exceptions.RedisError, redis.exceptions.RedisClusterException, OSError) as e:
            with self._stat_lock:
                self._errors += 1
            if self.breaker.failure():
                log.warning("remote tier degraded: %s failed (%s: %s); failing fast for %.1fs",
                            what, type(e).__name__, e, self.opts.breaker_cooldown_s)
            if isinstance(e, redis.exceptions.TimeoutError):
                raise DeadlineExceeded(f"remote tier: {what} timed out after {self.opts.timeout_s}s") from None
            raise Unavailable(f"remote tier: {what} failed: {type(e).__name__}: {e}") from None
        except BaseException:
            # No verdict (an in-place read handing over to the ordinary one, say): had this
            # call been the half-open probe, nothing would ever probe again.
            self.breaker.abandon()
            raise
        self._ok()
        return out

    def _ok(self) -> None:
        if self.breaker.success():
            log.info("remote tier resumed")  # good news: the outage's start was the warning

    def _ttl_ms(self) -> int | None:
        return int(self.opts.ttl_s * 1000) if self.opts.ttl_s > 0 else None

    def _groups(self, plan: list[tuple[int, int]]) -> list[list[int]]:
        """Chunk indices cut into pipelines of about ``pipeline_bytes`` each."""
        groups: list[list[int]] = []
        cur: list[int] = []
        size = 0
        for i, (_off, ln) in enumerate(plan):
            if cur and size + ln > self.opts.pipeline_bytes:
                groups.append(cur)
                cur, size = [], 0
            cur.append(i)
            size += ln
        if cur:
            groups.append(cur)
        return groups

    def _fan_out(self, groups: list[list[int]], run: Callable[[list[int]], None]) -> None:
        if len(groups) == 1:
            run(groups[0])
            return
        futures = [self._pool.submit(run, g) for g in groups]
        first: BaseException | None = None
        for f in futures:  # wait for all, so no pipeline still writes into a caller's buffer
            try:
                f.result()
            except BaseException as e:  # noqa: BLE001 - re-raised below
                first = first or e
        if first is not None:
            raise first

    # -- operations --------------------------------------------------------------

    def _find_manifest(self, client: Any, seq_id: str) -> tuple[bytes | None, bool]:
        """(raw manifest, whether it is in the legacy layout): the current layout's, else,
        for ids that may fall back, the legacy one's. One round trip."""
        layouts = self._layouts(seq_id)
        pipe = client.pipeline(transaction=False)
        for legacy in layouts:
            pipe.get(self.manifest_key(seq_id, legacy))
        for legacy, raw in zip(layouts, pipe.execute()):
            if raw is not None:
                return raw, legacy
        return None, False

    def put(self, m: Manifest, blocks: Sequence[memoryview]) -> None:
        """Write a sequence: every chunk, then its manifest (which publishes it)."""
        lengths = m.block_lengths
        if len(blocks) != len(lengths):
            raise ValueError(f"{len(blocks)} block views for {len(lengths)} blocks")
        chunk = self.opts.chunk_size
        views = [memoryview(b).cast("B") for b in blocks]
        plan = chunk_plan(lengths, chunk)
        px = self._ttl_ms()

        def run(idx: list[int]) -> None:
            def send(client: Any) -> None:
                pipe = client.pipeline(transaction=False)
                for i in idx:
                    key = self.chunk_key(m, i)
                    pieces = slices(views, *plan[i])
                    if self._sealer is None:  # header and block views go out as they are
                        value: Any = Pieces((chunk_head(i, m.fingerprint, m.gen, pieces), *pieces))
                    else:  # the cipher takes one plain buffer
                        value = self._sealer.seal(SEAL_CHUNK, key, encode_chunk(i, m.fingerprint, m.gen, pieces))
                    pipe.set(key, value, px=px)
                pipe.execute()

            self._call(f"put {m.seq_id!r}", send)

        self._fan_out(self._groups(plan), run)
        mkey = self.manifest_key(m.seq_id)

        def publish(client: Any) -> None:
            pipe = client.pipeline(transaction=False)
            pipe.set(mkey, self._seal(SEAL_MANIFEST, mkey, encode_manifest(m, chunk)), px=px)
            if self._legacy(m.seq_id):
                # A legacy manifest of the id is an older version, replaced by this one (as
                # one key it would have been): it must not surface once this one is dropped.
                pipe.delete(self.manifest_key(m.seq_id, legacy=True))
            pipe.execute()

        self._call(f"put {m.seq_id!r} manifest", publish)
        with self._stat_lock:
            self._written += m.nbytes

    def get_manifest(self, seq_id: str) -> Manifest | None:
        raw, legacy = self._call(f"manifest of {seq_id!r}", lambda c: self._find_manifest(c, seq_id))
        if raw is None:
            return None
        mkey = self.manifest_key(seq_id, legacy)
        try:
            return self._decode_manifest(mkey, raw)[0]
        except DataLoss as e:
            self._corrupt(seq_id, None, e, mkey)
            raise

    def get_manifests(self, seq_ids: Sequence[str]) -> list[Manifest | None]:
        """The manifests of ``seq_ids`` (None where absent), in one pipeline. A damaged
        manifest is deleted and reads as absent."""
        if not seq_ids:
            return []
        keys = [[self.manifest_key(s, legacy) for legacy in self._layouts(s)] for s in seq_ids]

        def run(client: Any) -> list[Any]:
            pipe = client.pipeline(transaction=False)
            for ks in keys:
                for k in ks:
                    pipe.get(k)
            return pipe.execute()

        got = iter(self._call("manifests", run))
        out: list[Manifest | None] = []
        for sid, ks in zip(seq_ids, keys):
            found = [(k, raw) for k, raw in ((k, next(got)) for k in ks) if raw is not None]
            if not found:
                out.append(None)
                continue
            mkey, raw = found[0]
            try:
                out.append(self._decode_manifest(mkey, raw)[0])
            except DataLoss as e:
                self._corrupt(sid, None, e, mkey)
                out.append(None)
        return out

    def exists(self, seq_ids: Sequence[str]) -> list[bool]:
        """Which of ``seq_ids`` have a manifest in Redis (one pipeline)."""
        if not seq_ids:
            return []
        keys = [[self.manifest_key(s, legacy) for legacy in self._layouts(s)] for s in seq_ids]

        def run(client: Any) -> list[bool]:
            pipe = client.pipeline(transaction=False)
            for ks in keys:
                for k in ks:
                    pipe.exists(k)
            got = iter(pipe.execute())
            return [any([bool(next(got)) for _ in ks]) for ks in keys]

        return self._call("exists", run)

    def copy_state(self, m: Manifest) -> str:
        """What Redis holds of generation ``m.gen``: ``WHOLE`` (its manifest is the current
        one and every chunk key exists), ``REPLACED`` (the current manifest is another
        generation's: a later write of the id, by this daemon or another) or ``GONE``
        (no manifest, or a chunk missing: expired, evicted, flushed, deleted). With
        ``ttl_s``, ``WHOLE`` also gives every one of those keys a fresh TTL in the same
        step (PEXPIRE answers whether the key was there), so the copy outlives the check
        by ``ttl_s``. Presence, not bytes: a read still verifies every chunk."""
        raw, legacy = self._call(f"manifest of {m.seq_id!r}", lambda c: self._find_manifest(c, m.seq_id))
        if raw is None:
            return GONE
        mkey = self.manifest_key(m.seq_id, legacy)
        try:
            cur, chunk = self._decode_manifest(mkey, raw)
        except DataLoss as e:
            self._corrupt(m.seq_id, None, e, mkey)
            return GONE
        if cur.gen != m.gen:
            return REPLACED
        keys = [mkey] + [self.chunk_key(m, i, legacy) for i in range(len(chunk_plan(m.block_lengths, chunk)))]
        px = self._ttl_ms()

        def run(client: Any) -> list[Any]:
            pipe = client.pipeline(transaction=False)
            for k in keys:  # one key per command: on a cluster the keys sit in many slots
                if px is None:
                    pipe.exists(k)
                else:
                    pipe.pexpire(k, px)
            return pipe.execute()

        return WHOLE if all(bool(n) for n in self._call(f"presence of {m.seq_id!r}", run)) else GONE

    def read(self, m: Manifest) -> bytearray:
        out = bytearray(m.nbytes)
        self.read_into(m, memoryview(out))
        return out

    def read_into(self, m: Manifest, out: memoryview) -> None:
        """Fetch and verify every chunk into ``out`` (``m.nbytes`` long)."""
        if len(out) != m.nbytes:
            raise ValueError(f"output of {len(out)} bytes for a {m.nbytes}-byte sequence")
        outs, off = [], 0
        for n in m.block_lengths:
            outs.append(out[off:off + n])
            off += n
        self.read_blocks_into(m, outs)

    def read_blocks_into(self, m: Manifest, outs: Sequence[memoryview]) -> None:
        """Fetch and verify every chunk into ``outs``, one writable view per block (slots
        of a memory tier, say: no staging buffer). A chunk that fails verification (or,
        with a key, does not open) deletes the sequence from Redis and raises
        ``DataLoss``; a chunk that is gone raises ``NotFound`` (and deletes what is left
        of that generation); ``outs`` then hold garbage."""
        lengths = m.block_lengths
        if len(outs) != len(lengths) or any(len(o) != n for o, n in zip(outs, lengths)):
            raise ValueError(f"{len(outs)} output views do not match the {len(lengths)} blocks of {m.seq_id!r}")
        raw_m, legacy = self._call(f"manifest of {m.seq_id!r}", lambda c: self._find_manifest(c, m.seq_id))
        if raw_m is None:
            raise NotFound(f"sequence {m.seq_id!r} is gone from the remote tier (dropped, expired or evicted)")
        try:
            cur, chunk = self._decode_manifest(self.manifest_key(m.seq_id, legacy), raw_m)
        except DataLoss as e:
            self._corrupt(m.seq_id, m, e)
            raise
        if cur.gen != m.gen:
            raise NotFound(f"sequence {m.seq_id!r} was replaced in the remote tier (generation {cur.gen}, "
                           f"not {m.gen})")
        plan = chunk_plan(lengths, chunk)
        views = [memoryview(o).cast("B") for o in outs]
        targets = [slices(views, off, ln) for off, ln in plan]  # where each chunk lands

        def run(idx: list[int]) -> None:
            ckeys = [self.chunk_key(m, i, legacy) for i in idx]
            if self._sealer is None:
                try:
                    self._read_in_place(m, ckeys, idx, targets)
                    return
                except Unparsed as e:  # read again the ordinary way: it follows redirects, names damage
                    log.debug("remote tier: %s read the ordinary way: %s", m.seq_id, e)
                    with self._stat_lock:
                        self._reread += 1

            def fetch(client: Any) -> list[Any]:
                pipe = client.pipeline(transaction=False)
                for k in ckeys:
                    pipe.get(k)
                out = pipe.execute(raise_on_error=False)
                for raw in out:
                    # A key of another type is damage (named below); any other error
                    # is Redis failing, for the breaker.
                    if isinstance(raw, Exception) and not _wrong_type(raw):
                        raise raw
                return out

            raws = self._call(f"read {m.seq_id!r}", fetch)
            for i, ckey, raw in zip(idx, ckeys, raws):
                if isinstance(raw, Exception):
                    raise DataLoss(f"sequence {m.seq_id!r} in the remote tier: chunk {i}: not a value ({raw})")
                if raw is None:  # gone (expired, evicted, dropped under us), not damaged
                    raise NotFound(f"sequence {m.seq_id!r}: chunk {i} is gone from the remote tier (expired, "
                                   "evicted or dropped)")
                try:
                    payload = verify_chunk(self._open(SEAL_CHUNK, ckey, raw), i, m.fingerprint, m.gen, plan[i][1])
                    pos = 0
                    for t in targets[i]:
                        t[:] = payload[pos:pos + len(t)]
                        pos += len(t)
                except DataLoss as e:
                    raise DataLoss(f"sequence {m.seq_id!r} in the remote tier: {e.message}") from None

        try:
            self._fan_out(self._groups(plan), run)
        except DataLoss as e:
            self._corrupt(m.seq_id, m, e)
            raise
        except NotFound:
            # What is left of this generation is useless: its manifest (if still the
            # current one) goes, so later readers miss at once instead of here.
            try:
                self.delete(m)
            except (Unavailable, DeadlineExceeded):
                pass  # a later read finds the same gap
            raise
        with self._stat_lock:
            self._read += m.nbytes

    def _read_in_place(self, m: Manifest, ckeys: list[str], idx: list[int],
                       targets: list[list[memoryview]]) -> None:
        """Chunks ``idx`` of ``m`` read from the sockets straight into their targets
        (``tiers/resp.py``), then verified there: ``NotFound`` for a chunk that is gone,
        ``DataLoss`` for one that is wrong, ``Unparsed`` for a reply to read the ordinary
        way (a cluster's redirect, a value of another size)."""
        heads = [memoryview(bytearray(CHUNK_HEADER.size)) for _ in idx]

        redis = self._redis

        def fetch(client: Any) -> list[bool]:
            found = [False] * len(idx)
            for pool, pos in self._pools(client, ckeys):
                try:
                    conn = pool.get_connection()
                    try:
                        got = read_bulks_into(conn, [ckeys[p] for p in pos], [heads[p] for p in pos],
                                              [targets[idx[p]] for p in pos])
                    finally:
                        pool.release(conn)
                except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError) as e:
                    if not self.opts.cluster:
                        raise
                    # A node gone or moved (a failover): the slot map is read again (as
                    # redis-py itself does from any thread after such an error), so the
                    # ordinary read, which retries, goes to the new node at once instead
                    # of waiting on the old one a second time.
                    try:
                        client.nodes_manager.initialize()
                    except (redis.exceptions.RedisError, redis.exceptions.RedisClusterException, OSError):
                        pass  # the ordinary read meets the same trouble and reports it
                    raise Unparsed(f"cluster node unreachable: {e}") from None
                for p, there in zip(pos, got):
                    found[p] = there
            return found

        found = self._call(f"read {m.seq_id!r}", fetch)
        for i, head, there in zip(idx, heads, found):
            if not there:
                raise NotFound(f"sequence {m.seq_id!r}: chunk {i} is gone from the remote tier (expired, "
                               "evicted or dropped)")
            try:
                verify_pieces(head, targets[i], i, m.fingerprint, m.gen)
            except DataLoss as e:
                raise DataLoss(f"sequence {m.seq_id!r} in the remote tier: {e.message}") from None

    def _pools(self, client: Any, keys: list[str]) -> list[tuple[Any, list[int]]]:
        """(connection pool, positions in ``keys``) per server that holds some of them: the
        one pool standalone; on a cluster, the pool of each key's primary by the client's
        slot map (a stale map shows as a redirect, which ``read_bulks_into`` does not take)."""
        if not self.opts.cluster:
            return [(client.connection_pool, list(range(len(keys))))]
        by_node: dict[str, tuple[Any, list[int]]] = {}
        for p, k in enumerate(keys):
            node = client.get_node_from_key(k)
            if node.name not in by_node:
                by_node[node.name] = (client.get_redis_connection(node).connection_pool, [])
            by_node[node.name][1].append(p)
        return list(by_node.values())

    def _corrupt(self, seq_id: str, m: Manifest | None, e: DataLoss, mkey: str = "") -> None:
        with self._stat_lock:
            self._data_loss += 1
        log.error("remote tier: %s; deleting it from Redis", e.message)
        try:
            if m is not None:
                self.delete(m)
            else:
                self._call(f"delete {seq_id!r}", lambda c: c.delete(mkey or self.manifest_key(seq_id)))
        except (Unavailable, DeadlineExceeded):
            pass  # never served either way; a later read finds it bad again

    def delete(self, m: Manifest) -> None:
        """Remove generation ``m.gen`` of a sequence: its manifest first (so nobody finds
        it), if that is still the current one, then its chunks; in the legacy layout too,
        for ids that may fall back to it.

        The manifest is checked, then deleted: not atomic, so a newer generation written
        in between by another daemon can lose its manifest (its chunks stay until their
        TTL); it is then a miss, never wrong data.
        """

        def run(client: Any) -> None:
            for legacy in self._layouts(m.seq_id):
                mkey = self.manifest_key(m.seq_id, legacy)
                raw = client.get(mkey)
                cur: Manifest | None = None
                chunk = self.opts.chunk_size
                if raw is not None:
                    try:
                        cur, written = self._decode_manifest(mkey, raw)
                        if cur.gen == m.gen:
                            chunk = written  # the writer's chunk size (another daemon's, maybe)
                    except DataLoss:
                        cur = None  # damaged: delete it too
                pipe = client.pipeline(transaction=False)
                if raw is not None and (cur is None or cur.gen == m.gen):
                    pipe.delete(mkey)
                # Without the manifest, chunks written with another chunk size are left to their TTL.
                for i in range(len(chunk_plan(m.block_lengths, chunk))):
                    pipe.delete(self.chunk_key(m, i, legacy))
                pipe.execute()

        self._call(f"delete {m.seq_id!r}", run)

    def ping(self) -> bool:
        return bool(self._call("ping", lambda c: c.ping()))

    def probe(self) -> str | None:
        """One ping, outside the breaker's count: None when Redis answers, else why not,
        with the breaker opened (stat says degraded until a later call succeeds)."""
        try:
            self._connect().ping()
        except Exception as e:  # noqa: BLE001 - any failure to answer is the finding
            with self._stat_lock:
                self._errors += 1
            self.breaker.trip()
            return f"{type(e).__name__}: {e}"
        self._ok()
        return None

    def stats(self) -> RemoteStats:
        with self._stat_lock:
            return RemoteStats(state=self.breaker.state, errors=self._errors, refused=self._refused,
                               data_loss=self._data_loss, bytes_written=self._written, bytes_read=self._read,
                               outages=self.breaker.opened_count, resealed=self._resealed,
                               reread=self._reread)

    def close(self) -> None:
        if self._reseal_pool is not None:
            self._reseal_pool.shutdown(wait=True)
        self._pool.shutdown(wait=True)
        with self._client_lock:
            if self._client is not None:
                try:
                    self._client.close()
                except Exception:  # noqa: BLE001 - closing a dead connection may raise
                    pass
                self._client = None
