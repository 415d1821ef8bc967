"""What the gateway charges for each shape of request it admits, beside vLLM's measured memory growth for the same
request (docs/deploy-vllm.md, "Charge against vLLM's growth, by shape"):

    .venv/bin/python tests/bench/bench_vllm_shapes_memory.py [--reps 3] [--families qwen2_vl,qwen3_vl]
        [--caches 0,4]

Needs `.venv-vllm` and both checkpoints (`make e2e` makes them). For each model family (the tiny Qwen2-VL and
Qwen3-VL checkpoints of the end-to-end tests) and each `--mm-processor-cache-gb` (0: off, the end-to-end tests'
setting; 4: vLLM's default), one vLLM (`tests.e2e.support.vllm_server`, `--max-model-len 16384`, up to 8 images and
2 videos a prompt) and a gateway in proxy mode in front of it in this process (`media.processor` the family,
videos sampled as vLLM 0.32 samples them for Qwen models, image URLs on loopback allowed). Each shape is sent
through the gateway `--reps` times, with content of its own every time (nothing is answered from a cache):

- the gateway's charge: the increase of `mmgate_media_counted_bytes_sum` (the raw body, the decoded pixels or the
  sampled frames, the processed tensors, a downloaded item's data URL; what the budget reserves in `bytes` mode);
- vLLM's growth: the resident memory (VmRSS) of its API server and of its engine core and worker, sampled every
  20 ms from just before the request to its answer (the peak of each, minus its value before), and their sum two
  seconds after the answer (settled). With the cache on, what the cache keeps shows in the settled growth.

Medians over the reps. The whole run (4 vLLM starts) takes about 10 minutes on a shared 2-core machine.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from gateway.__main__ import GATEWAY  # noqa: E402
from gateway.app import Gateway  # noqa: E402
from gateway.config import GatewaySettings  # noqa: E402
from tests.bench.bench_vllm_memory import (  # noqa: E402
    SETTLE_S,
    VLLM_PYTHON,
    Sampler,
    available_bytes,
    mib,
    photo_jpegs,
    versions,
)
from tests.e2e import support  # noqa: E402
from tests.e2e.support import MIB, MediaServer, data_url, video_clip  # noqa: E402
from tests.observe import metric  # noqa: E402
from tests.servers import ServerThread  # noqa: E402

MAX_MODEL_LEN = 16384
LIMITS = {"image": 8, "video": 2}
CHECKPOINTS = {
    "qwen2_vl": (ROOT / ".venv-vllm" / "checkpoint", support.MODEL),
    "qwen3_vl": (ROOT / ".venv-vllm" / "checkpoint-qwen3-vl", support.QWEN3_MODEL),
}
CACHES = (0.0, 4.0)


@dataclass(frozen=True)
class Shape:
    """A request: its route and a builder of its body from (model, seed, media server)."""

    name: str
    route: str
    build: Callable[[str, int, MediaServer], dict[str, Any]]


def chat_images(model: str, *urls: str) -> dict[str, Any]:
    return support.url_chat(*urls, model=model, max_tokens=1, temperature=0)


def images(width: int, height: int, count: int) -> Callable[[str, int, MediaServer], dict[str, Any]]:
    def build(model: str, seed: int, media: MediaServer) -> dict[str, Any]:
        return chat_images(model, *(data_url(j) for j in photo_jpegs(count, width, height, seed)))

    return build


def image_by_url(width: int, height: int) -> Callable[[str, int, MediaServer], dict[str, Any]]:
    def build(model: str, seed: int, media: MediaServer) -> dict[str, Any]:
        return chat_images(model, media.serve(f"/{seed}", photo_jpegs(1, width, height, seed)[0]))

    return build


def video(
    kind: str, width: int, height: int, seconds: int, rate: int
) -> Callable[[str, int, MediaServer], dict[str, Any]]:
    def build(model: str, seed: int, media: MediaServer) -> dict[str, Any]:
        clip = video_clip(width, height, seconds * rate, kind=kind, rate=rate, seed=seed)
        return support.video_chat(data_url(clip, support.CLIP_FORMATS[kind][2]), model=model, max_tokens=1)

    return build


def messages(width: int, height: int) -> Callable[[str, int, MediaServer], dict[str, Any]]:
    def build(model: str, seed: int, media: MediaServer) -> dict[str, Any]:
        data = base64.b64encode(photo_jpegs(1, width, height, seed)[0]).decode()
        source = {"type": "base64", "media_type": "image/jpeg", "data": data}
        content = [{"type": "image", "source": source}, {"type": "text", "text": "Describe the image."}]
        return {"model": model, "max_tokens": 1, "messages": [{"role": "user", "content": content}]}

    return build


def responses(width: int, height: int) -> Callable[[str, int, MediaServer], dict[str, Any]]:
    def build(model: str, seed: int, media: MediaServer) -> dict[str, Any]:
        content = [
            {"type": "input_image", "image_url": data_url(photo_jpegs(1, width, height, seed)[0])},
            {"type": "input_text", "text": "Describe the image."},
        ]
        return {"model": model, "max_output_tokens": 1, "input": [{"role": "user", "content": content}]}

    return build


def tokenize(width: int, height: int) -> Callable[[str, int, MediaServer], dict[str, Any]]:
    def build(model: str, seed: int, media: MediaServer) -> dict[str, Any]:
        body = images(width, height, 1)(model, seed, media)
        return {"model": model, "messages": body["messages"]}

    return build


SHAPES = (
    Shape("chat, 1 x 640x480 JPEG inline", "/v1/chat/completions", images(640, 480, 1)),
    Shape("chat, 1 x 1920x1080 JPEG inline", "/v1/chat/completions", images(1920, 1080, 1)),
    Shape("chat, 4 x 1024x768 JPEG inline", "/v1/chat/completions", images(1024, 768, 4)),
    Shape("chat, 1 x 1920x1080 JPEG by http URL", "/v1/chat/completions", image_by_url(1920, 1080)),
    Shape("chat, MP4 (H.264) 640x360, 10 s at 12 fps", "/v1/chat/completions", video("mp4", 640, 360, 10, 12)),
    Shape("chat, WebM (VP9) 640x360, 10 s at 12 fps", "/v1/chat/completions", video("webm", 640, 360, 10, 12)),
    Shape("/v1/messages, 1 x 1920x1080 base64", "/v1/messages", messages(1920, 1080)),
    Shape("/v1/responses, 1 x 1920x1080 input_image", "/v1/responses", responses(1920, 1080)),
    Shape("/tokenize, 1 x 1920x1080", "/tokenize", tokenize(1920, 1080)),
)


@dataclass
class Sample:
    charge: int
    api_peak: int
    engine_peak: int
    peak: int
    settled: int
    status: int


def gateway_settings(upstream: str, family: str) -> GatewaySettings:
    return GatewaySettings(
        upstream={"url": upstream},
        server={"access_log": False, "log_level": "warning"},
        media={
            "processor": family,
            "video": dict(support.QWEN_VIDEO_SAMPLING),
            "fetch": {"allowed_networks": ["127.0.0.0/8"]},
        },
        limits={"max_items": {"image": None}},
    )


def measure(server: support.VLLMServer, gateway_url: str, route: str, body: dict[str, Any]) -> Sample:
    pids = support.process_tree(server.process.pid)
    counted = metric(gateway_url, "mmgate_media_counted_bytes_sum")
    sampler = Sampler(pids)
    with sampler.running():
        response = support.post(gateway_url, body, route)
    time.sleep(SETTLE_S)
    settled = sum(support.rss_of(pid) for pid in pids) - sampler.before
    if response.status_code != 200:
        raise RuntimeError(f"{route} answered {response.status_code}: {response.text[:500]}")
    api = server.process.pid
    return Sample(
        charge=int(metric(gateway_url, "mmgate_media_counted_bytes_sum") - counted),
        api_peak=sampler.peaks[api] - sampler.befores[api],
        engine_peak=sum(sampler.peaks[pid] - sampler.befores[pid] for pid in pids if pid != api),
        peak=sampler.peak - sampler.before,
        settled=settled,
        status=response.status_code,
    )


@contextlib.contextmanager
def stack(family: str, cache_gb: float, home: Path) -> Iterator[tuple[support.VLLMServer, str]]:
    checkpoint, model = CHECKPOINTS[family]
    original = support.vllm_command

    def command(*args: Any, **kwargs: Any) -> list[str]:
        argv = original(*args, **kwargs)
        argv[argv.index("--max-model-len") + 1] = str(MAX_MODEL_LEN)
        return argv

    support.vllm_command = command
    try:
        with support.vllm_server(
            str(VLLM_PYTHON), str(checkpoint), home, 600, LIMITS, model, processor_cache_gb=cache_gb
        ) as server:
            settings = gateway_settings(server.url, family)
            app = Gateway(settings)
            with ServerThread(app, config=GATEWAY.server_config(app, settings)) as gateway:
                yield server, gateway.url
    finally:
        support.vllm_command = original


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--families", default=",".join(CHECKPOINTS))
    parser.add_argument("--caches", default=",".join(f"{c:g}" for c in CACHES), help="--mm-processor-cache-gb values")
    parser.add_argument("--shapes", help="names of shapes to run, separated by ';' (default: all)")
    args = parser.parse_args()
    families = args.families.split(",")
    caches = [float(c) for c in args.caches.split(",")]
    shapes = [s for s in SHAPES if not args.shapes or s.name in args.shapes.split(";")]
    for family in families:
        if not (CHECKPOINTS[family][0] / ".complete").exists():
            sys.exit(f"no {family} checkpoint: `make e2e` writes it")
    began = time.monotonic()
    results: dict[tuple[str, float, str], list[Sample]] = {}
    with MediaServer() as media:
        for family in families:
            for cache_gb in caches:
                with (
                    tempfile.TemporaryDirectory(prefix="mmgate-shapes-") as tmp,
                    stack(family, cache_gb, Path(tmp)) as (
                        server,
                        gateway_url,
                    ),
                ):
                    model = CHECKPOINTS[family][1]
                    print(f"{family}, cache {cache_gb:g} GiB: vLLM up in {server.started_in_s:.0f} s", file=sys.stderr)
                    # The first request of a vLLM is its warm-up (kernels, allocator pools): not measured.
                    support.post(gateway_url, images(640, 480, 1)(model, 999_999, media))
                    for n, shape in enumerate(shapes):
                        for rep in range(args.reps):
                            body = shape.build(model, 1000 * n + rep, media)
                            sample = measure(server, gateway_url, shape.route, body)
                            results.setdefault((family, cache_gb, shape.name), []).append(sample)
                            print(f"  {shape.name} run {rep + 1}: {sample}", file=sys.stderr)
    report(results, time.monotonic() - began, args.reps)


def report(results: dict[tuple[str, float, str], list[Sample]], elapsed: float, reps: int) -> None:
    print(f"\nvLLM side: {versions()}; machine: {available_bytes() / (1 << 30):.0f} GiB available at the end")
    print(f"{reps} runs a cell: medians, and the largest run's peak; benchmark {elapsed / 60:.1f} min\n")
    print(
        "| model | processor cache | shape | gateway charge MiB | vLLM peak +MiB: API server | engine core | "
        "sum (largest run) | peak ÷ charge (largest) | settled +MiB |"
    )
    print("| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for (family, cache_gb, name), samples in results.items():

        def med(key: str, samples: list[Sample] = samples) -> float:
            return float(statistics.median(getattr(s, key) for s in samples))

        charge, largest = med("charge"), max(s.peak for s in samples)
        cache = "off" if cache_gb == 0 else f"{cache_gb:g} GiB"
        print(
            f"| {family} | {cache} | {name} | {mib(charge)} | +{mib(med('api_peak'))} | +{mib(med('engine_peak'))} | "
            f"+{mib(med('peak'))} (+{mib(largest)}) | {med('peak') / charge:.2f} ({largest / charge:.2f}) | "
            f"{med('settled') / MIB:+,.0f} |"
        )


if __name__ == "__main__":
    main()
