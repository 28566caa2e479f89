"""Pure placement policy: no I/O. One contract suite runs over every registered policy."""

import random

import pytest

from kvpark.tiers import policy
from kvpark.tiers.policy import POLICIES, SeqMeta

NAMES = sorted(POLICIES)


def population(seed: int, n: int = 40) -> list[SeqMeta]:
    rng = random.Random(seed)
    return [
        SeqMeta(f"s{i}", rng.choice([1, 5, 10]), last_access=rng.random() * 100, priority=rng.choice([0, 0, 0, 1, 5]),
                access_count=rng.choice([0, 0, 1, 2, 7]), created_at=rng.random() * 50, promotions=rng.choice([0, 0, 1]))
        for i in range(n)
    ]


def test_all_four_policies_are_registered() -> None:
    assert {"lru", "lfu", "s3fifo", "arc"} <= set(NAMES)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("seed", range(5))
def test_contract_subset_minimal_and_deterministic(name: str, seed: int) -> None:
    cands = population(seed)
    used = sum(c.nbytes for c in cands)
    target = used // 2
    plan = policy.plan_demotion(name, cands, used, used, target)
    ids = {c.seq_id for c in cands}
    assert len(plan) == len(set(plan)) and set(plan) <= ids
    sizes = {c.seq_id: c.nbytes for c in cands}
    freed = sum(sizes[s] for s in plan)
    assert used - freed <= target  # enough
    assert used - (freed - sizes[plan[-1]]) > target  # and not one more than needed
    assert plan == policy.plan_demotion(name, list(reversed(cands)), used, used, target)


@pytest.mark.parametrize("name", NAMES)
def test_contract_full_order_and_priorities_last(name: str) -> None:
    cands = population(11)
    order = policy.demotion_order(name, cands)
    assert sorted(order) == sorted(c.seq_id for c in cands)
    prio = {c.seq_id: c.priority for c in cands}
    seen = [prio[s] for s in order]
    assert seen == sorted(seen), "a higher priority must never be demoted before a lower one"


@pytest.mark.parametrize("name", NAMES)
def test_contract_nothing_when_under_target_or_no_candidates(name: str) -> None:
    assert policy.plan_demotion(name, population(3), used=10, capacity=100, target=20) == []
    assert policy.plan_demotion(name, [], used=100, capacity=100, target=0) == []


def test_lru_order() -> None:
    c = [SeqMeta("a", 10, 3.0), SeqMeta("b", 10, 1.0), SeqMeta("c", 10, 2.0), SeqMeta("d", 10, 0.5, priority=5)]
    assert policy.plan_demotion("lru", c, used=40, capacity=40, target=20) == ["b", "c"]
    assert policy.plan_demotion("lru", c, used=40, capacity=40, target=0) == ["b", "c", "a", "d"]
    assert policy.demotion_order("lru", c) == ["b", "c", "a", "d"]


def test_lfu_prefers_the_rarely_used() -> None:
    c = [SeqMeta("hot", 1, 1.0, access_count=9), SeqMeta("cold", 1, 5.0, access_count=0)]
    assert policy.plan_demotion("lfu", c, 2, 2, 1) == ["cold"]


def test_s3fifo_drops_one_hit_wonders_first() -> None:
    c = [SeqMeta("old-reused", 1, 1.0, access_count=3, created_at=0.0),
         SeqMeta("new-unused", 1, 9.0, access_count=0, created_at=5.0)]
    assert policy.plan_demotion("s3fifo", c, 2, 2, 1) == ["new-unused"]


def test_arc_adapts_to_ghost_hits() -> None:
    recent = [SeqMeta(f"r{i}", 1, float(i), access_count=1, promotions=3) for i in range(4)]
    frequent = [SeqMeta(f"f{i}", 1, float(i), access_count=5) for i in range(4)]
    # Recency entries keep coming back from disk: ARC keeps more of them and demotes frequency entries first.
    first = policy.plan_demotion("arc", recent + frequent, 8, 8, 6)
    assert all(s.startswith("f") for s in first)


def test_watermarks() -> None:
    assert not policy.over_high(90, 100, 0.9)
    assert policy.over_high(91, 100, 0.9)
    assert policy.background_target(100, 0.8) == 80


def test_unknown_policy_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="known: arc, lfu, lru, s3fifo"):
        policy.plan_demotion("nope", population(1), 1, 1, 0)


def test_arc_with_even_ghost_hits_splits_evenly() -> None:
    """ARC's target share of the recency list is (g1 + 1) / (g1 + g2 + 2): ghost hits on
    both lists in equal numbers mean an even split. The recency list holding 60% is over
    its half, so a recency entry is demoted first; holding 40%, a frequency entry is."""
    def cands(recent: int, frequent: int) -> list[SeqMeta]:
        r = [SeqMeta(f"r{i}", 1, float(i), access_count=1, promotions=int(i == 0)) for i in range(recent)]
        f = [SeqMeta(f"f{i}", 1, float(i), access_count=5, promotions=int(i == 0)) for i in range(frequent)]
        return r + f

    assert policy.demotion_order("arc", cands(3, 2))[0].startswith("r")
    assert policy.demotion_order("arc", cands(2, 3))[0].startswith("f")


@pytest.mark.parametrize("name", NAMES)
def test_every_policy_orders_a_tier_of_thousands_whole(name: str) -> None:
    """A real tier holds thousands of sequences: every policy orders each candidate exactly
    once, however many there are (ARC's two lists each longer than 256 included)."""
    cands = population(11, 1500)
    order = policy.demotion_order(name, cands)
    assert sorted(order) == sorted(m.seq_id for m in cands)
