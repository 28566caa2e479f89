#!/usr/bin/env python
"""The remote tier against the raw Redis clients, on a standalone server and a cluster.

Starts its own servers on free loopback ports (``redis-server`` and ``redis-cli`` must be
installed): one standalone, one 3-master cluster. No persistence, so the figures are
the network stack, the server and the client, not a disk.

Rows, each for SET (write) and GET (read), over the same bytes (``--total``, cut into
``--value``-sized values):
- ``redis-py+hiredis``: raw pipelined SET/GET, ``--inflight`` pipelines of about
  ``--pipeline`` bytes at once on their own connections (what the store does), and the
  same with one pipeline at a time; then the same with redis-py's own command packer
  instead of hiredis's (``tiers.remote.connection_class``), which the store uses.
- ``valkey-glide-sync``: the same with its non-atomic ``Batch``/``ClusterBatch`` (one
  multiplexed client shared by the threads, as glide intends).
- ``kvpark RemoteStore``: ``put`` / ``read`` of ``--seq``-sized sequences of 1 MiB blocks:
  the same SET/GET plus the chunk header, xxh3 checksums, the manifest, and verification
  into a caller's buffer. The target is >= 0.8x the best raw redis-py row.
- Through real daemons (in this process, each with its own data dir, host tier, disk
  tier and the same Redis namespace): ``demote to remote`` times the disk tier's
  eviction of ``--total`` bytes of parked sequences into Redis
  (``Mover.evict_disk``: LMDB read + remote put + disk delete), ``tiers.remote.evict_parallel``
  sequences at once (the default), and once more on a daemon that moves one at a time; ``fetch from remote``
  times another daemon bringing them onto its disk (``Mover.fetch_remote``: remote
  read, verify, LMDB write: the path when memory has no room); ``restore from remote``
  times a third daemon's client restoring them (shm transport, ``into=`` a preallocated
  tensor): the local-miss lookup, the remote read and verification straight into the
  host tier, and the copy out of the shared arena.

Every figure is the median of ``--reps`` runs in MB/s (1e6 bytes per second). Every write
row writes fresh keys each run, as a demotion does (a server overwriting the same values
in place reuses their memory, and measured ~1.4x faster). The daemons' arenas are in
``/dev/shm`` (their default), not on the disk the temp dir is on.

``--sealed`` runs only the ``kvpark RemoteStore`` rows on the standalone server, plain
and sealed (``tiers.remote.key_file``: AES-256-GCM over every value) side by side,
alternating ``--rounds`` times so a shared machine's noise falls on both alike, and prints
sealed / plain as ratios; plus AES-256-GCM alone on one ``--value``-sized value, in
this process (no Redis), for the cipher's own cost.

Usage: ``python bench/remote.py [--quick] [--sealed] [--total 256MiB] [--json PATH]``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import write_json  # noqa: E402
from kvpark.daemon.config import parse_size  # noqa: E402
from kvpark.proto.layout import TensorMeta  # noqa: E402
from kvpark.tiers.disk import Manifest  # noqa: E402
from kvpark.tiers.remote import RemoteOptions, RemoteStore, connection_class  # noqa: E402
from tests.redis_servers import RedisCluster, RedisServer, have_redis  # noqa: E402


def _median(fn: Callable[[], float], reps: int) -> float:
    return statistics.median(fn() for _ in range(reps))


def _split(n: int, parts: int) -> list[list[int]]:
    return [list(range(i, n, parts)) for i in range(parts)]


def _threads(parts: list[list[int]], run: Callable[[list[int]], None]) -> float:
    ts = [threading.Thread(target=run, args=(p,)) for p in parts if p]
    t0 = time.perf_counter()
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return time.perf_counter() - t0


class RawRedisPy:
    name = "redis-py+hiredis"
    kw: dict[str, Any] = {}

    def __init__(self, url: str, cluster: bool) -> None:
        import redis
        from redis.cluster import RedisCluster as RC

        self.client: Any = RC.from_url(url, **self.kw) if cluster else redis.Redis.from_url(url, **self.kw)

    def set_many(self, keys: list[str], value: bytes, idx: list[int], per_pipe: int) -> None:
        for s in range(0, len(idx), per_pipe):
            pipe = self.client.pipeline(transaction=False)
            for i in idx[s:s + per_pipe]:
                pipe.set(keys[i], value)
            pipe.execute()

    def get_many(self, keys: list[str], idx: list[int], per_pipe: int) -> None:
        for s in range(0, len(idx), per_pipe):
            pipe = self.client.pipeline(transaction=False)
            for i in idx[s:s + per_pipe]:
                pipe.get(keys[i])
            out = pipe.execute()
            assert all(v is not None for v in out)

    def close(self) -> None:
        self.client.close()


class RawRedisPyPacker(RawRedisPy):
    """The same client with redis-py's own command packer (what the store uses)."""

    name = "redis-py+hiredis, py packer"

    def __init__(self, url: str, cluster: bool) -> None:
        self.kw = {"connection_class": connection_class(url)}
        super().__init__(url, cluster)


class RawGlide:
    name = "valkey-glide-sync"

    def __init__(self, url: str, cluster: bool) -> None:
        import glide_sync as g

        self.g = g
        port = int(url.rsplit(":", 1)[1].split("/")[0])
        addr = [g.NodeAddress("127.0.0.1", port)]
        self.cluster = cluster
        if cluster:
            self.client = g.GlideClusterClient.create(g.GlideClusterClientConfiguration(addr, request_timeout=20000))
        else:
            self.client = g.GlideClient.create(g.GlideClientConfiguration(addr, request_timeout=20000))

    def _batch(self) -> Any:
        return self.g.ClusterBatch(is_atomic=False) if self.cluster else self.g.Batch(is_atomic=False)

    def set_many(self, keys: list[str], value: bytes, idx: list[int], per_pipe: int) -> None:
        for s in range(0, len(idx), per_pipe):
            b = self._batch()
            for i in idx[s:s + per_pipe]:
                b.set(keys[i], value)
            self.client.exec(b, raise_on_error=True)

    def get_many(self, keys: list[str], idx: list[int], per_pipe: int) -> None:
        for s in range(0, len(idx), per_pipe):
            b = self._batch()
            for i in idx[s:s + per_pipe]:
                b.get(keys[i])
            out = self.client.exec(b, raise_on_error=True)
            assert out is not None and all(v is not None for v in out)

    def close(self) -> None:
        self.client.close()


def bench_raw(cls: type, url: str, cluster: bool, a: argparse.Namespace, inflight: int) -> dict[str, float]:
    n = a.total // a.value
    value = os.urandom(a.value)
    reps = iter(range(1 << 30))
    keys: list[str] = []
    per_pipe = max(1, a.pipeline // a.value)
    client = cls(url, cluster)
    try:
        parts = _split(n, inflight)

        def write() -> float:
            # Fresh keys every rep, as a demotion writes: overwriting the same values in
            # place measured ~1.4x faster (the server reuses their memory).
            rep = next(reps)
            keys[:] = [f"raw:{cls.__name__}:{rep}:{i}" for i in range(n)]
            return a.total / 1e6 / _threads(parts, lambda p: client.set_many(keys, value, p, per_pipe))

        w = _median(write, a.reps)
        r = _median(lambda: a.total / 1e6 / _threads(parts, lambda p: client.get_many(keys, p, per_pipe)),
                    a.reps)
    finally:
        client.close()
    return {"write_MBps": w, "read_MBps": r}


def bench_store(url: str, cluster: bool, a: argparse.Namespace, keys: tuple[bytes, ...] = ()) -> dict[str, float]:
    st = RemoteStore(RemoteOptions(url=url, cluster=cluster, namespace="bench", timeout_s=20.0,
                                   chunk_size=a.value, pipeline_bytes=a.pipeline, inflight=a.inflight, keys=keys))
    nseq = max(1, a.total // a.seq)
    block = 1 << 20
    reps = iter(range(1 << 30))
    ms: list[Manifest] = []
    data = memoryview(os.urandom(a.seq))
    blocks = [data[o:o + block] for o in range(0, a.seq, block)]
    outs = [bytearray(a.seq) for _ in range(nseq)]
    try:
        def put() -> float:
            rep = next(reps)  # fresh keys every rep, as the raw rows write
            ms[:] = [Manifest(seq_id=f"s{rep}-{i}", gen=1, tensors=(TensorMeta("uint8", (a.seq,), a.seq),),
                              nbytes=a.seq, block_size=block, fingerprint=0x1234) for i in range(nseq)]
            t0 = time.perf_counter()
            for m in ms:
                st.put(m, blocks)
            return nseq * a.seq / 1e6 / (time.perf_counter() - t0)

        def read() -> float:
            t0 = time.perf_counter()
            for m, out in zip(ms, outs):
                st.read_into(m, memoryview(out))
            return nseq * a.seq / 1e6 / (time.perf_counter() - t0)

        w = _median(put, a.reps)
        r = _median(read, a.reps)
        assert bytes(outs[0]) == bytes(data)
    finally:
        st.close()
    return {"write_MBps": w, "read_MBps": r}


def bench_daemons(url: str, cluster: bool, a: argparse.Namespace, tmp: Path, tag: str) -> dict[str, float]:
    import torch

    from kvpark.client import Client
    from kvpark.daemon import reads
    from kvpark.daemon.config import load
    from kvpark.daemon.server import Daemon

    nseq = max(1, a.total // a.seq)

    shm_root = Path(tempfile.mkdtemp(prefix="kvpark-bench-", dir="/dev/shm" if os.path.isdir("/dev/shm") else tmp))

    def start(name: str, host: int, evict_parallel: int = 4) -> Daemon:
        d = tmp / f"{tag}-{name}"
        d.mkdir(parents=True)
        (shm_root / name).mkdir()
        cfg = load(env={}, overrides={
            "server.listen": "127.0.0.1:0", "tiers.device.enabled": "false", "metrics.listen": "",
            "tiers.host.capacity": str(host), "tiers.host.shm_dir": str(shm_root / name),
            "tiers.disk.path": str(d / "disk"), "tiers.disk.capacity": str(4 * a.total * a.reps),
            "tiers.remote.url": url, "tiers.remote.cluster": cluster, "tiers.remote.namespace": f"bench-{tag}",
            "tiers.remote.timeout_s": 20.0, "tiers.remote.chunk_size": str(a.value),
            "tiers.remote.inflight": a.inflight, "policy.flush_on_shutdown": False,
            "tiers.remote.evict_parallel": evict_parallel,
        })
        return Daemon(cfg).start()

    # The reader's host tier holds everything it restores, so each restore promotes
    # straight from Redis into host memory (without room it would go through its disk).
    owner, fetcher, reader = start("a", 2 * a.seq), start("b", 2 * a.seq), start("c", a.reps * a.total + 2 * a.seq)
    # The same demotion, one sequence at a time (tiers.remote.evict_parallel = 1, as before
    # it existed), on its own daemon and namespace prefix, in the same rep.
    single = start("a1", 2 * a.seq, evict_parallel=1)
    data = torch.randint(0, 256, (a.seq,), dtype=torch.uint8)
    out = torch.empty_like(data)
    demote, demote1, fetch, restore = [], [], [], []
    try:
        with Client(owner.address) as c, Client(reader.address, transport="shm") as r, \
                Client(single.address) as c1:
            for rep in range(a.reps):
                ids = [f"r{rep}-{i}" for i in range(nseq)]
                for sid in ids:
                    c1.park(f"one-{sid}", [data])
                assert single.engine is not None
                single.engine.flush()
                t0 = time.perf_counter()
                assert single.engine.mover.evict_disk(0, target=0)
                demote1.append(nseq * a.seq / 1e6 / (time.perf_counter() - t0))
                for sid in ids:
                    c.park(sid, [data])
                eng = owner.engine
                assert eng is not None
                eng.flush()
                t0 = time.perf_counter()
                assert eng.mover.evict_disk(0, target=0)
                demote.append(nseq * a.seq / 1e6 / (time.perf_counter() - t0))
                fe = fetcher.engine
                assert fe is not None
                reads.adopt(fe, ids)  # the ids indexed as remote-only, as a local miss would
                with fe.catalog.lock:
                    seqs = [fe.catalog.get(sid) for sid in ids]
                t0 = time.perf_counter()
                for sq in seqs:
                    fe.mover.fetch_remote(sq)
                fetch.append(nseq * a.seq / 1e6 / (time.perf_counter() - t0))
                t0 = time.perf_counter()
                for sid in ids:
                    r.restore(sid, into=[out])
                restore.append(nseq * a.seq / 1e6 / (time.perf_counter() - t0))
                assert torch.equal(out, data)
                # Dropped (untimed), so Redis holds at most one rep's sequences, as the raw
                # rows' server does: memory a server grows into for the first time costs
                # far more on a VM (guest pages the host backs on first touch, here ~0.4
                # GB/s against ~3.4 GB/s once touched) and would land on these rows only.
                for sid in ids:
                    c.drop(sid)
                    c1.drop(f"one-{sid}")
    finally:
        for d in (owner, fetcher, reader, single):
            d.stop(0.5)
        shutil.rmtree(shm_root, ignore_errors=True)
    return {"demote_MBps": statistics.median(demote), "demote_one_MBps": statistics.median(demote1),
            "fetch_MBps": statistics.median(fetch),
            "restore_MBps": statistics.median(restore)}


def bench_cipher(a: argparse.Namespace) -> dict[str, float]:
    """AES-256-GCM seal and open of one ``--value``-sized value, one thread, MB/s."""
    from kvpark.tiers.remote import SEAL_CHUNK, Sealer

    sealer = Sealer([os.urandom(32)])
    plain = os.urandom(a.value)
    sealed = sealer.seal(SEAL_CHUNK, "k", plain)

    def rate(fn: Callable[[], Any], n: int = 8) -> float:
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        return n * a.value / 1e6 / (time.perf_counter() - t0)

    return {"seal_MBps": _median(lambda: rate(lambda: sealer.seal(SEAL_CHUNK, "k", plain)), a.reps),
            "open_MBps": _median(lambda: rate(lambda: sealer.open(SEAL_CHUNK, "k", sealed)), a.reps)}


def main_sealed(a: argparse.Namespace) -> None:
    key = (os.urandom(32),)
    runs: dict[str, list[dict[str, float]]] = {"plain": [], "sealed": []}
    with tempfile.TemporaryDirectory() as tmp:
        srv = RedisServer(Path(tmp) / "s").start()
        try:
            for _ in range(a.rounds):
                for name, keys in (("plain", ()), ("sealed", key)):
                    runs[name].append(bench_store(srv.url, False, a, keys))
                    srv_flush(srv)
        finally:
            srv.stop()
    med = {n: {k: statistics.median(r[k] for r in rs) for k in ("write_MBps", "read_MBps")} for n, rs in runs.items()}
    cipher = bench_cipher(a)
    print(f"\nstandalone: {'row':<36} {'put MB/s':>9} {'read MB/s':>9}")
    for n in ("plain", "sealed"):
        print(f"            kvpark RemoteStore x{a.inflight}, {n:<17} {med[n]['write_MBps']:9.0f} "
              f"{med[n]['read_MBps']:9.0f}")
    rw = med["sealed"]["write_MBps"] / med["plain"]["write_MBps"]
    rr = med["sealed"]["read_MBps"] / med["plain"]["read_MBps"]
    print(f"            {'sealed / plain':<36} {rw:9.2f} {rr:9.2f}")
    print(f"AES-256-GCM alone, one {a.value >> 20} MiB value, one thread: seal {cipher['seal_MBps']:.0f} MB/s, "
          f"open {cipher['open_MBps']:.0f} MB/s")
    if a.json:
        write_json(a.json, {"args": {k: v for k, v in vars(a).items() if k != "json"}, "store": med,
                            "ratio": {"put": rw, "read": rr}, "cipher": cipher,
                            "rounds": runs})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--total", default="256MiB")
    ap.add_argument("--value", default="4MiB", help="value size (the store's chunk_size)")
    ap.add_argument("--seq", default="64MiB", help="sequence size for the store rows")
    ap.add_argument("--pipeline", default="16MiB", help="bytes per pipeline")
    ap.add_argument("--inflight", type=int, default=4)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="64 MiB, 2 reps")
    ap.add_argument("--json", default="")
    ap.add_argument("--sealed", action="store_true", help="only the store, plain against sealed (ratios)")
    ap.add_argument("--rounds", type=int, default=3, help="--sealed: plain/sealed alternations")
    a = ap.parse_args()
    if a.quick:
        a.total, a.reps = "64MiB", 2
    for k in ("total", "value", "seq", "pipeline"):
        setattr(a, k, parse_size(getattr(a, k), k))
    a.seq = min(a.seq, a.total)
    why = have_redis()
    if why:
        sys.exit(f"bench/remote.py: {why}")
    import redis.utils

    if a.sealed:
        print(f"redis-py {redis.__version__}, total {a.total >> 20} MiB, sequences {a.seq >> 20} MiB, values "
              f"{a.value >> 20} MiB, inflight {a.inflight}, median of {a.reps} x {a.rounds} rounds")
        main_sealed(a)
        return
    print(f"redis-py {redis.__version__} (hiredis: {redis.utils.HIREDIS_AVAILABLE}), "
          f"total {a.total >> 20} MiB, values {a.value >> 20} MiB, pipelines {a.pipeline >> 20} MiB, "
          f"inflight {a.inflight}, median of {a.reps}")
    results: dict[str, Any] = {"args": {k: v for k, v in vars(a).items() if k != "json"}, "rows": []}
    with tempfile.TemporaryDirectory() as tmp:
        servers = [("standalone", RedisServer(Path(tmp) / "s")), ("cluster", RedisCluster(Path(tmp) / "c"))]
        try:
            for label, srv in servers:
                srv.start()
                cluster = label == "cluster"
                rows = []
                for cls in (RawRedisPy, RawRedisPyPacker, RawGlide):
                    for inflight in (1, a.inflight):
                        rows.append((f"{cls.name} x{inflight}", bench_raw(cls, srv.url, cluster, a, inflight)))
                        srv_flush(srv)
                rows.append((f"kvpark RemoteStore x{a.inflight}", bench_store(srv.url, cluster, a)))
                srv_flush(srv)
                dm = bench_daemons(srv.url, cluster, a, Path(tmp), label)
                srv_flush(srv)
                # The limit: the best raw figure of the chosen client (redis-py), per direction.
                best_w = max(r["write_MBps"] for n, r in rows if n.startswith("redis-py"))
                best_r = max(r["read_MBps"] for n, r in rows if n.startswith("redis-py"))
                print(f"\n{label}: {'row':<32} {'SET MB/s':>9} {'GET MB/s':>9} {'SET x':>6} {'GET x':>6}")
                for name, r in rows:
                    print(f"{'':{len(label) + 2}}{name:<32} {r['write_MBps']:9.0f} {r['read_MBps']:9.0f} "
                          f"{r['write_MBps'] / best_w:6.2f} {r['read_MBps'] / best_r:6.2f}")
                    results["rows"].append({"server": label, "row": name, **r})
                for name, key, base in (("kvpark demote to remote", "demote_MBps", best_w),
                                        ("  one sequence at a time", "demote_one_MBps", best_w),
                                        ("kvpark fetch from remote", "fetch_MBps", best_r),
                                        ("kvpark restore from remote", "restore_MBps", best_r)):
                    col = "SET" if key.startswith("demote") else "GET"
                    print(f"{'':{len(label) + 2}}{name:<32} {col} {dm[key]:6.0f} MB/s  {dm[key] / base:.2f}x raw {col}")
                results["daemon"] = results.get("daemon", {}) | {label: dm}
                srv.stop()
        finally:
            for _, srv in servers:
                srv.stop()
    if a.json:
        write_json(a.json, results)


def srv_flush(srv: Any) -> None:
    for n in getattr(srv, "nodes", [srv]):
        n.cli("flushall")


if __name__ == "__main__":
    main()
