#!/usr/bin/env bash
# Download the wheels listed in bench/gpu_wheels.txt into .whl/ (git-ignored), for a
# GPU machine that cannot reach a package index (Python 3.12, x86-64).
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
grep -v '^#' bench/gpu_wheels.txt | grep . | while read -r req; do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl "$req"
done
ls -la .whl
