"""What the gateway process really holds under memory attacks, against its configured bounds, each side by side in
one run with a baseline written here:

    .venv/bin/python tests/bench/bench_memory.py [--only bombs|bodies|forward]

- bombs: the three video files of `media_factory.VIDEO_BOMBS` (a matroska header that says 64x64 over a 12288x12288
  H.264 SPS; one 64x64 track and 8 hidden 8192x8192 ones; an honest 8192x8192 H.264), one request and 8 at once,
  through a gateway process. Baseline: `av.open` with FFmpeg's default stream probe on the same file, alone in a
  process (what the gateway did before it opened containers without decoding).
- bodies: 12 clients sending 40 MiB bodies at once to a gateway with a 128 MiB media budget: with the bound on
  buffered bodies (its default, the media budget) and without it (`limits.max_buffered_body_bytes: null`).
- forward: 200 requests with a 1024x768 JPEG by URL, one at a time: the gateway's CPU per request and the median
  latency with `media.fetch.forward: inline` (the default: a data URL of the bytes checked) and `url` (the URL).

Peak growth is VmHWM after the load minus VmRSS before it (`clear_refs` resets the peak); settled is VmRSS two
seconds after the load ended.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import yaml

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tests.gateway.media.video.test_loader import mp4_url, video_body  # noqa: E402
from tests.gateway.media_factory import chat_body, image_bytes, write_video_bombs  # noqa: E402
from tests.gateway.media_stub import PUBLIC, MediaStub  # noqa: E402
from tests.gateway.stub_upstream import StubUpstream  # noqa: E402
from tests.observe import process_memory, reset_peak  # noqa: E402
from tests.servers import ServerThread, served_process  # noqa: E402

MIB = 1 << 20
CHAT = "/v1/chat/completions"

_PROBE = """
import av, io, sys
from tests.observe import process_memory, reset_peak
data = open(sys.argv[1], "rb").read()
before = reset_peak("self")
try:
    av.open(io.BytesIO(data), options={"probesize": str(1 << 20), "analyzeduration": "2000000"}).close()
except Exception:
    pass
print(process_memory("self", "VmHWM") - before)
"""


@contextmanager
def gateway(directory: Path, upstream: str, **sections: Any) -> Iterator[tuple[str, int]]:
    config = {"upstream": {"url": upstream}, "server": {"access_log": False, "log_level": "warning"}, **sections}
    path = directory / f"gateway-{time.monotonic_ns()}.yaml"
    path.write_text(yaml.safe_dump(config), encoding="utf-8")
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("MMGATE_")}, "PYTHONPATH": str(ROOT)}
    with served_process("gateway", path, env=env) as served:
        yield served.url, served.process.pid


def post_at_once(url: str, body: bytes, count: int) -> list[int]:
    async def run() -> list[int]:
        async with httpx.AsyncClient(timeout=120) as client:
            responses = await asyncio.gather(*(client.post(url + CHAT, content=body) for _ in range(count)))
            return [response.status_code for response in responses]

    return asyncio.run(run())


def measured(pid: int, load: Any) -> tuple[Any, float, float]:
    """(what `load()` returned, peak growth MiB, settled growth MiB)."""
    before = reset_peak(pid)
    result = load()
    peak = process_memory(pid, "VmHWM") - before
    time.sleep(2)
    return result, peak / MIB, (process_memory(pid) - before) / MIB


def bombs(directory: Path, upstream: str) -> None:
    write_video_bombs(str(directory))
    print("\n| file | baseline: av.open's default probe, alone | gateway, 1 request | gateway, 8 at once | answers |")
    print("| --- | ---: | ---: | ---: | --- |")
    for name in ("size_liar.mkv", "hidden_tracks.mkv", "large.mp4"):
        path = directory / name
        probe = subprocess.run(
            [sys.executable, "-c", _PROBE, str(path)], cwd=ROOT, capture_output=True, text=True, check=True
        )
        baseline = int(probe.stdout) / MIB
        body = video_body(mp4_url(path.read_bytes()))
        with gateway(directory, upstream) as (url, pid):
            one, peak_one, _ = measured(pid, lambda: post_at_once(url, body, 1))  # noqa: B023
            eight, peak_eight, settled = measured(pid, lambda: post_at_once(url, body, 8))  # noqa: B023
        print(
            f"| {name} | +{baseline:,.0f} MiB | +{peak_one:,.0f} MiB | +{peak_eight:,.0f} MiB (settled "
            f"{settled:+,.0f}) | {sorted(set(one + eight))} |"
        )


def bodies(directory: Path, upstream: str) -> None:
    budget = 128 * MIB
    body = chat_body(text="x" * (40 * MIB))
    print("\n| 12 x 40 MiB bodies, media budget 128 MiB | bound on bodies | peak growth | settled | answers |")
    print("| --- | ---: | ---: | ---: | --- |")
    for label, bound in (("baseline: no bound", None), ("limits.max_buffered_body_bytes (default)", budget)):
        limits = {"max_multimodal_cpu_bytes": budget, "max_buffered_body_bytes": bound}
        with gateway(directory, upstream, limits=limits) as (url, pid):
            statuses, peak, settled = measured(pid, lambda: post_at_once(url, body, 12))
        shown = "none" if bound is None else f"{bound // MIB} MiB"
        counts = {code: statuses.count(code) for code in sorted(set(statuses))}
        print(f"| {label} | {shown} | +{peak:,.0f} MiB | {settled:+,.0f} MiB | {counts} |")


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def forward(directory: Path, upstream: str, requests: int = 200) -> None:
    media = MediaStub()
    media.files["photo.jpg"] = image_bytes(1024, 768)
    fetch = {"allowed_networks": [f"{PUBLIC}/32"]}
    print(f"\n| {requests} URL image requests (1024x768 JPEG), one at a time | gateway CPU per request | p50 latency |")
    print("| --- | ---: | ---: |")
    with ServerThread(media, bind=(PUBLIC, 0)) as server:
        body = chat_body(f"{server.url}/files/photo.jpg")
        for mode in ("url", "inline"):
            label = "baseline: forward url" if mode == "url" else "forward inline (default)"
            media_settings = {"fetch": {**fetch, "forward": mode}, "processor": None}
            with gateway(directory, upstream, media=media_settings) as (url, pid), httpx.Client() as client:
                for _ in range(10):
                    client.post(url + CHAT, content=body)
                started, latencies = cpu_seconds(pid), []
                for _ in range(requests):
                    begun = time.perf_counter()
                    assert client.post(url + CHAT, content=body).status_code == 200
                    latencies.append(time.perf_counter() - begun)
                cpu = (cpu_seconds(pid) - started) / requests
            print(f"| {label} | {cpu * 1000:.2f} ms | {statistics.median(latencies) * 1000:.2f} ms |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", choices=("bombs", "bodies", "forward"))
    args = parser.parse_args()
    print(f"machine: {os.cpu_count()} cores; loopback only")
    with tempfile.TemporaryDirectory(prefix="mmgate-memory-") as tmp, ServerThread(StubUpstream()) as upstream:
        for name, run in (("bombs", bombs), ("bodies", bodies), ("forward", forward)):
            if args.only in (None, name):
                run(Path(tmp), upstream.url)


if __name__ == "__main__":
    main()
