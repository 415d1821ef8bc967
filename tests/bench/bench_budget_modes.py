"""The media budget's two modes side by side in one run: wall time of a burst of ordinary image requests.

    .venv/bin/python tests/bench/bench_budget_modes.py [--requests 12] [--latency 1.0] [--rounds 3]

A stub upstream answers each non-streaming request after `--latency` seconds (a VLM generating its whole answer
before the first byte, which is when the budget returns with `release_on: first_byte`). A gateway process with the
shipped limits (2GiB budget, 512MiB per request) gets `--requests` concurrent chat requests, each with one 640x480
JPEG, once with `budget_mode: slots` (4 slots: the requests go through in waves) and once with `budget_mode: bytes`
(each reserves the ~2 MB its header predicts: one wave). Rounds interleave the modes; the table reports medians.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.gateway.media_factory import chat_body, data_url, image_bytes
from tests.gateway.stub_upstream import StubUpstream
from tests.servers import ServerThread, served_process

MODES = ("slots", "bytes")


async def burst(url: str, body: bytes, requests: int) -> tuple[float, list[int]]:
    async with httpx.AsyncClient(timeout=120) as client:
        started = time.perf_counter()
        responses = await asyncio.gather(
            *(client.post(url + "/v1/chat/completions", content=body) for _ in range(requests))
        )
        return time.perf_counter() - started, [response.status_code for response in responses]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=12)
    parser.add_argument("--latency", type=float, default=1.0, help="seconds the upstream takes to answer")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()

    body = chat_body(data_url(image_bytes(640, 480)))
    upstream = StubUpstream()
    upstream.state.hold_s = args.latency
    walls: dict[str, list[float]] = {mode: [] for mode in MODES}
    peaks: dict[str, list[int]] = {mode: [] for mode in MODES}
    with ServerThread(upstream) as server, tempfile.TemporaryDirectory() as tmp:
        for mode in MODES:
            config = Path(tmp) / f"{mode}.yaml"
            config.write_text(
                f"upstream:\n  url: {server.url}\nserver:\n  access_log: false\nlimits:\n  budget_mode: {mode}\n",
                encoding="utf-8",
            )
        for _ in range(args.rounds):
            for mode in MODES:
                with served_process("gateway", Path(tmp) / f"{mode}.yaml", log=Path(tmp) / f"{mode}.log") as gateway:
                    asyncio.run(burst(gateway.url, body, 1))  # warm-up: imports, connection pool
                    with upstream.state.lock:
                        upstream.state.max_active = 0
                    wall, statuses = asyncio.run(burst(gateway.url, body, args.requests))
                assert statuses == [200] * args.requests, statuses
                walls[mode].append(wall)
                peaks[mode].append(upstream.state.max_active)

    print(
        f"{args.requests} concurrent chat requests, one 640x480 JPEG each ({len(body):,} bytes), upstream latency "
        f"{args.latency:g} s, shipped limits (2GiB budget, 512MiB per request), median of {args.rounds} rounds\n"
    )
    print("| budget_mode | wall time (s) | at the upstream at once | waves of upstream latency |")
    print("| --- | --- | --- | --- |")
    for mode in MODES:
        wall = statistics.median(walls[mode])
        print(f"| {mode} | {wall:.2f} | {max(peaks[mode])} | {wall / args.latency:.1f} |")


if __name__ == "__main__":
    main()
