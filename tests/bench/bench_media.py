"""Media admission memory and throughput: peak RSS of one request's media path, unbounded against the gateway's.

    .venv/bin/python tests/bench/bench_media.py [--items 16 64 128] [--repeats 5]

Part 1, memory: one request with N random 1024x1024 JPEG data URLs; each row runs in a fresh process that
first reads the request body (as the gateway holds it) and then runs one media path:

- baseline: an unbounded gather, written here: parse the body, gather every item at once on an
  8-thread pool, each decoded to a float32 [3, H, W] tensor, all held until the request is complete;
- mmgate: the gateway's own admission path (`parse_request_body`, `find_media`, `MediaLoader.load` on an
  8-thread pool) with no cap, with a 256 MiB per-request cap, and with the raw body charged as well.

RSS delta is the peak resident set during the path (sampled every millisecond) minus the resident set with
the body already in memory. Part 2, throughput: a 16-image request through the mmgate path against bare
orjson + pybase64 + Pillow decode of the same images (sequential, and on the same 8-thread pool), interleaved
in one process; medians of the repeats.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

CAP = 256 << 20
WORKERS = 8
SIDE = 1024
MIB = 1 << 20


def make_body(items: int) -> bytes:
    import numpy as np
    import orjson
    from PIL import Image

    rng = np.random.default_rng(0)
    urls = []
    for i in range(min(items, 8)):  # eight distinct images, repeated: decoding cost does not depend on identity
        pixels = rng.integers(0, 256, size=(SIDE, SIDE, 3), dtype=np.uint8)
        out = io.BytesIO()
        Image.fromarray(pixels).save(out, format="JPEG", quality=90)
        urls.append("data:image/jpeg;base64," + base64.b64encode(out.getvalue()).decode())
        del pixels, i
    content: list[dict[str, Any]] = [{"type": "text", "text": "Describe every image."}]
    content += [{"type": "image_url", "image_url": {"url": urls[i % len(urls)]}} for i in range(items)]
    return orjson.dumps({"model": "m", "messages": [{"role": "user", "content": content}]})


def rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class PeakSampler:
    def __init__(self) -> None:
        self.peak = rss_bytes()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, rss_bytes())
            time.sleep(0.001)

    def __enter__(self) -> PeakSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss_bytes())


def baseline_path(body: bytearray) -> dict[str, Any]:
    """The unbounded gather: every item decoded to a float32 tensor, all held at once."""
    import numpy as np
    import orjson
    import pybase64
    import torch
    from PIL import Image

    def decode(url: str) -> torch.Tensor:
        data = pybase64.b64decode(url.split(",", 1)[1], validate=True)
        image = Image.open(io.BytesIO(data)).convert("RGB")
        array = np.asarray(image, dtype=np.float32).transpose(2, 0, 1) / 255.0
        return torch.from_numpy(np.ascontiguousarray(array))

    async def gather() -> list[torch.Tensor]:
        document = orjson.loads(body)
        urls = [part["image_url"]["url"] for part in document["messages"][0]["content"] if part["type"] == "image_url"]
        loop = asyncio.get_running_loop()
        with ThreadPoolExecutor(WORKERS) as pool:
            return list(await asyncio.gather(*(loop.run_in_executor(pool, decode, url) for url in urls)))

    tensors = asyncio.run(gather())
    held = sum(t.untyped_storage().nbytes() for t in tensors)
    return {"decodes": len(tensors), "outcome": f"{held / MIB:.0f} MiB returned", "keep": tensors}


def mmgate_path(body: bytearray, cap: int | None, charge_raw_body: bool) -> dict[str, Any]:
    from gateway.config import GatewaySettings
    from gateway.errors import RequestTooLarge
    from gateway.media.accounting import RequestAccount
    from gateway.media.body import parse_request_body
    from gateway.media.loader import MediaLoader
    from gateway.media.parts import find_media
    from gateway.media.sources.fetch import MediaFetcher
    from gateway.metrics import GatewayMetrics

    settings = GatewaySettings(
        limits={"max_multimodal_cpu_bytes_per_request": cap, "max_multimodal_cpu_bytes": None},
        media={"load_workers": WORKERS, "fetch": {"enabled": False}},
    )
    metrics = GatewayMetrics()

    async def admit() -> tuple[str, RequestAccount]:
        executor = ThreadPoolExecutor(WORKERS)
        loader = MediaLoader(
            settings=settings, metrics=metrics, fetcher=MediaFetcher(settings.media.fetch), executor=executor
        )
        refs = find_media("/v1/chat/completions", parse_request_body(body))
        account = RequestAccount(cap, raw_body_bytes=len(body) if charge_raw_body else 0)
        try:
            await loader.load(loader.plan(refs, loader.keep), account)
            outcome = f"{account.total / MIB:.1f} MiB counted"
        except RequestTooLarge:
            outcome = f"413 at {account.total / MIB:.1f} MiB"
        finally:
            executor.shutdown(wait=True)
        return outcome, account

    outcome, _ = asyncio.run(admit())
    return {"decodes": int(_decode_count(metrics)), "outcome": outcome, "keep": None}


def _decode_count(metrics: Any) -> float:
    for family in metrics.registry.collect():
        for sample in family.samples:
            if sample.name == "mmgate_media_decode_seconds_count":
                return float(sample.value)
    return 0.0


ROWS = {
    "baseline (unbounded gather)": lambda body: baseline_path(body),
    "mmgate, no cap": lambda body: mmgate_path(body, None, False),
    "mmgate, 256 MiB cap": lambda body: mmgate_path(body, CAP, False),
    "mmgate, 256 MiB cap, raw body charged": lambda body: mmgate_path(body, CAP, True),
}


def run_row(row: str, body_file: str) -> None:
    import gc

    # Libraries load before the measurement: their code and tables are not the path's memory.
    import aiohttp  # noqa: F401
    import numpy  # noqa: F401
    import orjson  # noqa: F401
    import PIL.Image  # noqa: F401
    import pybase64  # noqa: F401

    import gateway.media.loader  # noqa: F401

    if row.startswith("baseline"):
        import torch  # noqa: F401

    with open(body_file, "rb") as handle:
        body = bytearray(handle.read())
    gc.collect()
    before = rss_bytes()
    started = time.perf_counter()
    with PeakSampler() as sampler:
        result = ROWS[row](body)
    wall = time.perf_counter() - started
    print(
        json.dumps(
            {
                "decodes": result["decodes"],
                "outcome": result["outcome"],
                "peak_delta": sampler.peak - before,
                "after_delta": rss_bytes() - before,
                "wall": wall,
                "body": len(body),
            }
        )
    )


def fitting(row: str, items: int, body_bytes: int) -> int:
    """Decodes the cap has room for: every decode beyond this would have been past the cap."""
    room = CAP - (body_bytes if "raw body" in row else 0)
    return min(items, max(0, room // (SIDE * SIDE * 3)))


def memory_table(item_counts: list[int], repeats: int) -> None:
    print(
        f"\nRSS of one request with N random {SIDE}x{SIDE} JPEG data URLs; each run a fresh process; "
        f"{WORKERS} decode threads; median of {repeats} runs\n"
    )
    print(
        "| path | items | body MiB | finished decodes | decodes past the cap | outcome | peak RSS delta "
        "| RSS delta after | wall s |"
    )
    print("| --- | ---: | ---: | ---: | ---: | --- | ---: | ---: | ---: |")
    with tempfile.TemporaryDirectory() as tmp:
        for items in item_counts:
            body_file = os.path.join(tmp, f"body-{items}.json")
            with open(body_file, "wb") as handle:
                handle.write(make_body(items))
            for row in ROWS:
                runs = []
                for _ in range(repeats):
                    output = subprocess.run(
                        [sys.executable, __file__, "--row", row, "--body", body_file],
                        check=True,
                        capture_output=True,
                        text=True,
                        cwd=ROOT,
                    ).stdout
                    runs.append(json.loads(output.strip().splitlines()[-1]))
                peak = statistics.median(r["peak_delta"] for r in runs) / MIB
                after = statistics.median(r["after_delta"] for r in runs) / MIB
                wall = statistics.median(r["wall"] for r in runs)
                first = runs[0]
                past = (
                    "-" if "MiB cap" not in row else str(max(0, first["decodes"] - fitting(row, items, first["body"])))
                )
                print(
                    f"| {row} | {items} | {first['body'] / MIB:.1f} | {first['decodes']} | {past} | "
                    f"{first['outcome']} | +{peak:.1f} MiB | +{after:.1f} MiB | {wall:.2f} |",
                    flush=True,
                )


def throughput_table(repeats: int) -> None:
    import orjson
    import pybase64
    from PIL import Image

    body = bytearray(make_body(16))
    pool = ThreadPoolExecutor(WORKERS)

    def bare_decode(url: str) -> Image.Image:
        return Image.open(io.BytesIO(pybase64.b64decode(url.split(",", 1)[1], validate=True))).convert("RGB")

    def urls() -> list[str]:
        document = orjson.loads(body)
        return [p["image_url"]["url"] for p in document["messages"][0]["content"] if p["type"] == "image_url"]

    def bare_sequential() -> None:
        for url in urls():
            bare_decode(url)

    def bare_pool() -> None:
        list(pool.map(bare_decode, urls()))

    def mmgate() -> None:
        mmgate_path(body, CAP, True)

    paths = {"bare, sequential": bare_sequential, f"bare, {WORKERS}-thread pool": bare_pool, "mmgate path": mmgate}
    times: dict[str, list[float]] = {name: [] for name in paths}
    for path in paths.values():  # warm-up
        path()
    for _ in range(repeats):
        for name, path in paths.items():
            started = time.perf_counter()
            path()
            times[name].append(time.perf_counter() - started)
    best_bare = min(statistics.median(times[name]) for name in paths if name.startswith("bare"))
    print(
        f"\nmedia path throughput, one request of 16 {SIDE}x{SIDE} JPEG data URLs "
        f"({len(body) / MIB:.1f} MiB body), {repeats} interleaved repeats, medians\n"
    )
    print("| path | ms per request | images/s | vs best bare |")
    print("| --- | ---: | ---: | ---: |")
    for name in paths:
        median = statistics.median(times[name])
        print(f"| {name} | {median * 1000:.1f} | {16 / median:.1f} | {best_bare / median:.2f}x |")
    pool.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--items", type=int, nargs="+", default=[16, 64, 128])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--row")
    parser.add_argument("--body")
    parser.add_argument("--only", choices=["memory", "throughput"])
    args = parser.parse_args()
    if args.row:
        run_row(args.row, args.body)
        return
    if args.only != "throughput":
        memory_table(args.items, args.repeats)
    if args.only != "memory":
        throughput_table(max(args.repeats, 5))


if __name__ == "__main__":
    main()
