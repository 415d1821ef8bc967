"""FIFO and fair queueing of the media budget side by side in one run, through a real gateway process.

    .venv/bin/python tests/bench/bench_fairness.py [--seconds 8] [--hold 0.5] [--rounds 3] [--backend local|redis|both]

A stub upstream answers each request after `--hold` seconds (the budget returns at its first byte, so that is how
long a grant holds its bytes). The gateway has a 128MiB budget; tenants are named by `X-Tenant-ID`.

- flood: tenant A keeps 12 requests of one 2048x2048 PNG (about 32 MiB reserved each, its decode peak: 4 at once
  fill the budget) in flight; tenant B sends one 64x64 PNG every `--b-interval` seconds. B's wait is its
  request's latency less the upstream's hold.
- mutual: on a gateway of its own (no service carried over from the flood), A and B each keep 12 large requests
  in flight (weights 1:1); the shares are bytes x seconds held (reserved bytes x the upstream's hold per completed
  request) and Jain's index over them.
- cost: one small-image request at a time with an instant upstream, the gateway's latency per admission: every
  mode's gateway runs at once and batches of 50 take turns (`--admissions` per mode in all).

Each round runs both modes (`limits.fairness.enabled: false`, FIFO, and `true`) on each budget backend asked for
(`redis`: a redis-server of its own on loopback, `limits.budget_backend: redis`); the table reports medians.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.gateway.media_factory import chat_body, data_url, image_bytes
from tests.gateway.stub_upstream import StubUpstream
from tests.redis_server import RedisServer
from tests.servers import ServerThread, served_process

MODES = ("fifo", "fair")
BACKENDS = {"local": ("local",), "redis": ("redis",), "both": ("local", "redis")}
LARGE_SIDE = 2048
FLOOD = 12


def config(upstream_url: str, fair: bool, redis_url: str | None) -> str:
    shared = f"  budget_backend: redis\nredis:\n  url: {redis_url}\n  key_prefix: bench-{uuid.uuid4().hex[:8]}\n"
    return (
        f"upstream:\n  url: {upstream_url}\nserver:\n  access_log: false\n"
        "media:\n  processor: null\n  decode: header\n"
        "limits:\n  max_multimodal_cpu_bytes: 128MiB\n  max_multimodal_cpu_bytes_per_request: 64MiB\n"
        "  max_queued_requests: null\n  admission_timeout_s: 120\n  max_buffered_body_bytes: 2GiB\n"
        f"  fairness:\n    enabled: {'true' if fair else 'false'}\n    tenant_from: header\n"
        "    tenants: {a: {weight: 1}, b: {weight: 1}}\n" + (shared if redis_url else "")
    )


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))] if ordered else float("nan")


def jain(shares: list[float]) -> float:
    return sum(shares) ** 2 / (len(shares) * sum(x * x for x in shares)) if any(shares) else float("nan")


async def flood(client: httpx.AsyncClient, url: str, body: bytes, tenant: str, until: float, done: list[float]) -> None:
    while time.perf_counter() < until:
        started = time.perf_counter()
        response = await client.post(url, content=body, headers={"x-tenant-id": tenant})
        assert response.status_code == 200, response.text
        done.append(time.perf_counter() - started)


async def scenario(url: str, large: bytes, small: bytes | None, args: argparse.Namespace) -> dict[str, list[float]]:
    """Latencies of completed requests by tenant: A floods; B floods too (`small` None) or sends small ones."""
    endpoint = url + "/v1/chat/completions"
    done: dict[str, list[float]] = {"a": [], "b": []}
    limits = httpx.Limits(max_connections=64)
    async with httpx.AsyncClient(timeout=300, limits=limits) as client:
        until = time.perf_counter() + args.seconds
        tasks = [asyncio.ensure_future(flood(client, endpoint, large, "a", until, done["a"])) for _ in range(FLOOD)]
        if small is None:
            tasks += [
                asyncio.ensure_future(flood(client, endpoint, large, "b", until, done["b"])) for _ in range(FLOOD)
            ]
        else:

            async def one(started: float) -> None:
                response = await client.post(endpoint, content=small, headers={"x-tenant-id": "b"})
                assert response.status_code == 200, response.text
                done["b"].append(time.perf_counter() - started)

            while time.perf_counter() < until:
                tasks.append(asyncio.ensure_future(one(time.perf_counter())))
                await asyncio.sleep(args.b_interval)
        await asyncio.gather(*tasks)
    return done


async def admissions(url: str, body: bytes, count: int) -> list[float]:
    latencies = []
    async with httpx.AsyncClient(timeout=30) as client:
        for i in range(count):
            started = time.perf_counter()
            response = await client.post(
                url + "/v1/chat/completions", content=body, headers={"x-tenant-id": "ab"[i % 2]}
            )
            assert response.status_code == 200
            latencies.append(time.perf_counter() - started)
    return latencies


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--hold", type=float, default=0.5, help="seconds the upstream takes to answer")
    parser.add_argument("--b-interval", type=float, default=0.25)
    parser.add_argument("--admissions", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--backend", choices=tuple(BACKENDS), default="local")
    args = parser.parse_args()
    modes = [f"{mode} ({backend})" for backend in BACKENDS[args.backend] for mode in MODES]

    large = chat_body(data_url(image_bytes(LARGE_SIDE, LARGE_SIDE, "PNG"), "image/png"))
    small = chat_body(data_url(image_bytes(64, 64, "PNG"), "image/png"))
    large_bytes = LARGE_SIDE * LARGE_SIDE * 4
    upstream = StubUpstream()
    rows: dict[str, dict[str, list[float]]] = {mode: {} for mode in modes}

    def note(mode: str, key: str, value: float) -> None:
        rows[mode].setdefault(key, []).append(value)

    with ServerThread(upstream) as server, tempfile.TemporaryDirectory() as tmp:
        redis_server = None
        if "redis" in BACKENDS[args.backend]:
            redis_server = RedisServer(Path(tmp))
            redis_server.start()

        def fresh(mode: str) -> Path:
            """A gateway config of `mode` with a key prefix of its own: no tenant's service carries over."""
            redis_url = redis_server.url if redis_server is not None and "redis" in mode else None
            path = Path(tmp) / f"{mode.replace(' ', '-')}-{uuid.uuid4().hex[:8]}.yaml"
            path.write_text(config(server.url, mode.startswith("fair"), redis_url), encoding="utf-8")
            return path

        # The cost: every mode's gateway up at once, batches of admissions taking turns, so that what the machine
        # does meanwhile weighs on each mode alike.
        upstream.state.hold_s = 0.0
        with contextlib.ExitStack() as stack:
            paths = {mode: fresh(mode) for mode in modes}
            urls = {
                mode: stack.enter_context(served_process("gateway", path, log=path.with_suffix(".log"))).url
                for mode, path in paths.items()
            }
            for url in urls.values():
                asyncio.run(admissions(url, small, 50))  # warm-up
            cost: dict[str, list[float]] = {mode: [] for mode in modes}
            batch = 50
            for _ in range(max(1, args.admissions // batch)):
                for mode, url in urls.items():
                    cost[mode] += asyncio.run(admissions(url, small, batch))
            for mode in modes:
                note(mode, "cost_p50_ms", statistics.median(cost[mode]) * 1000)
        for _ in range(args.rounds):
            for mode in modes:
                path = fresh(mode)
                with served_process("gateway", path, log=path.with_suffix(".log")) as gateway:
                    upstream.state.hold_s = args.hold
                    done = asyncio.run(scenario(gateway.url, large, small, args))
                    waits = [max(0.0, latency - args.hold) for latency in done["b"]]
                    note(mode, "flood_a_rps", len(done["a"]) / args.seconds)
                    note(mode, "flood_b_rps", len(done["b"]) / args.seconds)
                    note(mode, "flood_b_wait_p50", percentile(waits, 0.5))
                    note(mode, "flood_b_wait_p99", percentile(waits, 0.99))
                # A gateway of its own: A's service from the flood would otherwise give B the budget.
                path = fresh(mode)
                with served_process("gateway", path, log=path.with_suffix(".log")) as gateway:
                    upstream.state.hold_s = args.hold
                    done = asyncio.run(scenario(gateway.url, large, None, args))
                    service = [len(done[t]) * large_bytes * args.hold for t in "ab"]
                    waits_a = [max(0.0, latency - args.hold) for latency in done["a"]]
                    waits_b = [max(0.0, latency - args.hold) for latency in done["b"]]
                    note(mode, "mutual_a_rps", len(done["a"]) / args.seconds)
                    note(mode, "mutual_b_rps", len(done["b"]) / args.seconds)
                    note(mode, "mutual_a_share", service[0] / sum(service))
                    note(mode, "mutual_a_wait_p99", percentile(waits_a, 0.99))
                    note(mode, "mutual_b_wait_p99", percentile(waits_b, 0.99))
                    note(mode, "mutual_jain", jain(service))

        if redis_server is not None:
            redis_server.stop()

    med = {mode: {key: statistics.median(values) for key, values in rows[mode].items()} for mode in modes}
    print(
        f"128MiB budget, upstream hold {args.hold:g} s, {args.seconds:g} s per scenario, A: {FLOOD} requests of a "
        f"{LARGE_SIDE}x{LARGE_SIDE} PNG (about 32 MiB reserved: 4 fill the budget) in flight; median of {args.rounds} "
        "rounds\n"
    )
    print("| scenario | metric | " + " | ".join(modes) + " |")
    print("| --- | --- |" + " ---: |" * len(modes))
    labels = [
        ("flood", "A throughput (req/s)", "flood_a_rps", "{:.2f}"),
        ("flood", f"B throughput (req/s, one every {args.b_interval:g} s)", "flood_b_rps", "{:.2f}"),
        ("flood", "B wait p50 (s)", "flood_b_wait_p50", "{:.3f}"),
        ("flood", "B wait p99 (s)", "flood_b_wait_p99", "{:.3f}"),
        ("mutual 1:1", "A throughput (req/s)", "mutual_a_rps", "{:.2f}"),
        ("mutual 1:1", "B throughput (req/s)", "mutual_b_rps", "{:.2f}"),
        ("mutual 1:1", "A's share of bytes x seconds", "mutual_a_share", "{:.3f}"),
        ("mutual 1:1", "A wait p99 (s)", "mutual_a_wait_p99", "{:.3f}"),
        ("mutual 1:1", "B wait p99 (s)", "mutual_b_wait_p99", "{:.3f}"),
        ("mutual 1:1", "Jain's fairness index", "mutual_jain", "{:.3f}"),
        ("cost", "latency per admission p50 (ms)", "cost_p50_ms", "{:.3f}"),
    ]
    for scenario_name, label, key, fmt in labels:
        print(f"| {scenario_name} | {label} | " + " | ".join(fmt.format(med[mode][key]) for mode in modes) + " |")
    print()
    for backend in BACKENDS[args.backend]:
        fifo, fair = med[f"fifo ({backend})"], med[f"fair ({backend})"]
        added = fair["cost_p50_ms"] / fifo["cost_p50_ms"] - 1
        print(f"added cost per admission, {backend} (fair vs FIFO, p50): {added:+.1%}")


if __name__ == "__main__":
    main()
