#!/usr/bin/env bash
# The prepared GPU check: the CUDA-marked tests plus the GPU bench, in under 4 minutes (GPU_CHECK_BUDGET_S, default 240)
# on one GPU. Usage: bash bench/gpu_check.sh [OUT_DIR]   (or OUT=DIR; default bench/results)
#
# Needs python3 with a CUDA build of torch, and the wheels listed in bench/gpu_wheels.txt
# in .whl/ (fetch them with bench/gpu_wheels.sh where there is network access; the GPU
# machine may have none). kvpark itself is installed from this checkout, offline.
# Each precondition that fails stops the check at once with one line saying why.
# Writes OUT_DIR/gpu_check.json (everything) and OUT_DIR/gpu_check.txt (a short table),
# plus the raw logs gpu_tests.log and gpu_bench.log.
#
# GPU_CHECK_CPU=1: a dry run on a machine without a GPU, in the current environment (no
# wheels installed): the wheel check, the test collection (every cuda test skips), the
# bench's code paths at the smoke size on the CPU, and the JSON, marked "cpu_dry_run".
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-${OUT:-bench/results}}
PY=${PYTHON:-python3}
BUDGET_S=${GPU_CHECK_BUDGET_S:-240}
start=$SECONDS
die() { echo "gpu_check: FAILED: $*" >&2; exit 2; }
left() { echo $((BUDGET_S - (SECONDS - start))); }
mkdir -p "$OUT" || die "cannot create output folder $OUT"

# 1. Wheels: every line of bench/gpu_wheels.txt needs its wheel in .whl/ (a file check only).
missing=()
while read -r req; do
  name=${req%%==*}; ver=${req#*==}
  norm=$(echo "$name" | tr 'A-Z.-' 'a-z__')
  compgen -G ".whl/${norm}-${ver}-*.whl" >/dev/null || missing+=("$req")
done < <(grep -v '^#' bench/gpu_wheels.txt | grep .)
if ((${#missing[@]})); then
  die "wheels missing from .whl/: ${missing[*]} (run 'bash bench/gpu_wheels.sh' where pip can reach the index, then bring .whl/ along)"
fi

# 2. Versions first: torch, its CUDA, the device and the driver. No CUDA: stop here.
versions=$(mktemp)
"$PY" - "$versions" 2>"$versions.err" <<'EOF' || die "cannot read torch's versions: $(tail -n 1 "$versions.err")"
import json, subprocess, sys
import torch
v = {"torch": torch.__version__, "torch_cuda": torch.version.cuda, "cuda_available": torch.cuda.is_available(),
     "devices": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
     if torch.cuda.is_available() else []}
def smi(fields):
    try:
        return subprocess.run(["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=20).stdout.strip().splitlines()[0]
    except (OSError, subprocess.SubprocessError, IndexError):
        return ""
v["driver"] = smi("driver_version,memory.total")
# The PCIe link bounds every host<->device figure: generation and width, now and at most
# (an idle GPU may report a lower current generation until traffic starts).
link = [x.strip() for x in smi("pcie.link.gen.current,pcie.link.gen.max,pcie.link.width.current,"
                               "pcie.link.width.max").split(",")]
v["pcie"] = dict(zip(["gen_current", "gen_max", "width_current", "width_max"], link)) if len(link) == 4 else {}
json.dump(v, open(sys.argv[1], "w"))
print(f"gpu_check: torch {v['torch']} (CUDA {v['torch_cuda']}), devices {v['devices'] or 'none'}, "
      f"driver/memory {v['driver'] or 'unknown'}, PCIe {v['pcie'] or 'unknown'}")
EOF
CPU=${GPU_CHECK_CPU:-0}
[ "$CPU" = 1 ] || "$PY" -c "import json,sys; sys.exit(0 if json.load(open('$versions'))['cuda_available'] else 1)" \
  || die "no CUDA device visible to torch ($("$PY" -c 'import torch; print(torch.__version__)')); this check needs a GPU"

# 3. Install the wheels and kvpark (offline, into /tmp, leaving the system alone).
if [ "$CPU" != 1 ]; then
  site=$(mktemp -d)
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" .whl/*.whl \
    || die "installing the wheels from .whl/ failed"
  "$PY" -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir --target "$site/kvpark-pkg" . \
    || die "installing kvpark from this checkout failed"
  export PYTHONPATH=$site/kvpark-pkg:$site${PYTHONPATH:+:$PYTHONPATH}
  export PYTHONUNBUFFERED=1
fi
"$PY" -c "import kvpark.daemon.engine, kvpark.client" 2>/dev/null || die "kvpark does not import after the install"

# 4. The CUDA-marked tests, then the bench, inside the budget (the bench gets what is left).
# Test arenas on tmpfs (a disk-backed arena may not page-lock, and unpinned copies run
# synchronously, hiding ordering bugs); test modules that need a package the image lacks
# (cryptography for TLS, redis) are skipped at collection, not fatal.
base=$(mktemp -d -p /dev/shm kvpark-gpu-tests.XXXXXX 2>/dev/null || mktemp -d)
export KVPARK_TESTS_SKIP_MISSING=1
t0=$SECONDS
timeout -k 5 $(( $(left) - 110 )) "$PY" -m pytest -q -m cuda -p no:cacheprovider --timeout=120 --basetemp="$base/t" tests \
  >"$OUT/gpu_tests.log" 2>&1
tests_rc=$?
tests_s=$((SECONDS - t0))
rm -rf "$base"
tail -n 30 "$OUT/gpu_tests.log"
# Full size (5 GiB pools, a 4 GiB sequence) only where /dev/shm can hold the 5 GiB
# arena; elsewhere the smoke size, and the JSON says which.
shm_free=$(df -Pk /dev/shm 2>/dev/null | awk 'NR==2 {print $4}')
size_args=()
if [ "${shm_free:-0}" -lt $((6 << 20)) ]; then size_args=(--small); fi
if [ "$CPU" = 1 ]; then size_args=(--small --device cpu); fi
bench_json=$(mktemp)
t0=$SECONDS
timeout -k 5 $(( $(left) - 5 )) "$PY" bench/gpu_bench.py "${size_args[@]}" --json "$bench_json" >"$OUT/gpu_bench.log" 2>&1
bench_rc=$?
bench_s=$((SECONDS - t0))

# 5. One JSON, one short table.
"$PY" - "$versions" "$bench_json" "$OUT/gpu_tests.log" "$OUT" "$tests_rc" "$tests_s" "$bench_rc" "$bench_s" \
  "$((SECONDS - start))" "${size_args[*]:-full}" <<'EOF'
import json, os, re, sys
versions, bench_json, tests_log, out, tests_rc, tests_s, bench_rc, bench_s, total_s, size = sys.argv[1:]
v = json.load(open(versions))
try:
    bench = json.load(open(bench_json))
except (OSError, ValueError):
    bench = None
log = open(tests_log, errors="replace").read()
counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|skipped|errors?|deselected)", log.splitlines()[-1] if log else "")}
failed = re.findall(r"^(?:FAILED|ERROR) (\S+)", log, re.M)
skipped = re.findall(r"^SKIPPED \[\d+\] (.*)$", log, re.M)
ok = int(tests_rc) == 0 and int(bench_rc) == 0 and bench is not None
result = {"ok": ok, "versions": v, "seconds": int(total_s),
          "tests": {"rc": int(tests_rc), "seconds": int(tests_s), "counts": counts, "failed": failed, "skipped": skipped},
          "bench": {"rc": int(bench_rc), "seconds": int(bench_s), "size": size, "result": bench}}
with open(os.path.join(out, "gpu_check.json"), "w") as fh:
    json.dump(result, fh, indent=2)
pcie = v.get("pcie") or {}
dry = bool(bench and bench.get("cpu_dry_run"))
result["cpu_dry_run"] = dry
with open(os.path.join(out, "gpu_check.json"), "w") as fh:
    json.dump(result, fh, indent=2)
rows = [("device", ", ".join(v["devices"]) or "none: a CPU dry run, no figure below is a GPU's"), ("torch / CUDA / driver", f"{v['torch']} / {v['torch_cuda']} / {v['driver']}"),
        ("PCIe link now / max", f"gen {pcie.get('gen_current', '?')} x{pcie.get('width_current', '?')} / "
                                f"gen {pcie.get('gen_max', '?')} x{pcie.get('width_max', '?')}"),
        ("cuda tests", f"rc {tests_rc}, {counts} in {tests_s}s" + (f"; failed: {', '.join(failed)}" if failed else ""))]
if bench:
    raw, kv, r = bench["raw"], bench["kvpark"], bench["llama3_8b_32k_restore"]
    rows += [("host arena page-locked", str(bench.get("arena_pinned"))),
             ("raw pinned D2H / H2D GB/s", f"{raw['d2h_gbps']:.1f} / {raw['h2d_gbps']:.1f}"),
             ("kvpark demote / promote GB/s", f"{kv['demote_gbps']:.1f} / {kv['promote_gbps']:.1f} "
              f"({bench['ratios']['demote_vs_raw_d2h']:.2f}x / {bench['ratios']['promote_vs_raw_h2d']:.2f}x raw)"),
             (f"restore {r['bytes'] / 2**30:.2f} GiB host->device", f"best {r['best_ms']:.1f} ms, median {r['median_ms']:.1f} ms")]
    ratios = bench.get("ratios", {})
    for b in (2, 64):
        if f"demote_{b}MiB_vs_raw" in ratios:
            rows.append((f"{b} MiB blocks demote / promote vs raw",
                         f"{ratios[f'demote_{b}MiB_vs_raw']:.2f}x / {ratios[f'promote_{b}MiB_vs_raw']:.2f}x"))
    if "duplex_vs_one_direction" in ratios:
        rows.append(("duplex vs one direction", f"{ratios['duplex_vs_one_direction']:.2f}x (raw "
                     f"{ratios.get('raw_duplex_vs_one_direction', float('nan')):.2f}x)"))
    for name, c in (bench.get("client") or {}).items():
        rows.append((f"client {name} park / restore vs raw",
                     f"{ratios[f'client_{name}_park_vs_raw']:.2f}x / {ratios[f'client_{name}_restore_vs_raw']:.2f}x, "
                     f"bytes ok {c['bytes_ok']}, mapping pinned {c['client_mapping_pinned']}"))
    if "pinned_bytes" in bench:
        rows.append(("page-locked bytes", str(bench["pinned_bytes"])))
else:
    rows.append(("bench", f"rc {bench_rc}, no result (see gpu_bench.log)"))
rows.append(("verdict", f"{'OK' if ok else 'FAILED'}{' (CPU dry run)' if dry else ''} in {total_s}s"))
w = max(len(k) for k, _ in rows)
table = "\n".join(f"{k:<{w}}  {val}" for k, val in rows)
open(os.path.join(out, "gpu_check.txt"), "w").write(table + "\n")
print(table)
sys.exit(0 if ok else 1)
EOF
