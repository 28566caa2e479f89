"""GPU bench: raw pinned copy limits against kvpark's paths, side by side in one run.

Measures:
- the limits: raw torch ``copy_`` between a pinned host buffer and device memory, D2H and
  H2D, one direction at a time and both at once (duplex), per block size (2 MiB, 64 MiB,
  one whole sequence), and device to device;
- kvpark's tier machinery (the engine and its copy engine, no gRPC): demotion (device ->
  pinned host arena) and promotion (host -> device) of many 2 MiB and 64 MiB blocks and
  of one whole sequence, and demotion and promotion at once (duplex);
- the time to restore a Llama-3-8B-shaped sequence of 32k tokens (32 layers x K,V x 8 KV
  heads x 128 dim x 32768 tokens, bf16 = 4 GiB) from the host tier into the device tier;
- end to end through a client: a park and a restore of CUDA tensors over shm (the
  page-locked arena) and over cuda_ipc (device to device), against the raw copies.

Targets (docs/BENCHMARKS.md): D2H/H2D >= 0.8x the pinned limit on 64 MiB blocks and >= 0.6x
on 2 MiB blocks; duplex >= 1.6x one direction; the 4 GiB restore < 120 ms on an H200.

``--device cpu --small`` runs the same code paths on a CPU (a smoke test of the script;
its JSON says ``cpu_dry_run``). Writes JSON to ``--json``.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch

from kvpark.daemon.config import load
from kvpark.daemon.engine import Engine
from kvpark.daemon.mover import await_copy
from kvpark.daemon.server import Daemon
from kvpark.daemon.model import ParkSpec
from kvpark.proto.layout import TensorMeta
from kvpark.tiers.cuda import pinned_bytes

from _common import write_json  # bench/ is on sys.path when a script here runs

GiB = 1 << 30


def timer(device: torch.device):
    if device.type == "cuda":
        def run(fn) -> float:
            torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            fn()
            torch.cuda.synchronize(device)
            return time.perf_counter() - t0
    else:
        def run(fn) -> float:
            t0 = time.perf_counter()
            fn()
            return time.perf_counter() - t0
    return run


def raw_limits(device: torch.device, nbytes: int, reps: int, block: int | None = None) -> dict[str, float]:
    """Pinned ``copy_`` GB/s each way and both at once (two streams), ``block`` bytes per copy."""
    pin = device.type == "cuda"
    block = block or nbytes
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
    host2 = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dev2 = torch.empty(nbytes, dtype=torch.uint8, device=device)
    t = timer(device)

    def copies(dst: torch.Tensor, src: torch.Tensor) -> None:
        for o in range(0, nbytes, block):
            dst[o : o + block].copy_(src[o : o + block], non_blocking=True)

    d2h = min(t(lambda: copies(host, dev)) for _ in range(reps))
    h2d = min(t(lambda: copies(dev, host)) for _ in range(reps))
    out = {"d2h_gbps": nbytes / d2h / 1e9, "h2d_gbps": nbytes / h2d / 1e9}
    if device.type == "cuda":
        s1, s2 = torch.cuda.Stream(device), torch.cuda.Stream(device)

        def both() -> None:
            with torch.cuda.stream(s1):
                copies(host, dev)
            with torch.cuda.stream(s2):
                copies(dev2, host2)

        dup = min(t(both) for _ in range(reps))
        out["duplex_gbps"] = 2 * nbytes / dup / 1e9
        d2d = min(t(lambda: dev2.copy_(dev)) for _ in range(reps))
        out["d2d_gbps"] = nbytes / d2d / 1e9
    return out


def park_into(engine: Engine, seq_id: str, nbytes: int, tier: str) -> None:
    spec = ParkSpec(seq_id, (TensorMeta("uint8", (nbytes,), nbytes),), nbytes, overwrite=True)
    r = engine.reserve(spec, inline=True, tier=tier)
    mem = engine.tiers[r.tier]
    for off, n in r.segments:
        mem.pool[off : off + n].fill_(7)
    engine.commit(r.lease_id)


def blocks_bench(engine: Engine, t, block: int, total: int, reps: int) -> dict[str, float]:
    """Demote then promote ``total // block`` sequences of ``block`` bytes, all in flight at once."""
    n = max(1, total // block)
    ids = [f"b{block}-{i}" for i in range(n)]
    demote, promote = [], []
    for _ in range(reps):
        for sid in ids:
            park_into(engine, sid, block, "device")

        def down() -> None:
            jobs: list = []
            for sid in ids:
                engine.mover.demote(sid, "device", jobs)
            for job in jobs:
                await_copy(job)

        demote.append(t(down))
        with engine.catalog.lock:
            seqs = [engine.catalog.get(sid) for sid in ids]
        assert all(s.tier == "host" for s in seqs), "a block did not leave the device tier"
        promote.append(t(lambda: engine.mover.promote_batch(seqs, "device")))
        for sid in ids:
            engine.drop(sid)
    nbytes = n * block
    return {"block": block, "blocks": n, "demote_gbps": nbytes / min(demote) / 1e9,
            "promote_gbps": nbytes / min(promote) / 1e9}


def duplex_bench(engine: Engine, t, block: int, total: int, reps: int) -> dict[str, float]:
    """Demote one set of blocks while promoting another: both directions' copies at once."""
    n = max(1, total // block)
    down_ids = [f"dn-{i}" for i in range(n)]
    up_ids = [f"up-{i}" for i in range(n)]
    best = float("inf")
    for _ in range(reps):
        for sid in down_ids:
            park_into(engine, sid, block, "device")
        for sid in up_ids:
            park_into(engine, sid, block, "host")
        with engine.catalog.lock:
            ups = [engine.catalog.get(sid) for sid in up_ids]

        def both() -> None:
            jobs: list = []
            for sid in down_ids:
                engine.mover.demote(sid, "device", jobs)
            engine.mover.promote_batch(ups, "device")
            for job in jobs:
                await_copy(job)

        best = min(best, t(both))
        for sid in down_ids + up_ids:
            engine.drop(sid)
    return {"block": block, "bytes_each_way": n * block, "duplex_gbps": 2 * n * block / best / 1e9}


def client_bench(address: str, device: torch.device, nbytes: int, reps: int, transport: str) -> dict[str, float]:
    """Park and restore one ``nbytes`` tensor on ``device`` through a client."""
    from kvpark.client import Client

    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    t = timer(device)
    with Client(address, transport=transport) as c:
        park = []
        for i in range(reps):
            park.append(t(lambda: c.park("e2e", [src], overwrite=True)))
        restore = [t(lambda: c.restore("e2e", into=[dst])) for _ in range(reps)]
        ok = bool(torch.equal(src, dst))
        pinned = bool(getattr(c._transport, "pinned", False))
        c.drop("e2e")
    return {"transport": transport, "bytes": nbytes, "park_gbps": nbytes / min(park) / 1e9,
            "restore_gbps": nbytes / min(restore) / 1e9, "bytes_ok": ok, "client_mapping_pinned": pinned}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--small", action="store_true", help="1 GiB pools, 256 MiB sequences (smoke run)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--shm-dir", default="/dev/shm")
    ap.add_argument("--json", default="bench/results/gpu.json")
    args = ap.parse_args()
    device = torch.device(args.device)
    seq_bytes = (256 << 20) if args.small else 4 * GiB
    pool = (1 * GiB) if args.small else 5 * GiB  # room for one 4 GiB sequence per tier
    blocks_total = (128 << 20) if args.small else 1 * GiB
    out: dict[str, object] = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                              "torch": torch.__version__, "cuda": torch.version.cuda,
                              "date": time.strftime("%Y-%m-%d"),
                              # a CPU run checks the script, not the GPU paths: its figures say so
                              "cpu_dry_run": device.type != "cuda"}

    out["raw"] = raw_limits(device, min(seq_bytes, 1 * GiB), args.reps)
    out["raw_blocks"] = {str(b): raw_limits(device, blocks_total, args.reps, block=b) for b in (2 << 20, 64 << 20)}
    with tempfile.TemporaryDirectory() as tmp:
        cfg = load(env={}, overrides={
            "server.listen": "127.0.0.1:0", "metrics.listen": "", "server.log_level": "warning",
            "tiers.device.enabled": "true", "tiers.device.device": args.device,
            "tiers.device.capacity": pool, "tiers.host.capacity": pool,
            "tiers.host.shm_dir": args.shm_dir, "tiers.disk.path": tmp, "tiers.disk.capacity": 2 * pool,
            "policy.high_watermark": 0.99, "policy.low_watermark": 0.98, "policy.flush_on_shutdown": False,
        })
        t0 = time.perf_counter()
        daemon = Daemon(cfg).start()
        engine = daemon.engine
        assert engine is not None
        out["engine_start_s"] = time.perf_counter() - t0
        # Whether the arena really is page-locked: if not, every "async" copy is synchronous
        # and the figures below are not the pinned path's.
        out["arena_pinned"] = engine.arena_pinned
        t = timer(device)
        try:
            demote, promote = [], []
            for _ in range(args.reps):
                park_into(engine, "x", seq_bytes, "device")
                demote.append(t(lambda: engine.mover.demote("x", "device")))
                with engine.catalog.lock:
                    seq = engine.catalog.get("x")
                assert seq.tier == "host", seq.tier
                promote.append(t(lambda: engine.mover.promote(seq, "device", make_room=True)))
                assert seq.tier == "device"
            out["kvpark"] = {"demote_gbps": seq_bytes / min(demote) / 1e9,
                             "promote_gbps": seq_bytes / min(promote) / 1e9,
                             "demote_median_s": statistics.median(demote),
                             "promote_median_s": statistics.median(promote)}
            engine.drop("x")
            out["kvpark_blocks"] = {str(b): blocks_bench(engine, t, b, blocks_total, args.reps)
                                    for b in (2 << 20, 64 << 20)}
            out["kvpark_duplex"] = duplex_bench(engine, t, 64 << 20, blocks_total // 2, args.reps)
            # Llama-3-8B shape, 32k tokens, bf16: host tier -> device tier.
            layers, heads, dim, tokens = 32, 8, 128, 32768
            llama = layers * 2 * heads * dim * tokens * 2 if not args.small else seq_bytes
            times = []
            for _ in range(args.reps):
                park_into(engine, "llama", llama, "host")
                with engine.catalog.lock:
                    seq = engine.catalog.get("llama")
                times.append(t(lambda: engine.mover.promote(seq, "device", make_room=True)))
                assert seq.tier == "device"
                engine.drop("llama")
            out["llama3_8b_32k_restore"] = {"bytes": llama, "best_ms": min(times) * 1e3,
                                            "median_ms": statistics.median(times) * 1e3}
            e2e = 256 << 20 if not args.small else 64 << 20
            out["client"] = {"shm": client_bench(daemon.address, device, e2e, args.reps, "shm")}
            if device.type == "cuda":
                out["client"]["cuda_ipc"] = client_bench(daemon.address, device, e2e, args.reps, "cuda_ipc")
            out["pinned_bytes"] = pinned_bytes()
        finally:
            daemon.stop()
    raw = out["raw"]
    kv = out["kvpark"]
    ratios = {"demote_vs_raw_d2h": kv["demote_gbps"] / raw["d2h_gbps"],
              "promote_vs_raw_h2d": kv["promote_gbps"] / raw["h2d_gbps"]}
    for b, r in out["kvpark_blocks"].items():
        lim = out["raw_blocks"][b]
        ratios[f"demote_{int(b) >> 20}MiB_vs_raw"] = r["demote_gbps"] / lim["d2h_gbps"]
        ratios[f"promote_{int(b) >> 20}MiB_vs_raw"] = r["promote_gbps"] / lim["h2d_gbps"]
    one_way = max(out["kvpark_blocks"][str(64 << 20)]["demote_gbps"], out["kvpark_blocks"][str(64 << 20)]["promote_gbps"])
    ratios["duplex_vs_one_direction"] = out["kvpark_duplex"]["duplex_gbps"] / one_way
    if "duplex_gbps" in raw:
        ratios["raw_duplex_vs_one_direction"] = raw["duplex_gbps"] / max(raw["d2h_gbps"], raw["h2d_gbps"])
    for name, r in out["client"].items():
        limit = raw.get("d2d_gbps") if name == "cuda_ipc" else min(raw["d2h_gbps"], raw["h2d_gbps"])
        ratios[f"client_{name}_park_vs_raw"] = r["park_gbps"] / limit
        ratios[f"client_{name}_restore_vs_raw"] = r["restore_gbps"] / limit
    out["ratios"] = ratios
    print(f"device: {out['device']}  torch {out['torch']}  engine start {out['engine_start_s']:.2f}s  "
          f"arena pinned {out['arena_pinned']}  page-locked {out['pinned_bytes']}")
    print(f"{'path':<34}{'GB/s':>10}{'vs raw':>9}")
    print(f"{'raw pinned copy_ D2H':<34}{raw['d2h_gbps']:>10.2f}")
    print(f"{'raw pinned copy_ H2D':<34}{raw['h2d_gbps']:>10.2f}")
    print(f"{'kvpark demote (D2H)':<34}{kv['demote_gbps']:>10.2f}{ratios['demote_vs_raw_d2h']:>8.2f}x")
    print(f"{'kvpark promote (H2D)':<34}{kv['promote_gbps']:>10.2f}{ratios['promote_vs_raw_h2d']:>8.2f}x")
    for b, r in out["kvpark_blocks"].items():
        mib = int(b) >> 20
        print(f"{f'kvpark demote {mib} MiB blocks':<34}{r['demote_gbps']:>10.2f}{ratios[f'demote_{mib}MiB_vs_raw']:>8.2f}x")
        print(f"{f'kvpark promote {mib} MiB blocks':<34}{r['promote_gbps']:>10.2f}"
              f"{ratios[f'promote_{mib}MiB_vs_raw']:>8.2f}x")
    print(f"{'kvpark duplex (64 MiB blocks)':<34}{out['kvpark_duplex']['duplex_gbps']:>10.2f}"
          f"{ratios['duplex_vs_one_direction']:>8.2f}x one way")
    for name, r in out["client"].items():
        print(f"{f'client park / restore ({name})':<34}{r['park_gbps']:>10.2f}{ratios[f'client_{name}_park_vs_raw']:>8.2f}x"
              f"  / {r['restore_gbps']:.2f} ({ratios[f'client_{name}_restore_vs_raw']:.2f}x), bytes ok {r['bytes_ok']}")
    r = out["llama3_8b_32k_restore"]
    print(f"restore {r['bytes'] / GiB:.2f} GiB host->device: best {r['best_ms']:.1f} ms, median {r['median_ms']:.1f} ms"
          " (target < 120 ms on H200; ratios: >= 0.8x at 64 MiB, >= 0.6x at 2 MiB, duplex >= 1.6x)")
    write_json(args.json, out)
    return 0 if all(r["bytes_ok"] for r in out["client"].values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
