"""What one request costs the gateway process, for sizing (docs/sizing.md): CPU time a request, so requests a second
one core serves, and the peak resident memory above the process's baseline, by traffic kind. The gateway runs in a
process of its own (proxy mode, `media.processor: qwen2_5_vl`, the defaults otherwise) in front of a stub model
server that answers at once; a client sends each kind with 8 requests in flight; the CPU is the gateway process's own
(utime + stime from /proc), so the client and the stub do not count.

    .venv/bin/python tests/bench/bench_gateway_cost.py [--requests 200] [--rounds 3]

Rounds interleave the kinds; the table reports medians across rounds.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import os
import random
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import httpx
import yaml
from PIL import Image

from tests.gateway.media_factory import chat_body, data_url
from tests.gateway.stub_upstream import StubUpstream
from tests.observe import process_memory, reset_peak
from tests.servers import ServerThread, served_process

TICKS = os.sysconf("SC_CLK_TCK")
MIB = 1 << 20


def photo(width: int, height: int, seed: int) -> bytes:
    """A photo-like JPEG: a smooth random field with fine noise (compresses as photos do)."""
    rng = random.Random(seed)
    small = Image.frombytes("RGB", (8, 6), rng.randbytes(8 * 6 * 3)).resize((width, height), Image.BICUBIC)
    noise = Image.frombytes("RGB", (width, height), rng.randbytes(width * height * 3))
    out = io.BytesIO()
    Image.blend(small, noise, 0.08).save(out, "JPEG", quality=90)
    return out.getvalue()


def kinds() -> dict[str, bytes]:
    return {
        "text chat": chat_body(text="Describe a sunny day in one sentence."),
        "1 x 640x480 JPEG": chat_body(data_url(photo(640, 480, 1))),
        "1 x 1920x1080 JPEG": chat_body(data_url(photo(1920, 1080, 2))),
        "4 x 1024x768 JPEG": chat_body(*(data_url(photo(1024, 768, 3 + i)) for i in range(4))),
    }


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS


async def send(url: str, body: bytes, count: int, concurrency: int = 8) -> None:
    async with httpx.AsyncClient(timeout=60) as client:
        semaphore = asyncio.Semaphore(concurrency)

        async def one() -> None:
            async with semaphore:
                response = await client.post(url + "/v1/chat/completions", content=body)
                assert response.status_code == 200, response.text

        await asyncio.gather(*(one() for _ in range(count)))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    bodies = kinds()
    cpu_ms: dict[str, list[float]] = {name: [] for name in bodies}
    peak: dict[str, list[float]] = {name: [] for name in bodies}
    with tempfile.TemporaryDirectory() as tmp, ServerThread(StubUpstream()) as upstream:
        config = Path(tmp) / "gateway.yaml"
        settings = {
            "upstream": {"url": upstream.url},
            "server": {"access_log": False},
            "media": {"processor": "qwen2_5_vl"},
        }
        config.write_text(yaml.safe_dump(settings), encoding="utf-8")
        env = {name: value for name, value in os.environ.items() if not name.startswith("MMGATE_")}
        with served_process("gateway", config, env=env) as gateway:
            pid = gateway.process.pid
            asyncio.run(send(gateway.url, bodies["text chat"], 50))  # warm up
            baseline = process_memory(pid, "VmRSS")
            for _ in range(args.rounds):
                for name, body in bodies.items():
                    reset_peak(pid)
                    before = cpu_seconds(pid)
                    asyncio.run(send(gateway.url, body, args.requests))
                    cpu_ms[name].append((cpu_seconds(pid) - before) * 1000 / args.requests)
                    peak[name].append((process_memory(pid, "VmHWM") - baseline) / MIB)
    cores = os.cpu_count()
    print(f"gateway process: baseline RSS {baseline / MIB:.0f} MiB after start-up and 50 requests; {cores} cores")
    print("| traffic | body KiB | CPU ms / request | requests / s a core | peak RSS above baseline (MiB) |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for name, body in bodies.items():
        ms = statistics.median(cpu_ms[name])
        print(
            f"| {name} | {len(body) / 1024:,.1f} | {ms:.2f} | {1000 / ms:,.0f} | {statistics.median(peak[name]):.0f} |"
        )


if __name__ == "__main__":
    main()
