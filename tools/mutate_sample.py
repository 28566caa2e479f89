"""Bound and score a cosmic-ray session (used by tools/mutate.sh).

Primitives:
- ``sample DB N SEED``: keep N mutants drawn at random (seeded) and delete the rest,
  so a pass fits its time budget; a survival rate over a uniform sample estimates the
  whole population's.
- ``report DB``: the score (killed / (killed + survived)), per module, and each
  surviving mutant's diff: the list of bugs the fast tests would let through.
"""

from __future__ import annotations

import random
import sqlite3
import sys
from collections import Counter

from cosmic_ray.work_db import WorkDB, use_db
from cosmic_ray.work_item import TestOutcome


def sample(db: str, n: int, seed: int) -> None:
    con = sqlite3.connect(db)
    ids = sorted(r[0] for r in con.execute("SELECT job_id FROM work_items"))
    keep = set(random.Random(seed).sample(ids, min(n, len(ids))))
    drop = [(i,) for i in ids if i not in keep]
    with con:
        con.executemany("DELETE FROM mutation_specs WHERE job_id = ?", drop)
        con.executemany("DELETE FROM work_results WHERE job_id = ?", drop)
        con.executemany("DELETE FROM work_items WHERE job_id = ?", drop)
    con.close()
    print(f"mutants: {len(ids)} in all; {len(keep)} sampled (seed {seed})")


def report(db: str) -> None:
    with use_db(db, WorkDB.Mode.open) as wdb:
        done = wdb.completed_work_items
        pending = len(wdb.pending_work_items)
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
    for item, result in survivors:
        m = item.mutations[0]
        print(f"\nSURVIVED {m.module_path}:{m.start_pos[0]} {m.operator_name}\n{result.diff or ''}")


if __name__ == "__main__":
    cmd, db, *rest = sys.argv[1:]
    if cmd == "sample":
        sample(db, int(rest[0]), int(rest[1]))
    elif cmd == "report":
        report(db)
    else:
        sys.exit(f"unknown command {cmd!r}: sample DB N SEED | report DB")
