"""What the gateway process really holds, measured: its peak RSS (VmHWM) against what it was given to hold.

Each test runs the gateway in a process of its own, resets that process's peak with `clear_refs`, sends what an
attacker would, and reads the peak back: a refusal is only worth something if nothing was allocated before it.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
import yaml

from tests.gateway.media.video.test_loader import mp4_url, video_body
from tests.gateway.media_factory import chat_body, data_url, image_bytes, png_text_bomb
from tests.gateway.stub_upstream import StubUpstream
from tests.observe import metric, process_memory, reset_peak
from tests.servers import ROOT, free_port, served_process

# Every test here starts a gateway process of its own and measures it.
pytestmark = pytest.mark.slow

MIB = 1 << 20
# What a gateway process may hold at peak beyond what its bounds count: allocator arenas (a body over 1 MiB is parsed
# on a media thread, which allocates from an arena of its own), connection buffers, decoder scratch. gateway/
# memory_fit.py counts it in every process's overhead.
SLACK = 96 * MIB


@pytest.fixture(scope="module")
def video_bombs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, bytes]:
    """The files of `media_factory.VIDEO_BOMBS`, written by a process of their own."""
    directory = tmp_path_factory.mktemp("bombs")
    code = f"from tests.gateway.media_factory import write_video_bombs; write_video_bombs({str(directory)!r})"
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, timeout=120)
    return {path.name: path.read_bytes() for path in directory.iterdir()}


def gateway_config(
    directory: Path,
    upstream: str,
    media: dict[str, object] | None = None,
    server: dict[str, object] | None = None,
    **limits: object,
) -> Path:
    config = {
        "upstream": {"url": upstream},
        "server": {"access_log": False, **(server or {})},
        "limits": limits,
        "media": media or {},
    }
    path = directory / "gateway.yaml"
    path.write_text(yaml.safe_dump(config), encoding="utf-8")
    return path


# `python -m gateway` with the cyclic garbage collector off: what a reference cycle holds then stays held.
WITHOUT_COLLECTOR = [
    sys.executable,
    "-c",
    "import gc, runpy; gc.disable(); runpy.run_module('gateway', run_name='__main__', alter_sys=True)",
]


@contextmanager
def gateway_process(
    directory: Path,
    upstream: str,
    media: dict[str, object] | None = None,
    *,
    command: list[str] | None = None,
    server: dict[str, object] | None = None,
    **limits: object,
) -> Iterator[tuple[str, int]]:
    """A gateway process: (its URL, its pid); `command` replaces `python -m gateway`, `server` adds settings."""
    env = {name: value for name, value in os.environ.items() if not name.startswith("MMGATE_")}
    config = gateway_config(directory, upstream, media, server, **limits)
    with served_process("gateway", config, env=env, command=command) as served:
        yield served.url, served.process.pid


@pytest.fixture
def gateway(stub: tuple[StubUpstream, str], tmp_path: Path) -> Iterator[tuple[str, int]]:
    """A gateway process with the default limits."""
    with gateway_process(tmp_path, stub[1]) as served:
        yield served


def post_at_once(url: str, body: bytes, count: int) -> list[httpx.Response]:
    async def run() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=60) as client:
            return list(
                await asyncio.gather(*(client.post(url + "/v1/chat/completions", content=body) for _ in range(count)))
            )

    return asyncio.run(run())


def truncated_jpeg() -> bytes:
    jpeg = image_bytes(3000, 2000)
    return chat_body(data_url(jpeg[: len(jpeg) * 3 // 4]))


TRIM_INTERVAL_S = 0.05

# A refusal of each kind, about 4 MiB a request: (body, whether the upstream is down, the status).
REFUSALS = {
    "400 invalid base64": (lambda: chat_body("data:image/png;base64," + "!" * (4 * MIB)), False, 400),
    "400 malformed JSON": (
        lambda: b'{"model":"m","messages":[{"role":"user","content":"' + b"a" * (4 * MIB),
        False,
        400,
    ),
    "400 truncated JPEG": (truncated_jpeg, False, 400),
    "502 upstream down": (lambda: chat_body(text="a" * (4 * MIB)), True, 502),
}


@pytest.mark.parametrize("kind", list(REFUSALS))
def test_rounds_of_refusals_leave_nothing_behind(stub: tuple[StubUpstream, str], tmp_path: Path, kind: str) -> None:
    """6 rounds of 12 concurrent requests refused the same way, to a gateway whose collector is off: what a
    reference cycle held would stay, 12 bodies and their parsed and decoded forms a round (the gateway grew by
    about 240 MiB a round of 20 MiB bodies before). Its RSS after the last round is within a few MiB of the
    first's."""
    make, down, status = REFUSALS[kind]
    upstream = f"http://127.0.0.1:{free_port()}" if down else stub[1]
    body = make()
    # Free heap pages go back to the system every 50 ms (serving/allocator.py), so that what each round leaves
    # resident is what is still referenced, not what glibc's arenas happened to keep.
    trimmed = {"malloc_trim_interval_s": TRIM_INTERVAL_S}
    with gateway_process(tmp_path, upstream, command=WITHOUT_COLLECTOR, server=trimmed) as (url, pid):
        after: list[int] = []
        for _ in range(6):
            responses = post_at_once(url, body, 12)
            assert [response.status_code for response in responses] == [status] * 12, responses[0].text
            time.sleep(10 * TRIM_INTERVAL_S)
            after.append(process_memory(pid))
    # Within one round's bodies of the first round, where a leak would add one round's bodies (and more) every round.
    assert after[-1] - after[0] < 12 * len(body), f"RSS after each round (MiB): {[v // MIB for v in after]}"


@pytest.mark.parametrize(
    ("name", "message"),
    [
        # Its matroska header says 64x64; its SPS, which the decoder follows, 12288x12288.
        ("size_liar.mkv", "video frames are 12288x12288 = 150,994,944 pixels, over limits.max_video_pixels"),
        # One valid 64x64 track and 8 more, each one 8192x8192 keyframe that a stream probe would decode.
        ("hidden_tracks.mkv", "video stream 1 declares 8192x8192 = 67,108,864 pixels a frame, over"),
        ("large.mp4", "video frames are 8192x8192 = 67,108,864 pixels, over limits.max_video_pixels"),
    ],
)
def test_a_video_whose_decoder_would_allocate_gigabytes_is_refused_before_anything_decodes(
    gateway: tuple[str, int], video_bombs: dict[str, bytes], name: str, message: str
) -> None:
    """8 at once, each refused 413 from what its container and its SPS declare: FFmpeg's stream probe decodes
    nothing, so the peak grows by the request bodies and little more (it grew by 2-2.7 GiB before)."""
    url, pid = gateway
    body = video_body(mp4_url(video_bombs[name]))
    before = reset_peak(pid)
    responses = post_at_once(url, body, 8)
    growth = process_memory(pid, "VmHWM") - before
    assert [response.status_code for response in responses] == [413] * 8, responses[0].text
    assert message in responses[0].json()["message"]
    # The bodies themselves are held while they are read and parsed: 8 of them, and the slack for the rest.
    assert growth < 8 * len(body) + SLACK, f"peak RSS grew by {growth / MIB:.0f} MiB"


def test_bodies_in_flight_stay_within_their_bound(stub: tuple[StubUpstream, str], tmp_path: Path) -> None:
    """12 clients send 40 MiB bodies at once to a gateway whose media budget (and so its bound on buffered
    bodies) is 128 MiB: three bodies are held at a time, the others wait unread, and every client is answered.
    The peak stays within the body bound, the media budget and 96 MiB (it grew by 815 MiB before)."""
    bound = 128 * MIB
    body = chat_body(text="x" * (40 * MIB))
    with gateway_process(tmp_path, stub[1], max_multimodal_cpu_bytes=bound) as (url, pid):
        before = reset_peak(pid)
        responses = post_at_once(url, body, 12)
        growth = process_memory(pid, "VmHWM") - before
    assert {response.status_code for response in responses} <= {200, 429}
    assert sum(response.status_code == 200 for response in responses) >= 3
    assert growth < 2 * bound + SLACK, f"peak RSS grew by {growth / MIB:.0f} MiB"


def test_image_bodies_in_flight_stay_within_their_bound(stub: tuple[StubUpstream, str], tmp_path: Path) -> None:
    """12 clients send bodies of about 40 MiB, each one item that is not an image at all (a 400), to a gateway
    holding at most 128 MiB of bodies with a 128 MiB media budget: the peak stays within the body bound, the media
    budget and 96 MiB (it grew by 845 MiB before, what the refusals' reference cycles held included)."""
    bound = 128 * MIB
    body = chat_body("data:image/png;base64," + "!" * (40 * MIB))
    limits = {"max_buffered_body_bytes": bound, "max_multimodal_cpu_bytes": bound}
    with gateway_process(tmp_path, stub[1], **limits) as (url, pid):
        before = reset_peak(pid)
        responses = post_at_once(url, body, 12)
        growth = process_memory(pid, "VmHWM") - before
    # Every one answered for what it is: the small parse of a body read goes ahead of the bodies waiting for room.
    assert [response.status_code for response in responses] == [400] * 12, [r.status_code for r in responses]
    assert growth < 2 * bound + SLACK, f"peak RSS grew by {growth / MIB:.0f} MiB"


def test_what_parsing_allocates_is_within_the_body_bound(stub: tuple[StubUpstream, str], tmp_path: Path) -> None:
    """Three 20 MiB text-only bodies of `{},{},...` at once, the bound on bodies at 128 MiB: each would parse into
    more than a GiB of objects, so each is refused 413 naming the bound, nothing reaches the upstream, and the
    peak stays within the bound and 96 MiB (it grew by 1.65 GiB before). A body whose parse fits is served."""
    app, upstream = stub
    bound = 128 * MIB
    objects = b'{"model":"m","messages":[{"role":"user","content":"hi"}],"x":[' + b"{}," * (7 * MIB) + b"{}]}"
    text = chat_body(text="a" * (20 * MIB))
    with gateway_process(tmp_path, upstream, max_buffered_body_bytes=bound) as (url, pid):
        before = reset_peak(pid)
        responses = post_at_once(url, objects, 3)
        growth = process_memory(pid, "VmHWM") - before
        served = post_at_once(url, text, 1)
    assert [response.status_code for response in responses] == [413] * 3, responses[0].text
    message = responses[0].json()["message"]
    assert "parsing the request body" in message, message
    assert "limits.max_buffered_body_bytes (134,217,728 bytes)" in message, message
    assert growth < bound + SLACK, f"peak RSS grew by {growth / MIB:.0f} MiB"
    assert served[0].status_code == 200
    assert [seen.method for seen in app.state.requests if seen.path == "/v1/chat/completions"] == ["POST"]


@pytest.mark.parametrize(
    ("chunks", "message"),
    [
        # 64 MiB of text each: past the per-item limit on its own.
        (64, "over limits.max_image_metadata_bytes=16,777,216"),
        # 12 MiB each, within the per-item limit: together past the per-request cap.
        (12, "over limits.max_multimodal_cpu_bytes_per_request=67,108,864"),
    ],
)
def test_png_text_chunks_before_the_image_data_are_charged_before_anything_inflates_them(
    stub: tuple[StubUpstream, str], tmp_path: Path, chunks: int, message: str
) -> None:
    """One request with 8 small PNGs, each with `chunks` zTXt chunks of about 1 MiB of text before its image
    data, under a 64 MiB per-request cap: refused 413 from the headers' walk, which inflates a piece at a time;
    the gateway's own header read never inflates them (it grew by 484 MiB, and answered 200, before)."""
    png = png_text_bomb(chunks, before_idat=True)
    body = chat_body(*[data_url(png, "image/png")] * 8)
    with gateway_process(tmp_path, stub[1], max_multimodal_cpu_bytes_per_request="64MiB") as (url, pid):
        before = reset_peak(pid)
        responses = post_at_once(url, body, 1)
        growth = process_memory(pid, "VmHWM") - before
    assert [response.status_code for response in responses] == [413], responses[0].text
    assert message in responses[0].json()["message"]
    assert growth < 16 * MIB, f"peak RSS grew by {growth / MIB:.0f} MiB"


def test_png_text_after_the_image_data_is_charged_and_never_inflated_by_the_gateways_decode(
    stub: tuple[StubUpstream, str], tmp_path: Path
) -> None:
    """4 PNGs of 68 KB, each with 64 MiB of zTXt text after its image data, decoded in full, the metadata limit
    off: charged what the model server's loader allocates for the text (about 4 x 66 MiB), decoded without it;
    the peak grows by the body and little more (it grew by 256 MiB, charged 367 KB, before)."""
    png = png_text_bomb(64, before_idat=False)
    body = chat_body(*[data_url(png, "image/png")] * 4)
    with gateway_process(tmp_path, stub[1], {"decode": "full"}, max_image_metadata_bytes=None) as (url, pid):
        before = reset_peak(pid)
        responses = post_at_once(url, body, 1)
        growth = process_memory(pid, "VmHWM") - before
        counted = metric(url, "mmgate_media_counted_bytes_sum")
    assert [response.status_code for response in responses] == [200], responses[0].text
    assert counted > 4 * 64 * MIB
    assert growth < 16 * MIB, f"peak RSS grew by {growth / MIB:.0f} MiB"
