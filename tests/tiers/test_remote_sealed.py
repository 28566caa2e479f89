"""The remote tier's key spaces (a tenant's, an open daemon's, the legacy layout) and its
sealed values (AES-256-GCM under ``RemoteOptions.keys``), against a real Redis."""

from __future__ import annotations

import os
import struct

import pytest
import xxhash

from kvpark.proto.errors import DataLoss, NotFound
from kvpark.tiers.remote import (
    CHUNK_HEADER,
    TENANT_SEP,
    RemoteOptions,
    RemoteStore,
    Sealer,
    encode_chunk,
    encode_manifest,
    key_id,
)

from ..conftest import wait_until
from .test_remote import _manifest, _ns_name, _payload, _store

KEY, OLD, OTHER = os.urandom(32), os.urandom(32), os.urandom(32)


def _raw(st: RemoteStore):
    return st._connect()


def forge_chunk(raw: bytes, payload: bytes) -> bytes:
    """A plain chunk rewritten with ``payload`` and its recomputed xxh3: what anyone who can
    write to Redis can do without a key."""
    head = list(CHUNK_HEADER.unpack_from(raw))
    head[-2], head[-1] = len(payload), xxhash.xxh3_64_intdigest(payload)
    return CHUNK_HEADER.pack(*head) + payload


def test_key_spaces_of_tenants_and_open_ids_are_disjoint(redis_server):
    st = _store(redis_server.url)
    ns = st.opts.namespace
    try:
        for sid in ("chat", "alice" + TENANT_SEP + "chat", "a:b" + TENANT_SEP + "x"):
            m = _manifest(sid, 3000)
            st.put(m, _payload(m)[1])
        keys = set(redis_server.cli("--scan", "--pattern", f"{ns}:*").split())
        assert f"{ns}:o:m:chat" in keys and f"{ns}:t:alice:m:alice{TENANT_SEP}chat" in keys
        assert f"{ns}:t:a%3Ab:m:a:b{TENANT_SEP}x" in keys  # a ':' in a tenant cannot fake a segment
        for k in keys:
            rest = k[len(ns) + 1:]
            assert rest.startswith("o:") != rest.startswith("t:"), k
            assert (TENANT_SEP in k) == rest.startswith("t:"), k
    finally:
        st.close()


def _put_legacy(st: RemoteStore, m, views) -> None:
    """Write ``m`` as the previous layout did (``NS:m:<id>``, ``NS:v:...``)."""
    c, base = _raw(st), st.opts.namespace
    data = b"".join(bytes(v) for v in views)
    c.set(f"{base}:v:{m.fingerprint:016x}:{m.seq_id}:{m.gen}:0", encode_chunk(0, m.fingerprint, m.gen, data))
    c.set(f"{base}:m:{m.seq_id}", encode_manifest(m, st.opts.chunk_size))


def test_open_ids_fall_back_to_the_legacy_layout_and_deletes_reach_it(redis_server):
    st = _store(redis_server.url, chunk_size=1 << 16)
    ns = st.opts.namespace
    try:
        m = _manifest("old", 5000, gen=3)
        data, views = _payload(m)
        _put_legacy(st, m, views)
        assert st.exists(["old"]) == [True]
        assert st.get_manifest("old") == m and st.get_manifests(["old"]) == [m]
        assert st.copy_state(m) == "whole"
        assert bytes(st.read(m)) == data
        st.delete(m)
        assert redis_server.cli("--scan", "--pattern", f"{ns}:*").split() == []
        # A new write of the id replaces the legacy manifest, which never surfaces again.
        _put_legacy(st, m, views)
        m2 = _manifest("old", 5000, gen=4)
        st.put(m2, _payload(m2, seed=2)[1])
        assert redis_server.cli("exists", f"{ns}:m:old").strip() == "0"
        st.delete(m2)
        assert st.get_manifest("old") is None
    finally:
        st.close()


def test_tenant_ids_never_fall_back_to_the_legacy_layout(redis_server):
    st = _store(redis_server.url, chunk_size=1 << 16)
    try:
        sid = "alice" + TENANT_SEP + "chat"
        m = _manifest(sid, 5000)
        _put_legacy(st, m, _payload(m)[1])  # planted by an older open daemon, or kept from before
        assert st.exists([sid]) == [False] and st.get_manifest(sid) is None and st.get_manifests([sid]) == [None]
        assert st.copy_state(m) == "gone"
    finally:
        st.close()


def test_without_a_key_a_forged_chunk_with_a_recomputed_checksum_is_served(redis_server):
    """The documented no-key behaviour (issue 23 F6): the checksum catches damage, not a
    Redis writer."""
    st = _store(redis_server.url)
    try:
        m = _manifest("victim", 3000)
        st.put(m, _payload(m)[1])
        key = st.chunk_key(m, 0)
        evil = b"E" * 3000
        _raw(st).set(key, forge_chunk(_raw(st).get(key), evil))
        assert bytes(st.read(m)) == evil
    finally:
        st.close()


def test_with_a_key_values_are_sealed_and_read_back(redis_server):
    st = _store(redis_server.url, keys=(KEY,))
    try:
        m = _manifest("s", 40000)
        data, views = _payload(m)
        st.put(m, views)
        for k in (st.manifest_key("s"), st.chunk_key(m, 0), st.chunk_key(m, 2)):
            raw = _raw(st).get(k)
            assert raw[:4] == b"KVPX" and data[:64] not in raw and b"KVPR" not in raw and b"KVPM" not in raw
        assert st.get_manifest("s") == m and st.exists(["s"]) == [True] and st.copy_state(m) == "whole"
        assert bytes(st.read(m)) == data
    finally:
        st.close()


@pytest.mark.parametrize("how", ["plain forgery", "flipped byte", "moved generation"])
def test_with_a_key_a_forged_chunk_is_data_loss_and_deleted(redis_server, how):
    st = _store(redis_server.url, keys=(KEY,))
    plain = _store(redis_server.url, namespace=st.opts.namespace)  # same keys, no key: what a writer can make
    try:
        m = _manifest("victim", 3000, gen=5)
        st.put(m, _payload(m)[1])
        key = st.chunk_key(m, 0)
        if how == "plain forgery":
            forged = encode_chunk(0, m.fingerprint, m.gen, b"E" * 3000)
        elif how == "flipped byte":
            raw = bytearray(_raw(st).get(key))
            raw[-20] ^= 1
            forged = bytes(raw)
        else:  # a sealed chunk of another generation of the id, moved under this one's key
            old = _manifest("victim", 3000, gen=4)
            st.put(old, _payload(old, seed=9)[1])
            forged = _raw(st).get(st.chunk_key(old, 0))
            st.put(m, _payload(m)[1])
        _raw(st).set(key, forged)
        with pytest.raises(DataLoss):
            st.read(m)
        assert redis_server.cli("exists", key).strip() == "0"
        assert st.exists(["victim"]) == [False] and st.stats().data_loss == 1
    finally:
        st.close()
        plain.close()


def test_with_a_key_a_manifest_moved_to_another_id_fails(redis_server):
    st = _store(redis_server.url, keys=(KEY,))
    try:
        a, b = _manifest("a", 3000), _manifest("b", 3000)
        st.put(a, _payload(a)[1])
        st.put(b, _payload(b)[1])
        _raw(st).set(st.manifest_key("b"), _raw(st).get(st.manifest_key("a")))
        assert st.get_manifests(["b"]) == [None]
        assert redis_server.cli("exists", st.manifest_key("b")).strip() == "0"
        with pytest.raises(NotFound):  # refused and deleted: a miss from now on
            st.read(b)
        assert st.get_manifest("a") == a
    finally:
        st.close()


def test_a_plain_value_is_refused_by_a_keyed_store(redis_server):
    plain = _store(redis_server.url)
    st = _store(redis_server.url, namespace=plain.opts.namespace, keys=(KEY,))
    try:
        m = _manifest("p", 3000)
        plain.put(m, _payload(m)[1])
        assert st.get_manifests(["p"]) == [None]  # refused, deleted
        assert redis_server.cli("exists", st.manifest_key("p")).strip() == "0"
    finally:
        plain.close()
        st.close()


def test_a_wrong_key_refuses(redis_server):
    st = _store(redis_server.url, keys=(KEY,))
    wrong = _store(redis_server.url, namespace=st.opts.namespace, keys=(OTHER,))
    try:
        m = _manifest("w", 3000)
        st.put(m, _payload(m)[1])
        with pytest.raises(DataLoss, match="unknown key"):
            wrong.get_manifest("w")
        assert st.get_manifest("w") is None  # the refusal deleted it
    finally:
        st.close()
        wrong.close()


def test_rotation_reads_old_values_and_reseals_them(redis_server):
    old = _store(redis_server.url, keys=(OLD,))
    new = _store(redis_server.url, namespace=old.opts.namespace, keys=(KEY, OLD))
    only_new = _store(redis_server.url, namespace=old.opts.namespace, keys=(KEY,))
    try:
        m = _manifest("r", 40000)
        data, views = _payload(m)
        old.put(m, views)
        assert new.get_manifest("r") == m
        assert bytes(new.read(m)) == data
        keys = [new.manifest_key("r")] + [new.chunk_key(m, i) for i in range(3)]
        kid = struct.Struct("<4sBBH8s12s")
        from kvpark.tiers.remote import key_id

        def resealed() -> bool:
            return all(kid.unpack_from(_raw(new).get(k))[4] == key_id(KEY) for k in keys)

        assert wait_until(resealed, timeout=10)
        assert new.stats().resealed >= len(keys)
        assert bytes(only_new.read(m)) == data  # the old key is no longer needed
    finally:
        old.close()
        new.close()
        only_new.close()


def test_a_reseal_never_overwrites_a_newer_value(redis_server):
    old = _store(redis_server.url, keys=(OLD,))
    new = _store(redis_server.url, namespace=old.opts.namespace, keys=(KEY, OLD))
    try:
        m = _manifest("c", 3000)
        old.put(m, _payload(m)[1])
        k = new.manifest_key("c")
        raw = _raw(new).get(k)
        plain, was_old = new._sealer.open(2, k, raw)
        assert was_old
        _raw(new).set(k, b"newer")
        new._reseal_later(2, k, raw, plain)
        new._reseal_pool.submit(lambda: None).result()
        assert _raw(new).get(k) == b"newer"
    finally:
        old.close()
        new.close()


def test_keys_must_be_32_bytes():
    with pytest.raises(ValueError):
        RemoteStore(RemoteOptions(namespace=_ns_name("k"), keys=(b"short",)))
    # Every key, not only when the list is empty: a short old key among good ones too.
    with pytest.raises(ValueError, match="32 bytes each"):
        Sealer([b"k" * 32, b"short"])
    with pytest.raises(ValueError, match="32 bytes each"):
        Sealer([])
    assert Sealer([b"k" * 32, b"j" * 32]).current == key_id(b"k" * 32)
