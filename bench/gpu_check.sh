#!/usr/bin/env bash
# The prepared GPU check: the CUDA tests plus the GPU bench, in under 5 minutes on one GPU.
# Needs python3 with a CUDA build of torch. Missing packages come from .whl/ (see
# bench/gpu_wheels.sh); kvpark itself is installed from this checkout, offline.
# Results land in ${OUT:-bench/results}.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench/results}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/kvsite .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/kvsite${PYTHONPATH:+:$PYTHONPATH}
fi
python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir --target /tmp/kvpark-pkg . || exit 1
export PYTHONPATH=/tmp/kvpark-pkg:$PYTHONPATH
python3 -c "import torch; assert torch.cuda.is_available(), 'no CUDA'; print(torch.__version__, torch.cuda.get_device_name(0))" || exit 1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu_info.txt"
rc=0
timeout 180 python3 -m pytest -q -m cuda -p no:cacheprovider tests 2>&1 | tee "$OUT/gpu_tests.log" || rc=1
timeout 150 python3 bench/gpu_bench.py --json "$OUT/gpu.json" 2>&1 | tee "$OUT/gpu_bench.txt" || rc=1
exit $rc
