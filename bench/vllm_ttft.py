"""Time to first token in a real vLLM engine, with and without kvpark, side by side in one run.

For each model shape, every row is a separate engine process against the same daemon
(or none), with the same prompt length and ``max_tokens=1``:

- ``recompute``: no kvpark; the engine's prefix cache is reset between rounds.
- ``miss, kvpark off`` and ``miss + save``: one engine with kvpark on, a fresh prompt
  each round, the rounds alternating a request sent with
  ``kv_transfer_params={"kvpark": "off"}`` (no lookup, no save) and a plain one (the
  lookup misses, the engine prefills, the connector snapshots the new blocks for its
  background saver). Each round's saves are waited for after it, untimed. The ratio of
  their TTFTs, under the same load in the same process, is what saving adds to the step
  of a request that misses; the ratio of the CPU seconds the rounds took (engine process
  plus daemon, the background park included) is what it costs the machine.
- ``kvpark hit (host)``: kvpark on, the same prompt each round, the engine's own cache
  reset between rounds: every round after the first loads all full blocks from the
  daemon's host tier (the background saves are waited for between rounds, untimed).
- ``kvpark hit (disk)``: the daemon is restarted (SIGTERM writes everything to disk),
  then each round asks for one of the ``miss + save`` prompts for the first time: served
  from the disk tier (LMDB; warm in the OS page cache on this machine).
- ``engine prefix cache``: no kvpark, no reset: vLLM's own cache, for reference.

Round 0 of every engine process warms it up and is not counted; the figure is the median
of the others. The bench also reports the time the steps spent snapshotting, as a share
of a miss's TTFT. Shapes (random-weight Llamas built locally by tests/vllm/engine.py):
``tiny`` (2 layers, hidden 64, 480-token prompt: the tests' model) and ``medium``
(8 layers, hidden 1024, GQA 16/4, head_dim 64, bf16, 2048-token prompt: a prefill that
is real work on a CPU).

Needs the vLLM venv (`make test-vllm` builds .venv-vllm):

    .venv-vllm/bin/python bench/vllm_ttft.py [--shapes tiny,medium] [--rounds N] [--json PATH]

(``--rounds`` per engine process; the miss row's process runs ``2 * rounds - 1``.)
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

from _common import write_json  # bench/ is on sys.path when a script here runs

ROOT = Path(__file__).resolve().parents[1]
ENGINE = ROOT / "tests" / "vllm" / "engine.py"
SHAPES = {  # prompt tokens, max_model_len, engine KV bytes, rounds per engine process
    # tiny rounds take milliseconds, where one preemption of a loaded machine's scheduler
    # costs ~100 ms: many rounds, so that medians see through them.
    "tiny": (480, 512, 64 << 20, 15),
    "medium": (2048, 4096, 256 << 20, 7),
}
ROWS = (("recompute (no kvpark)", "recompute"), ("miss, kvpark off for the request", "miss_off"),
        ("miss + background save", "miss_save"),
        ("kvpark hit, host tier", "hit_host"), ("kvpark hit, disk tier (restarted daemon)", "hit_disk"),
        ("engine prefix cache (no reset)", "engine_cache"))


def engine(model: str, spec: dict) -> dict:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    r = subprocess.run([sys.executable, str(ENGINE), "run", "--model", model, "--spec", json.dumps(spec)],
                       capture_output=True, text=True, env=env, timeout=1800)
    line = next((l for l in r.stdout.splitlines() if l.startswith("RESULT ")), None)
    if r.returncode or not line:
        raise SystemExit(r.stderr[-3000:])
    return json.loads(line[7:])


class Daemon:
    def __init__(self, data: Path, shm: Path) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvpark.daemon.cli", "serve", "--listen", "127.0.0.1:0", "--data-dir",
             str(data / "disk"), "--set", f"tiers.host.shm_dir={shm}", "--set", "tiers.host.capacity=1GiB",
             "--set", "tiers.disk.capacity=4GiB", "--set", "tiers.device.enabled=false", "--set", "metrics.listen="],
            stderr=subprocess.PIPE, text=True)
        self.address = ""
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            m = re.search(r'listening on ([^\s"]+)', line)
            if m:
                self.address = m.group(1)
                break
        if not self.address:
            raise SystemExit("daemon did not start")

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)  # a graceful stop writes every sequence to disk
        self.proc.wait(120)


def prompt(n: int, seed: int) -> list[int]:
    return [(i * 7 + seed * 131 + (i * i * seed) % 97) % 500 + 5 for i in range(n)]


def timed(rows: list[dict]) -> list[float]:
    """Milliseconds of every round but each process's first (its warm-up)."""
    return [r["seconds"] * 1e3 for row in rows for r in row["rounds"][1:]]


def run_shape(shape: str, rounds: int, tmp: Path, shm: Path) -> dict:
    n, max_len, kv_bytes, default_rounds = SHAPES[shape]
    rounds = rounds or default_rounds
    model = str(tmp / f"model-{shape}")
    subprocess.run([sys.executable, str(ENGINE), "make-model", model, "--shape", shape], check=True,
                   capture_output=True)
    base = {"max_tokens": 1, "max_model_len": max_len, "kv_bytes": kv_bytes}
    same = [[prompt(n, 0)]] * rounds
    fresh = [[prompt(n, 1 + r)] for r in range(2 * rounds - 1)]
    runs: dict[str, list[dict]] = {k: [] for _, k in ROWS}
    d = Daemon(tmp / f"daemon-{shape}", shm)
    try:
        runs["recompute"].append(engine(model, {**base, "round_prompts": same, "reset": True}))
        # One process, fresh prompts, rounds alternating a request with kvpark off and
        # one with it on (a miss, then the snapshot): the ratio of the two is the cost of
        # saving, measured under the same load.
        # Each round's background saves are waited for after it (untimed), so its wall time
        # is the step's own and its CPU time includes the saver's (and the daemon's) work.
        ab = engine(model, {**base, "round_prompts": fresh, "reset": True, "address": d.address, "settle": True,
                            "daemon_pid": d.proc.pid, "off_rounds": list(range(1, 2 * rounds - 1, 2))})
        runs["hit_host"].append(engine(model, {**base, "round_prompts": same, "reset": True, "settle": True,
                                               "address": d.address}))
        runs["engine_cache"].append(engine(model, {**base, "round_prompts": same, "reset": False}))
    finally:
        d.stop()
    d = Daemon(tmp / f"daemon-{shape}", shm)  # the same data dir: everything is on disk now
    try:
        saved = [p for i, p in enumerate(fresh) if i % 2 == 0]  # the rounds that saved
        runs["hit_disk"].append(engine(model, {**base, "round_prompts": saved, "reset": True, "settle": True,
                                               "address": d.address}))
    finally:
        d.stop()
    rounds_ms = {k: timed(v) for k, v in runs.items() if v}
    ab_ms = [r["seconds"] * 1e3 for r in ab["rounds"]]
    rounds_ms["miss_off"] = ab_ms[1::2]
    rounds_ms["miss_save"] = ab_ms[2::2]
    ttft = {k: statistics.median(v) for k, v in rounds_ms.items()}
    pair_ratios = [on / off for off, on in zip(rounds_ms["miss_off"], rounds_ms["miss_save"])]
    # CPU seconds (engine process + daemon) of the off and on rounds: load from other work
    # stretches wall time but hardly the CPU a round itself burns.
    cpu = [r["cpu_s"] + r["daemon_cpu_s"] for r in ab["rounds"]]
    cpu_off, cpu_on = statistics.median(cpu[1::2]), statistics.median(cpu[2::2])
    first = lambda k: runs[k][0]  # noqa: E731
    # Identical tokens: every hit's first token is the recomputed one for the same prompt.
    same_tokens = (all(r["tokens"] == first("recompute")["rounds"][0]["tokens"] for r in first("hit_host")["rounds"])
                   and [r["tokens"] for r in first("hit_disk")["rounds"]]
                   == [r["tokens"] for i, r in enumerate(ab["rounds"]) if i % 2 == 0])
    cached = {k: [r["cached"][0] for r in first(k)["rounds"][1:]] for k in ("hit_host", "hit_disk")}
    cached["miss"] = [r["cached"][0] for r in ab["rounds"]]
    miss = Counter(ab["stats"])
    saves = max(1, miss["saves_queued"])
    snapshot_ms = miss["save_step_us"] / saves / 1e3
    return {
        "prompt_tokens": n,
        "ttft_ms": ttft,
        "rounds_ms": rounds_ms,
        "vs_recompute": {k: v / ttft["recompute"] for k, v in ttft.items()},
        "miss_save_vs_miss_off_per_pair": pair_ratios,
        "cached_tokens": cached,
        "same_tokens": same_tokens,
        "miss_cpu_s": {"off": cpu_off, "save": cpu_on, "ratio": cpu_on / cpu_off},
        "save_snapshot_ms": snapshot_ms,
        "save_snapshot_share_of_miss_ttft": snapshot_ms / ttft["miss_save"],
        "background_park_ms": miss["save_us"] / max(1, miss["saves"]) / 1e3,
        "stats": {**{k: v[0]["stats"] for k, v in runs.items() if v and v[0]["stats"]}, "miss_ab": ab["stats"]},
    }


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="tiny,medium")
    ap.add_argument("--rounds", type=int, default=0,
                    help="rounds per engine process (round 0 is a warm-up); default: per shape, 15 tiny, 7 medium")
    ap.add_argument("--json", default=str(ROOT / "bench" / "results" / "vllm_ttft.json"))
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="kvpark-ttft-"))
    # The host arena in tmpfs where there is one, as in a deployment.
    shm = Path(tempfile.mkdtemp(prefix="kvpark-ttft-", dir="/dev/shm" if os.path.isdir("/dev/shm") else tmp))
    result = {"date": time.strftime("%Y-%m-%d"), "rounds": args.rounds or "per shape",
              "loadavg": os.getloadavg(), "shapes": {}}
    for shape in args.shapes.split(","):
        r = run_shape(shape, args.rounds, tmp, shm)
        result["shapes"][shape] = r
        print(f"\n{shape}: prompt {r['prompt_tokens']} tokens; tokens identical: {r['same_tokens']}; "
              f"kvpark served {r['cached_tokens']['hit_host']} (host) / {r['cached_tokens']['hit_disk']} (disk)")
        print(f"{'path':<44}{'TTFT ms (median)':>18}{'vs recompute':>14}")
        for name, key in ROWS:
            print(f"{name:<44}{r['ttft_ms'][key]:>18.2f}{r['vs_recompute'][key]:>13.2f}x")
        off, on = r["ttft_ms"]["miss_off"], r["ttft_ms"]["miss_save"]
        pairs = sorted(r["miss_save_vs_miss_off_per_pair"])
        print(f"miss + save vs the same engine's kvpark-off requests: {on / off:.3f}x (ratio of medians); "
              f"per alternating pair: median {statistics.median(pairs):.3f}x, {pairs[0]:.3f}x to {pairs[-1]:.3f}x")
        c = r["miss_cpu_s"]
        print(f"CPU of a miss (engine + daemon, saves settled): off {c['off'] * 1e3:.1f} ms, with save "
              f"{c['save'] * 1e3:.1f} ms: {c['ratio']:.3f}x")
        print(f"saves: snapshot {r['save_snapshot_ms']:.2f} ms in the step "
              f"({100 * r['save_snapshot_share_of_miss_ttft']:.2f}% of a miss's TTFT), background park "
              f"{r['background_park_ms']:.2f} ms")
    result["loadavg_after"] = os.getloadavg()
    shutil.rmtree(shm, ignore_errors=True)
    write_json(args.json, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
