"""Pure placement policy: no I/O, just decisions over metadata."""

import pytest

from kvpark.tiers import policy
from kvpark.tiers.policy import SeqMeta


def seqs() -> list[SeqMeta]:
    return [
        SeqMeta("a", 10, last_access=3.0),
        SeqMeta("b", 10, last_access=1.0),
        SeqMeta("c", 10, last_access=2.0),
        SeqMeta("d", 10, last_access=0.5, priority=5),
    ]


def test_lru_order_until_target() -> None:
    assert policy.plan_demotion("lru", seqs(), used=40, capacity=40, target=20) == ["b", "c"]


def test_higher_priority_goes_last_even_if_oldest() -> None:
    assert policy.plan_demotion("lru", seqs(), used=40, capacity=40, target=0) == ["b", "c", "a", "d"]


def test_nothing_when_under_target() -> None:
    assert policy.plan_demotion("lru", seqs(), used=15, capacity=40, target=20) == []


def test_watermarks() -> None:
    assert not policy.over_high(90, 100, 0.9)
    assert policy.over_high(91, 100, 0.9)
    assert policy.background_target(100, 0.8) == 80
    assert policy.room_target(100, 30) == 70


def test_not_enough_candidates_returns_all_of_them() -> None:
    assert policy.plan_demotion("lru", seqs()[:2], used=100, capacity=100, target=0) == ["b", "a"]


def test_unknown_policy_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="known: lru"):
        policy.plan_demotion("nope", seqs(), 1, 1, 0)
