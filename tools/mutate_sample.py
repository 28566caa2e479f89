"""Bound and score a cosmic-ray session (used by tools/mutate.sh).

Primitives:
- ``sample DB N SEED``: keep N mutants drawn at random (seeded) and delete the rest,
  so a pass fits its time budget; a survival rate over a uniform sample estimates the
  whole population's. Mutants that cannot change what a test may observe are taken out
  of the population first (``inert``): those inside a type annotation (never evaluated
  under ``from __future__ import annotations``) and those inside a logging call's
  arguments (a log line's text or figures). Each costs a whole run of the fast tests to
  survive, and the earlier pass found a tenth of its sample to be annotations alone.
  The draw is over the mutants in source order, so one seed draws the same sample from
  the same tree (cosmic-ray's job ids are random).
- ``sample DB N SEED K/M``: the same sample, then only its K-th of M shards (every M-th
  mutant from the K-th, K counted from 0): M passes, each in its own scratch copy with
  its own DB, run the sample in parallel.
- ``report DB...``: the score over one or more DBs (the shards of one sample) (killed / (killed + survived)), per module, and each
  surviving mutant's diff: the list of bugs the fast tests would let through.
"""

from __future__ import annotations

import ast
import random
import sqlite3
import sys
from collections import Counter

from cosmic_ray.work_db import WorkDB, use_db
from cosmic_ray.work_item import TestOutcome


_LOG_CALLS = {"debug", "info", "warning", "error", "exception", "critical"}
_LOGGERS = {"log", "logger", "logging"}


def inert_spans(source: str) -> list[tuple[tuple[int, int], tuple[int, int]]]:
    """(start, end) of each annotation and each logging call's arguments in ``source``."""
    spans: list[ast.AST] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.arg) and node.annotation is not None:
            spans.append(node.annotation)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.returns is not None:
            spans.append(node.returns)
        elif isinstance(node, ast.AnnAssign):
            spans.append(node.annotation)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in _LOG_CALLS \
                and isinstance(node.func.value, ast.Name) and node.func.value.id in _LOGGERS:
            spans.extend([*node.args, *(k.value for k in node.keywords)])
    return [((s.lineno, s.col_offset), (s.end_lineno or s.lineno, s.end_col_offset or 0)) for s in spans]


def sample(db: str, n: int, seed: int, shard: str = "0/1") -> None:
    con = sqlite3.connect(db)
    rows = sorted(con.execute("SELECT module_path, start_pos_row, start_pos_col, operator_name, occurrence, job_id "
                              "FROM mutation_specs"))
    spans: dict[str, list[tuple[tuple[int, int], tuple[int, int]]]] = {}
    live, inert = [], []
    for module, row, col, _op, _occ, job in rows:
        if module not in spans:
            with open(module, encoding="utf-8") as fh:
                spans[module] = inert_spans(fh.read())
        at = (row, col)
        (inert if any(a <= at < b for a, b in spans[module]) else live).append(job)
    k, m = (int(x) for x in shard.split("/"))
    drawn = random.Random(seed).sample(live, min(n, len(live)))
    keep = set(drawn[k::m])
    drop = [(r[5],) for r in rows if r[5] not in keep]
    with con:
        con.executemany("DELETE FROM mutation_specs WHERE job_id = ?", drop)
        con.executemany("DELETE FROM work_results WHERE job_id = ?", drop)
        con.executemany("DELETE FROM work_items WHERE job_id = ?", drop)
    con.close()
    print(f"mutants: {len(rows)} in all, {len(inert)} inert (annotations, log calls) left out; "
          f"{len(drawn)} of the other {len(live)} sampled (seed {seed}); shard {shard}: {len(keep)}")


def report(dbs: list[str]) -> None:
    done, pending = [], 0
    for db in dbs:
        with use_db(db, WorkDB.Mode.open) as wdb:
            done.extend(wdb.completed_work_items)
            pending += len(wdb.pending_work_items)
    per: dict[str, Counter[str]] = {}
    survivors = []
    for item, result in done:
        outcome = (result.test_outcome or result.worker_outcome).value
        module = str(item.mutations[0].module_path)
        per.setdefault(module, Counter())[outcome] += 1
        if result.test_outcome == TestOutcome.SURVIVED:
            survivors.append((item, result))
    total = Counter[str]()
    for c in per.values():
        total.update(c)
    killed, survived = total[TestOutcome.KILLED.value], total[TestOutcome.SURVIVED.value]
    print(f"{'module':32} killed survived incompetent")
    for module in sorted(per):
        c = per[module]
        print(f"{module:32} {c['killed']:6} {c['survived']:8} {c['incompetent']:11}")
    judged = killed + survived
    score = 100.0 * killed / judged if judged else 0.0
    print(f"score: {killed}/{judged} killed = {score:.1f}% "
          f"({total['incompetent']} incompetent, {pending} not run)")
    for item, result in sorted(survivors, key=lambda ir: (str(ir[0].mutations[0].module_path),
                                                         ir[0].mutations[0].start_pos[0])):
        m = item.mutations[0]
        ran = (result.output or "").splitlines()[:1]  # tools/mutate_select.py: which tests judged it
        print(f"\nSURVIVED {m.module_path}:{m.start_pos[0]} {m.operator_name}"
              f"{' | ' + ran[0].removeprefix('mutate_select: ') if ran else ''}\n{result.diff or ''}")


if __name__ == "__main__":
    cmd, db, *rest = sys.argv[1:]
    if cmd == "sample":
        sample(db, int(rest[0]), int(rest[1]), *rest[2:3])
    elif cmd == "report":
        report([db, *rest])
    else:
        sys.exit(f"unknown command {cmd!r}: sample DB N SEED [K/M] | report DB...")
