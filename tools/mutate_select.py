"""Run, for one mutant, only the fast tests that execute the mutated code (used by
tools/mutate.sh; cosmic-ray calls ``run`` as its test command).

Each mutant used to run the whole fast subset (about 2 minutes, far more on busy cores),
and every survivor paid all of it: 200 mutants did not fit a sitting. The baseline now
runs the subset once under coverage, with each test's node id as its coverage context,
and each mutant runs the tests whose context executed a mutated line.

The selection errs towards running more, never fewer:
- a mutated line outside any function body (module or class level, a default argument,
  a decorator) ran at import, once, for whichever test imported it first: it gets the
  whole subset;
- a line executed outside any test's context (at collection, in a child process, or by
  a background thread between tests) gets the whole subset;
- a line of a file the subset executes in part, but not this line: a child process
  killed by its test (``SIGKILL`` leaves no coverage data) may have run it, so the tests
  that start child processes (``_spawning()``: the subset files naming ``subprocess`` or
  the ``proc`` fixture) run;
- a file the subset never executes, or a line of it no test executes in a file no child
  process imports (``NEVER_IN_CHILDREN``), cannot change what it observes: the mutant
  survives without a run, and the output says so ("no fast test executes ...").

Primitives:
- ``SUBSET``: the fast tests, in the order they run.
- ``baseline OUT``: the subset under coverage (contexts per test) into ``OUT/.coverage``;
  fails as the subset fails.
- ``run``: find the mutated file and lines (against the pristine copy in ``.pristine/``),
  select, run; exit status as pytest's.
- the pytest plugin (``-p mutate_select``): switches the coverage context per test.
"""

from __future__ import annotations

import ast
import difflib
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterator

import pytest

SUBSET = [
    "tests/tiers", "tests/daemon/test_config.py", "tests/daemon/test_safety_net.py",
    "tests/daemon/test_regressions.py", "tests/daemon/test_disk_io_outside_locks.py",
    "tests/daemon/test_roundtrip.py", "tests/daemon/test_errors.py", "tests/daemon/test_spill.py",
    "tests/daemon/test_integrity_commit.py", "tests/daemon/test_attack_findings.py",
    "tests/daemon/test_remote_tombstones.py", "tests/daemon/test_tomb_attacks.py",
    "tests/client/test_bad_input.py", "tests/client/test_transport.py", "tests/client/test_cut_short.py",
    "tests/client/test_verify.py", "tests/security/test_private_memory.py", "tests/daemon/test_window_segments.py",
    # Added after the pass of 2026-12-02, whose survivors these files' modules held: the
    # client's deadlines, CLI and adapters, the device tier's CPU stand-in, metrics, the
    # data channel, eviction, flush and the security attacks. Selection by coverage keeps
    # a mutant's cost to the tests that run its lines; only the baseline grows.
    "tests/client/test_address.py", "tests/client/test_deadlines.py", "tests/client/test_cli.py",
    "tests/client/test_hf.py", "tests/client/test_paged.py", "tests/client/test_vllm_io.py",
    "tests/client/test_vllm_options.py", "tests/client/test_close_safety.py", "tests/client/test_compact.py",
    "tests/daemon/test_device_tier.py", "tests/daemon/test_metrics.py", "tests/daemon/test_datachannel.py",
    "tests/daemon/test_disk_eviction.py", "tests/daemon/test_flush.py", "tests/daemon/test_transfer_leases.py",
    "tests/daemon/test_remote_tier.py", "tests/daemon/test_tenants.py", "tests/daemon/test_arena_safety.py",
    "tests/security",
    # Added after the survivors of that pass were read one by one: the files whose tests
    # kill them (the CLI's frame and durations, prefix keys, windowed parks, restart
    # collection, TLS start-up refusals, crash images after an acknowledgment).
    "tests/client/test_keys.py", "tests/client/test_cli_units.py", "tests/daemon/test_mutation_gaps.py",
    "tests/daemon/test_large_seq.py", "tests/daemon/test_integrity_maintenance.py", "tests/daemon/test_tls.py",
    "tests/daemon/test_crash_after_ack.py", "tests/client/test_benchkit.py", "tests/client/test_bench_units.py",
    "tests/daemon/test_evict_delete_attacks.py", "tests/daemon/test_delete_race_attacks.py",
    "tests/daemon/test_refused_overwrite_attacks.py", "tests/daemon/test_revert_attacks.py",
    "tests/daemon/test_undo_failure_attacks.py", "tests/daemon/test_undo_hold_attacks.py",
    "tests/daemon/test_windowed_refusal_undo.py", "tests/daemon/test_evict_retry_race.py",
    "tests/daemon/test_pin_revert.py", "tests/daemon/test_retry_exception.py",
    "tests/daemon/test_close_waiter.py", "tests/daemon/test_drop_overlap.py",
    "tests/daemon/test_stop_flush_queued_delete.py", "tests/daemon/test_windowed_double_refusal.py",
    "tests/daemon/test_reader_overtakes_eviction.py", "tests/daemon/test_stop_waiter.py",
    "tests/daemon/test_drop_during_takeover.py", "tests/daemon/test_drop_during_fetch_takeover.py",
    "tests/daemon/test_fetch_takeover_attacks.py", "tests/daemon/test_absence_before_durable.py",
    "tests/daemon/test_drop_settles_older.py", "tests/daemon/test_atk14_settle_refused.py",
    "tests/daemon/test_atk14_unsettled_notfound.py", "tests/daemon/test_atk14_commit_orphans.py",
    "tests/daemon/test_atk14_claim_leak.py", "tests/daemon/test_atk15_rotten_settle.py",
    "tests/daemon/test_atk15_tombstone_window.py", "tests/daemon/test_atk16_overwrite_tombstone.py",
    "tests/daemon/test_atk16_ref_in_redis.py", "tests/daemon/test_atk17_redis_older_version.py",
    "tests/daemon/test_remote_only_stubs.py", "tests/daemon/test_atk18_unstub_before_tomb.py",
    "tests/daemon/test_atk18_gone_stub_retry.py", "tests/daemon/test_atk18_loose_tomb_stub.py",
    "tests/daemon/test_atk18_stub_pin.py", "tests/daemon/test_atk18_stub_replaced_by_other_daemon.py",
    "tests/daemon/test_atk17_pin_redis.py", "tests/daemon/test_atk17_reindexed_absent.py",
    # A retried park's compare (client/same.py): its TTL match survived the files above
    # (none retries a park with a TTL) though this file's tests kill it (2026-12-03).
    "tests/client/test_park_retry_attacks.py",
    # The write-back batch's bounds (daemon/dirty.py) and the per-id count of queued deletes
    # and the scope of a delete's refused undos (daemon/deletes.py): survivors of the
    # 2026-12-03 sample these files kill.
    "tests/daemon/test_dirty_bounds.py", "tests/daemon/test_queued_delete_counts.py", "tests/daemon/test_revert_scope.py",
    "tests/daemon/test_queued_delete_key_counts.py", "tests/daemon/test_pending_counts.py",
    "tests/daemon/test_busy_delete_counts.py",
    # Unix socket paths claimed before gRPC binds (daemon/sockets.py): the start-up
    # survivor at daemon/server.py:150 hid the bug these tests catch.
    "tests/daemon/test_unix_claim.py",
]
def _spawning() -> list[str]:
    """The subset's test files that start child processes (daemons, clients) and may kill
    them: those naming ``subprocess`` or the ``proc`` fixture."""
    files: list[str] = []
    for entry in SUBSET:
        for f in sorted(Path(entry).rglob("test_*.py")) if Path(entry).is_dir() else [Path(entry)]:
            text = f.read_text() if f.exists() else ""
            if "subprocess" in text or re.search(r"\bproc\b\s*[:(]", text):
                files.append(str(f))
    return files
# Client modules no child process of the subset's tests imports (the children are `kvpark serve` and
# a plain Client script): a line of these that the subset did not execute in-process is
# executed nowhere, and the files that start children need not run for it.
NEVER_IN_CHILDREN = {"client/bench.py", "client/benchkit.py", "client/cli.py", "client/hf.py", "client/paged.py",
                     "client/vllm.py", "client/vllm_io.py", "client/vllm_options.py", "client/amx.py"}
PACKAGES = ("daemon", "tiers", "client")
PYTEST = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "-p", "no:randomly", "--timeout", "90"]


# ---------------------------------------------------------------- the pytest plugin

@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: Any) -> Iterator[None]:
    import coverage

    cov = coverage.Coverage.current()
    if cov is not None:
        cov.switch_context(item.nodeid)
    yield
    if cov is not None:
        cov.switch_context("")  # between tests: whatever still runs selects the whole subset


# ---------------------------------------------------------------- baseline

def baseline(out: str) -> int:
    rc_file = Path(out) / ".coveragerc"
    rc_file.write_text("[run]\nbranch = false\nsource = daemon,tiers,client\npatch = subprocess\n"
                       f"data_file = {Path(out) / '.coverage'}\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")]))
    rc = subprocess.call([sys.executable, "-m", "coverage", "run", f"--rcfile={rc_file}", "-m",
                          *PYTEST[2:], "-p", "mutate_select", *SUBSET], env=env)
    # Child processes write their own data files (parallel mode): one file for all.
    return rc or subprocess.call([sys.executable, "-m", "coverage", "combine", "-q", f"--rcfile={rc_file}"])


# ---------------------------------------------------------------- one mutant

def _mutated() -> tuple[str, list[int]] | None:
    """(path, changed line numbers of the original) of the one file that differs."""
    for pkg in PACKAGES:
        for p in sorted(Path(pkg).rglob("*.py")):
            orig = Path(".pristine") / p
            if not orig.exists():
                continue
            a, b = orig.read_text().splitlines(), p.read_text().splitlines()
            if a == b:
                continue
            lines: list[int] = []
            for tag, i1, i2, _j1, _j2 in difflib.SequenceMatcher(None, a, b, autojunk=False).get_opcodes():
                if tag != "equal":
                    lines.extend(range(i1 + 1, max(i2, i1 + 1) + 1))
            return str(p), lines
    return None


def _in_function_body(source: str, lines: list[int]) -> bool:
    """Every line lies inside some function's body (not its signature or decorators)."""
    bodies: list[tuple[int, int]] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            body = node.body if isinstance(node.body, list) else [node.body]
            bodies.append((body[0].lineno, max(getattr(s, "end_lineno", s.lineno) or s.lineno for s in body)))
    return all(any(a <= n <= b for a, b in bodies) for n in lines)


def select(path: str, lines: list[int], data_file: str) -> list[str] | None:
    """The tests to run; ``None``: the whole subset; ``[]``: no test executes the lines."""
    if not _in_function_body(Path(".pristine", path).read_text(), lines):
        return None
    import coverage

    data = coverage.CoverageData(basename=data_file)
    data.read()
    # By the path inside the tree: the baseline may have run in another scratch copy.
    want = os.sep + os.path.normpath(path)
    measured = next((f for f in data.measured_files() if os.path.realpath(f).endswith(want)), None)
    if measured is None:
        return []
    by_line = data.contexts_by_lineno(measured)
    ctx: set[str] = set()
    for n in lines:
        ctx.update(by_line.get(n, []))
    if "" in ctx:
        return None
    if not ctx:
        return [] if path in NEVER_IN_CHILDREN else _spawning()
    return sorted(ctx, key=_order)


def _order(nodeid: str) -> tuple[int, str]:
    f = nodeid.split("::", 1)[0]
    return next((i for i, s in enumerate(SUBSET) if f == s or f.startswith(s + "/")), len(SUBSET)), nodeid


def run() -> int:
    found = _mutated()
    data_file = os.environ["MUTATE_COVERAGE"]
    if found is None:
        print("mutate_select: no mutated file found: the whole subset runs")
        tests: list[str] | None = None
    else:
        path, lines = found
        tests = select(path, lines, data_file)
        if tests == []:
            print(f"mutate_select: no fast test executes {path}:{','.join(map(str, lines))}")
            return 0
        what = ("the whole subset" if tests is None else
                "not run in-process: the test files that start child processes" if tests == _spawning() else
                f"{len(tests)} test(s)")
        print(f"mutate_select: {path}:{','.join(map(str, lines))}: {what}")
    sys.stdout.flush()
    return subprocess.call([*PYTEST, *(SUBSET if tests is None else tests)])


if __name__ == "__main__":
    cmd, *rest = sys.argv[1:]
    if cmd == "baseline":
        sys.exit(baseline(rest[0]))
    if cmd == "run":
        sys.exit(run())
    sys.exit(f"unknown command {cmd!r}: baseline OUT | run")
