"""Random request streams, budgets and policies driven through the scheduler with a fake encoder.

Every iteration checks the scheduler's invariants (budgets never passed, FCFS, atomic items); see `drive`.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from encoder_scheduler import (
    AdmissionError,
    EncoderBudget,
    EncoderCache,
    EncoderItem,
    EncoderRequest,
    EncoderScheduler,
    SchedulingPolicy,
)
from tests.encoder_scheduler.helpers import fake_output

BITS = {torch.float32: torch.int32, torch.bfloat16: torch.int16}


@dataclass
class Scenario:
    policy: SchedulingPolicy
    budget: EncoderBudget
    cache_bytes: int | None
    arrivals: list[tuple[int, EncoderRequest, int | None]]  # (iteration, request, cancel at iteration)
    capacities: list[int | None]  # max_new_requests, cycled over iterations
    hold: int  # iterations the consumer keeps a taken buffer before releasing it


@st.composite
def scenarios(draw: st.DrawFn) -> Scenario:
    dtype = draw(st.sampled_from([torch.float32, torch.bfloat16]))
    width = draw(st.integers(1, 3))
    items = st.builds(
        EncoderItem,
        modality=st.sampled_from(["image", "video"]),
        num_tokens=st.integers(1, 48),
        num_embeddings=st.integers(1, 4),
        content_hash=st.none() | st.sampled_from("abc"),
    )
    arrivals = []
    for n in range(draw(st.integers(1, 10))):
        request = EncoderRequest(
            request_id=f"r{n}",
            embedding_width=width,
            dtype=dtype,
            items=draw(st.lists(items, min_size=1, max_size=5)),
            processor_key=draw(st.sampled_from(["", "max_pixels=64"])),
        )
        cancel_at = draw(st.none() | st.none() | st.integers(0, 15))
        arrivals.append((draw(st.integers(0, 5)), request, cancel_at))
    arrivals.sort(key=lambda arrival: arrival[0])
    row_bytes = width * dtype.itemsize
    largest = max(request.footprint_bytes for _, request, _ in arrivals)
    budget = EncoderBudget(
        max_num_items=draw(st.integers(1, 4)),
        max_num_tokens=draw(st.integers(4, 32)),
        max_resident_bytes=draw(st.none() | st.integers(max(row_bytes, largest // 2), 2 * largest)),
    )
    return Scenario(
        policy=draw(st.sampled_from(list(SchedulingPolicy))),
        budget=budget,
        cache_bytes=draw(st.none() | st.just(1 << 20) | st.integers(0, 16 * row_bytes)),
        arrivals=arrivals,
        capacities=draw(st.lists(st.none() | st.integers(1, 3), min_size=1, max_size=4)),
        hold=draw(st.integers(0, 2)),
    )


def bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().view(BITS[tensor.dtype])


def drive(scenario: Scenario) -> None:
    event(f"policy {scenario.policy}")
    budget = scenario.budget
    cache = EncoderCache(scenario.cache_bytes) if scenario.cache_bytes is not None else None
    sched = EncoderScheduler(budget, scenario.policy, cache)
    budgeted = scenario.policy is not SchedulingPolicy.DISABLED
    limit = budget.max_resident_bytes if budgeted else None

    admitted: dict[str, EncoderRequest] = {}
    queue: list[str] = []  # the model of the FCFS queue
    start_position: dict[str, int] = {}
    next_item: dict[str, int] = {}
    charged: dict[str, int] = {}
    release_at: dict[str, int] = {}
    finished: set[str] = set()
    cancelled: set[str] = set()
    keyed_selected = 0

    last_arrival = scenario.arrivals[-1][0]
    total_items = sum(request.num_items for _, request, _ in scenario.arrivals)
    # Each iteration moves at least one item, except while bytes wait for a held buffer to be released.
    bound = last_arrival + (total_items + 2) * (scenario.hold + 2) + 2

    for iteration in range(bound):
        for arrival, request, _ in scenario.arrivals:
            if arrival != iteration:
                continue
            if limit is not None and request.footprint_bytes > limit:
                with pytest.raises(AdmissionError) as refused:
                    sched.submit(request)
                assert refused.value.knob == "encoder.max_resident_bytes"
                assert (refused.value.required, refused.value.limit) == (request.footprint_bytes, limit)
                event("admission refused")
                continue
            sched.submit(request)
            admitted[request.request_id] = request
            queue.append(request.request_id)
            next_item[request.request_id] = 0

        for _, request, cancel_at in scenario.arrivals:
            request_id = request.request_id
            if cancel_at == iteration and request_id in admitted and request_id not in cancelled:
                was_live = request_id in sched
                freed = sched.release(request_id)
                assert freed == charged.pop(request_id, 0)
                assert (request_id in sched) is False
                if was_live:
                    event("cancelled a live request")
                    cancelled.add(request_id)
                    release_at.pop(request_id, None)
                    if request_id in queue:
                        queue.remove(request_id)
        for request_id, when in list(release_at.items()):
            if when <= iteration:
                assert sched.release(request_id) == charged.pop(request_id)
                del release_at[request_id]
        assert sched.resident_bytes == sum(charged.values())

        active = [
            request_id
            for request_id in sorted(start_position, key=start_position.__getitem__)
            if request_id not in cancelled and next_item[request_id] < admitted[request_id].num_items
        ]
        capacity = scenario.capacities[iteration % len(scenario.capacities)]
        plan = sched.schedule(max_new_requests=capacity)

        # FCFS: the requests that start are exactly the head of the queue, in order.
        started = list(plan.started)
        assert started == queue[: len(started)]
        del queue[: len(started)]
        if scenario.policy is SchedulingPolicy.DEFAULT and capacity is not None:
            assert len(started) <= capacity
        for request_id in started:
            start_position[request_id] = len(start_position)
            charged[request_id] = admitted[request_id].footprint_bytes

        # Budgets: items and tokens per iteration (one oversized item may run alone), resident bytes.
        costs = [admitted[request_id].item_tokens[index] for request_id, index in plan]
        assert plan.num_tokens == sum(costs)
        if budgeted:
            assert len(plan) <= budget.max_num_items
            if plan.num_tokens > budget.max_num_tokens:
                assert len(costs) == 1
                assert costs[0] > budget.max_num_tokens
                assert plan.token_budget == costs[0]
                event("oversized item ran alone")
        if limit is not None:
            assert sched.resident_bytes <= limit
        assert sched.resident_bytes == sum(charged.values())

        # Order: started requests first in start order; every request's items in prompt order, none skipped.
        positions = [start_position[request_id] for request_id, _ in plan]
        assert positions == sorted(positions)
        selected: dict[str, list[int]] = defaultdict(list)
        for request_id, index in [*plan, *plan.cache_hits]:
            selected[request_id].append(index)
        for request_id, indices in selected.items():
            first = next_item[request_id]
            assert sorted(indices) == list(range(first, first + len(indices)))
            next_item[request_id] += len(indices)
        for request_id in plan.runs:
            assert request_id[0] in selected
        if budgeted and active:
            # A started request never waits: the oldest one always moves.
            assert active[0] in selected
        if not budgeted:
            for request_id in started:
                assert next_item[request_id] == admitted[request_id].num_items

        # Cache: each keyed item is looked up exactly once, when selected; unkeyed items never.
        if plan.cache_hits:
            event("cache hit")
        if queue and limit is not None and sched.resident_bytes + admitted[queue[0]].footprint_bytes > limit:
            event("head waits for bytes")
        if cache is None:
            assert plan.cache_hits == ()
        else:
            keyed_selected += sum(
                1
                for request_id, index in [*plan, *plan.cache_hits]
                if admitted[request_id].cache_keys is not None and admitted[request_id].cache_keys[index] is not None  # type: ignore[index]
            )
        assert sched.cache_hits + sched.cache_misses == keyed_selected
        assert set(plan.cache_hits).isdisjoint(plan.work)

        # The fake encoder, then the hand-off: every row range holds the encoder's output for that item.
        for request_id, index in plan:
            sched.record(request_id, index, fake_output(admitted[request_id], index))
        for request_id in plan.ready:
            assert sched.is_ready(request_id)
        for request_id in sched.ready_requests():
            buffer, offsets = sched.take(request_id)
            request = admitted[request_id]
            assert offsets == request.offsets
            assert buffer.shape == (request.total_rows, request.embedding_width)
            for index in range(request.num_items):
                rows = buffer[offsets[index] : offsets[index + 1]]
                assert torch.equal(bits(rows), bits(fake_output(request, index)))
            finished.add(request_id)
            release_at[request_id] = iteration + scenario.hold

        if (
            iteration >= last_arrival
            and not release_at
            and all(request_id in finished or request_id in cancelled for request_id in admitted)
        ):
            break
    else:
        unfinished = sorted(set(admitted) - finished - cancelled)
        raise AssertionError(f"requests {unfinished} did not finish within {bound} iterations")

    # Released requests free their bytes; nothing is left behind.
    assert sched.resident_bytes == 0
    assert sched.num_live == 0
    assert sched.num_waiting == 0


@settings(
    max_examples=300,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(scenarios())
def test_random_streams_keep_every_invariant(scenario: Scenario) -> None:
    drive(scenario)


def test_cache_hits_are_bit_identical_to_misses() -> None:
    """Two identical streams, one with a cache large enough for everything: the buffers agree bit for bit."""
    hashes = ["x", "y", "x", "z", "y", "x"]
    buffers: dict[bool, list[torch.Tensor]] = {}
    for with_cache in (False, True):
        cache = EncoderCache(1 << 20) if with_cache else None
        sched = EncoderScheduler(EncoderBudget(2, 64, None), SchedulingPolicy.DEFAULT, cache)
        out = []
        for n, content_hash in enumerate(hashes):
            request = EncoderRequest(
                f"r{n}",
                8,
                torch.bfloat16,
                [EncoderItem("image", 4, 3, content_hash), EncoderItem("image", 4, 2, None)],
            )
            sched.submit(request)
            while not sched.is_ready(request.request_id):
                for request_id, index in sched.schedule():
                    sched.record(request_id, index, fake_output(sched.request(request_id), index))
            out.append(sched.take(request.request_id)[0])
        buffers[with_cache] = out
        if with_cache:
            assert sched.cache_hits == 3
    for plain, cached in zip(buffers[False], buffers[True], strict=True):
        assert torch.equal(bits(plain), bits(cached))
