"""Time to first token request by request: each prompt sent direct to a real vLLM, through the bare aiohttp proxy and
through the gateway, one after another (by hand, not in CI):

    .venv/bin/python tests/bench/bench_ttft_paired.py [--requests 200] [--images 1] [--size 640x480]
        [--vllm-omp-threads N] [--baseline TREE]

`bench_aiperf_vllm.py` runs each path for a batch of requests and compares the batches' medians. On two cores
shared with vLLM those medians move by more than the gateway adds: vLLM's CPU backend runs its forward pass on as
many OpenMP threads as there are cores, and when any other process takes a core for a moment (the load generator,
vLLM's own API server, a proxy) a thread falls behind and the others wait for it; about 40 % of requests then take
twice as long, on every path. Here every prompt is a pair of measurements on each path, taken within a fraction
of a second of each other, and the differences are summarised: the median of the per-prompt differences does not
move with the share of slow requests.

Each request is one streaming chat completion (`max_tokens` 8, `ignore_eos`) with a prompt of about 60 random words
and `--images` fresh noise JPEGs (quality 75, 4:2:0, as `vllm bench serve`'s random-mm dataset makes them); the
paths go in a rotating order. Measured by the client for each request: the response headers (vLLM sends them
before the model runs, so a proxy's own work before it forwards shows there), the first token (the first chunk
with content), the end. The gateway's and the bare proxy's CPU time per request from their processes.

`--vllm-omp-threads 1` leaves a core to the rest: no request is slowed by a straggling thread, and the spread of
each path's own times shrinks to a few milliseconds. `--baseline TREE`: a second gateway from another checkout (a
`git worktree` of the commit to compare with), run in the same rotation.

vLLM, the gateway and the bare proxy are those of `bench_aiperf_vllm.py` (its checkpoint from `make e2e`).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import numpy as np
import simplejpeg

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.bench.bench_aiperf_vllm import (
    bare_proxy_process,
    environment,
    gateway_process,
    vllm_for_bench,
    vllm_install,
)
from tests.bench.bench_workers import tree_cpu_s
from tests.e2e.support import MODEL

WORDS = (
    "the",
    "a",
    "cat",
    "dog",
    "tree",
    "house",
    "blue",
    "red",
    "runs",
    "quickly",
    "over",
    "under",
    "image",
    "describe",
    "small",
    "large",
    "green",
)


@dataclass
class Target:
    name: str
    url: str
    pid: int | None
    headers_s: list[float] = field(default_factory=list)
    first_token_s: list[float] = field(default_factory=list)
    end_s: list[float] = field(default_factory=list)
    cpu_s: float = 0.0


def request_body(rng: np.random.Generator, images: int, width: int, height: int) -> bytes:
    content: list[dict[str, object]] = [{"type": "text", "text": " ".join(rng.choice(WORDS, 60))}]
    for _ in range(images):
        pixels = rng.integers(0, 256, size=(height, width, 3), dtype=np.uint8)
        jpeg = simplejpeg.encode_jpeg(pixels, quality=75, colorsubsampling="420")
        url = "data:image/jpeg;base64," + base64.b64encode(jpeg).decode()
        content.append({"type": "image_url", "image_url": {"url": url}})
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 8,
        "ignore_eos": True,
        "stream": True,
    }
    return json.dumps(body).encode()


async def timed(session: aiohttp.ClientSession, url: str, body: bytes) -> tuple[float, float, float]:
    """Seconds to the response headers, to the first chunk with content, to the end of the stream."""
    started = time.perf_counter()
    first: float | None = None
    async with session.post(
        url + "/v1/chat/completions", data=body, headers={"content-type": "application/json"}
    ) as response:
        headers = time.perf_counter() - started
        if response.status != 200:
            raise RuntimeError(f"{url}: {response.status} {await response.text()}")
        async for line in response.content:
            if first is None and line.startswith(b"data: {") and b'"content":"' in line and b'"content":""' not in line:
                first = time.perf_counter() - started
    if first is None:
        raise RuntimeError(f"{url}: no token in the stream")
    return headers, first, time.perf_counter() - started


async def measure(paths: list[Target], requests: int, images: int, width: int, height: int) -> None:
    rng = np.random.default_rng(7)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        for path in paths:  # warm-up: connections, vLLM's compiled shapes
            for _ in range(3):
                await timed(session, path.url, request_body(rng, images, width, height))
        for index in range(requests):
            body = request_body(rng, images, width, height)
            shift = index % len(paths)
            for path in paths[shift:] + paths[:shift]:
                before = tree_cpu_s(path.pid) if path.pid is not None else 0.0
                headers, first, end = await timed(session, path.url, body)
                if path.pid is not None:
                    path.cpu_s += tree_cpu_s(path.pid) - before
                path.headers_s.append(headers)
                path.first_token_s.append(first)
                path.end_s.append(end)


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:,.1f}"


def signed_ms(seconds: float) -> str:
    return f"{seconds * 1e3:+,.2f}"


def print_table(paths: list[Target], requests: int, images: int, size: str, omp_threads: str) -> None:
    direct = paths[0]
    print(
        f"\n{requests} prompts of {images} x {size} noise JPEG(s), each sent to every path in a rotating order; "
        f"{os.cpu_count()} cores; vLLM OpenMP threads: {omp_threads}\n"
    )
    print(
        "| path | TTFT p50 | p90 | mean | p50 ÷ direct | per-prompt TTFT − direct: median | mean | "
        "headers − direct: median | CPU per request |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for path in paths:
        ttft = path.first_token_s
        differences = [a - b for a, b in zip(ttft, direct.first_token_s, strict=True)]
        headers = [a - b for a, b in zip(path.headers_s, direct.headers_s, strict=True)]
        cpu = f"{path.cpu_s / requests * 1e3:.2f} ms" if path.pid is not None else ""
        print(
            f"| {path.name} | {ms(statistics.median(ttft))} ms | {ms(statistics.quantiles(ttft, n=10)[-1])} ms | "
            f"{ms(statistics.mean(ttft))} ms | {statistics.median(ttft) / statistics.median(direct.first_token_s):.3f} "
            f"| {signed_ms(statistics.median(differences))} ms | {signed_ms(statistics.mean(differences))} ms | "
            f"{signed_ms(statistics.median(headers))} ms | {cpu} |"
        )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, default=200, help="prompts, each sent to every path")
    parser.add_argument("--images", type=int, default=1)
    parser.add_argument("--size", default="640x480")
    parser.add_argument("--vllm-omp-threads", help="OMP_NUM_THREADS for vLLM (default: its own, one per core)")
    parser.add_argument("--baseline", type=Path, help="a checkout whose gateway runs as a fourth path")
    args = parser.parse_args()
    width, height = (int(part) for part in args.size.split("x"))
    python, checkpoint = vllm_install()
    home = Path(tempfile.mkdtemp(prefix="mmgate-bench-ttft-"))
    with contextlib.ExitStack() as stack:
        with environment(OMP_NUM_THREADS=args.vllm_omp_threads):
            vllm = stack.enter_context(vllm_for_bench(python, checkpoint, home))
        paths = [
            Target("direct", vllm.url, None),
            Target("bare proxy", *stack.enter_context(bare_proxy_process(vllm.url, home))),
        ]
        if args.baseline is not None:
            url, pid = stack.enter_context(
                gateway_process(vllm.url, home, "check", tree=args.baseline.resolve(), name="baseline")
            )
            paths.append(Target(f"gateway ({args.baseline.name})", url, pid))
        paths.append(Target("gateway", *stack.enter_context(gateway_process(vllm.url, home, "check"))))
        print(f"vLLM started in {vllm.started_in_s:.0f} s", flush=True)
        asyncio.run(measure(paths, args.requests, args.images, width, height))
    print_table(paths, args.requests, args.images, args.size, args.vllm_omp_threads or "one per core")


if __name__ == "__main__":
    main()
