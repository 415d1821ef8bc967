"""A longer soak of the gateway process: identical rounds of mixed traffic against one `python -m gateway`, with
the budget, the 5xx count and the process RSS read after each round.

    .venv/bin/python tests/bench/bench_soak.py [--clients 150] [--seconds 60] [--rounds 2] [--allocator both]

`--allocator both` (the default) runs the soak twice, side by side: first with glibc's malloc as it comes (the
baseline, `server.malloc_trim_interval_s: null`), then with the gateway's default (the heap trimmed once a second,
serving/allocator.py), and ends with RSS at start, after each round and at its peak (VmHWM) against the budget for
each.

Loopback only. The gateway runs as a subprocess from a temporary YAML config (so its RSS is read from
/proc/<pid>/status); the upstream is `tests/gateway/fault_upstream.py` in a second subprocess, picking each
request's behaviour from its `x-fault` header. Each client loops over a weighted mix: text-only, small images on
the three routes, streamed answers, images over the per-request cap, corrupt images, an upstream that answers
slowly, hangs (504), closes (502) or resets mid-stream, clients that send their body slowly, and clients that leave
(queued, decoding, awaiting headers or mid-stream). A round stops at its time or at `--max-requests`, whichever
comes first; then the gateway is given up to 10 s to finish what the leavers left, and the round's row is printed.

Per round: requests/s held, answers by class, 5xx that no injected fault explains (must be 0), the budget bytes
still reserved and requests still waiting once idle (must be 0), the gateway's RSS, and p50/p99 latency of
small-image requests answered 200.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import os
import random
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import aiohttp
import httpx
from PIL import Image
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tests.gateway.media_factory import chat_body, data_url, image_bytes, messages_body, responses_body  # noqa: E402
from tests.observe import process_memory  # noqa: E402
from tests.servers import served_process  # noqa: E402

CHAT, MESSAGES, RESPONSES = ROUTES = ("/v1/chat/completions", "/v1/messages", "/v1/responses")

CONFIG = """
server:
  host: 127.0.0.1
  malloc_trim_interval_s: {trim}
  access_log: false
  log_level: warning
  drain_timeout_s: 1
upstream:
  url: {upstream}
  read_timeout_s: 1.0
limits:
  budget_mode: slots
  max_multimodal_cpu_bytes: {total}
  max_multimodal_cpu_bytes_per_request: {share}
  admission_timeout_s: 2.0
  max_queued_requests: 256
media:
  load_workers: 2
  processor: null
"""

UPSTREAM = """
import sys, time
from tests.gateway.fault_upstream import FaultUpstream
with FaultUpstream() as upstream:
    print(upstream.url, flush=True)
    sys.stdin.read()
"""

# kind: weight. Faults: "slow" 0.2 s before headers, "hang" until upstream.read_timeout_s (504), "close" (502),
# "reset" mid-stream (a truncated 200), "stream" a whole event stream.
KINDS = {
    "text": 4,
    "image": 6,
    "stream": 2,
    "over_cap": 1,
    "corrupt": 1,
    "slow": 1,
    "hang": 1,
    "close": 1,
    "reset": 1,
    "slow_client": 1,
    "leave": 2,
}
FAULTS = {"slow": "slow=0.2", "hang": "hang", "close": "close", "reset": "reset", "stream": "sse"}
INJECTED_5XX = {"hang": 504, "close": 502}


def bodies(side: int = 32) -> dict[str, bytes]:
    """`side`: the side of the images the image kinds send (random pixels, as large as photographs compress)."""
    small = [data_url(image_bytes(side, side, seed=i)) for i in range(2)]
    out = io.BytesIO()
    Image.new("RGB", (400, 400), (10, 120, 200)).save(out, format="PNG")  # 480,000 decoded bytes
    return {
        "text": chat_body(),
        CHAT: chat_body(*small),
        MESSAGES: messages_body(image_bytes(side, side)),
        RESPONSES: responses_body(*small),
        "stream": chat_body(small[0], stream=True),
        "over_cap": chat_body(data_url(out.getvalue())),
        "corrupt": chat_body(data_url(image_bytes(64, 64)[:300])),
    }


def scrape(url: str) -> tuple[float, float, float, Counter[int]]:
    """(budget in use, waiting, in flight, answers on the admission routes by code)."""
    text = httpx.get(url + "/metrics", timeout=5).text
    values: dict[str, float] = {}
    codes: Counter[int] = Counter()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "mmgate_requests_total" and sample.labels["route"] in ROUTES:
                codes[int(sample.labels["code"])] += int(sample.value)
            elif not sample.labels:
                values[sample.name] = sample.value
    return (
        values["mmgate_budget_in_use_bytes"],
        values["mmgate_budget_waiting_requests"],
        values["mmgate_inflight_requests"],
        codes,
    )


def rss_mib(pid: int, field: str = "VmRSS") -> float:
    return process_memory(pid, field) / (1 << 20)


class Round:
    def __init__(self) -> None:
        self.outcomes: Counter[tuple[str, Any]] = Counter()
        self.sent = 0
        self.small_image_ms: list[float] = []


async def run_round(
    url: str, clients: int, seconds: float, max_requests: int, seed: int, image_side: int = 32
) -> tuple[Round, float]:
    result = Round()
    payloads = bodies(image_side)
    kinds = list(KINDS)
    weights = list(KINDS.values())
    host, port = url.removeprefix("http://").split(":")
    deadline = time.monotonic() + seconds

    async def raw(rng: random.Random, leave: bool) -> int | str:
        """A media request on its own connection: sent slowly and read to the end, or sent whole and left."""
        fault = rng.choice(["", "slow=0.3", "stall"]) if leave else ""
        body = payloads["stream"] if fault == "stall" else payloads[CHAT]
        extra = f"x-fault: {fault}\r\n" if fault else ""
        head = f"POST {CHAT} HTTP/1.1\r\nhost: g\r\ncontent-length: {len(body)}\r\nconnection: close\r\n{extra}\r\n"
        reader, writer = await asyncio.open_connection(host, int(port))
        try:
            if leave:
                writer.write(head.encode() + body)
                await writer.drain()
                await asyncio.sleep(rng.random() * 0.2)
                return "left"
            writer.write(head.encode())
            pieces = 8
            step = len(body) // pieces + 1
            for i in range(0, len(body), step):
                writer.write(body[i : i + step])
                await writer.drain()
                await asyncio.sleep(0.05)
            status = int((await reader.readline()).split()[1])
            await reader.read()
            return status
        finally:
            writer.close()
            await writer.wait_closed()

    async def one(session: aiohttp.ClientSession, kind: str, rng: random.Random) -> Any:
        if kind in ("leave", "slow_client"):
            return await raw(rng, leave=kind == "leave")
        route = rng.choice(ROUTES) if kind == "image" else CHAT
        body = payloads[route] if kind == "image" else payloads.get(kind, payloads[CHAT])
        headers = {"x-fault": FAULTS[kind]} if kind in FAULTS else {}
        started = time.perf_counter()
        try:
            async with session.post(url + route, data=body, headers=headers) as response:
                await response.read()
                status = response.status
        except aiohttp.ClientPayloadError:
            return "truncated"
        if kind == "image" and status == 200:
            result.small_image_ms.append((time.perf_counter() - started) * 1000)
        return status

    async def worker(seed: int, session: aiohttp.ClientSession) -> None:
        rng = random.Random(seed)
        while time.monotonic() < deadline and result.sent < max_requests:
            kind = rng.choices(kinds, weights)[0]
            result.sent += 1
            try:
                outcome = await one(session, kind, rng)
            except (aiohttp.ClientError, OSError, TimeoutError) as exc:
                outcome = type(exc).__name__
            result.outcomes[(kind, outcome)] += 1

    started = time.monotonic()
    connector = aiohttp.TCPConnector(limit=clients)
    timeout = aiohttp.ClientTimeout(total=30)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        await asyncio.gather(*(worker(seed * 10_000 + i, session) for i in range(clients)))
    return result, time.monotonic() - started


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=150)
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--max-requests", type=int, default=500_000, help="per round")
    parser.add_argument("--slots", type=int, default=16, help="budget slots of --share-kib each")
    parser.add_argument("--share-kib", type=int, default=256, help="the per-request cap (a slot), KiB")
    parser.add_argument("--image-side", type=int, default=32, help="side of the images sent, pixels")
    parser.add_argument("--allocator", choices=("both", "trimmed", "default"), default="both")
    args = parser.parse_args()

    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    upstream = subprocess.Popen(
        [sys.executable, "-c", UPSTREAM], cwd=ROOT, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert upstream.stdout is not None
    upstream_url = upstream.stdout.readline().strip()
    modes = {"both": (False, True), "trimmed": (True,), "default": (False,)}[args.allocator]
    memory: list[tuple[str, float, list[float], float]] = []
    try:
        for trimmed in modes:
            memory.append(soak(args, upstream_url, env, trimmed=trimmed))
    finally:
        if upstream.stdin is not None:
            upstream.stdin.close()
        try:
            upstream.wait(15)
        except subprocess.TimeoutExpired:
            upstream.kill()
            upstream.wait()
    budget = args.slots * args.share_kib / 1024
    rounds = " | ".join(f"after round {n}" for n in range(1, args.rounds + 1))
    print(f"\n| allocator | RSS at start | {rounds} | peak (VmHWM) | budget |")
    print("| --- | ---: |" + " ---: |" * args.rounds + " ---: | ---: |")
    for name, start, after, peak in memory:
        cells = " | ".join(f"{value:.0f} MiB" for value in after)
        print(f"| {name} | {start:.0f} MiB | {cells} | {peak:.0f} MiB | {budget:.0f} MiB |")


def soak(
    args: argparse.Namespace, upstream_url: str, env: dict[str, str], *, trimmed: bool
) -> tuple[str, float, list[float], float]:
    """One soak against a fresh gateway; (allocator, RSS at start, RSS after each round, peak RSS) in MiB."""
    name = "trimmed once a second (default)" if trimmed else "glibc as it comes (baseline)"
    with tempfile.TemporaryDirectory(prefix="mmgate-soak-") as tmp:
        config = Path(tmp) / "gateway.yaml"
        share = args.share_kib << 10
        text = CONFIG.format(
            upstream=upstream_url, total=args.slots * share, share=share, trim="1" if trimmed else "null"
        )
        config.write_text(text)
        with served_process("gateway", config, log=Path(tmp) / "gateway.log", env=env) as served:
            gateway, url = served.process, served.url
            rss_start = rss_mib(gateway.pid)
            print(
                f"\nsoak, {name}: {args.rounds} rounds x {args.seconds:g} s, {args.clients} clients; budget "
                f"{args.slots * share:,} bytes in {args.slots} slots; gateway pid {gateway.pid}, "
                f"RSS at start {rss_start:.1f} MiB\n"
            )
            rows = []
            before: Counter[int] = Counter()
            for number in range(1, args.rounds + 1):
                result, elapsed = asyncio.run(
                    run_round(url, args.clients, args.seconds, args.max_requests, number, args.image_side)
                )
                idle_deadline = time.monotonic() + 10
                while True:
                    in_use, waiting, inflight, codes = scrape(url)
                    counted = (codes - before).total()
                    settled = in_use == 0 and waiting == 0 and inflight <= 1 and counted >= result.sent
                    if settled or time.monotonic() > idle_deadline:
                        break
                    time.sleep(0.1)
                delta = codes - before
                before = codes
                injected = sum(n for (kind, outcome), n in result.outcomes.items() if INJECTED_5XX.get(kind) == outcome)
                server_5xx = sum(n for code, n in delta.items() if code >= 500)
                unexplained = server_5xx - injected
                truncated = sum(n for (_, outcome), n in result.outcomes.items() if outcome == "truncated")
                client_errors = sum(
                    n
                    for (_, outcome), n in result.outcomes.items()
                    if isinstance(outcome, str) and outcome not in ("left", "truncated")
                )
                rows.append(
                    {
                        "round": number,
                        "seconds": elapsed,
                        "sent": result.sent,
                        "counted": delta.total(),
                        "rps": result.sent / elapsed,
                        "200": delta[200],
                        "4xx": sum(n for code, n in delta.items() if 400 <= code < 500 and code != 499),
                        "429": delta[429],
                        "499": delta[499],
                        "5xx injected": injected,
                        "5xx other": unexplained,
                        "truncated": truncated,
                        "client errors": client_errors,
                        "leaked bytes": int(in_use),
                        "waiting": int(waiting),
                        "RSS MiB": rss_mib(gateway.pid),
                        "p50 ms": percentile(result.small_image_ms, 0.50),
                        "p99 ms": percentile(result.small_image_ms, 0.99),
                    }
                )
                print(f"round {number}: {sorted(result.outcomes.items(), key=lambda kv: str(kv[0]))}")
            peak = rss_mib(gateway.pid, "VmHWM")
    print()
    columns = list(rows[0])
    print("| " + " | ".join(columns) + " |")
    print("| " + " | ".join("---:" for _ in columns) + " |")
    for row in rows:
        cells = [f"{v:.1f}" if isinstance(v, float) else str(v) for v in row.values()]
        print("| " + " | ".join(cells) + " |")
    failures = [
        f"round {row['round']}: {key} = {row[key]}"
        for row in rows
        for key in ("leaked bytes", "waiting", "5xx other")
        if row[key] != 0
    ]
    failures += [
        f"round {row['round']}: counted {row['counted']} of {row['sent']} requests"
        for row in rows
        if row["counted"] != row["sent"]
    ]
    print("\n" + ("FAIL:\n  " + "\n  ".join(failures) if failures else "OK: no leak, no unexplained 5xx"))
    return name, rss_start, [row["RSS MiB"] for row in rows], peak


if __name__ == "__main__":
    main()
