"""The remote store's promises, each checked against a real redis-server.

- A put publishes its manifest after every chunk: Redis's own MONITOR shows the order
  of the commands as Redis ran them, so what any reader could see at any moment
  during a put is known, not sampled.
- A put that fails part-way (Redis refusing writes: out of memory) leaves chunks and no
  manifest: readers see a miss (``NotFound``, never ``DataLoss``), delete nothing, and
  an older generation already published still reads back whole.
- A Redis that hangs (SIGSTOP) instead of refusing: every call ends within its
  ``timeout_s`` as ``DeadlineExceeded``, the breaker opens and then refuses at once
  (``Unavailable``); once Redis answers again the tier resumes.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time

import pytest

from kvpark.proto.errors import DeadlineExceeded, NotFound, Unavailable
from kvpark.tiers.remote import GONE, REPLACED, WHOLE

from ..conftest import wait_until
from ..redis_servers import RedisServer
from .test_remote import _manifest, _payload, _store


class Monitor:
    """``redis-cli monitor``: the commands Redis runs, in the order it runs them."""

    def __init__(self, srv: RedisServer) -> None:
        self.srv = srv
        self.lines: list[str] = []
        self.proc = subprocess.Popen(["redis-cli", "-p", str(srv.port), "monitor"], stdout=subprocess.PIPE,
                                     stderr=subprocess.DEVNULL, text=True, errors="replace")
        self._t = threading.Thread(target=self._pump, daemon=True)
        self._t.start()
        self.mark("start")

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)

    def mark(self, tag: str) -> None:
        """Send a marker command and wait until the monitor has seen it."""
        word = f"kvpark-test-mark-{tag}"
        assert wait_until(lambda: (self.srv.cli("echo", word), any(word in ln for ln in self.lines))[1],
                          timeout=20, interval=0.1), "MONITOR never showed the marker"

    def sets(self) -> list[str]:
        """The keys of every SET, in order."""
        out = []
        for ln in self.lines:
            parts = ln.split('"')
            if len(parts) > 3 and parts[1].upper() == "SET":
                out.append(parts[3])
        return out

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait(10)


def test_a_put_publishes_its_manifest_after_every_chunk(fresh_redis: RedisServer) -> None:
    # Many chunks in several pipelines, three in flight at once.
    st = _store(fresh_redis.url, chunk_size=4096, pipeline_bytes=8192, inflight=3)
    mon = Monitor(fresh_redis)
    try:
        m = _manifest("ordered", 4096 * 12 + 100)
        data, views = _payload(m)
        st.put(m, views)
        mon.mark("end")
        keys = mon.sets()
        mkey, chunks = st.manifest_key("ordered"), {st.chunk_key(m, i) for i in range(13)}
        assert set(keys) == chunks | {mkey}
        assert keys[-1] == mkey, f"the manifest was published before chunk(s) {keys[keys.index(mkey) + 1:]}"
        assert bytes(st.read(m)) == data
    finally:
        mon.close()
        st.close()


def _refuse_writes(srv: RedisServer, headroom: int) -> None:
    used = int(next(ln for ln in srv.cli("info", "memory").splitlines() if ln.startswith("used_memory:"))
               .split(":")[1])
    srv.cli("config", "set", "maxmemory-policy", "noeviction")
    srv.cli("config", "set", "maxmemory", str(used + headroom))


def test_a_failed_put_leaves_its_chunks_no_manifest_and_readers_a_miss(fresh_redis: RedisServer) -> None:
    st = _store(fresh_redis.url, chunk_size=1 << 14, pipeline_bytes=1 << 15, inflight=1, breaker_failures=100)
    try:
        old = _manifest("half", 20000, gen=1)
        old_data, old_views = _payload(old)
        st.put(old, old_views)
        # Step: Redis refuses writes part-way through the next generation's chunks.
        new = _manifest("half", 1 << 21, gen=2)
        _refuse_writes(fresh_redis, 200 << 10)
        with pytest.raises(Unavailable, match="OutOfMemory"):
            st.put(new, _payload(new)[1])
        fresh_redis.cli("config", "set", "maxmemory", "0")
        written = [i for i in range(128) if fresh_redis.cli("exists", st.chunk_key(new, i)).strip() == "1"]
        assert written, "no chunk was written: the fault came too early to test anything"
        # Step: readers see the published generation, whole, and a miss for the failed one.
        cur = st.get_manifest("half")
        assert cur is not None and cur.gen == 1
        assert bytes(st.read(old)) == old_data
        with pytest.raises(NotFound):
            st.read(new)
        assert st.stats().data_loss == 0
        # Nothing a reader did deleted anything: the old generation is still there.
        assert st.exists(["half"]) == [True]
        # Step: the same with nothing published before: a miss, not DATA_LOSS.
        lone = _manifest("lone", 1 << 21)
        _refuse_writes(fresh_redis, 200 << 10)
        with pytest.raises(Unavailable, match="OutOfMemory"):
            st.put(lone, _payload(lone)[1])
        fresh_redis.cli("config", "set", "maxmemory", "0")
        assert fresh_redis.cli("exists", st.chunk_key(lone, 0)).strip() == "1"
        assert st.get_manifest("lone") is None and st.exists(["lone"]) == [False]
        with pytest.raises(NotFound):
            st.read(lone)
        assert st.stats().data_loss == 0
    finally:
        fresh_redis.cli("config", "set", "maxmemory", "0")
        st.close()


def test_a_hung_redis_times_out_typed_and_opens_the_breaker(fresh_redis: RedisServer, stopped: list[int]) -> None:
    st = _store(fresh_redis.url, timeout_s=0.5, breaker_failures=2, breaker_cooldown_s=0.3)
    try:
        m = _manifest("h", 30000)
        data, views = _payload(m)
        st.put(m, views)
        assert fresh_redis.proc is not None
        os.kill(fresh_redis.proc.pid, signal.SIGSTOP)
        stopped.append(fresh_redis.proc.pid)
        # Step: Redis accepts connections (the kernel does) but answers nothing.
        for call in (lambda: st.get_manifest("h"), lambda: st.read(m)):
            with pytest.raises(DeadlineExceeded, match="timed out"):
                call()
        assert st.stats().state == "open" and st.stats().outages == 1
        # Step: the open breaker refuses without waiting on the hung server.
        for call in (lambda: st.exists(["h"]), lambda: st.put(m, views)):
            with pytest.raises(Unavailable, match="circuit open"):
                call()
        assert st.stats().refused >= 2
        # Step: Redis answers again: after the cool-down one probe closes the breaker.
        os.kill(fresh_redis.proc.pid, signal.SIGCONT)

        def back() -> bool:
            try:
                return st.ping()
            except (Unavailable, DeadlineExceeded):
                time.sleep(0.05)
                return False

        assert wait_until(back, timeout=30)
        assert st.stats().state == "closed"
        assert bytes(st.read(m)) == data
    finally:
        st.close()



def test_copy_state_answers_for_one_generation_whole_and_refreshes_its_ttl(redis_server: RedisServer) -> None:
    st = _store(redis_server.url, ttl_s=3.0)
    try:
        m = _manifest("held", 40000)
        st.put(m, _payload(m)[1])
        assert st.copy_state(m) == WHOLE
        assert st.copy_state(_manifest("held", 40000, gen=2)) == REPLACED  # another generation's is current
        # Step: with ttl_s, a yes gives every key of that generation a fresh TTL.
        keys = [st.manifest_key("held")] + [st.chunk_key(m, i) for i in range(3)]
        pttl = lambda: min(int(redis_server.cli("pttl", k).strip()) for k in keys)  # noqa: E731
        assert wait_until(lambda: pttl() < 2000, timeout=20, interval=0.05)
        assert st.copy_state(m) == WHOLE
        assert pttl() > 2000, "copy_state() did not refresh the TTL"
        # Step: one chunk gone (evicted by Redis) is a no; so is the manifest gone.
        redis_server.cli("del", st.chunk_key(m, 1))
        assert st.copy_state(m) == GONE
        st.put(m, _payload(m)[1])
        redis_server.cli("del", st.manifest_key("held"))
        assert st.copy_state(m) == GONE
        # Step: expired is gone (watched with exists(), which refreshes nothing).
        st.put(m, _payload(m)[1])
        assert wait_until(lambda: st.exists(["held"]) == [False], timeout=20, interval=0.2)
        assert st.copy_state(m) == GONE
    finally:
        st.close()


def test_a_chunk_redis_evicted_reads_as_not_found_never_data_loss(redis_server: RedisServer) -> None:
    # docs/remote.md: "A sequence whose keys Redis evicted or expired reads as NOT_FOUND".
    # With ttl_s the chunks, written first, expire just before their manifest; Redis's
    # maxmemory evicts keys one by one; another daemon's drop deletes the manifest, then
    # the chunks, under a reader that already has the manifest.
    st = _store(redis_server.url)
    try:
        m = _manifest("evicted", 40000)
        _, views = _payload(m)
        st.put(m, views)
        redis_server.cli("del", st.chunk_key(m, 1))
        with pytest.raises(NotFound, match="chunk 1"):
            st.read(m)
        assert st.stats().data_loss == 0, "a chunk Redis dropped was counted as damage"
        # What is left of that generation is gone too: no later reader finds its manifest.
        assert st.exists(["evicted"]) == [False]
        assert redis_server.cli("exists", st.chunk_key(m, 0)).strip() == "0"
    finally:
        st.close()
