"""The fair queue's order and its tenant states, on the queue alone (the budgets' behaviour with it, on both
backends, is in redis/test_fairness.py)."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.budget.fair_queue import INTERACTIVE, FairQueue, TenantState, Waiter, finishes_first
from gateway.tenants import Tenant


def queue(**options: float) -> FairQueue:
    return FairQueue(max_tenants=int(options.pop("max_tenants", 100)), window_s=options.pop("window_s", 60.0))


def tenant(name: str, label: str = "other", weight: float = 1.0) -> Tenant:
    return Tenant(name, label, weight)


def push(fair: FairQueue, state: TenantState, nbytes: int) -> Waiter:
    return fair.push(nbytes, asyncio.get_running_loop().create_future(), state, INTERACTIVE)


def grant_next(fair: FairQueue) -> Waiter:
    head = fair.next()
    assert head is not None
    fair.granted(head)
    head.state.waiting -= 1
    head.state.in_use += head.nbytes
    return head


async def test_a_new_tenant_starts_at_its_class_clock_and_a_small_request_finishes_first() -> None:
    fair = queue()
    strangers = [fair.add(tenant(f"s{i}"), None, 0.0) for i in range(6)]
    for state in strangers:
        push(fair, state, 100)
    for _ in range(3):
        grant_next(fair)
    clock = strangers[0].cls.vtime[INTERACTIVE]
    assert clock > 0
    honest = push(fair, fair.add(tenant("honest"), None, 0.0), 5)
    assert honest.start == clock
    # The strangers still waiting started earlier, but their 100 bytes finish after the honest tenant's 5.
    assert all(state.queues and state.queues[0][0].start < honest.start for state in strangers[3:])
    assert fair.next() is honest


@settings(max_examples=100, deadline=None)
@given(sizes=st.lists(st.tuples(st.integers(0, 7), st.integers(1, 50)), min_size=1, max_size=40))
def test_the_clocks_never_go_back_and_a_tenant_never_starts_before_its_class_clock(
    sizes: list[tuple[int, int]],
) -> None:
    async def run() -> None:
        fair = queue()
        states = [fair.add(tenant(f"t{i}", "ab"[i % 2], 1.0 + i % 3), None, 0.0) for i in range(8)]
        last_clock, last_vtime = 0.0, {"a": 0.0, "b": 0.0}
        for step, (who, nbytes) in enumerate(sizes):
            state = states[who]
            waiter = push(fair, state, nbytes)
            if state.queues is not None and state.queues[0][0] is waiter:
                assert waiter.start >= state.cls.vtime[INTERACTIVE]
            if step % 2:
                grant_next(fair)
            assert fair._clock[INTERACTIVE] >= last_clock
            last_clock = fair._clock[INTERACTIVE]
            for cls in {state.cls for state in states}:
                assert cls.vtime[INTERACTIVE] >= last_vtime[cls.label]
                last_vtime[cls.label] = cls.vtime[INTERACTIVE]
        while fair.next() is not None:
            grant_next(fair)
        assert not fair._waiting[INTERACTIVE]

    asyncio.run(run())


async def test_states_of_tenants_that_hold_or_wait_are_never_forgotten_at_the_cap() -> None:
    fair = queue(max_tenants=2)
    busy = []
    for i in range(4):
        busy.append(fair.add(tenant(f"b{i}"), None, float(i)))
        busy[-1].in_use = 10
    assert set(fair.tenants) == {"b0", "b1", "b2", "b3"}
    assert fair.evictions == 0
    busy[0].in_use = 0  # idle, and no lead: the next state made sweeps it
    fair.add(tenant("new"), None, 5.0)
    assert "b0" not in fair.tenants
    assert fair.evictions == 0


async def test_at_the_cap_the_least_recently_active_idle_state_is_evicted() -> None:
    fair = queue(max_tenants=3)
    states = []
    for i in range(3):
        states.append(fair.add(tenant(f"t{i}"), None, float(i)))
        states[-1].finish[INTERACTIVE] = 1.0  # it leads its class's clock: kept while idle
    fair.touch(states[0], 3.0)  # t0 active again: t1 is now the least recently active
    fair.add(tenant("t3"), None, 4.0)
    assert list(fair.tenants) == ["t2", "t0", "t3"]
    assert fair.evictions == 1


@pytest.mark.parametrize("hold_s", [46.50074310803563, 83.17353363415837])
def test_finishes_equal_but_for_rounding_are_a_tie_that_goes_to_the_earlier_arrival(hold_s: float) -> None:
    """Three grants of a weight-3 class cost what one of a weight-1 class does; summed, a measured hold makes them
    1 ulp over (the first hold) or under (the second) the single cost, which ordered the grants by rounding."""
    third = 10 * hold_s / 3
    summed, whole = third + third + third, 10 * hold_s
    assert summed != whole
    assert finishes_first(whole, 2, summed, 5)
    assert not finishes_first(summed, 5, whole, 2)
    assert finishes_first(summed, 1, whole, 2)
    assert finishes_first(whole * 0.999, 9, whole, 2)
    assert not finishes_first(whole, 2, whole * 0.999, 9)
