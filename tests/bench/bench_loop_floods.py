"""`/healthz` under floods of requests the limits admit: how long one request's work holds the event loop.

    .venv/bin/python tests/bench/bench_loop_floods.py [--connections 32] [--seconds 10] [--baseline TREE]

For each flood, a fresh gateway process (default limits) in front of the stub upstream gets `--connections`
connections sending the same body back to back for `--seconds`, while `/healthz` is asked every 50 ms on a
connection of its own; the table gives its latency (p50, p99, max) beside what the flood got through. A liveness
probe's default timeout is 1 s. `--baseline TREE` runs the same against the gateway of another checkout first.

Floods: a 1 MiB text-only chat body of 199,990 strings; a 1 MiB text-only body of one string; 1 MiB of a
noise JPEG (one image, the shape the gateway may check on the event loop's thread); a 2.6 MB body of 4 noise JPEGs.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import httpx
import orjson
import yaml

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tests.bench.bench_refusals import command  # noqa: E402
from tests.gateway.media_factory import chat_body, data_url, image_bytes  # noqa: E402
from tests.gateway.stub_upstream import StubUpstream  # noqa: E402
from tests.servers import ServerThread, served_process  # noqa: E402

CHAT = "/v1/chat/completions"


def short_strings() -> bytes:
    """Just over 1 MiB, the size from which a body's long literals were walked in Python before parsing."""
    texts = [{"type": "text", "text": "a" * 60_000}]
    body = {"model": "m", "messages": [{"role": "user", "content": texts}], "stop": ["ab"] * 199_980}
    return orjson.dumps(body)


def one_string() -> bytes:
    return chat_body(text="a" * (1 << 20))


def one_jpeg() -> bytes:
    return chat_body(data_url(image_bytes(1250, 1250)))  # a noise JPEG just under 1 MiB


def four_jpegs() -> bytes:
    return chat_body(*(data_url(image_bytes(640, 480, seed=i)) for i in range(4)))


FLOODS = {
    "199,990 strings": short_strings,
    "one 1 MiB string": one_string,
    "one JPEG under 1 MiB": one_jpeg,
    "four JPEGs": four_jpegs,
}


async def flood(url: str, body: bytes, connections: int, seconds: float) -> tuple[list[float], Counter[int]]:
    """Health latencies (s) while the flood runs, and the flood's statuses."""
    statuses: Counter[int] = Counter()
    stop = time.monotonic() + seconds

    async def sender() -> None:
        async with httpx.AsyncClient(timeout=60) as client:
            while time.monotonic() < stop:
                try:
                    statuses[(await client.post(url + CHAT, content=body)).status_code] += 1
                except httpx.TransportError:
                    statuses[0] += 1

    async def prober() -> list[float]:
        latencies = []
        async with httpx.AsyncClient(timeout=30) as client:
            await asyncio.sleep(0.5)  # the flood under way
            while time.monotonic() < stop:
                started = time.perf_counter()
                await client.get(url + "/healthz")
                latencies.append(time.perf_counter() - started)
                await asyncio.sleep(0.05)
        return latencies

    *_, latencies = await asyncio.gather(*(sender() for _ in range(connections)), prober())
    return latencies, statuses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--connections", type=int, default=32)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--baseline", type=Path)
    parser.add_argument("--only", nargs="*", choices=list(FLOODS), default=list(FLOODS))
    args = parser.parse_args()
    trees = ([("baseline", args.baseline.resolve())] if args.baseline else []) + [("this tree", ROOT)]
    print(f"{args.connections} connections for {args.seconds:g} s each; /healthz every 50 ms")
    print("| flood | gateway | /healthz p50 | p99 | max | flood answered |")
    print("| --- | --- | ---: | ---: | ---: | --- |")
    stub = StubUpstream()
    with ServerThread(stub) as upstream, tempfile.TemporaryDirectory() as scratch:
        path = Path(scratch) / "gateway.yaml"
        config = {"upstream": {"url": upstream.url}, "server": {"access_log": False, "log_level": "warning"}}
        path.write_text(yaml.safe_dump(config), encoding="utf-8")
        for name in args.only:
            body = FLOODS[name]()
            for tree_name, tree in trees:
                with served_process("gateway", path, command=command(tree, "on")) as served:
                    latencies, statuses = asyncio.run(flood(served.url, body, args.connections, args.seconds))
                ms = sorted(value * 1000 for value in latencies)
                p99 = ms[min(len(ms) - 1, int(0.99 * len(ms)))]
                answered = ", ".join(f"{count} x {status}" for status, count in sorted(statuses.items()))
                print(
                    f"| {name} ({len(body) / 1e6:.1f} MB) | {tree_name} | {statistics.median(ms):,.0f} ms | "
                    f"{p99:,.0f} ms | {ms[-1]:,.0f} ms | {answered} |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
