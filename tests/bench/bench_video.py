"""Video admission against a naive decode, by hand: peak RSS growth and wall time for one request.

    .venv/bin/python -m tests.bench.bench_video [--seconds-1080p 60] [--seconds-480p 600]

Generates the videos once into a temporary directory with PyAV (mpeg4, low bitrate, a keyframe every 2 s):
a 1920x1080 one and an 854x480 one at 30 fps. For each, in a fresh child process (so peak RSS is its own):

- mmgate: `MediaLoader.load` of one `video_url` data-URL item (header, 32 sampled frames predicted, charged and
  decoded one at a time), as the gateway runs it;
- naive: decode every frame with PyAV into a list of RGB arrays, then take the same 32 samples.

Also times the refusal of an AVI that declares 1,000,000 frames (`limits.max_video_seconds`), and says how many
frames were decoded for it.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import io
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RATE = 30


def encode(path: Path, width: int, height: int, seconds: int) -> None:
    import av
    import numpy as np

    frames = seconds * RATE
    with av.open(str(path), "w", format="mp4") as container:
        stream = container.add_stream("mpeg4", rate=RATE)
        assert isinstance(stream, av.VideoStream)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        stream.bit_rate = 200_000
        stream.codec_context.gop_size = 2 * RATE
        base = np.zeros((height, width, 3), np.uint8)
        for index in range(frames):
            base[:, :, 0] = index % 256
            base[: height // 8, : width // 8, 1] = (index * 7) % 256
            for packet in stream.encode(av.VideoFrame.from_ndarray(base, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)


def peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def child(mode: str, path: str) -> None:
    data = Path(path).read_bytes()
    body_url = "data:video/mp4;base64," + base64.b64encode(data).decode()
    del data
    import av
    import numpy as np

    from gateway.video_decode import probe_video, sample_frame_indices  # noqa: F401

    baseline = peak_rss()
    started = time.perf_counter()
    frames = 0
    if mode == "naive":
        raw = base64.b64decode(body_url.split(",", 1)[1])
        with av.open(io.BytesIO(raw)) as container:
            decoded = [frame.to_ndarray(format="rgb24") for frame in container.decode(video=0)]
        indices = np.linspace(0, len(decoded) - 1, 32, dtype=int)
        sampled = [decoded[i] for i in indices]
        frames = len(decoded)
        del decoded, sampled
    else:
        import asyncio
        from concurrent.futures import ThreadPoolExecutor

        from gateway.accounting import RequestAccount
        from gateway.config import GatewaySettings
        from gateway.fetch import MediaFetcher
        from gateway.media_loader import MediaLoader
        from gateway.media_parts import MediaRef, Modality, Source
        from gateway.metrics import GatewayMetrics

        settings = GatewaySettings(
            limits={"max_multimodal_cpu_bytes_per_request": 4 << 30, "max_multimodal_cpu_bytes": 4 << 30}
        )
        metrics = GatewayMetrics()

        async def run() -> None:
            loader = MediaLoader(
                settings=settings,
                metrics=metrics,
                fetcher=MediaFetcher(settings.media.fetch),
                executor=ThreadPoolExecutor(2),
            )
            ref = MediaRef(Modality.VIDEO, Source.DATA_URL, "video", body_url)
            await loader.load([ref], RequestAccount(None))

        asyncio.run(run())
        frames = int(metrics.media_frames_decoded.labels("video")._value.get())
    wall = time.perf_counter() - started
    print(json.dumps({"wall_s": wall, "rss_growth": peak_rss() - baseline, "frames": frames}))


def refusal(tmp: Path) -> tuple[float, float]:
    import asyncio
    import struct
    from concurrent.futures import ThreadPoolExecutor

    from gateway.accounting import RequestAccount
    from gateway.config import GatewaySettings
    from gateway.errors import RequestTooLarge
    from gateway.fetch import MediaFetcher
    from gateway.media_loader import MediaLoader
    from gateway.media_parts import MediaRef, Modality, Source
    from gateway.metrics import GatewayMetrics
    from tests.gateway.test_video_decode import make_video

    patched = bytearray(make_video("mpeg4", "avi", width=320, height=256, frames=20))
    struct.pack_into("<I", patched, patched.find(b"avih") + 24, 1_000_000)
    struct.pack_into("<I", patched, patched.find(b"strh") + 40, 1_000_000)
    url = "data:video/x-msvideo;base64," + base64.b64encode(bytes(patched)).decode()
    settings = GatewaySettings()
    metrics = GatewayMetrics()

    async def run() -> float:
        loader = MediaLoader(
            settings=settings,
            metrics=metrics,
            fetcher=MediaFetcher(settings.media.fetch),
            executor=ThreadPoolExecutor(2),
        )
        ref = MediaRef(Modality.VIDEO, Source.DATA_URL, "video", url)
        best = float("inf")
        for _ in range(5):
            started = time.perf_counter()
            with contextlib.suppress(RequestTooLarge):
                await loader.load([ref], RequestAccount(None))
            best = min(best, time.perf_counter() - started)
        return best

    best = asyncio.run(run())
    return best, metrics.media_frames_decoded.labels("video")._value.get()


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] in ("mmgate", "naive"):
        child(sys.argv[1], sys.argv[2])
        return
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds-1080p", type=int, default=60)
    parser.add_argument("--seconds-480p", type=int, default=600)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as directory:
        tmp = Path(directory)
        videos = [
            (f"{args.seconds_1080p} s 1920x1080", tmp / "1080p.mp4", 1920, 1080, args.seconds_1080p),
            (f"{args.seconds_480p} s 854x480", tmp / "480p.mp4", 854, 480, args.seconds_480p),
        ]
        for _, path, width, height, seconds in videos:
            started = time.perf_counter()
            encode(path, width, height, seconds)
            print(f"encoded {path.name}: {path.stat().st_size:,} bytes in {time.perf_counter() - started:.1f} s")
        print("| video | path | frames decoded | wall s | peak RSS growth MiB | 32 sampled RGB frames MiB |")
        print("| --- | --- | --- | --- | --- | --- |")
        for name, path, width, height, _ in videos:
            for mode in ("mmgate", "naive"):
                out = subprocess.run(
                    [sys.executable, "-m", "tests.bench.bench_video", mode, str(path)],
                    capture_output=True,
                    text=True,
                    check=True,
                    env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])},
                )
                result = json.loads(out.stdout.strip().splitlines()[-1])
                sampled = 32 * width * height * 3 / 2**20
                print(
                    f"| {name} | {mode} | {result['frames']:,} | {result['wall_s']:.2f} | "
                    f"{result['rss_growth'] / 2**20:.0f} | {sampled:.0f} |"
                )
        best, frames = refusal(tmp)
        print(
            f"\nrefusal of a declared 1,000,000-frame AVI: {best * 1000:.1f} ms (best of 5), "
            f"{frames:.0f} frames decoded"
        )


if __name__ == "__main__":
    main()
