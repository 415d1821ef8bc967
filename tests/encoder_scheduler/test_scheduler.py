from __future__ import annotations

import logging

import pytest
import torch

import encoder_scheduler.scheduler as scheduler_module
from encoder_scheduler import (
    AdmissionError,
    EncoderBudget,
    EncoderCache,
    EncoderScheduler,
    RequestBuffer,
    RequestProgress,
    SchedulingPolicy,
    UnknownRequestError,
)
from tests.encoder_scheduler.helpers import WIDTH, encode_plan, expected_buffer, fake_output, item, request

F32 = 4  # bytes per float32 element


def scheduler(
    items: int = 8,
    tokens: int = 1000,
    resident: int | None = None,
    *,
    cache: EncoderCache | None = None,
    policy: SchedulingPolicy = SchedulingPolicy.DEFAULT,
) -> EncoderScheduler:
    return EncoderScheduler(EncoderBudget(items, tokens, resident), policy=policy, cache=cache)


def footprint(rows: int) -> int:
    return rows * WIDTH * F32


# ------------------------------------------------------------------------------------------------ budgets


def test_item_budget_limits_items_per_iteration() -> None:
    sched = scheduler(items=2)
    sched.submit(request("r", [item(1) for _ in range(5)]))
    plans = []
    for _ in range(3):
        plan = sched.schedule()
        plans.append(list(plan))
        encode_plan(sched, plan)
    assert plans == [[("r", 0), ("r", 1)], [("r", 2), ("r", 3)], [("r", 4)]]
    assert sched.is_ready("r")


def test_token_budget_pays_whole_items_and_never_skips_an_earlier_item() -> None:
    sched = scheduler(tokens=10)
    sched.submit(request("r", [item(6), item(6), item(3)]))
    first = sched.schedule()
    # Item 2 (3 tokens) would fit the 4 tokens left, but item 1 comes first and does not.
    assert list(first) == [("r", 0)]
    assert first.num_tokens == 6
    encode_plan(sched, first)
    second = sched.schedule()
    assert list(second) == [("r", 1), ("r", 2)]
    assert second.num_tokens == 9
    assert second.token_budget == 10


def test_started_requests_continue_first_then_waiting_ones_fill_the_budget() -> None:
    sched = scheduler(tokens=10)
    sched.submit(request("a", [item(8), item(8)]))
    sched.submit(request("b", [item(2), item(2)]))
    first = sched.schedule()
    assert list(first) == [("a", 0), ("b", 0)]
    assert first.started == ("a", "b")
    encode_plan(sched, first)
    second = sched.schedule()
    assert list(second) == [("a", 1), ("b", 1)]
    assert second.started == ()


def test_waiting_head_that_cannot_start_blocks_later_requests() -> None:
    sched = scheduler(tokens=20)
    sched.submit(request("running", [item(5), item(5), item(5)]))
    encode_plan(sched, sched.schedule(max_new_requests=1))  # "running" started with all three items
    sched.submit(request("running2", [item(5), item(5)]))
    sched.submit(request("head", [item(20)]))
    sched.submit(request("small", [item(1)]))
    plan = sched.schedule()
    # running2 starts (10 tokens), head needs 20 > 10 left: small must not overtake it.
    assert plan.started == ("running2",)
    assert sched.waiting_requests() == ("head", "small")
    encode_plan(sched, plan)
    plan = sched.schedule()
    assert plan.started == ("head",)
    assert list(plan) == [("head", 0)]
    encode_plan(sched, plan)
    assert sched.schedule().started == ("small",)


def test_oversized_item_runs_alone_under_a_raised_budget_with_one_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    sched = scheduler(tokens=10)
    caplog.set_level(logging.WARNING, logger="encoder_scheduler.scheduler")
    sched.submit(request("small", [item(3)]))
    sched.submit(request("big", [item(25), item(2)]))
    sched.submit(request("big2", [item(25)]))
    warnings = [record for record in caplog.records if record.levelno == logging.WARNING]
    assert len(warnings) == 1
    message = warnings[0].getMessage()
    assert "25 tokens" in message
    assert "encoder.max_num_tokens=10" in message
    assert "%" not in message
    assert sched.effective_max_num_tokens == 25

    first = sched.schedule()
    assert list(first) == [("small", 0)]  # big's first item does not fit an iteration that has work
    encode_plan(sched, first)
    second = sched.schedule()
    assert list(second) == [("big", 0)]
    assert second.num_tokens == 25
    assert second.token_budget == 25
    encode_plan(sched, second)
    third = sched.schedule()
    # big's remaining item continues first; big2's oversized item cannot join a non-empty iteration.
    assert list(third) == [("big", 1)]
    assert third.token_budget == 10
    encode_plan(sched, third)
    fourth = sched.schedule()
    assert list(fourth) == [("big2", 0)]
    assert fourth.token_budget == 25


def test_oversized_item_of_a_started_request_is_never_stuck() -> None:
    sched = scheduler(items=4, tokens=10)
    sched.submit(request("r", [item(4), item(50), item(4)]))
    seen = []
    for _ in range(5):
        plan = sched.schedule()
        seen.append(list(plan))
        encode_plan(sched, plan)
    assert seen[:3] == [[("r", 0)], [("r", 1)], [("r", 2)]]
    assert sched.is_ready("r")


# ----------------------------------------------------------------------------------------- resident bytes


def test_whole_footprint_is_charged_when_the_first_item_is_scheduled() -> None:
    sched = scheduler(items=1)
    sched.submit(request("r", [item(1, rows=2), item(1, rows=3), item(1, rows=4)]))
    assert sched.resident_bytes == 0
    assert sched.progress("r") is RequestProgress.PENDING
    encode_plan(sched, sched.schedule())
    assert sched.resident_bytes == footprint(9)
    assert sched.progress("r") is RequestProgress.PARTIAL
    encode_plan(sched, sched.schedule())
    encode_plan(sched, sched.schedule())
    assert sched.resident_bytes == footprint(9)
    assert sched.progress("r") is RequestProgress.READY


def test_resident_budget_defers_starts_until_bytes_are_released() -> None:
    sched = scheduler(resident=footprint(10))
    sched.submit(request("a", [item(1, rows=4)]))
    sched.submit(request("b", [item(1, rows=5)]))
    sched.submit(request("c", [item(1, rows=2)]))
    sched.submit(request("d", [item(1, rows=1)]))
    plan = sched.schedule()
    # c does not fit (4 + 5 + 2 > 10 rows); d would, but must not overtake c.
    assert plan.started == ("a", "b")
    assert sched.resident_bytes == footprint(9)
    encode_plan(sched, plan)
    assert sched.schedule().started == ()
    sched.take("a")
    assert sched.schedule().started == ()  # taken, still charged until released
    assert sched.release("a") == footprint(4)
    plan = sched.schedule()
    assert plan.started == ("c", "d")
    assert sched.resident_bytes == footprint(8)


def test_request_larger_than_the_resident_budget_is_refused_at_submit() -> None:
    limit = footprint(10)
    sched = scheduler(resident=limit)
    too_big = request("big", [item(1, rows=6), item(1, rows=5)])
    with pytest.raises(AdmissionError) as excinfo:
        sched.submit(too_big)
    error = excinfo.value
    message = str(error)
    assert "encoder.max_resident_bytes" in message
    assert f"{footprint(11):,}" in message
    assert f"{limit:,}" in message
    assert (error.knob, error.required, error.limit) == ("encoder.max_resident_bytes", footprint(11), limit)
    assert "big" not in sched
    assert sched.num_waiting == 0
    assert sched.stats().admission_rejections == 1
    sched.submit(request("exact", [item(1, rows=10)]))  # exactly the budget fits
    assert sched.schedule().started == ("exact",)


# ----------------------------------------------------------------------------------------- order, progress


def test_partial_request_resumes_in_prompt_order_next_iteration() -> None:
    sched = scheduler(items=2)
    req = request("r", [item(1, rows=n + 1) for n in range(5)])
    sched.submit(req)
    order = []
    while not sched.is_ready("r"):
        plan = sched.schedule()
        assert plan, "a partially encoded request must resume"
        order.extend(index for _, index in plan)
        encode_plan(sched, plan)
    assert order == [0, 1, 2, 3, 4]
    buffer, offsets = sched.take("r")
    assert offsets == req.offsets
    assert torch.equal(buffer, expected_buffer(req))


def test_items_in_flight_are_not_scheduled_again() -> None:
    sched = scheduler(items=1)
    sched.submit(request("r", [item(1), item(1)]))
    assert list(sched.schedule()) == [("r", 0)]
    # The engine schedules the next iteration before recording the last one.
    assert list(sched.schedule()) == [("r", 1)]
    assert list(sched.schedule()) == []
    encode_plan(sched, [("r", 1), ("r", 0)])
    assert sched.is_ready("r")


def test_plan_is_a_sequence_with_runs_and_totals() -> None:
    sched = scheduler(items=8, tokens=100)
    sched.submit(request("a", [item(3), item(4)]))
    sched.submit(request("b", [item(5)]))
    plan = sched.schedule()
    assert len(plan) == 3
    assert plan[0] == ("a", 0)
    assert plan[-1] == ("b", 0)
    assert plan[1:] == (("a", 1), ("b", 0))
    assert list(plan) == [("a", 0), ("a", 1), ("b", 0)]
    assert plan.runs == (("a", 0, 2), ("b", 0, 1))
    assert plan.num_tokens == 12
    assert plan.started == ("a", "b")


def test_max_new_requests_must_not_be_negative() -> None:
    with pytest.raises(ValueError, match="max_new_requests"):
        scheduler().schedule(max_new_requests=-1)


# ----------------------------------------------------------------------------------- record, take, release


def test_take_hands_out_the_buffer_itself(monkeypatch: pytest.MonkeyPatch) -> None:
    created: list[RequestBuffer] = []

    class Spy(RequestBuffer):
        def __init__(self, *args: object, **kwargs: object) -> None:
            super().__init__(*args, **kwargs)  # type: ignore[arg-type]
            created.append(self)

    monkeypatch.setattr(scheduler_module, "RequestBuffer", Spy)
    sched = scheduler()
    req = request("r", [item(1, rows=2), item(1, rows=3)])
    sched.submit(req)
    encode_plan(sched, sched.schedule())

    def no_cat(*args: object, **kwargs: object) -> None:
        raise AssertionError("take() must not concatenate")

    monkeypatch.setattr(torch, "cat", no_cat)
    buffer, offsets = sched.take("r")
    monkeypatch.undo()
    assert buffer is created[0].tensor
    assert offsets == (0, 2, 5)
    assert buffer.untyped_storage().nbytes() == footprint(5)
    assert torch.equal(buffer, expected_buffer(req))
    assert sched.progress("r") is RequestProgress.TAKEN
    assert not sched.is_ready("r")


def test_take_requires_a_ready_request() -> None:
    sched = scheduler(items=1)
    sched.submit(request("r", [item(1), item(1)]))
    with pytest.raises(ValueError, match="not ready"):
        sched.take("r")
    encode_plan(sched, sched.schedule())
    with pytest.raises(ValueError, match="not ready"):
        sched.take("r")
    encode_plan(sched, sched.schedule())
    sched.take("r")
    with pytest.raises(ValueError, match="not ready"):
        sched.take("r")
    with pytest.raises(UnknownRequestError):
        sched.take("nobody")


def test_record_validates_before_copying() -> None:
    sched = scheduler(items=1)
    req = request("r", [item(1, rows=2), item(1, rows=2)])
    sched.submit(req)
    with pytest.raises(ValueError, match="not scheduled"):
        sched.record("r", 0, fake_output(req, 0))
    sched.schedule()
    with pytest.raises(ValueError, match="not scheduled"):
        sched.record("r", 1, fake_output(req, 1))
    with pytest.raises(ValueError, match="shape"):
        sched.record("r", 0, torch.zeros(3, WIDTH))
    with pytest.raises(TypeError, match="dtype"):
        sched.record("r", 0, torch.zeros(2, WIDTH, dtype=torch.float64))
    assert sched.record("r", 0, fake_output(req, 0)) is False
    with pytest.raises(ValueError, match="already recorded"):
        sched.record("r", 0, fake_output(req, 0))
    with pytest.raises(UnknownRequestError):
        sched.record("nobody", 0, fake_output(req, 0))
    assert sched.stats().items_recorded == 1


@pytest.mark.parametrize("state", ["waiting", "partial", "in_flight", "ready", "taken"])
def test_release_works_in_every_state_frees_bytes_at_once_and_is_idempotent(state: str) -> None:
    sched = scheduler(items=1, resident=footprint(6))
    req = request("r", [item(1, rows=3), item(1, rows=3)])
    sched.submit(req)
    sched.submit(request("next", [item(1, rows=6)]))
    if state != "waiting":
        encode_plan(sched, sched.schedule())
        if state == "in_flight":
            sched.schedule()  # item 1 handed to the encoder, not recorded yet
        elif state != "partial":
            encode_plan(sched, sched.schedule())
        if state == "taken":
            sched.take("r")
    charged = 0 if state == "waiting" else footprint(6)
    assert sched.resident_bytes == charged
    assert sched.release("r") == charged
    assert sched.resident_bytes == 0
    assert "r" not in sched
    assert sched.progress("r") is None
    assert sched.release("r") == 0
    if state == "in_flight":
        with pytest.raises(UnknownRequestError):
            sched.record("r", 1, fake_output(req, 1))
    # The freed bytes (or the freed queue position) let the next request start at once.
    assert sched.schedule().started == ("next",)
    assert sched.stats().live_requests == 1


def test_released_id_can_be_submitted_again_but_live_ids_are_unique() -> None:
    sched = scheduler()
    sched.submit(request("r", [item(1)]))
    with pytest.raises(ValueError, match="already live"):
        sched.submit(request("r", [item(1)]))
    sched.release("r")
    sched.submit(request("r", [item(1)]))
    assert sched.waiting_requests() == ("r",)


def test_stats_track_every_state() -> None:
    sched = scheduler(items=1)
    for name in "abcd":
        sched.submit(request(name, [item(1)]))
    encode_plan(sched, sched.schedule())  # a ready
    encode_plan(sched, sched.schedule())  # b ready
    sched.take("a")
    sched.schedule()  # c in flight
    stats = sched.stats()
    assert (stats.waiting_requests, stats.running_requests, stats.ready_requests, stats.taken_requests) == (
        1,
        1,
        1,
        1,
    )
    assert stats.live_requests == 4 == len(sched)
    assert stats.iterations == 3
    assert stats.items_scheduled == 3
    assert stats.items_recorded == 2
    assert stats.resident_bytes == sched.resident_bytes == 3 * footprint(1)
    assert stats.max_num_items == 1
    assert stats.effective_max_num_tokens == 1000
    assert sched.ready_requests() == ("b",)


# ------------------------------------------------------------------------------------------------- cache


def test_cache_hit_is_copied_into_the_buffer_and_never_encoded() -> None:
    cache = EncoderCache(1 << 20)
    sched = scheduler(cache=cache)
    first = request("first", [item(5, rows=3, content_hash="img")])
    sched.submit(first)
    plan = sched.schedule()
    assert list(plan) == [("first", 0)]
    assert plan.cache_hits == ()
    encode_plan(sched, plan)
    miss_buffer, _ = sched.take("first")
    second = request("second", [item(5, rows=3, content_hash="img")])
    sched.submit(second)
    plan = sched.schedule()
    assert list(plan) == []
    assert plan.num_tokens == 0
    assert plan.cache_hits == (("second", 0),)
    assert plan.ready == ("second",)
    assert plan.started == ("second",)
    hit_buffer, _ = sched.take("second")
    assert torch.equal(hit_buffer, miss_buffer)
    assert hit_buffer.view(torch.int32).equal(miss_buffer.view(torch.int32))  # bit for bit
    assert (sched.cache_hits, sched.cache_misses) == (1, 1)


def test_cache_never_shares_storage_with_request_buffers() -> None:
    cache = EncoderCache(1 << 20)
    sched = scheduler(cache=cache)
    req = request("a", [item(1, rows=2, content_hash="x")])
    sched.submit(req)
    encode_plan(sched, sched.schedule())
    buffer_a, _ = sched.take("a")
    buffer_a.fill_(7.0)  # the consumer writing into its buffer must not reach the cache
    sched.submit(request("b", [item(1, rows=2, content_hash="x")]))
    sched.schedule()
    buffer_b, _ = sched.take("b")
    assert torch.equal(buffer_b, fake_output(req, 0))
    buffer_b.fill_(9.0)  # nor the other way round
    cached = cache.get(req.cache_keys[0])  # type: ignore[index]
    assert cached is not None
    assert torch.equal(cached, fake_output(req, 0))
    storages = {t.untyped_storage().data_ptr() for t in (buffer_a, buffer_b, cached)}
    assert len(storages) == 3


def test_each_keyed_item_is_looked_up_once_and_unkeyed_never() -> None:
    cache = EncoderCache(1 << 20)
    sched = scheduler(items=1, cache=cache)
    sched.submit(request("keyed", [item(1, content_hash=f"k{n}") for n in range(4)]))
    sched.submit(request("unkeyed", [item(1) for _ in range(4)]))
    for _ in range(12):
        encode_plan(sched, sched.schedule())
    assert sched.is_ready("keyed")
    assert sched.is_ready("unkeyed")
    # Four iterations for "keyed" with the budget exhausted in between: still exactly one lookup per item.
    assert cache.hits + cache.misses == 4
    assert (sched.cache_hits, sched.cache_misses) == (0, 4)


def test_hits_cost_no_budget_and_keep_prompt_order() -> None:
    cache = EncoderCache(1 << 20)
    sched = scheduler(items=1, cache=cache)
    warm = request("warm", [item(1, content_hash="h0"), item(1, content_hash="h1"), item(1, content_hash="h3")])
    sched.submit(warm)
    for _ in range(3):
        encode_plan(sched, sched.schedule())
    sched.release("warm")
    req = request(
        "r",
        [
            item(1, content_hash="h0"),
            item(1, content_hash="h1"),
            item(1, content_hash="new"),
            item(1, content_hash="h3"),
        ],
    )
    sched.submit(req)
    plan = sched.schedule()
    assert plan.cache_hits == (("r", 0), ("r", 1))
    assert list(plan) == [("r", 2)]
    encode_plan(sched, plan)
    plan = sched.schedule()
    # Item 3 is a hit, but it was not probed while item 2 held the only item slot.
    assert plan.cache_hits == (("r", 3),)
    assert list(plan) == []
    assert plan.ready == ("r",)
    buffer, _ = sched.take("r")
    assert torch.equal(buffer, expected_buffer(req))


def test_hits_split_runs_and_processor_key_separates_entries() -> None:
    cache = EncoderCache(1 << 20)
    sched = scheduler(cache=cache)
    sched.submit(request("warm", [item(1, content_hash="h")]))
    encode_plan(sched, sched.schedule())
    sched.submit(request("r", [item(1), item(1, content_hash="h"), item(1)]))
    sched.submit(request("p", [item(1, content_hash="h")], processor_key="max_pixels=4"))
    plan = sched.schedule()
    assert list(plan) == [("r", 0), ("r", 2), ("p", 0)]
    assert plan.runs == (("r", 0, 1), ("r", 2, 3), ("p", 0, 1))
    assert plan.cache_hits == (("r", 1),)


def test_cached_entry_of_another_width_or_dtype_is_a_miss() -> None:
    cache = EncoderCache(1 << 20)
    sched = scheduler(cache=cache)
    sched.submit(request("wide", [item(1, content_hash="h")], width=8))
    encode_plan(sched, sched.schedule())
    sched.submit(request("narrow", [item(1, content_hash="h")]))
    sched.submit(request("half", [item(1, content_hash="h")], dtype=torch.float16))
    plan = sched.schedule()
    assert list(plan) == [("narrow", 0), ("half", 0)]
    assert plan.cache_hits == ()
    encode_plan(sched, plan)
    assert sched.is_ready("narrow")
    assert sched.is_ready("half")


def test_unkeyable_request_is_never_looked_up_across_iterations() -> None:
    class CountingCache(EncoderCache):
        calls = 0

        def get(self, key):  # type: ignore[no-untyped-def]
            CountingCache.calls += 1
            return super().get(key)

    sched = scheduler(items=1, cache=CountingCache(1 << 20))
    sched.submit(request("r", [item(1) for _ in range(6)]))
    for _ in range(8):
        encode_plan(sched, sched.schedule())
    assert sched.is_ready("r")
    assert CountingCache.calls == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_buffers_live_on_the_scheduler_device() -> None:
    cache = EncoderCache(1 << 20)
    sched = EncoderScheduler(EncoderBudget(8, 100, None), cache=cache, device="cuda")
    req = request("a", [item(1, rows=2, content_hash="h"), item(1, rows=3)])
    sched.submit(req)
    for request_id, index in sched.schedule():
        sched.record(request_id, index, fake_output(req, index).cuda())
    buffer, _ = sched.take("a")
    assert buffer.is_cuda
    assert torch.equal(buffer.cpu(), expected_buffer(req))
    sched.submit(request("b", [item(1, rows=2, content_hash="h")]))
    plan = sched.schedule()
    assert plan.cache_hits == (("b", 0),)
    hit, _ = sched.take("b")
    assert hit.is_cuda
    assert torch.equal(hit.cpu(), fake_output(req, 0))
