"""Engine benchmark (run by hand, not in CI): throughput, iteration latency and peak memory per scheduling policy.

For each policy (DEFAULT / EAGER / DISABLED) and each number of images per request (1 / 4 / 7), 32 clients each
submit one request at once to the real engine (`engine_adapter.engine.Engine`: intake, scheduler, runtime loop
on its encoder thread, reference hand-off), claim the response and read it to the end. Each row runs in a fresh
process, so one row's peak memory cannot hide in another's.

Columns: items/s over the row's wall time; encoder iteration latency (pack + forward, p50 / p99); request latency
(submit to last response byte, p50); peak RSS of the process during the row and its rise over the idle engine
(Linux: VmHWM after resetting it through /proc/self/clear_refs); on CUDA, peak torch allocation during the row;
the high-water marks of the resident embedding buffers and of the queued encoder inputs (uint8 patch rows).

    .venv/bin/python tests/bench/bench_engine.py                      # CPU, the `small` preset
    .venv/bin/python tests/bench/bench_engine.py --preset tiny --image 112 --images 1,4   # a quick dry run
    python tests/bench/bench_engine.py --preset qwen2-vl-2b --device cuda --dtype bfloat16 --image 448   # GPU

Seed 001's claim to check: under DEFAULT, peak memory stays flat as images per request grow (the per-iteration
item/token budgets bound the encoder's working set and `encoder.max_resident_bytes` bounds the buffers), while
DISABLED encodes whole requests at once and its memory tracks the traffic.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

# Run as a script, the repository root is not on sys.path; the package must come from this checkout.
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from engine_adapter.client.wire import WireItem, encode_submit, item_part

POLICIES = ("DEFAULT", "EAGER", "DISABLED")
MIB = 1 << 20


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="small", help="vision tower preset (default: small)")
    parser.add_argument("--device", default="cpu", help="cpu | cuda | auto")
    parser.add_argument("--dtype", default="auto", help="auto | float32 | bfloat16 | float16")
    parser.add_argument("--image", type=int, default=224, help="square image side in pixels (a multiple of 28)")
    parser.add_argument("--images", default="1,4,7", help="images per request, comma-separated")
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument("--requests", type=int, default=32, help="concurrent requests per row")
    parser.add_argument("--max-num-items", type=int, default=8)
    parser.add_argument("--max-num-tokens", type=int, default=2048)
    parser.add_argument("--max-resident-bytes", default="64MiB")
    parser.add_argument("--max-concurrency", type=int, default=8, help="handoff.max_concurrency")
    parser.add_argument("--row", nargs=2, metavar=("POLICY", "IMAGES"), help=argparse.SUPPRESS)
    return parser.parse_args(argv)


@dataclass
class Watch:
    """Filled by the engine's invariant hook after every iteration."""

    iteration_s: list[float] = field(default_factory=list)
    iteration_tokens: list[int] = field(default_factory=list)
    peak_resident: int = 0
    peak_inputs: int = 0
    budget_violations: int = 0


def rss_bytes(key: str) -> int:
    """VmRSS / VmHWM from /proc (Linux); ru_maxrss elsewhere."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def reset_peak_rss() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def request_body(index: int, images: int, side: int) -> bytes:
    rng = np.random.default_rng(index)
    items = []
    for i in range(images):
        pixels = rng.integers(0, 256, (side, side, 3), dtype=np.uint8)
        items.append(WireItem("image", f"bench-{index}-{i}", hashlib.sha256(pixels.tobytes()).hexdigest(), pixels))
    content: list[Any] = [{"type": "text", "text": "describe the images"}, *(item_part(i) for i in range(images))]
    document = {"model": "bench", "messages": [{"role": "user", "content": content}]}
    return encode_submit(f"bench-{index}", document, items)


async def run_row(args: argparse.Namespace, policy: str, images: int) -> dict[str, Any]:
    import torch

    from engine_adapter.config import EngineSettings
    from engine_adapter.device import peak_memory_bytes, reset_peak_memory, synchronize
    from engine_adapter.engine import Engine
    from engine_adapter.errors import EngineError
    from engine_adapter.runtime import IterationReport

    settings = EngineSettings(
        model={"preset": args.preset, "device": args.device, "dtype": args.dtype},
        encoder={
            "scheduling_policy": policy,
            "max_num_items": args.max_num_items,
            "max_num_tokens": args.max_num_tokens,
            "max_resident_bytes": args.max_resident_bytes,
            "max_pending_input_bytes": None,
        },
        handoff={"backend": "reference", "max_concurrency": args.max_concurrency},
        server={"response_claim_timeout_s": 3600},
    )
    watch = Watch()
    budget = settings.encoder.max_resident_bytes
    engine: Engine | None = None

    def hook(report: IterationReport) -> None:
        stats = report.stats
        if report.seconds is not None:
            watch.iteration_s.append(report.seconds)
            watch.iteration_tokens.append(report.plan.num_tokens)
        watch.peak_resident = max(watch.peak_resident, stats.resident_bytes)
        if engine is not None:
            watch.peak_inputs = max(watch.peak_inputs, engine.runtime.pending_input_bytes)
        if policy != "DISABLED" and budget is not None and stats.resident_bytes > budget:
            watch.budget_violations += 1

    engine = Engine(settings, on_iteration=hook)
    await engine.start()

    async def one(index: int) -> float:
        body = request_body(index, images, args.image)
        started = time.perf_counter()
        job = await engine.submit(body)
        del body
        engine.claim(job.id)
        result = await job.outcome
        if isinstance(result, EngineError):
            raise result
        try:
            async for _ in result.chunks():
                pass
        finally:
            await result.aclose()
            engine.finish(job, "completed")
        return time.perf_counter() - started

    try:
        await one(10_000)  # warm-up: first-call allocations and kernels, excluded
        device = engine.encoder.device
        synchronize(device)
        watch.iteration_s.clear()
        watch.iteration_tokens.clear()
        watch.peak_resident = watch.peak_inputs = 0
        idle_rss = rss_bytes("VmRSS")
        exact_peak = reset_peak_rss()
        reset_peak_memory(device)
        started = time.perf_counter()
        latencies = await asyncio.gather(*(one(index) for index in range(args.requests)))
        wall = time.perf_counter() - started
        peak_rss = rss_bytes("VmHWM") if exact_peak else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        cuda_peak = peak_memory_bytes(device)
    finally:
        await engine.aclose()
    iterations = sorted(watch.iteration_s)
    return {
        "policy": policy,
        "images": images,
        "items_per_s": args.requests * images / wall,
        "iterations": len(iterations),
        "tokens_per_iteration": statistics.fmean(watch.iteration_tokens) if watch.iteration_tokens else 0.0,
        "iteration_p50_ms": 1000 * percentile(iterations, 0.50),
        "iteration_p99_ms": 1000 * percentile(iterations, 0.99),
        "request_p50_s": percentile(sorted(latencies), 0.50),
        "peak_rss_mib": peak_rss / MIB,
        "rss_rise_mib": (peak_rss - idle_rss) / MIB,
        "exact_peak": exact_peak,
        "cuda_peak_mib": None if cuda_peak is None else cuda_peak / MIB,
        "peak_resident_mib": watch.peak_resident / MIB,
        "peak_inputs_mib": watch.peak_inputs / MIB,
        "budget_violations": watch.budget_violations,
        "torch": torch.__version__,
        "device": str(engine.encoder.device),
        "dtype": str(engine.encoder.dtype).removeprefix("torch."),
    }


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    return values[min(len(values) - 1, round(q * (len(values) - 1)))]


def table(rows: list[dict[str, Any]], args: argparse.Namespace) -> str:
    cuda = any(row["cuda_peak_mib"] is not None for row in rows)
    head = [
        "policy",
        "images/req",
        "items/s",
        "iters",
        "tokens/iter",
        "iter p50 ms",
        "iter p99 ms",
        "req p50 s",
        "peak RSS MiB",
        "RSS rise MiB",
        *(["peak CUDA MiB"] if cuda else []),
        "peak buffers MiB",
        "peak queued inputs MiB",
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in rows:
        cells = [
            row["policy"],
            str(row["images"]),
            f"{row['items_per_s']:.1f}",
            str(row["iterations"]),
            f"{row['tokens_per_iteration']:.0f}",
            f"{row['iteration_p50_ms']:.1f}",
            f"{row['iteration_p99_ms']:.1f}",
            f"{row['request_p50_s']:.2f}",
            f"{row['peak_rss_mib']:.0f}",
            f"{row['rss_rise_mib']:.0f}",
            *([f"{row['cuda_peak_mib']:.0f}"] if cuda else []),
            f"{row['peak_resident_mib']:.1f}",
            f"{row['peak_inputs_mib']:.1f}",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    first = rows[0]
    tokens = (args.image // 14) ** 2
    lines.append("")
    lines.append(
        f"preset {args.preset} on {first['device']} ({first['dtype']}, torch {first['torch']}); {args.requests} "
        f"concurrent requests of {args.image}x{args.image} images ({tokens} encoder tokens, {tokens // 4} rows each); "
        f"encoder.max_num_items={args.max_num_items}, max_num_tokens={args.max_num_tokens}, "
        f"max_resident_bytes={args.max_resident_bytes}; handoff.max_concurrency={args.max_concurrency} (reference)."
    )
    violations = sum(row["budget_violations"] for row in rows)
    lines.append(f"Iterations over encoder.max_resident_bytes (DEFAULT/EAGER): {violations}.")
    if not all(row["exact_peak"] for row in rows):
        lines.append("Peak RSS is the process lifetime's (ru_maxrss): /proc/self/clear_refs was not writable.")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.row:
        policy, images = args.row
        print(json.dumps(asyncio.run(run_row(args, policy, int(images)))), flush=True)
        return 0
    passthrough = list(argv if argv is not None else sys.argv[1:])
    rows = []
    for policy in args.policies.split(","):
        for images in (int(value) for value in args.images.split(",")):
            command = [sys.executable, __file__, *passthrough, "--row", policy, str(images)]
            done = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
            if done.returncode != 0:
                print(done.stdout, done.stderr, sep="\n", file=sys.stderr)
                return done.returncode
            rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
            row = rows[-1]
            print(
                f"  {policy} x{images}: {row['items_per_s']:.1f} items/s, peak RSS {row['peak_rss_mib']:.0f} MiB",
                file=sys.stderr,
                flush=True,
            )
    print(table(rows, args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
