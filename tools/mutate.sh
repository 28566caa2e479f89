#!/usr/bin/env bash
# A bounded mutation pass over daemon/, tiers/ and client/ (`make mutate`; not part of `make test`).
#
# cosmic-ray rewrites the source in place, one mutant at a time. It runs here in a scratch
# copy of the tree, imported through a `kvpark` package of symlinks ahead of the editable
# install, so an interrupted pass can never leave a mutant in the checkout.
# MUTATE_SAMPLE mutants (default 60) are drawn at random with MUTATE_SEED (default 17).
# MUTATE_JOBS=N (default 1) runs the sample as N shards in parallel, each in its own
# scratch copy with its own DB (under .mutate/shard-K), and reports them together.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
py="$root/.venv/bin/python"
sample=${MUTATE_SAMPLE:-60}
seed=${MUTATE_SEED:-17}
out=${MUTATE_OUT:-$root/.mutate}
jobs=${MUTATE_JOBS:-1}
shard=${MUTATE_SHARD:-0/1}

if [ "$jobs" -gt 1 ]; then
  mkdir -p "$out"
  pids=()
  for k in $(seq 0 $((jobs - 1))); do
    MUTATE_JOBS=1 MUTATE_SHARD="$k/$jobs" MUTATE_OUT="$out/shard-$k" "$0" > "$out/shard-$k.log" 2>&1 &
    pids+=($!)
  done
  status=0
  for p in "${pids[@]}"; do wait "$p" || status=1; done
  dbs=()
  for k in $(seq 0 $((jobs - 1))); do dbs+=("$out/shard-$k/session.sqlite"); done
  "$py" "$root/tools/mutate_sample.py" report "${dbs[@]}" | tee "$out/report.txt"
  exit $status
fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

mkdir -p "$out" "$work/_import/kvpark"
cp -r "$root/daemon" "$root/tiers" "$root/proto" "$root/client" "$root/tests" "$root/docs" "$root/deploy" "$root/examples" \
  "$root/tools" "$root/pyproject.toml" "$root/README.md" "$work/"
find "$work" -name __pycache__ -prune -exec rm -rf {} +
# The pristine sources: tools/mutate_select.py finds each mutant's file and lines by them.
mkdir -p "$work/.pristine" && cp -r "$work/daemon" "$work/tiers" "$work/client" "$work/.pristine/"
for pkg in proto daemon client tiers; do ln -s "$work/$pkg" "$work/_import/kvpark/$pkg"; done
cd "$work"
export PYTHONPATH="$work/_import" PATH="$root/.venv/bin:$PATH"
"$py" -c "import kvpark.daemon.engine as e, sys; sys.exit(0 if e.__file__.startswith('$work') else 'kvpark is not imported from the scratch copy: ' + e.__file__)"

db="$out/session.sqlite"
rm -f "$db"
cosmic-ray init "$root/tools/mutate.toml" "$db"
"$py" "$root/tools/mutate_sample.py" sample "$db" "$sample" "$seed" "$shard"
# The baseline: the unmutated tree must pass the fast tests, or every mutant looks killed.
# It runs under coverage, each test its own context: each mutant then runs only the tests
# that execute its lines (tools/mutate_select.py).
"$py" tools/mutate_select.py baseline "$out" > "$out/baseline.log" 2>&1 \
  || { echo "baseline failed: see $out/baseline.log" >&2; exit 1; }
export MUTATE_COVERAGE="$out/.coverage"
start=$(date +%s)
cosmic-ray exec "$root/tools/mutate.toml" "$db"
echo "mutation pass: $(( $(date +%s) - start )) s for $sample mutants"
"$py" "$root/tools/mutate_sample.py" report "$db" | tee "$out/report.txt"
