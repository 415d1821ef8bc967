"""Host cost of EncoderScheduler per iteration (run by hand, not in CI).

Requests of N items are submitted up front and driven to completion by the engine loop
(schedule -> record every item -> take and release ready requests) with a fake encoder whose output is a
preallocated tensor, so the time is the scheduler's bookkeeping, not encoding. Every item costs 1024 encoder
tokens and yields 256 rows of width 8 (float32); budgets: 8 items and 8192 tokens per iteration, no resident
byte limit, DEFAULT policy with unbounded consumer capacity unless the row says otherwise.

Columns: iterations per drive; schedule() alone (us per iteration, us per scheduled item); the whole loop
(schedule + record + take + release; us per iteration, us per item); submit (us per request). Medians of
round means over interleaved rounds.

    .venv/bin/python tests/bench/bench_encoder_scheduler.py [--rounds 15]
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

# Run as a script, the repository root is not on sys.path; the package must come from this checkout.
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from encoder_scheduler import (
    EncoderBudget,
    EncoderCache,
    EncoderItem,
    EncoderRequest,
    EncoderScheduler,
    SchedulingPolicy,
)

ROWS = 256
WIDTH = 8
TOKENS = 1024


@dataclass(frozen=True)
class Scenario:
    name: str
    num_requests: int
    items_per_request: int
    policy: SchedulingPolicy = SchedulingPolicy.DEFAULT
    max_new_requests: int | None = None
    max_num_items: int = 8
    cached: bool = False  # every item keyed; each content hash appears twice, so half the items hit


SCENARIOS = [
    Scenario("32 x 8", 32, 8),
    Scenario("128 x 4", 128, 4),
    Scenario("32 x 8, capacity 4/iter", 32, 8, max_new_requests=4),
    Scenario("128 x 4, capacity 4/iter", 128, 4, max_new_requests=4),
    Scenario("32 x 8, cache (50% hits)", 32, 8, cached=True),
    Scenario("128 x 4, cache (50% hits)", 128, 4, cached=True),
    Scenario("128 x 4, EAGER", 128, 4, policy=SchedulingPolicy.EAGER),
    Scenario("128 x 4, DISABLED", 128, 4, policy=SchedulingPolicy.DISABLED, max_new_requests=8),
]


@dataclass
class Sample:
    iterations: int
    items: int
    schedule_ns: int
    loop_ns: int
    submit_ns: int


def build_requests(scenario: Scenario) -> list[EncoderRequest]:
    total = scenario.num_requests * scenario.items_per_request
    requests = []
    for n in range(scenario.num_requests):
        items = []
        for i in range(scenario.items_per_request):
            serial = n * scenario.items_per_request + i
            content_hash = f"h{serial % (total // 2)}" if scenario.cached else None
            items.append(EncoderItem("image", TOKENS, ROWS, content_hash))
        requests.append(EncoderRequest(f"r{n}", WIDTH, torch.float32, items))
    return requests


def drive(scenario: Scenario, requests: list[EncoderRequest], output: torch.Tensor) -> Sample:
    budget = EncoderBudget(scenario.max_num_items, scenario.max_num_items * TOKENS, None)
    cache = EncoderCache(1 << 30) if scenario.cached else None
    sched = EncoderScheduler(budget, scenario.policy, cache)
    clock = time.perf_counter_ns
    start = clock()
    for request in requests:
        sched.submit(request)
    submit_ns = clock() - start
    schedule_ns = loop_ns = iterations = items = 0
    remaining = len(requests)
    while remaining:
        begin = clock()
        plan = sched.schedule(scenario.max_new_requests)
        scheduled = clock()
        for request_id, index in plan:
            sched.record(request_id, index, output)
        for request_id in sched.ready_requests():
            sched.take(request_id)
            sched.release(request_id)
            remaining -= 1
        end = clock()
        schedule_ns += scheduled - begin
        loop_ns += end - begin
        iterations += 1
        items += len(plan) + len(plan.cache_hits)
    return Sample(iterations, items, schedule_ns, loop_ns, submit_ns)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    torch.set_num_threads(1)
    output = torch.ones(ROWS, WIDTH)
    prepared = [(scenario, build_requests(scenario)) for scenario in SCENARIOS]
    for scenario, requests in prepared:  # warm-up
        drive(scenario, requests, output)
    samples: dict[str, list[Sample]] = {scenario.name: [] for scenario in SCENARIOS}
    gc.disable()
    try:
        for round_index in range(args.rounds):
            order = prepared if round_index % 2 == 0 else prepared[::-1]
            for scenario, requests in order:
                samples[scenario.name].append(drive(scenario, requests, output))
    finally:
        gc.enable()

    print(f"torch {torch.__version__}, {args.rounds} rounds; medians of round means")
    header = [
        "scenario",
        "iterations",
        "items",
        "schedule us/iter",
        "schedule us/item",
        "loop us/iter",
        "loop us/item",
        "submit us/request",
    ]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for scenario, requests in prepared:
        runs = samples[scenario.name]
        first = runs[0]

        def median(values: list[float]) -> float:
            return statistics.median(values)

        cells = [
            scenario.name,
            str(first.iterations),
            str(first.items),
            f"{median([s.schedule_ns / s.iterations / 1e3 for s in runs]):.1f}",
            f"{median([s.schedule_ns / s.items / 1e3 for s in runs]):.2f}",
            f"{median([s.loop_ns / s.iterations / 1e3 for s in runs]):.1f}",
            f"{median([s.loop_ns / s.items / 1e3 for s in runs]):.2f}",
            f"{median([s.submit_ns / len(requests) / 1e3 for s in runs]):.2f}",
        ]
        print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
