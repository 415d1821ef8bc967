"""Fairness against clients that mint identities, and the tenant state they leave, through a real gateway process
(run by hand, not in CI).

    .venv/bin/python tests/bench/bench_identities.py flood [--seconds 12] [--backend local|redis|both]
    .venv/bin/python tests/bench/bench_identities.py states [--keys 60000] [--backend local|redis|both]
    .venv/bin/python tests/bench/bench_identities.py maxmemory [--seconds 10] [--after 15] [--headroom 1MiB]
    .venv/bin/python tests/bench/bench_identities.py redis-memory [--tenants 2000]

Tenants are API keys (`limits.fairness.tenant_from: api_key`, the default), which the gateway hashes and never
checks. A stub upstream holds each request `--hold` seconds.

- flood: a 64MiB budget, a 6 s admission timeout. 24 attacking clients send a 2048x2048 PNG (a gradient: a small
  body, 16 MiB of pixels) again as soon as they are answered, with one key (one-key) or a fresh random key each
  time (fresh-key); an honest tenant sends one 64x64 PNG every 0.25 s with its own key. FIFO
  (`limits.fairness.enabled: false`) and fair on each backend asked for. The honest tenant's wait is its latency
  less the upstream's hold for a 200, the time to its refusal otherwise.
- states: `--keys` sequential small requests (16 clients), each with a fresh key, then the tenant states the
  budget keeps (local: `mmgate_budget_tenant_states` when the gateway exports it, and the gateway's RSS growth;
  redis: the records under the prefix and Redis's `used_memory` growth), right away and after `--idle` seconds.
- maxmemory: a redis-server with `maxmemory` at what it uses plus `--headroom` and `noeviction`; 16 clients send
  small requests with fresh keys for `--seconds`, then one client sends one every 0.1 s for `--after` seconds: the
  statuses of each second.
- redis-memory: what a tenant costs Redis (`used_memory`), with a `RedisBudget` in this process: `--tenants`
  tenants each waiting with one request, then as many tenants served while those wait (so that each keeps an idle
  record for its lead), then as many holding a lease.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import io
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import redis
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.gateway.media_factory import chat_body, data_url, image_bytes
from tests.gateway.stub_upstream import StubUpstream
from tests.observe import metric_in, until
from tests.redis_server import RedisServer
from tests.servers import ServedProcess, ServerThread, served_process

BACKENDS = {"local": ("local",), "redis": ("redis",), "both": ("local", "redis")}
ATTACKERS = 24
LARGE_SIDE = 2048
CHAT = "/v1/chat/completions"


def gradient_png(side: int) -> bytes:
    """A PNG of `side` x `side` RGB pixels that compresses well: a small body, all of its pixels to decode."""
    ramp = np.arange(side, dtype=np.uint16)
    pixels = np.stack([(ramp[None, :] + ramp[:, None]) % 256, np.broadcast_to(ramp[None, :] % 256, (side, side))], -1)
    pixels = np.concatenate([pixels, pixels[..., :1]], axis=-1).astype(np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels, "RGB").save(out, format="PNG")
    return out.getvalue()


def config(upstream_url: str, *, fair: bool, redis_url: str | None, prefix: str, extra: str = "") -> str:
    shared = f"  budget_backend: redis\nredis:\n  url: {redis_url}\n  key_prefix: {prefix}\n" if redis_url else ""
    return (
        f"upstream:\n  url: {upstream_url}\nserver:\n  access_log: false\n"
        "media:\n  processor: null\n  decode: header\n"
        "limits:\n  max_multimodal_cpu_bytes: 64MiB\n  max_multimodal_cpu_bytes_per_request: 64MiB\n"
        "  admission_timeout_s: 6\n  max_buffered_body_bytes: 2GiB\n"
        f"  fairness:\n    enabled: {'true' if fair else 'false'}\n{extra}" + shared
    )


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))] if ordered else float("nan")


def statuses(counter: collections.Counter[int]) -> str:
    return ", ".join(f"{count} x {code}" for code, count in sorted(counter.items())) or "-"


class Bench:
    def __init__(self, args: argparse.Namespace, stack: contextlib.ExitStack) -> None:
        self.args = args
        self.tmp = Path(stack.enter_context(tempfile.TemporaryDirectory()))
        self.upstream = StubUpstream()
        self.server = stack.enter_context(ServerThread(self.upstream))
        self.redis: RedisServer | None = None

    def start_redis(self) -> RedisServer:
        if self.redis is None:
            self.redis = RedisServer(self.tmp)
            self.redis.start()
        return self.redis

    @contextlib.contextmanager
    def gateway(self, backend: str, *, fair: bool = True, extra: str = "") -> Iterator[tuple[ServedProcess, str]]:
        """A gateway on `backend` with a key prefix of its own; yields it and its prefix."""
        redis_url = self.start_redis().url if backend == "redis" else None
        prefix = f"bench-{uuid.uuid4().hex[:8]}"
        path = self.tmp / f"{backend}-{prefix}.yaml"
        path.write_text(config(self.server.url, fair=fair, redis_url=redis_url, prefix=prefix, extra=extra))
        with served_process("gateway", path, log=path.with_suffix(".log")) as gateway:
            yield gateway, prefix


# -- flood -------------------------------------------------------------------------------------------------------


async def flood_run(
    url: str, large: bytes, small: bytes, fresh: bool, seconds: float, hold: float
) -> dict[str, object]:
    endpoint = url + CHAT
    attacker: collections.Counter[int] = collections.Counter()
    honest: collections.Counter[int] = collections.Counter()
    waits: list[float] = []
    limits = httpx.Limits(max_connections=ATTACKERS + 64)
    async with httpx.AsyncClient(timeout=120, limits=limits) as client:
        until = time.perf_counter() + seconds

        async def attack() -> None:
            while time.perf_counter() < until:
                key = uuid.uuid4().hex if fresh else "attacker"
                response = await client.post(endpoint, content=large, headers={"authorization": f"Bearer {key}"})
                attacker[response.status_code] += 1

        async def one() -> None:
            started = time.perf_counter()
            response = await client.post(endpoint, content=small, headers={"authorization": "Bearer honest"})
            latency = time.perf_counter() - started
            honest[response.status_code] += 1
            waits.append(max(0.0, latency - hold) if response.status_code == 200 else latency)

        tasks = [asyncio.ensure_future(attack()) for _ in range(ATTACKERS)]
        await asyncio.sleep(1.0)  # the attackers' queue forms first
        while time.perf_counter() < until:
            tasks.append(asyncio.ensure_future(one()))
            await asyncio.sleep(0.25)
        await asyncio.gather(*tasks)
    return {"attacker": attacker, "honest": honest, "waits": waits}


def flood(bench: Bench) -> None:
    args = bench.args
    large = chat_body(data_url(gradient_png(LARGE_SIDE), "image/png"))
    small = chat_body(data_url(image_bytes(64, 64, "PNG"), "image/png"))
    bench.upstream.state.hold_s = args.hold
    print(
        f"64MiB budget, admission timeout 6 s, upstream hold {args.hold:g} s, {args.seconds:g} s per run; "
        f"{ATTACKERS} attacking clients of a {LARGE_SIDE}x{LARGE_SIDE} PNG ({len(large):,}-byte body); "
        "the honest tenant sends a 64x64 PNG every 0.25 s\n"
    )
    print(
        "| backend | queue | flood | honest wait p50 (s) | honest wait p99 (s) | honest statuses | attacker statuses |"
    )
    print("| --- | --- | --- | ---: | ---: | --- | --- |")
    for backend in BACKENDS[args.backend]:
        for fair in (False, True):
            for fresh in (False, True):
                with bench.gateway(backend, fair=fair) as (gateway, _):
                    result = asyncio.run(flood_run(gateway.url, large, small, fresh, args.seconds, args.hold))
                waits = result["waits"]
                assert isinstance(waits, list)
                print(
                    f"| {backend} | {'fair' if fair else 'FIFO'} | {'fresh-key' if fresh else 'one-key'} | "
                    f"{percentile(waits, 0.5):.3f} | {percentile(waits, 0.99):.3f} | "
                    f"{statuses(result['honest'])} | {statuses(result['attacker'])} |",  # type: ignore[arg-type]
                    flush=True,
                )


# -- states ------------------------------------------------------------------------------------------------------


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


async def fresh_keys(url: str, body: bytes, count: int, clients: int = 16) -> collections.Counter[int]:
    seen: collections.Counter[int] = collections.Counter()
    left = iter(range(count))
    async with httpx.AsyncClient(timeout=60) as client:

        async def run() -> None:
            for _ in left:
                response = await client.post(
                    url + CHAT, content=body, headers={"authorization": f"Bearer {uuid.uuid4().hex}"}
                )
                seen[response.status_code] += 1

        await asyncio.gather(*(run() for _ in range(clients)))
    return seen


def redis_state(server: RedisServer, prefix: str) -> tuple[int, int]:
    """The tenant records under the prefix, and Redis's `used_memory`."""
    with server.client() as client:
        return int(client.hlen("{" + prefix + "}:tenants")), int(client.info("memory")["used_memory"])


def states(bench: Bench) -> None:
    args = bench.args
    small = chat_body(data_url(image_bytes(8, 8, "PNG"), "image/png"))
    rows = []
    for backend in BACKENDS[args.backend]:
        with bench.gateway(backend) as (gateway, prefix):
            asyncio.run(fresh_keys(gateway.url, small, 500))  # warm-up
            pid = gateway.process.pid
            rss_before = rss_bytes(pid)
            redis_before = redis_state(bench.redis, prefix) if bench.redis and backend == "redis" else (0, 0)
            started = time.perf_counter()
            seen = asyncio.run(fresh_keys(gateway.url, small, args.keys))
            took = time.perf_counter() - started
            for when in ("right after", f"after {args.idle:g} s idle"):
                if when != "right after":
                    time.sleep(args.idle)
                text = httpx.get(gateway.url + "/metrics", timeout=10).text
                exported = "mmgate_budget_tenant_states" in text
                if backend == "local":
                    count = f"{metric_in(text, 'mmgate_budget_tenant_states'):,.0f}" if exported else "not exported"
                    grown = rss_bytes(pid) - rss_before
                    rows.append((backend, when, count, f"{grown / 2**20:.1f} MiB RSS", statuses(seen), took))
                else:
                    assert bench.redis is not None
                    records, used = redis_state(bench.redis, prefix)
                    grown = used - redis_before[1]
                    rows.append((backend, when, f"{records:,}", f"{grown / 2**20:.2f} MiB", statuses(seen), took))
    print(f"{args.keys:,} requests, each with a fresh API key, 16 clients\n")
    print("| backend | when | tenant states | memory grown | statuses | seconds |")
    print("| --- | --- | ---: | ---: | --- | ---: |")
    for backend, when, count, grown, seen_text, took in rows:
        print(f"| {backend} | {when} | {count} | {grown} | {seen_text} | {took:.0f} |")


# -- maxmemory ---------------------------------------------------------------------------------------------------


def parse_bytes(text: str) -> int:
    units = {"KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}
    for unit, scale in units.items():
        if text.endswith(unit):
            return int(float(text[: -len(unit)]) * scale)
    return int(text)


def maxmemory(bench: Bench) -> None:
    args = bench.args
    small = chat_body(data_url(image_bytes(8, 8, "PNG"), "image/png"))
    server = bench.start_redis()
    with bench.gateway("redis") as (gateway, prefix):
        asyncio.run(fresh_keys(gateway.url, small, 50))
        with server.client() as client:
            used = int(client.info("memory")["used_memory"])
            limit = used + parse_bytes(args.headroom)
            client.config_set("maxmemory", limit)
            client.config_set("maxmemory-policy", "noeviction")
        by_second: dict[int, collections.Counter[int]] = collections.defaultdict(collections.Counter)

        async def run() -> float:
            started = time.perf_counter()
            async with httpx.AsyncClient(timeout=60) as client:
                stop = started + args.seconds

                async def flood_client() -> None:
                    while time.perf_counter() < stop:
                        response = await client.post(
                            gateway.url + CHAT, content=small, headers={"authorization": f"Bearer {uuid.uuid4().hex}"}
                        )
                        by_second[int(time.perf_counter() - started)][response.status_code] += 1

                await asyncio.gather(*(flood_client() for _ in range(16)))
                ended = time.perf_counter()
                while time.perf_counter() < ended + args.after:
                    response = await client.post(
                        gateway.url + CHAT, content=small, headers={"authorization": f"Bearer {uuid.uuid4().hex}"}
                    )
                    by_second[int(time.perf_counter() - started)][response.status_code] += 1
                    await asyncio.sleep(0.1)
            return ended - started

        flood_s = asyncio.run(run())
        records, used_now = redis_state(server, prefix)
    print(
        f"redis-server maxmemory {limit:,} bytes ({args.headroom} over what it used), noeviction; 16 clients with a "
        f"fresh key per request for {args.seconds:g} s, then one request every 0.1 s for {args.after:g} s\n"
    )
    print("| second | phase | statuses |")
    print("| ---: | --- | --- |")
    for second in sorted(by_second):
        phase = "flood" if second < flood_s else "after"
        print(f"| {second} | {phase} | {statuses(by_second[second])} |")
    print(f"\ntenant records at the end: {records:,}; used_memory {used_now:,} of {limit:,}")


async def redis_memory_run(url: str, tenants: int) -> list[tuple[str, int, int]]:
    from gateway.budget.redis import RedisBudget
    from gateway.tenants import Tenant

    budget = RedisBudget(
        url=url, key_prefix=f"bench-{uuid.uuid4().hex[:8]}", capacity=1 << 40, timeout_s=None, max_queued=None
    )
    await budget.start()
    client = redis.Redis.from_url(url)

    def used() -> int:
        return int(client.info("memory")["used_memory"])

    def key() -> Tenant:
        return Tenant(uuid.uuid4().hex[:16], "other")  # as long as an API key's id

    rows = []
    holder = await budget.reserve((1 << 40) - 10 * tenants, tenant=key())
    start = used()
    waiting = [asyncio.ensure_future(budget.reserve(1 << 30, tenant=key())) for _ in range(tenants)]
    await until(
        lambda: budget.waiting >= tenants and all(w.queued for w in budget.holdings.waiters.values()),
        timeout_s=60,
        what="every tenant waiting",
    )
    waited = used()
    rows.append(("waiting with one request", tenants, waited - start))
    for _ in range(tenants):
        (await budget.reserve(10, tenant=key())).release()
    await budget.flush()
    idle = int(client.hlen(budget.keys["tenants"])) - tenants - 1
    served = used()
    rows.append(("idle, keeping its lead", idle, served - waited))
    held = [await budget.reserve(1, tenant=key()) for _ in range(tenants)]
    rows.append(("holding a lease", tenants, used() - served))
    for task in waiting:
        task.cancel()
    await asyncio.gather(*waiting, return_exceptions=True)
    for reservation in held:
        reservation.release()
    holder.release()
    await budget.aclose()
    client.close()
    return rows


def redis_memory(bench: Bench) -> None:
    rows = asyncio.run(redis_memory_run(bench.start_redis().url, bench.args.tenants))
    print("Redis used_memory per tenant (tenant ids of 16 characters, the class other)\n")
    print("| tenants | count | bytes | bytes each |")
    print("| --- | ---: | ---: | ---: |")
    for what, count, grown in rows:
        print(f"| {what} | {count:,} | {grown:,} | {grown / max(count, 1):,.0f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("scenario", choices=("flood", "states", "maxmemory", "redis-memory"))
    parser.add_argument("--backend", choices=tuple(BACKENDS), default="both")
    parser.add_argument("--seconds", type=float, default=12.0)
    parser.add_argument("--hold", type=float, default=0.5)
    parser.add_argument("--keys", type=int, default=60_000)
    parser.add_argument("--idle", type=float, default=10.0)
    parser.add_argument("--after", type=float, default=15.0)
    parser.add_argument("--headroom", default="1MiB")
    parser.add_argument("--tenants", type=int, default=2000)
    args = parser.parse_args()
    with contextlib.ExitStack() as stack:
        bench = Bench(args, stack)
        try:
            scenarios = {"flood": flood, "states": states, "maxmemory": maxmemory, "redis-memory": redis_memory}
            scenarios[args.scenario](bench)
        finally:
            if bench.redis is not None:
                bench.redis.stop()


if __name__ == "__main__":
    main()
