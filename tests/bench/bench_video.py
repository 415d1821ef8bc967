"""One video request through a real gateway process against a naive decode-all, side by side in one run.

    .venv/bin/python tests/bench/bench_video.py [--workdir DIR] [--seconds-1080p 60] [--seconds-480p 600]
        [--rounds 1] [--refusal-tries 7] [--keep-cap-gib 8]

Videos (PyAV; libx264 when the wheel has it, else mpeg4; 30 fps, a keyframe every 2 s, a moving gradient with a
block of fresh noise in every frame): `--seconds-1080p` of 1920x1080 and `--seconds-480p` of 854x480, written once
into `--workdir` (a rerun with the same workdir skips encoding).

For each video, side by side:

- mmgate: a fresh `python -m gateway --config <temp yaml>` process on a free loopback port, in front of the tests'
  stub upstream (which answers the forwarded chat request), warmed up with one small video request, receives one
  chat request whose `video_url` is the video as a data URL. Limits are raised so that the video is admitted
  (body cap, per-request cap, budget, `media.video.decode_timeout_s`); sampling is the shipped one (32 frames,
  vLLM's rule). Peak RSS growth of the gateway process for that request: the kernel's peak counter is reset
  (`echo 5 > /proc/PID/clear_refs` resets VmHWM) and VmRSS read just before the request is sent; VmHWM is read
  after the answer. Growth = VmHWM - VmRSS before. The frames the gateway decoded, its decode time and the bytes
  it predicted come from its /metrics (`mmgate_media_frames_decoded_total`, `mmgate_media_decode_seconds`,
  `mmgate_media_predicted_bytes`), read before and after.
- mmgate, upstream unreachable: the same request to a gateway whose upstream port has no listener, so it
  receives, parses and decodes, then fails to connect (502) before writing the body upstream: the growth of
  everything up to the forward.
- mmgate, control: a chat body of the same size without media through the same kind of gateway: what
  receiving and forwarding a body that large costs with nothing decoded.
- naive, written here, in a child process that holds the video's bytes first (its growth is measured the same
  way on itself): decode every frame with PyAV to an RGB ndarray, then take vLLM's 32 samples.
  "keep" holds every array in a list, as the naive loader does; decoding stops once the list holds
  `--keep-cap-gib` (lowered to what the machine has available minus 4 GiB) so the machine survives, and the
  full figure is extrapolated (labelled so). "drop" decodes every frame to RGB and keeps only the 32 samples:
  the decode-all wall time, uncapped.

The million-frame refusal: an AVI whose headers declare 1,000,000 frames (100,000 s at 10 fps, over the shipped
`limits.max_video_seconds`) sent `--refusal-tries` times to a gateway; time from request sent to 413 received,
median, and the frames its /metrics say were decoded (must stay 0).

Rounds (`--rounds`, default 1 because the long rows take minutes) repeat the mmgate and drop rows, interleaved;
the table shows medians. The keep row runs once per video. Other processes on the machine add noise to wall
times: the ratio of decode-all to the gateway's sampled decode is the figure to read.
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import os
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402
import orjson  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from tests.gateway.stub_upstream import StubUpstream  # noqa: E402
from tests.servers import ServerThread, free_port, served_process  # noqa: E402

RATE = 30
GOP_SECONDS = 2
SAMPLED = 32  # media.video.num_frames, shipped default (vLLM's)
HEADROOM = 64 << 20  # the issue's allowance on top of the sampled frames' bytes
MIB = 1 << 20
GIB = 1 << 30
# Bit rates of the generated files (bits per second): ordinary streaming rates for these sizes.
BIT_RATES = {(1920, 1080): 4_000_000, (854, 480): 1_000_000}

GATEWAY_CONFIG = """\
upstream:
  url: {upstream}
server:
  access_log: false
  log_level: warning
limits:
  max_request_body_bytes: 2GiB
  max_multimodal_cpu_bytes_per_request: 4GiB
  max_multimodal_cpu_bytes: 8GiB
  max_buffered_body_bytes: 4GiB
media:
  video:
    decode_timeout_s: 1200
"""


# --- the videos ----------------------------------------------------------------------------------------------


def video_codec() -> str:
    import av

    try:
        av.codec.Codec("libx264", "w")
    except Exception:  # the wheel was built without it
        return "mpeg4"
    return "libx264"


def video_file(workdir: Path, width: int, height: int, seconds: int, codec: str) -> Path:
    """The cached file, encoded once: a moving gradient (luma and chroma) with a block of fresh noise a frame."""
    import av
    import numpy as np

    bit_rate = BIT_RATES.get((width, height), width * height * 2)
    path = workdir / f"{width}x{height}-{seconds}s-{RATE}fps-{codec}-{bit_rate}.mp4"
    if path.exists():
        return path
    partial = path.with_suffix(".partial")
    started = time.perf_counter()
    rng = np.random.default_rng(0)
    ramp = (np.arange(2 * width) * 255 // (2 * width - 1)).astype(np.uint8)
    luma_rows = np.clip(
        ramp[None, :].astype(np.int16) // 2 + (np.arange(height) * 127 // height)[:, None], 0, 255
    ).astype(np.uint8)
    chroma_ramp = np.tile(ramp[None, ::2], (height // 2, 1))
    picture = np.empty((height * 3 // 2, width), np.uint8)
    block_h, block_w = height // 4, width // 4
    with av.open(str(partial), "w", format="mp4") as container:
        stream = container.add_stream(codec, rate=RATE)
        assert isinstance(stream, av.VideoStream)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        stream.bit_rate = bit_rate
        stream.codec_context.gop_size = GOP_SECONDS * RATE
        if codec == "libx264":
            keyint = GOP_SECONDS * RATE
            stream.codec_context.options = {
                "preset": "veryfast",
                "x264-params": f"keyint={keyint}:min-keyint={keyint}:scenecut=0",
            }
        for index in range(seconds * RATE):
            shift = (index * 4) % width
            picture[:height] = luma_rows[:, shift : shift + width]
            top = (index * 3) % (height - block_h)
            left = (index * 5) % (width - block_w)
            picture[top : top + block_h, left : left + block_w] = rng.integers(0, 256, (block_h, block_w), np.uint8)
            half = shift // 2
            chroma = chroma_ramp[:, half : half + width // 2]
            picture[height : height + height // 4] = chroma.reshape(height // 4, width)
            picture[height + height // 4 :] = chroma[:, ::-1].reshape(height // 4, width)
            for packet in stream.encode(av.VideoFrame.from_ndarray(picture, format="yuv420p")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    partial.rename(path)
    print(f"encoded {path.name}: {path.stat().st_size:,} bytes in {time.perf_counter() - started:.0f} s", flush=True)
    return path


def million_frame_avi() -> bytes:
    """A 20-frame mpeg4 AVI whose main and stream headers both declare 1,000,000 frames."""
    from tests.gateway.media.video.test_decode import make_video

    patched = bytearray(make_video("mpeg4", "avi", width=320, height=256, frames=20))
    struct.pack_into("<I", patched, patched.find(b"avih") + 24, 1_000_000)
    struct.pack_into("<I", patched, patched.find(b"strh") + 40, 1_000_000)
    return bytes(patched)


def small_mp4() -> bytes:
    from tests.gateway.media.video.test_decode import make_video

    return make_video("mpeg4", "mp4", width=320, height=240, frames=60, rate=30, gop=30)


def video_body(data: bytes, media_type: str) -> bytes:
    url = f"data:{media_type};base64,{base64.b64encode(data).decode()}"
    content = [{"type": "text", "text": "Describe the video."}, {"type": "video_url", "video_url": {"url": url}}]
    return orjson.dumps({"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": content}]})


# --- /proc and /metrics --------------------------------------------------------------------------------------


def status_bytes(pid: int | str, field: str) -> int:
    """A `kB` line of /proc/PID/status, in bytes."""
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


def reset_peak(pid: int | str) -> int:
    """Reset the process's VmHWM to its current RSS; return that RSS."""
    with open(f"/proc/{pid}/clear_refs", "w") as clear:
        clear.write("5")
    return status_bytes(pid, "VmRSS")


def machine() -> str:
    return f"{os.cpu_count()} cores, {status_meminfo('MemTotal') / GIB:.1f} GiB memory"


def status_meminfo(field: str) -> int:
    with open("/proc/meminfo") as meminfo:
        for line in meminfo:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


def video_metrics(url: str) -> dict[str, float]:
    """The gateway's video counters: frames decoded, decode seconds (sum, count), predicted bytes (sum)."""
    wanted = {
        "mmgate_media_frames_decoded_total": "frames",
        "mmgate_media_decode_seconds_sum": "decode_s",
        "mmgate_media_decode_seconds_count": "decodes",
        "mmgate_media_predicted_bytes_sum": "predicted",
    }
    found = dict.fromkeys(wanted.values(), 0.0)
    text = httpx.get(url + "/metrics", timeout=10).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in wanted and sample.labels.get("modality") == "video":
                found[wanted[sample.name]] = sample.value
    return found


# --- mmgate: the gateway process -----------------------------------------------------------------------------


@dataclass
class GatewayRun:
    wall_s: float
    decode_s: float
    frames: int
    predicted: int
    growth: int
    body: int


@contextmanager
def gateway(workdir: Path, upstream: str, name: str, status: int = 200) -> Iterator[Any]:
    """A gateway process in front of `upstream`, warmed up by one small video request answered `status`."""
    config = workdir / f"gateway-{name}.yaml"
    config.write_text(GATEWAY_CONFIG.format(upstream=upstream), encoding="utf-8")
    with served_process("gateway", config, log=workdir / f"gateway-{name}.log") as served:
        with httpx.Client(timeout=1800) as client:
            # Warm-up: PyAV, the decode threads and the upstream connection exist before the measured request.
            answer = client.post(served.url + "/v1/chat/completions", content=video_body(small_mp4(), "video/mp4"))
            assert answer.status_code == status, answer.text
        yield served


def text_body(size: int) -> bytes:
    """A chat body of `size` bytes without media: what forwarding a body that large costs the gateway alone."""
    shell = orjson.dumps({"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": ""}]})
    body = orjson.dumps(
        {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "x" * (size - len(shell))}]}
    )
    assert len(body) == size
    return body


def mmgate_row(workdir: Path, upstream_url: str, body: bytes, *, status: int, decodes: int) -> GatewayRun:
    """One request through a fresh gateway process: its peak RSS growth and what its /metrics counted."""
    with gateway(workdir, upstream_url, "video", status) as served, httpx.Client(timeout=1800) as client:
        pid = served.process.pid
        before = video_metrics(served.url)
        rss_before = reset_peak(pid)
        started = time.perf_counter()
        answer = client.post(served.url + "/v1/chat/completions", content=body)
        wall = time.perf_counter() - started
        peak = status_bytes(pid, "VmHWM")
        after = video_metrics(served.url)
    assert answer.status_code == status, answer.text[:500]
    assert after["decodes"] - before["decodes"] == decodes, (before, after)
    return GatewayRun(
        wall_s=wall,
        decode_s=after["decode_s"] - before["decode_s"],
        frames=round(after["frames"] - before["frames"]),
        predicted=round(after["predicted"] - before["predicted"]),
        growth=peak - rss_before,
        body=len(body),
    )


def refusal_row(workdir: Path, upstream_url: str, tries: int) -> tuple[list[float], int, str]:
    body = video_body(million_frame_avi(), "video/x-msvideo")
    times = []
    with gateway(workdir, upstream_url, "refusal") as served, httpx.Client(timeout=60) as client:
        before = video_metrics(served.url)
        for _ in range(tries):
            started = time.perf_counter()
            answer = client.post(served.url + "/v1/chat/completions", content=body)
            times.append(time.perf_counter() - started)
            assert answer.status_code == 413, answer.text
        after = video_metrics(served.url)
    return times, round(after["frames"] - before["frames"]), answer.json().get("message", answer.text)


# --- naive: decode every frame -------------------------------------------------------------------------------


def naive_child(mode: str, path: str, cap: int) -> None:
    """In its own process: decode every frame to RGB; `keep` holds them all (until `cap` bytes), `drop` keeps
    only the 32 samples. Prints one JSON line."""
    import av
    import numpy as np

    data = Path(path).read_bytes()
    rss_before = reset_peak("self")
    started = time.perf_counter()
    held: list[Any] = []
    held_bytes = 0
    decoded = 0
    with av.open(io.BytesIO(data), "r") as container:
        stream = container.streams.video[0]
        total = stream.frames
        wanted = set(np.linspace(0, total - 1, SAMPLED, dtype=int).tolist())
        for frame in container.decode(stream):
            array = frame.to_ndarray(format="rgb24")
            if mode == "keep" or decoded in wanted:
                held.append(array)
                held_bytes += array.nbytes
            decoded += 1
            if mode == "keep" and held_bytes >= cap:
                break
        if mode == "keep" and decoded == total:
            held = [held[i] for i in sorted(wanted)]
    wall = time.perf_counter() - started
    peak = status_bytes("self", "VmHWM")
    print(json.dumps({"wall_s": wall, "growth": peak - rss_before, "frames": decoded, "total": total}))


def naive_row(mode: str, path: Path, cap: int) -> dict[str, Any]:
    out = subprocess.run(
        [sys.executable, __file__, "--naive", mode, "--video", str(path), "--cap", str(cap)],
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
    )
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def row_median(runs: list[Any], key: str) -> float:
    """The median of `key` over the rounds of one row (GatewayRun fields or the naive child's JSON)."""
    return float(statistics.median(getattr(r, key) if isinstance(r, GatewayRun) else r[key] for r in runs))


# --- the run -------------------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()) / "mmgate-bench-video")
    parser.add_argument("--seconds-1080p", type=int, default=60)
    parser.add_argument("--seconds-480p", type=int, default=600)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--refusal-tries", type=int, default=7)
    parser.add_argument("--keep-cap-gib", type=float, default=8.0)
    parser.add_argument("--naive", choices=["keep", "drop"], help=argparse.SUPPRESS)
    parser.add_argument("--video", help=argparse.SUPPRESS)
    parser.add_argument("--cap", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.naive:
        naive_child(args.naive, args.video, args.cap)
        return

    args.workdir.mkdir(parents=True, exist_ok=True)
    codec = video_codec()
    videos = [
        (f"{args.seconds_1080p} s 1920x1080", video_file(args.workdir, 1920, 1080, args.seconds_1080p, codec)),
        (f"{args.seconds_480p} s 854x480", video_file(args.workdir, 854, 480, args.seconds_480p, codec)),
    ]
    keep_cap = int(min(args.keep_cap_gib * GIB, status_meminfo("MemAvailable") - 4 * GIB))
    # Nothing listens there: the gateway receives, parses and decodes, then fails to connect (502) before it
    # writes a byte of the body upstream.
    unreachable = f"http://127.0.0.1:{free_port()}"
    upstream = StubUpstream()
    results: dict[str, dict[str, Any]] = {}
    with ServerThread(upstream) as upstream_server:
        times, refused_frames, message = refusal_row(args.workdir, upstream_server.url, args.refusal_tries)
        for name, path in videos:
            body = video_body(path.read_bytes(), "video/mp4")
            rows: dict[str, list[Any]] = {row: [] for row in ("forwarded", "not forwarded", "control", "drop")}
            for _ in range(args.rounds):
                rows["forwarded"].append(mmgate_row(args.workdir, upstream_server.url, body, status=200, decodes=1))
                rows["not forwarded"].append(mmgate_row(args.workdir, unreachable, body, status=502, decodes=1))
                control = text_body(len(body))
                rows["control"].append(mmgate_row(args.workdir, upstream_server.url, control, status=200, decodes=0))
                del control
                with upstream.state.lock:
                    upstream.state.requests.clear()
                rows["drop"].append(naive_row("drop", path, 0))
            keep = naive_row("keep", path, keep_cap)
            results[name] = {"path": path, "rows": rows, "keep": keep}
            del body

    print(
        f"\nmachine: {machine()}; videos: {codec}, {RATE} fps, a keyframe every {GOP_SECONDS} s; workdir {args.workdir}"
    )
    print(
        f"rounds: {args.rounds} (medians); the keep row once per video, capped at {keep_cap / GIB:.1f} GiB; "
        f"gateway: {SAMPLED} sampled frames (media.video.num_frames default)\n"
    )
    print("| video | path | frames decoded | wall s | decode s | peak RSS growth | notes |")
    print("| --- | --- | ---: | ---: | ---: | ---: | --- |")
    verdicts = []
    for name, result in results.items():
        rows, keep = result["rows"], result["keep"]
        total = keep["total"]
        size = result["path"].stat().st_size
        runs = rows["forwarded"]
        body = runs[0].body
        predicted = runs[0].predicted
        target = predicted + HEADROOM + body

        growth, decode_s, wall = (
            row_median(rows["forwarded"], "growth"),
            row_median(rows["forwarded"], "decode_s"),
            row_median(rows["forwarded"], "wall_s"),
        )
        local_growth = row_median(rows["not forwarded"], "growth")
        local_wall, local_decode_s = (
            row_median(rows["not forwarded"], "wall_s"),
            row_median(rows["not forwarded"], "decode_s"),
        )
        control_wall, drop_growth = row_median(rows["control"], "wall_s"), row_median(rows["drop"], "growth")
        control_growth = row_median(rows["control"], "growth")
        drop_wall = row_median(rows["drop"], "wall_s")
        print(
            f"| {name} | mmgate gateway, one request | {runs[0].frames:,} of {total:,} | {wall:.2f} | {decode_s:.2f} "
            f"| {growth / MIB:,.0f} MiB | file {size / MIB:.1f} MiB, body {body / MIB:.1f} MiB; "
            f"{SAMPLED} sampled RGB frames {predicted / MIB:.0f} MiB; target {target / MIB:,.0f} MiB "
            f"(sampled + 64 MiB + body) |"
        )
        print(
            f"| {name} | mmgate gateway, upstream unreachable (502) | {rows['not forwarded'][0].frames:,} of {total:,} "
            f"| {local_wall:.2f} | {local_decode_s:.2f} "
            f"| {local_growth / MIB:,.0f} MiB | receive, parse, decode; no body written upstream |"
        )
        print(
            f"| {name} | mmgate gateway, same-size body without media | 0 | {control_wall:.2f} | - "
            f"| {control_growth / MIB:,.0f} MiB | receive, parse, forward {body / MIB:.1f} MiB; nothing decoded |"
        )
        print(
            f"| {name} | naive decode-all, drop each | {rows['drop'][0]['frames']:,} of {total:,} | {drop_wall:.2f} "
            f"| {drop_wall:.2f} | {drop_growth / MIB:,.0f} MiB | every frame to RGB, {SAMPLED} kept |"
        )
        if keep["frames"] < total:
            full = keep["growth"] / keep["frames"] * total
            keep_rss = (
                f"≥ {keep['growth'] / GIB:.1f} GiB (stopped at cap after {keep['frames']:,} of {total:,} frames); "
                f"≈ {full / GIB:.1f} GiB extrapolated to all frames"
            )
        else:
            keep_rss = f"{keep['growth'] / GIB:.1f} GiB"
        print(
            f"| {name} | naive decode-all into a list | {keep['frames']:,} of {total:,} | {keep['wall_s']:.2f} "
            f"| {keep['wall_s']:.2f} | {keep_rss} | |"
        )
        verdicts.append(
            f"- {name}: gateway peak RSS growth {growth / MIB:,.0f} MiB vs target {target / MIB:,.0f} MiB "
            f"(sampled {predicted / MIB:.0f} + 64 + body {body / MIB:.0f}): {'met' if growth < target else 'MISSED'}; "
            f"without the body {(growth - body) / MIB:,.0f} MiB vs {(predicted + HEADROOM) / MIB:,.0f} MiB. "
            f"Up to the forward (upstream unreachable) {local_growth / MIB:,.0f} MiB: "
            f"{'met' if local_growth < target else 'MISSED'}; forwarding the same-size body without media "
            f"{control_growth / MIB:,.0f} MiB. Decode-all {drop_wall:.2f} s / gateway sampled decode {decode_s:.2f} s "
            f"= {drop_wall / decode_s:.1f}x (whole request {wall:.2f} s: {drop_wall / wall:.1f}x); "
            f"frames decoded {runs[0].frames:,} of {total:,}"
        )
    median_ms = statistics.median(times) * 1000
    print("\ntargets:")
    for line in verdicts:
        print(line)
    print(
        f"- declared 1,000,000-frame AVI: 413 in {median_ms:.1f} ms median of {len(times)} "
        f"(min {min(times) * 1000:.1f}, max {max(times) * 1000:.1f}), frames decoded {refused_frames}: "
        f'{"met" if median_ms < 50 and refused_frames == 0 else "MISSED"} (< 50 ms, 0 frames); "{message}"'
    )


if __name__ == "__main__":
    main()
