"""The remote tier over real Redis servers: a standalone one and a 3-master cluster.

Pure parts (chunk plan, record formats, the breaker) are tested without I/O; the store
is tested against real ``redis-server`` processes on loopback ports.
"""

from __future__ import annotations

import itertools
import os

import pytest

from kvpark.proto.errors import DataLoss, DeadlineExceeded, NotFound, Unavailable
from kvpark.proto.layout import TensorMeta
from kvpark.tiers.breaker import CLOSED, HALF_OPEN, OPEN, Breaker
from kvpark.tiers.disk import Manifest
from kvpark.tiers.remote import (
    CHUNK_HEADER,
    RemoteOptions,
    TENANT_SEP,
    RemoteStore,
    chunk_plan,
    decode_manifest,
    encode_chunk,
    encode_manifest,
    slices,
    verify_chunk,
)

from ..conftest import wait_until
from ..redis_servers import RedisCluster, free_port

_ns = itertools.count()


def _ns_name(tag: str) -> str:
    return f"test-{os.getpid()}-{tag}-{next(_ns)}"


def _manifest(seq_id: str, nbytes: int, block_size: int = 1 << 16, gen: int = 1, fp: int = 0xF00D) -> Manifest:
    return Manifest(seq_id=seq_id, gen=gen, tensors=(TensorMeta("uint8", (nbytes,), nbytes),), nbytes=nbytes,
                    block_size=block_size, fingerprint=fp)


def _payload(m: Manifest, seed: int = 0) -> tuple[bytes, list[memoryview]]:
    data = bytes((i * 131 + seed) & 0xFF for i in range(m.nbytes)) if m.nbytes < 4096 else os.urandom(m.nbytes)
    views, off = [], 0
    for ln in m.block_lengths:
        views.append(memoryview(data)[off:off + ln])
        off += ln
    return data, views


def _store(url: str, cluster: bool = False, **kw) -> RemoteStore:
    opts = dict(url=url, cluster=cluster, namespace=_ns_name("ns"), timeout_s=2.0, chunk_size=1 << 14,
                pipeline_bytes=1 << 16, inflight=3, breaker_cooldown_s=0.2)
    opts.update(kw)
    return RemoteStore(RemoteOptions(**opts))


# -- pure ---------------------------------------------------------------------------


def test_chunk_plan_cuts_the_payload_across_blocks():
    assert chunk_plan([10, 10, 3], 4) == [(0, 4), (4, 4), (8, 4), (12, 4), (16, 4), (20, 3)]
    assert chunk_plan([8, 5], 8) == [(0, 8), (8, 5)]
    assert chunk_plan([], 8) == []


def test_slices_cover_a_range_of_block_views():
    views = [memoryview(b"abcd"), memoryview(b"efg"), memoryview(b"hi")]
    assert [bytes(v) for v in slices(views, 0, 9)] == [b"abcd", b"efg", b"hi"]
    assert [bytes(v) for v in slices(views, 2, 4)] == [b"cd", b"ef"]
    assert [bytes(v) for v in slices(views, 4, 3)] == [b"efg"]
    assert [bytes(v) for v in slices(views, 8, 1)] == [b"i"]
    raw = encode_chunk(0, 1, 2, slices(views, 2, 6))
    assert bytes(verify_chunk(raw, 0, 1, 2, 6)) == b"cdefgh"  # one checksum over the pieces


def test_chunk_record_verifies_every_field():
    raw = encode_chunk(3, 0xAB, 7, b"hello")
    assert bytes(verify_chunk(raw, 3, 0xAB, 7, 5)) == b"hello"
    with pytest.raises(DataLoss, match="missing"):
        verify_chunk(None, 3, 0xAB, 7, 5)
    with pytest.raises(DataLoss, match="fingerprint"):
        verify_chunk(raw, 3, 0xAC, 7, 5)
    with pytest.raises(DataLoss, match="generation"):
        verify_chunk(raw, 3, 0xAB, 8, 5)
    with pytest.raises(DataLoss, match="chunk 3"):
        verify_chunk(raw, 4, 0xAB, 7, 5)
    with pytest.raises(DataLoss, match="length"):
        verify_chunk(raw, 3, 0xAB, 7, 6)
    flipped = bytearray(raw)
    flipped[CHUNK_HEADER.size + 1] ^= 1
    with pytest.raises(DataLoss, match="checksum"):
        verify_chunk(bytes(flipped), 3, 0xAB, 7, 5)
    with pytest.raises(DataLoss, match="truncated"):
        verify_chunk(raw[:10], 3, 0xAB, 7, 5)


def test_manifest_record_round_trips_and_detects_damage():
    m = _manifest("s", 1000)
    raw = encode_manifest(m, 4096)
    back, chunk = decode_manifest(raw)
    assert (back.seq_id, back.nbytes, back.fingerprint, chunk) == ("s", 1000, m.fingerprint, 4096)
    bad = bytearray(raw)
    bad[-3] ^= 0xFF
    with pytest.raises(DataLoss):
        decode_manifest(bytes(bad))


def test_breaker_opens_after_failures_probes_after_cooldown_and_closes_on_success():
    now = [0.0]
    b = Breaker(failures=2, cooldown_s=5.0, clock=lambda: now[0])
    assert b.allow() and b.state == CLOSED
    assert b.failure() is False  # one failure: still closed
    assert b.failure() is True  # the second opens it, reported once
    assert b.state == OPEN and not b.allow()
    now[0] = 5.0
    assert b.state == HALF_OPEN
    assert b.allow()  # one probe
    assert not b.allow()  # ... and only one
    assert b.failure() is False  # failed probe: a fresh cool-down
    assert b.state == OPEN and not b.allow()
    now[0] = 10.0
    assert b.allow()
    assert b.success() is True  # closed again, reported once
    assert b.state == CLOSED and b.allow() and b.opened_count == 1
    assert b.success() is False


def test_breaker_trip_opens_at_once_counts_one_outage_and_probes_after_cooldown():
    now = [0.0]
    b = Breaker(failures=3, cooldown_s=2.0, clock=lambda: now[0])
    assert b.trip() is True and b.state == OPEN and b.opened_count == 1 and not b.allow()
    assert b.trip() is False and b.opened_count == 1  # already open: not a second outage
    now[0] = 2.0
    assert b.state == HALF_OPEN and b.allow()
    assert b.success() is True and b.state == CLOSED


def test_breaker_abandoned_probe_lets_the_next_call_probe():
    now = [0.0]
    b = Breaker(failures=1, cooldown_s=1.0, clock=lambda: now[0])
    b.trip()
    now[0] = 1.0
    assert b.allow() and not b.allow()  # the probe is out
    b.abandon()  # ... and ended with no verdict
    assert b.state == HALF_OPEN and b.allow()  # so another call may probe
    assert b.success() is True and b.state == CLOSED
    b.abandon()  # closed: nothing to release
    assert b.state == CLOSED and b.allow()


def test_breaker_only_the_probe_itself_frees_the_probe():
    # Calls let through while closed that end (abandoned) after the breaker opened must
    # not free the one probe: a crowd of them would all probe a store that may be down.
    import threading

    now = [0.0]
    b = Breaker(failures=1, cooldown_s=1.0, clock=lambda: now[0])
    b.trip()
    now[0] = 1.0
    assert b.allow()  # this thread holds the probe
    others = [threading.Thread(target=b.abandon) for _ in range(3)]
    for t in others:
        t.start()
    for t in others:
        t.join()
    assert not b.allow()  # still out: no second probe
    b.abandon()
    assert b.allow()


def test_breaker_success_resets_the_failure_count():
    b = Breaker(failures=2, cooldown_s=1.0, clock=lambda: 0.0)
    b.failure()
    b.success()
    assert b.failure() is False and b.state == CLOSED


# -- standalone server ----------------------------------------------------------------


@pytest.mark.parametrize("nbytes", [0, 1, 5000, (1 << 16) * 3 + 777])
def test_put_read_bit_exact(redis_server, nbytes):
    st = _store(redis_server.url)
    try:
        m = _manifest("seq/a{x}", nbytes)
        data, views = _payload(m)
        st.put(m, views)
        back = st.get_manifest("seq/a{x}")
        assert back is not None and back.nbytes == nbytes and back.fingerprint == m.fingerprint
        assert bytes(st.read(back)) == data
        s = st.stats()
        assert s.bytes_written == nbytes and s.bytes_read == nbytes and s.state == "closed"
    finally:
        st.close()


def test_chunks_spanning_blocks_read_back_into_block_views(redis_server):
    # Chunks of 100000 bytes over 64 KiB blocks: most chunks cover parts of two blocks.
    st = _store(redis_server.url, chunk_size=100_000)
    try:
        m = _manifest("span", (1 << 16) * 5 + 123)
        data, views = _payload(m)
        st.put(m, views)
        outs = [bytearray(n) for n in m.block_lengths]
        st.read_blocks_into(m, [memoryview(o) for o in outs])
        assert b"".join(outs) == data
    finally:
        st.close()


def test_exists_delete_and_missing(redis_server):
    st = _store(redis_server.url)
    try:
        m = _manifest("a", 3000)
        _, views = _payload(m)
        st.put(m, views)
        assert st.exists(["a", "b"]) == [True, False]
        assert st.get_manifest("b") is None
        got = st.get_manifests(["b", "a"])
        assert got[0] is None and got[1] is not None and got[1].gen == m.gen
        newer = _manifest("a", 3000, gen=2)
        st.put(newer, _payload(newer)[1])
        st.delete(m)  # an older generation's delete leaves the newer manifest
        assert st.exists(["a"]) == [True]
        st.delete(newer)
        st.delete(m)
        assert st.exists(["a"]) == [False]
        with pytest.raises(NotFound):
            st.read(m)  # gone, not corrupt
        assert redis_server.cli("keys", f"{st.opts.namespace}:*").strip() == ""
    finally:
        st.close()


def test_namespaces_and_tenants_are_isolated(redis_server):
    a, b = _store(redis_server.url), _store(redis_server.url)
    try:
        m = _manifest("same-id", 2000)
        _, views = _payload(m)
        a.put(m, views)
        assert a.exists(["same-id"]) == [True]
        assert b.exists(["same-id"]) == [False]
        t1, t2 = "t1" + TENANT_SEP + "same-id", "t2" + TENANT_SEP + "same-id"
        assert a.exists([t1]) == [False]
        a.put(_manifest(t1, 2000), views)
        assert a.exists([t1]) == [True]
        assert a.exists([t2]) == [False]
    finally:
        a.close()
        b.close()


def test_corrupted_value_is_data_loss_and_deleted(redis_server):
    st = _store(redis_server.url)
    try:
        m = _manifest("victim", 40000)
        _, views = _payload(m)
        st.put(m, views)
        key = st.chunk_key(m, 1)
        # Flip one payload byte in Redis itself (SETRANGE at an offset past the header).
        assert redis_server.cli("setrange", key, str(CHUNK_HEADER.size + 10), "Z").strip().isdigit()
        with pytest.raises(DataLoss, match="checksum"):
            st.read(m)
        assert st.exists(["victim"]) == [False]
        assert redis_server.cli("exists", key).strip() == "0"
        assert st.stats().data_loss == 1
    finally:
        st.close()


def test_value_of_another_layout_is_never_served(redis_server):
    st = _store(redis_server.url)
    try:
        m = _manifest("fp", 20000)
        _, views = _payload(m)
        st.put(m, views)
        other = _manifest("fp", 20000, fp=0xBEEF)
        _, oviews = _payload(other, seed=1)
        # A chunk written under another fingerprint, copied over this one's key.
        st.put(other, oviews)
        assert redis_server.cli("exists", st.chunk_key(other, 0)).strip() == "1"
        st._connect().set(st.chunk_key(m, 0), st._connect().get(st.chunk_key(other, 0)))
        with pytest.raises(DataLoss, match="fingerprint"):
            st.read(m)
    finally:
        st.close()


def test_ttl_expires_keys(redis_server):
    st = _store(redis_server.url, ttl_s=0.3)
    try:
        m = _manifest("ephemeral", 5000)
        _, views = _payload(m)
        st.put(m, views)
        ttl = int(redis_server.cli("pttl", st.manifest_key("ephemeral")).strip())
        assert 0 < ttl <= 300
        assert wait_until(lambda: st.exists(["ephemeral"]) == [False], timeout=15)
        assert wait_until(lambda: redis_server.cli("exists", st.chunk_key(m, 0)).strip() == "0", timeout=15)
    finally:
        st.close()


def test_outage_fails_fast_opens_breaker_and_resumes(fresh_redis):
    st = _store(fresh_redis.url, timeout_s=1.0, breaker_failures=2, breaker_cooldown_s=0.3)
    try:
        m = _manifest("o", 3000)
        data, views = _payload(m)
        st.put(m, views)
        fresh_redis.stop()
        # Step 1: Redis is gone: typed errors, then the breaker refuses without trying.
        for _ in range(2):
            with pytest.raises((Unavailable, DeadlineExceeded)):
                st.put(m, views)
        assert st.stats().state == "open" and st.stats().degraded
        with pytest.raises(Unavailable, match="circuit open"):
            st.exists(["o"])
        assert st.stats().refused >= 1 and st.stats().errors >= 2 and st.stats().outages == 1
        # Step 2: Redis comes back (empty: no persistence); the tier resumes after the cool-down.
        fresh_redis.restart()

        def back() -> bool:
            try:
                return st.ping()
            except (Unavailable, DeadlineExceeded):
                return False

        assert wait_until(back, timeout=30)
        assert st.stats().state == "closed"
        st.put(m, views)
        assert bytes(st.read(m)) == data
    finally:
        st.close()


def test_unreachable_url_is_typed_not_a_hang():
    st = _store(f"redis://127.0.0.1:{free_port()}/0", timeout_s=0.5, breaker_failures=1)
    try:
        with pytest.raises((Unavailable, DeadlineExceeded)):
            st.get_manifest("x")
        with pytest.raises(Unavailable, match="circuit open"):
            st.get_manifest("x")
    finally:
        st.close()


# -- cluster ---------------------------------------------------------------------------


def test_cluster_spreads_chunks_and_reads_back_bit_exact(redis_cluster):
    st = _store(redis_cluster.url, cluster=True)
    try:
        m = _manifest("big{tag}", (1 << 16) * 4 + 99)
        data, views = _payload(m)
        st.put(m, views)
        assert bytes(st.read(m)) == data
        per_node = [int(n.cli("dbsize").strip() or 0) for n in redis_cluster.nodes]
        assert sum(1 for c in per_node if c > 0) >= 2, per_node  # chunks spread over the masters
        other = _store(redis_cluster.url, cluster=True, namespace=st.opts.namespace)
        try:
            back = other.get_manifest("big{tag}")
            assert back is not None and bytes(other.read(back)) == data
        finally:
            other.close()
    finally:
        st.close()


def test_cluster_node_restarted_mid_run(tmp_path):
    from ..redis_servers import have_redis

    if have_redis():
        pytest.skip(have_redis())
    cl = RedisCluster(tmp_path / "cluster").start()
    st = _store(cl.url, cluster=True, timeout_s=1.0, breaker_cooldown_s=0.2)
    try:
        m = _manifest("spread", (1 << 16) * 4)
        data, views = _payload(m)
        st.put(m, views)
        # Step 1: one master dies (no persistence: its share of the chunks is gone).
        cl.nodes[1].stop()

        def fails_typed() -> bool:
            try:
                st.read(m)
            except (Unavailable, DeadlineExceeded, DataLoss):
                return True
            return False

        assert wait_until(fails_typed, timeout=30)
        # Step 2: it comes back on the same port with its slots (nodes.conf); the tier
        # resumes: a new park reads back bit-exact.
        cl.nodes[1].start()
        cl.wait_ok()

        def works() -> bool:
            try:
                st.put(m, views)
                return bytes(st.read(m)) == data
            except (Unavailable, DeadlineExceeded):
                return False

        assert wait_until(works, timeout=60, interval=0.2)
        assert st.stats().errors >= 1
    finally:
        st.close()
        cl.stop()
