from __future__ import annotations

import pytest

from encoder_scheduler import EncoderBudget, EncoderScheduler, SchedulingPolicy
from tests.encoder_scheduler.helpers import WIDTH, encode_plan, item, request


def test_policy_parses_config_spellings() -> None:
    assert SchedulingPolicy("DEFAULT") is SchedulingPolicy.DEFAULT
    assert SchedulingPolicy("eager") is SchedulingPolicy.EAGER
    assert SchedulingPolicy(" Disabled ") is SchedulingPolicy.DISABLED
    with pytest.raises(ValueError, match="LAZY"):
        SchedulingPolicy("LAZY")


def test_default_starts_at_most_max_new_requests() -> None:
    sched = EncoderScheduler(EncoderBudget(8, 100, None), SchedulingPolicy.DEFAULT)
    for name in "abcde":
        sched.submit(request(name, [item(1), item(1)]))
    assert sched.schedule(max_new_requests=2).started == ("a", "b")
    # No consumer capacity: nothing new starts, but nothing is in progress either.
    assert sched.schedule(max_new_requests=0).started == ()
    assert sched.schedule(max_new_requests=None).started == ("c", "d", "e")


def test_default_with_no_capacity_still_continues_started_requests() -> None:
    sched = EncoderScheduler(EncoderBudget(1, 100, None), SchedulingPolicy.DEFAULT)
    sched.submit(request("a", [item(1), item(1)]))
    sched.submit(request("b", [item(1)]))
    encode_plan(sched, sched.schedule(max_new_requests=1))
    plan = sched.schedule(max_new_requests=0)
    assert list(plan) == [("a", 1)]
    assert sched.waiting_requests() == ("b",)


def test_eager_starts_ahead_of_consumer_capacity_within_budgets() -> None:
    row_bytes = WIDTH * 4
    sched = EncoderScheduler(EncoderBudget(3, 100, 5 * row_bytes), SchedulingPolicy.EAGER)
    for name in "abcd":
        sched.submit(request(name, [item(1, rows=2)]))
    plan = sched.schedule(max_new_requests=0)
    # Capacity is ignored; the resident budget (5 rows) still stops the third request.
    assert plan.started == ("a", "b")
    assert sched.resident_bytes == 4 * row_bytes
    encode_plan(sched, plan)
    for name in ("a", "b"):
        sched.take(name)
        sched.release(name)
    plan = sched.schedule(max_new_requests=0)
    assert plan.started == ("c", "d")


def test_eager_respects_item_and_token_budgets() -> None:
    sched = EncoderScheduler(EncoderBudget(2, 10, None), SchedulingPolicy.EAGER)
    for name in "abc":
        sched.submit(request(name, [item(4)]))
    plan = sched.schedule(max_new_requests=0)
    assert list(plan) == [("a", 0), ("b", 0)]
    assert plan.num_tokens == 8


def test_disabled_schedules_each_request_whole_without_budgets() -> None:
    row_bytes = WIDTH * 4
    sched = EncoderScheduler(EncoderBudget(1, 10, 2 * row_bytes), SchedulingPolicy.DISABLED)
    # Over every budget, yet admitted: DISABLED is the unprotected baseline.
    sched.submit(request("a", [item(50, rows=3), item(50, rows=3)]))
    sched.submit(request("b", [item(7, rows=1)]))
    sched.submit(request("c", [item(7, rows=1)]))
    plan = sched.schedule(max_new_requests=2)
    assert list(plan) == [("a", 0), ("a", 1), ("b", 0)]
    assert plan.token_budget is None
    assert plan.num_tokens == 107
    assert sched.resident_bytes == 7 * row_bytes
    assert sched.effective_max_num_tokens == 10
    encode_plan(sched, plan)
    assert sched.is_ready("a")
    assert sched.is_ready("b")
    assert list(sched.schedule()) == [("c", 0)]
