"""RESP without redis-py's copies (``tiers/resp.py``): values sent in pieces and chunks read
from the socket into their slots, against real Redis servers.

What must hold: a value in pieces is byte for byte the value joined; a read in place
takes only replies it can parse (nils, bulks of the expected size) and leaves the
connection exactly at the next reply; anything else (a value of another size, a wrong
type, a cluster's redirect) is read again the ordinary way, which names it; a stalled
Redis is a typed timeout and the store recovers.
"""

from __future__ import annotations

import array

import pytest
from redis.connection import Encoder, PythonRespSerializer

from kvpark.proto.errors import DataLoss, DeadlineExceeded, NotFound, Unavailable
from kvpark.tiers.remote import CHUNK_HEADER, connection_class
from kvpark.tiers.resp import Pieces, Unparsed, read_bulks_into, serializer_class

from ..conftest import wait_until
from .test_remote import _manifest, _payload, _store


def _packed(out: list) -> bytes:
    return b"".join(bytes(p) for p in out)


def test_pieces_pack_exactly_like_the_joined_value():
    enc = Encoder("utf-8", "strict", False).encode
    wide = array.array("h", [1, -2, 300])  # a view of 2-byte items: 6 bytes, 3 items
    parts = [b"head", memoryview(bytearray(b"middle")), memoryview(wide)]
    joined = b"head" + b"middle" + wide.tobytes()
    ours = serializer_class()(6000, enc)
    theirs = PythonRespSerializer(6000, enc)
    assert _packed(ours.pack("SET", "k", Pieces(parts), "PX", 5)) == _packed(theirs.pack("SET", "k", joined, "PX", 5))
    assert len(Pieces(parts)) == len(joined)
    # Without pieces it is redis-py's packer unchanged.
    assert _packed(ours.pack("GET", "k")) == _packed(theirs.pack("GET", "k"))


@pytest.mark.parametrize("where", ["standalone", "cluster"])
def test_a_value_in_pieces_lands_whole(where, request):
    import redis
    from redis.cluster import RedisCluster as Cluster

    srv = request.getfixturevalue("redis_server" if where == "standalone" else "redis_cluster")
    kw = dict(connection_class=connection_class(srv.url))
    c = Cluster.from_url(srv.url, **kw) if where == "cluster" else redis.Redis.from_url(srv.url, **kw)
    try:
        big = bytes(range(256)) * 40000  # past redis-py's buffer cut-off: sent on its own
        pipe = c.pipeline(transaction=False)
        pipe.set("resp:pieces", Pieces([b"h", memoryview(big), b"t"]), px=60000)
        pipe.execute()
        assert c.get("resp:pieces") == b"h" + big + b"t"
        assert 0 < c.pttl("resp:pieces") <= 60000
    finally:
        c.close()


def test_a_gap_mid_pipeline_is_not_found_and_the_connection_stays_in_step(redis_server):
    # One pipeline, one connection: a nil in the middle must be consumed exactly, or the
    # next read on the same connection would parse the wrong bytes.
    st = _store(redis_server.url, inflight=1, pipeline_bytes=1 << 30)
    try:
        gone, kept = _manifest("gone", 5 * (1 << 14) + 7), _manifest("kept", 3 * (1 << 14) + 1)
        _, gviews = _payload(gone)
        data, kviews = _payload(kept, seed=3)
        st.put(gone, gviews)
        st.put(kept, kviews)
        assert redis_server.cli("del", st.chunk_key(gone, 2)).strip() == "1"
        with pytest.raises(NotFound, match="chunk 2"):
            st.read(gone)
        for _ in range(3):
            assert bytes(st.read(kept)) == data
        assert st.stats().data_loss == 0  # a gap is not damage
        assert st.stats().reread == 0  # both read in place
    finally:
        st.close()


def test_a_value_of_another_size_is_read_the_ordinary_way_and_named(redis_server):
    st = _store(redis_server.url, inflight=1)
    try:
        m, ok = _manifest("short", 3 * (1 << 14)), _manifest("ok", 2 * (1 << 14) + 5)
        _, views = _payload(m)
        data, oviews = _payload(ok, seed=9)
        st.put(m, views)
        st.put(ok, oviews)
        key = st.chunk_key(m, 1)
        redis_server.cli("setrange", key, str(3 * (1 << 14)), "tail")  # one value now 4 bytes longer
        with pytest.raises(DataLoss, match="length"):
            st.read(m)
        assert st.stats().reread == 1
        assert redis_server.cli("exists", key).strip() == "0"  # damage is deleted
        assert bytes(st.read(ok)) == data  # the closed connection was replaced
    finally:
        st.close()


def test_a_chunk_key_of_the_wrong_type_fails_typed_and_the_store_goes_on(redis_server):
    st = _store(redis_server.url, inflight=1)
    try:
        m, ok = _manifest("typed", 2 * (1 << 14)), _manifest("fine", 1 << 14)
        _, views = _payload(m)
        data, oviews = _payload(ok, seed=5)
        st.put(m, views)
        st.put(ok, oviews)
        key = st.chunk_key(m, 0)
        redis_server.cli("del", key)
        redis_server.cli("rpush", key, "x")
        with pytest.raises(DataLoss, match="chunk 0"):
            st.read(m)
        assert bytes(st.read(ok)) == data
    finally:
        st.close()


def _six_chunks_on(st, seq_id: str):
    """A sequence of six chunks (and a short seventh) put through ``st``: (manifest, its
    bytes, the store's cluster client)."""
    m = _manifest(seq_id, 6 * (1 << 14) + 3)
    data, views = _payload(m)
    st.put(m, views)
    return m, data, st._connect()


def test_a_stale_cluster_slot_map_is_followed_not_misread(redis_cluster):
    st = _store(redis_cluster.url, cluster=True, inflight=1, pipeline_bytes=1 << 30)
    try:
        m, data, client = _six_chunks_on(st, "moved")
        nm = client.nodes_manager
        slot = client.keyslot(st.chunk_key(m, 0))
        right = nm.slots_cache[slot][0]
        wrong = next(n for n in client.get_primaries() if n.name != right.name)
        nm.slots_cache[slot] = [wrong]  # as if the slot had moved since the map was read
        assert bytes(st.read(m)) == data  # MOVED: read again the ordinary way, which follows it
        assert st.stats().data_loss == 0 and st.stats().reread == 1
        assert bytes(st.read(m)) == data and st.stats().reread == 1  # the map was refreshed
    finally:
        st.close()


def test_a_stalled_redis_is_a_typed_timeout_and_the_connection_is_dropped(fresh_redis):
    import redis

    st = _store(fresh_redis.url, inflight=1, timeout_s=0.5, breaker_cooldown_s=0.1)
    try:
        m = _manifest("stall", 4 * (1 << 14))
        data, views = _payload(m)
        st.put(m, views)
        pool = st._connect().connection_pool
        conn = pool.get_connection()
        try:
            fresh_redis.cli("client", "pause", "1500", "all")
            head = memoryview(bytearray(CHUNK_HEADER.size))
            with pytest.raises(redis.exceptions.TimeoutError):
                read_bulks_into(conn, [st.chunk_key(m, 0)], [head], [[memoryview(bytearray(1 << 14))]])
            assert conn._sock is None  # where the stream stands is unknown: never reused as is
        finally:
            pool.release(conn)
        # The store's own read times out typed while the pause lasts, then reads again.
        wait_until(lambda: _reads(st, m) == data, timeout=10.0)
    finally:
        st.close()


def _reads(st, m) -> bytes | None:
    try:
        return bytes(st.read(m))
    except DeadlineExceeded:  # the pause; nothing else may go wrong
        return None
    except Unavailable:  # the breaker's cool-down after the timeouts
        return None


def test_a_probe_that_hands_over_to_the_ordinary_read_does_not_wedge_the_breaker(redis_server):
    # Half-open lets one probe through; a call that ends in ``Unparsed`` (no verdict:
    # the ordinary read gives it) must free the probe, or every later call is refused.
    st = _store(redis_server.url, breaker_cooldown_s=0.05)
    try:
        st.breaker.trip()
        wait_until(lambda: st.breaker.state == "half_open", timeout=5.0)

        def hand_over(client):
            raise Unparsed("a reply for the ordinary read")

        with pytest.raises(Unparsed):
            st._call("probe", hand_over)
        assert st.ping()  # the next call probed, and closed the breaker
        assert st.breaker.state == "closed"
    finally:
        st.close()


def test_a_dead_node_in_a_stale_cluster_map_is_read_the_ordinary_way(redis_cluster):
    # What a failover leaves until the slot map is read again: slots naming a primary that
    # is gone. The in-place read hands those chunks to redis-py's cluster pipeline, which
    # refreshes the map and retries.
    from redis.cluster import ClusterNode

    from ..redis_servers import free_port

    st = _store(redis_cluster.url, cluster=True, pipeline_bytes=1 << 30)
    try:
        m, data, client = _six_chunks_on(st, "failover")
        nm = client.nodes_manager
        dead = ClusterNode("127.0.0.1", free_port(), server_type="primary")
        nm.nodes_cache[dead.name] = dead
        mslot = client.keyslot(st.manifest_key(m.seq_id))
        for i in range(6):
            slot = client.keyslot(st.chunk_key(m, i))
            if slot != mslot:
                nm.slots_cache[slot] = [dead]
        assert bytes(st.read(m)) == data
        assert st.stats().reread >= 1 and st.stats().errors == 0
        assert bytes(st.read(m)) == data and st.breaker.state == "closed"
    finally:
        st.close()
