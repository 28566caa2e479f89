#!/usr/bin/env bash
# A bounded mutation pass over daemon/, tiers/ and client/ (`make mutate`; not part of `make test`).
#
# cosmic-ray rewrites the source in place, one mutant at a time. It runs here in a scratch
# copy of the tree, imported through a `kvpark` package of symlinks ahead of the editable
# install, so an interrupted pass can never leave a mutant in the checkout.
# MUTATE_SAMPLE mutants (default 60) are drawn at random with MUTATE_SEED (default 17).
# MUTATE_JOBS=N (default 1) runs the sample as N shards in parallel, each in its own
# scratch copy with its own DB (under .mutate/shard-K), and reports them together; the
# baseline runs once (under .mutate/baseline) and every shard reuses it.
# MUTATE_RESUME=1 keeps a shard's DB where one exists: the mutants already judged are not
# run again, so a sample too big for one sitting runs in several.
# MUTATE_BASELINE=FILE reuses a baseline's coverage file (one of this same tree) instead of
# running the baseline; MUTATE_BASELINE_ONLY=1 runs the baseline and stops.
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
  if [ -z "${MUTATE_BASELINE:-}" ]; then
    MUTATE_JOBS=1 MUTATE_BASELINE_ONLY=1 MUTATE_OUT="$out/baseline" "$0"
    export MUTATE_BASELINE="$out/baseline/.coverage"
  fi
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

# The baseline: the unmutated tree must pass the fast tests, or every mutant looks killed.
# It runs under coverage, each test its own context: each mutant then runs only the tests
# that execute its lines (tools/mutate_select.py, which matches files by their path inside
# the tree, so a baseline taken in one scratch copy serves another).
if [ -n "${MUTATE_BASELINE:-}" ]; then
  [ -f "$MUTATE_BASELINE" ] || { echo "no baseline at $MUTATE_BASELINE" >&2; exit 1; }
  export MUTATE_COVERAGE="$MUTATE_BASELINE"
else
  start=$(date +%s)
  "$py" tools/mutate_select.py baseline "$out" > "$out/baseline.log" 2>&1 \
    || { echo "baseline failed: see $out/baseline.log" >&2; exit 1; }
  echo "baseline: $(( $(date +%s) - start )) s"
  export MUTATE_COVERAGE="$out/.coverage"
fi
[ "${MUTATE_BASELINE_ONLY:-0}" = 1 ] && exit 0

db="$out/session.sqlite"
if [ "${MUTATE_RESUME:-0}" = 1 ] && [ -f "$db" ]; then
  echo "resuming $db: the mutants it has judged are not run again"
else
  rm -f "$db"
  cosmic-ray init "$root/tools/mutate.toml" "$db"
  "$py" "$root/tools/mutate_sample.py" sample "$db" "$sample" "$seed" "$shard"
fi
start=$(date +%s)
cosmic-ray exec "$root/tools/mutate.toml" "$db"
echo "mutation pass: $(( $(date +%s) - start )) s for $sample mutants"
"$py" "$root/tools/mutate_sample.py" report "$db" | tee "$out/report.txt"
