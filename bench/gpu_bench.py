"""GPU bench: raw pinned copy limits against kvpark's demote/promote, plus a 4 GiB restore.

Measures in one run, side by side:
- raw torch ``copy_`` between a pinned host buffer and device memory, D2H and H2D (the limit);
- kvpark demotion (device -> pinned host arena) and promotion (host -> device) GB/s,
  through the engine and its copy engine (no gRPC: this is the tier machinery);
- the time to restore a Llama-3-8B-shaped sequence of 32k tokens
  (32 layers x K,V x 8 KV heads x 128 dim x 32768 tokens, bf16 = 4 GiB) from the host
  tier into the device tier.

Targets: demote/promote >= 0.8x the raw pinned copy_; the 4 GiB restore < 120 ms on an H200.

``--device cpu --small`` runs the same code paths on a CPU (a smoke test of the script).
Writes JSON to ``--json``.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch

from kvpark.daemon.config import load
from kvpark.daemon.engine import Engine
from kvpark.daemon.model import ParkSpec
from kvpark.proto.layout import TensorMeta

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


def raw_limits(device: torch.device, nbytes: int, reps: int) -> dict[str, float]:
    pin = device.type == "cuda"
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    t = timer(device)
    d2h = min(t(lambda: host.copy_(dev, non_blocking=True)) for _ in range(reps))
    h2d = min(t(lambda: dev.copy_(host, non_blocking=True)) for _ in range(reps))
    return {"d2h_gbps": nbytes / d2h / 1e9, "h2d_gbps": nbytes / h2d / 1e9}


def park_into(engine: Engine, seq_id: str, nbytes: int, tier: str) -> None:
    spec = ParkSpec(seq_id, (TensorMeta("uint8", (nbytes,), nbytes),), nbytes, overwrite=True)
    r = engine.reserve(spec, inline=True, tier=tier)
    mem = engine.tiers[r.tier]
    for off, n in r.segments:
        mem.pool[off : off + n].fill_(7)
    engine.commit(r.lease_id)


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
    out: dict[str, object] = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                              "torch": torch.__version__, "cuda": torch.version.cuda,
                              "date": time.strftime("%Y-%m-%d"),
                              # a CPU run checks the script, not the GPU paths: its figures say so
                              "cpu_dry_run": device.type != "cuda"}

    out["raw"] = raw_limits(device, min(seq_bytes, 1 * GiB), args.reps)
    with tempfile.TemporaryDirectory() as tmp:
        cfg = load(env={}, overrides={
            "tiers.device.enabled": "true", "tiers.device.device": args.device,
            "tiers.device.capacity": pool, "tiers.host.capacity": pool,
            "tiers.host.shm_dir": args.shm_dir, "tiers.disk.path": tmp, "tiers.disk.capacity": 2 * pool,
            "policy.high_watermark": 0.99, "policy.low_watermark": 0.98, "policy.flush_on_shutdown": False,
        })
        t0 = time.perf_counter()
        engine = Engine(cfg)
        out["engine_start_s"] = time.perf_counter() - t0
        # Whether the arena really is page-locked: if not, every "async" copy is synchronous
        # and the figures below are not the pinned path's.
        out["arena_pinned"] = engine.arena_pinned
        engine.start()
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
        finally:
            engine.close(flush=False)
    raw = out["raw"]
    kv = out["kvpark"]
    out["ratios"] = {"demote_vs_raw_d2h": kv["demote_gbps"] / raw["d2h_gbps"],
                     "promote_vs_raw_h2d": kv["promote_gbps"] / raw["h2d_gbps"]}
    print(f"device: {out['device']}  torch {out['torch']}  engine start {out['engine_start_s']:.2f}s")
    print(f"{'path':<28}{'GB/s':>10}{'vs raw':>9}")
    print(f"{'raw pinned copy_ D2H':<28}{raw['d2h_gbps']:>10.2f}")
    print(f"{'raw pinned copy_ H2D':<28}{raw['h2d_gbps']:>10.2f}")
    print(f"{'kvpark demote (D2H)':<28}{kv['demote_gbps']:>10.2f}{out['ratios']['demote_vs_raw_d2h']:>8.2f}x")
    print(f"{'kvpark promote (H2D)':<28}{kv['promote_gbps']:>10.2f}{out['ratios']['promote_vs_raw_h2d']:>8.2f}x")
    r = out["llama3_8b_32k_restore"]
    print(f"restore {r['bytes'] / GiB:.2f} GiB host->device: best {r['best_ms']:.1f} ms, median {r['median_ms']:.1f} ms"
          " (target < 120 ms on H200; ratios target >= 0.8x)")
    write_json(args.json, out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
