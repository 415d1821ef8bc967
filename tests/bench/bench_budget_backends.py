"""Media admission overhead per request: `LocalBudget` against `RedisBudget` on loopback (run by hand, not in CI).

One process, one event loop, budgets never full (admission never waits for bytes), so what is timed is the
bookkeeping itself. Rows, timed in interleaved rounds:
  local                      `await reserve(n)` then `release()` on the in-process budget
  floor: one redis-py PING   one round trip of a plain redis-py client to the same server: what this machine
                             and client library cost before any budget logic
  redis: request waits       `await reserve(n)` then `release()`: what a request's path waits for (the release
                             is sent in the background)
  redis: both round trips    the same, then waiting until the release has been answered by Redis
  concurrent C               C requests at once on the same loop (p50/p99 of each request's own time)

    .venv/bin/python tests/bench/bench_budget_backends.py [--requests 5000] [--rounds 5] [--concurrency 16]
        [--url redis://127.0.0.1:6379/0] [--loop uvloop|asyncio]

Without --url a redis-server is started on a free loopback port with no persistence (the Debian package).
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

# Run as a script, the repository root is not on sys.path; the package must come from this checkout.
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import redis
import redis.asyncio as aioredis

from gateway.budget.local import LocalBudget
from gateway.budget.redis import RedisBudget

NBYTES = 64 << 20
CAPACITY = 1 << 40


@contextmanager
def redis_server() -> Iterator[str]:
    binary = shutil.which("redis-server")
    if binary is None:
        raise SystemExit("redis-server is not installed (Debian package redis-server), or pass --url")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with tempfile.TemporaryDirectory() as directory:
        command = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
        process = subprocess.Popen([*command, "--dir", directory], stdout=subprocess.DEVNULL)
        try:
            client = redis.Redis(host="127.0.0.1", port=port)
            deadline = time.monotonic() + 10
            while True:
                try:
                    client.ping()
                    break
                except redis.ConnectionError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.02)
            client.close()
            yield f"redis://127.0.0.1:{port}/0"
        finally:
            process.terminate()
            process.wait()


Op = Callable[[], Awaitable[None]]


def local_op(budget: LocalBudget) -> Op:
    async def op() -> None:
        (await budget.reserve(NBYTES)).release()

    return op


def redis_op(budget: RedisBudget, *, await_release: bool) -> Op:
    async def op() -> None:
        reservation = await budget.reserve(NBYTES)
        reservation.release()
        if await_release:
            await budget.flush()

    return op


async def time_ops(op: Op, requests: int, concurrency: int) -> tuple[list[float], float]:
    """Each request's own seconds, and the wall time of all of them."""
    samples: list[float] = []

    async def client(count: int) -> None:
        for _ in range(count):
            started = time.perf_counter()
            await op()
            samples.append(time.perf_counter() - started)

    shares = [requests // concurrency + (1 if i < requests % concurrency else 0) for i in range(concurrency)]
    started = time.perf_counter()
    await asyncio.gather(*(client(count) for count in shares))
    return samples, time.perf_counter() - started


def percentile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


async def bench(args: argparse.Namespace, url: str) -> str:
    local = LocalBudget(CAPACITY, timeout_s=10, max_queued=None)
    shared = RedisBudget(
        url=url, key_prefix=f"bench:{uuid.uuid4().hex[:8]}", capacity=CAPACITY, timeout_s=10, max_queued=None
    )
    await shared.start()
    plain = aioredis.Redis.from_url(url)

    async def ping() -> None:
        await plain.ping()

    rows: dict[str, Op] = {
        "local": local_op(local),
        "floor: one redis-py PING": ping,
        "redis: request waits": redis_op(shared, await_release=False),
        "redis: both round trips": redis_op(shared, await_release=True),
    }
    levels = [1] + ([args.concurrency] if args.concurrency > 1 else [])
    # Waiting for "the release has been answered" means waiting for every release in flight: one client only.
    cells = [(name, c) for c in levels for name in rows if c == 1 or name != "redis: both round trips"]
    samples: dict[tuple[str, int], list[float]] = {cell: [] for cell in cells}
    walls: dict[tuple[str, int], float] = dict.fromkeys(samples, 0.0)
    for op in rows.values():  # warm-up
        await time_ops(op, 200, 1)
    await shared.flush()
    for _ in range(args.rounds):
        for name, concurrency in cells:
            taken, wall = await time_ops(rows[name], args.requests // args.rounds, concurrency)
            await shared.flush()
            samples[name, concurrency] += taken
            walls[name, concurrency] += wall
    await shared.refresh()
    assert shared.cluster_in_use == 0, shared.cluster_in_use
    round_trips = shared.stats.round_trips
    await shared.aclose()
    await plain.aclose()

    lines = [
        f"media admission overhead per request, {args.requests} requests per row in {args.rounds} interleaved "
        f"rounds, loop {args.loop}, Python {sys.version.split()[0]}, redis-py {redis.__version__}",
        "",
        "| backend | concurrent | p50 ms | p99 ms | mean ms | requests/s | p50 added over local |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, concurrency in cells:
        base = statistics.median(samples["local", concurrency])
        taken = samples[name, concurrency]
        p50 = statistics.median(taken)
        lines.append(
            f"| {name} | {concurrency} | {p50 * 1e3:.3f} | {percentile(taken, 0.99) * 1e3:.3f} | "
            f"{statistics.fmean(taken) * 1e3:.3f} | {len(taken) / walls[name, concurrency]:,.0f} | "
            f"{(p50 - base) * 1e3:+.3f} |"
        )
    lines.append("")
    lines.append(f"Redis script and ping round trips: {round_trips:,}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=5000, help="requests per row (all rounds together)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--concurrency", type=int, default=16, help="the second level of concurrent requests")
    parser.add_argument("--url", help="an existing Redis (default: start a redis-server on a free port)")
    parser.add_argument("--loop", choices=["uvloop", "asyncio"], default="uvloop")
    args = parser.parse_args()
    if args.loop == "uvloop":
        import uvloop

        uvloop.install()
    if args.url:
        print(asyncio.run(bench(args, args.url)))
    else:
        with redis_server() as url:
            print(asyncio.run(bench(args, url)))


if __name__ == "__main__":
    main()
