#!/usr/bin/env bash
# The package as a user gets it: build an sdist and a wheel, install the wheel into a
# fresh venv (with the CPU torch wheel), and run `kvpark --version`, `kvpark serve` and a
# park/restore from outside the checkout. The sdist must build a wheel too. The build
# must print no warning. `make test` runs this last (`make wheel-check` alone).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
py="$root/.venv/bin/python"
work=$(mktemp -d)
serve_pid=""
cleanup() { [ -n "$serve_pid" ] && kill "$serve_pid" 2>/dev/null; rm -rf "$work"; }
trap cleanup EXIT
fail() { echo "wheel-check: FAILED: $*" >&2; exit 1; }

echo "== wheel-check: building the sdist and the wheel"
# What pyproject's [build-system] asks for, in the venv the build runs in (no isolation).
"$py" -m pip install -q "setuptools>=69" "build>=1.2" > "$work/pip.log" 2>&1 \
  || { tail -n 20 "$work/pip.log"; fail "installing setuptools and build failed"; }
# No isolation: the venv's setuptools builds it, offline, as the editable install did.
rm -rf "$root/build"  # setuptools' scratch folder: a stale one could carry removed files
"$py" -m build --no-isolation --outdir "$work/dist" "$root" > "$work/build.log" 2>&1 \
  || { tail -n 30 "$work/build.log"; fail "python -m build failed"; }
# (Not counted: pip's notes on absent local index folders, and the byte-compiling note
# that PYTHONDONTWRITEBYTECODE=1 causes: the environment's, not the package's.)
quiet='is ignored: it is neither a file nor a directory|byte-compiling is disabled'
if grep -i -E "warning" "$work/build.log" | grep -v -i -E "$quiet" | grep -q .; then
  grep -i -B2 -A6 "warning" "$work/build.log" | grep -v -i -E "$quiet" | head -n 40
  fail "the build printed warnings (above)"
fi
whl=$(ls "$work"/dist/kvpark-*.whl) && sdist=$(ls "$work"/dist/kvpark-*.tar.gz) || fail "no wheel or sdist in dist/"

echo "== wheel-check: installing $(basename "$whl") into a fresh venv"
"$py" -m venv "$work/venv"
"$work/venv/bin/pip" install -q --upgrade pip > /dev/null 2>&1 || true
"$work/venv/bin/pip" install -q torch==2.13.0 "$whl" > "$work/install.log" 2>&1 \
  || { tail -n 20 "$work/install.log"; fail "installing the wheel failed"; }
# The sdist builds a wheel of its own (what pip does with it where no wheel fits).
"$work/venv/bin/pip" wheel -q --no-deps --no-build-isolation -w "$work/from-sdist" "$sdist" > "$work/sdist.log" 2>&1 \
  || "$work/venv/bin/pip" wheel -q --no-deps -w "$work/from-sdist" "$sdist" >> "$work/sdist.log" 2>&1 \
  || { tail -n 20 "$work/sdist.log"; fail "the sdist does not build"; }

cd "$work"  # away from the checkout: only the installed package can be imported
ver=$("$work/venv/bin/kvpark" --version) || fail "kvpark --version failed"
echo "   $ver"
mkdir -p "$work/shm"
"$work/venv/bin/kvpark" serve --listen 127.0.0.1:0 --data-dir "$work/disk" --set metrics.listen= \
  --set tiers.host.capacity=64MiB --set "tiers.host.shm_dir=$work/shm" 2> "$work/serve.log" &
serve_pid=$!
for _ in $(seq 1 300); do
  addr=$(sed -n 's/.*kvpark listening on \(.*\)$/\1/p' "$work/serve.log" | head -n 1)
  [ -n "$addr" ] && break
  kill -0 "$serve_pid" 2>/dev/null || { cat "$work/serve.log"; fail "kvpark serve exited"; }
  sleep 0.2
done
[ -n "$addr" ] || { cat "$work/serve.log"; fail "kvpark serve did not start listening"; }
"$work/venv/bin/python" - "$addr" <<'PY' || fail "park/restore against the installed daemon failed"
import sys

import torch

import kvpark.client as kc
assert "/venv/" in kc.__file__, kc.__file__  # the installed package, not the checkout
with kc.Client(sys.argv[1]) as c:
    t = torch.arange(4096, dtype=torch.float32)
    c.park("wheel-check", [t])
    (back,) = c.restore("wheel-check")
    assert torch.equal(back, t)
print("   park/restore through the installed wheel: ok")
PY
"$work/venv/bin/kvpark" health --address "$addr" > /dev/null || fail "kvpark health failed"
echo "== wheel-check: ok"
