"""Time to first token of a long shared prefix in a real vLLM engine, with and without a
kvpark hit, side by side in one run; plus kvpark's park (save) and restore (load) time
per request.

Needs the vLLM venv (`make test-vllm` builds .venv-vllm):

    .venv-vllm/bin/python bench/vllm_ttft.py [--json bench/results/vllm_ttft.json]

Each engine runs in its own process (tests/vllm/engine.py). The prompt is as long as the
tiny model allows (max_model_len 512: 480 prompt tokens, 15 full 32-token blocks).
"After reset" rows call ``llm.reset_prefix_cache()`` between rounds, so the engine's own
prefix cache is empty and any hit is kvpark's.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import write_json  # bench/ is on sys.path when a script here runs

ROOT = Path(__file__).resolve().parents[1]
ENGINE = ROOT / "tests" / "vllm" / "engine.py"


def engine(model: str, spec: dict) -> dict:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    r = subprocess.run([sys.executable, str(ENGINE), "run", "--model", model, "--spec", json.dumps(spec)],
                       capture_output=True, text=True, env=env, timeout=900)
    line = next((l for l in r.stdout.splitlines() if l.startswith("RESULT ")), None)
    if r.returncode or not line:
        raise SystemExit(r.stderr[-3000:])
    return json.loads(line[7:])


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--json", default=str(ROOT / "bench" / "results" / "vllm_ttft.json"))
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="kvpark-ttft-"))
    (tmp / "shm").mkdir()
    model = str(tmp / "model")
    subprocess.run([sys.executable, str(ENGINE), "make-model", model], check=True, capture_output=True)
    daemon = subprocess.Popen(
        [sys.executable, "-m", "kvpark.daemon.cli", "serve", "--listen", "127.0.0.1:0", "--data-dir",
         str(tmp / "disk"), "--set", f"tiers.host.shm_dir={tmp / 'shm'}", "--set", "tiers.host.capacity=256MiB"],
        stderr=subprocess.PIPE, text=True)
    address = ""
    assert daemon.stderr is not None
    for line in daemon.stderr:
        m = re.search(r"listening on (\S+)", line)
        if m:
            address = m.group(1)
            break
    try:
        prompt = [(i * 7) % 500 + 5 for i in range(480)]
        spec = {"prompts": [prompt], "max_tokens": 1, "rounds": args.rounds, "reset": True}
        plain = engine(model, spec)
        kv = engine(model, {**spec, "address": address})
        warm = engine(model, {**spec, "reset": False})  # the engine's own prefix cache, for reference
    finally:
        daemon.terminate()
        daemon.wait(60)
    cold = [r["seconds"] for r in plain["rounds"][1:]]  # round 0 also warms the engine up
    hit = [r["seconds"] for r in kv["rounds"][1:]]
    local = [r["seconds"] for r in warm["rounds"][1:]]
    stats = kv["stats"]
    out = {
        "date": time.strftime("%Y-%m-%d"),
        "prompt_tokens": len(prompt),
        "cached_tokens_with_kvpark": kv["rounds"][-1]["cached"][0],
        "ttft_ms": {"recompute": statistics.median(cold) * 1e3, "kvpark_hit": statistics.median(hit) * 1e3,
                    "engine_prefix_cache": statistics.median(local) * 1e3},
        "per_request_ms": {"restore": stats.get("load_us", 0) / max(1, stats.get("loads", 0)) / 1e3,
                           "park": stats.get("save_us", 0) / max(1, stats.get("saves", 0)) / 1e3},
        "stats": stats,
        "same_tokens": plain["rounds"][-1]["tokens"] == kv["rounds"][-1]["tokens"],
    }
    t = out["ttft_ms"]
    print(f"prompt {len(prompt)} tokens; kvpark served {out['cached_tokens_with_kvpark']} of them after reset")
    print(f"{'path':<36}{'TTFT ms (median)':>18}{'vs recompute':>14}")
    for name, key in (("recompute (no kvpark)", "recompute"), ("kvpark hit (after reset)", "kvpark_hit"),
                      ("engine prefix cache (no reset)", "engine_prefix_cache")):
        print(f"{name:<36}{t[key]:>18.2f}{t[key] / t['recompute']:>13.2f}x")
    p = out["per_request_ms"]
    print(f"kvpark per request: restore {p['restore']:.2f} ms, park {p['park']:.2f} ms; tokens identical: "
          f"{out['same_tokens']}")
    write_json(args.json, out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
