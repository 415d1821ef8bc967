"""Every way a request can end frees what it held by reference counting alone.

With the cyclic collector off, each kind of ending (served, every refusal at every stage, upstream failures, a
client that leaves at each stage) is sent several times to the real gateway in uvicorn; then every request's
`RequestInfo` (and with it the ASGI scope) must be gone, and a collection must find nothing of the gateway's: no
frame of its code and no buffer of a request's size. A reference cycle on any path would hold the request's body,
parsed document and decoded media until a collection happened to run: what a refused flood leaves behind.
"""

from __future__ import annotations

import contextlib
import io
import logging
import socket
import struct
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import cache

import pytest
from PIL import Image

from engine_adapter.__main__ import ENGINE
from engine_adapter.app import EngineApp
from gateway.app import Gateway
from gateway.request_info import RequestInfo
from tests.conftest import engine_settings, gateway_served, merge
from tests.gateway.fault_upstream import FaultUpstream
from tests.gateway.media.audio.test_decode import make_audio
from tests.gateway.media.audio.test_loader import audio_body
from tests.gateway.media.video.test_decode import make_video
from tests.gateway.media.video.test_loader import mp4_url, video_body
from tests.gateway.media_factory import chat_body, data_url, image_bytes, jpeg_header_claiming
from tests.gateway.rawhttp import open_request, read_response
from tests.observe import collector_off, cyclic_garbage, live, request_garbage, wait_until
from tests.servers import ServerThread, free_port

CHAT = "/v1/chat/completions"
ROUNDS = 3
# Request data worth finding: every body below is at least this large.
LARGE = 256 << 10
BODY_PAD = "x" * LARGE
CAP = 16 << 20
BYTES_LIMITS = {
    "max_multimodal_cpu_bytes": CAP,
    "max_multimodal_cpu_bytes_per_request": CAP,
    "max_request_body_bytes": 8 << 20,
    "admission_timeout_s": 0.5,
    "max_queued_requests": 1,
    "max_media_items_per_request": 8,
}
SLOT_LIMITS = {**BYTES_LIMITS, "budget_mode": "slots"}
# Room for the rows of a small image, not of a large one: the engine refuses the large one (413).
ENGINE_ENCODER = {"max_resident_bytes": 1 << 17}
SERVER = {"drain_timeout_s": 1, "body_idle_timeout_s": 0.5}
MEDIA = {"fetch": {"allow_private_networks": True, "connect_timeout_s": 1, "read_timeout_s": 1}}
# Quick to time out (504); the gateways that hold a request at the upstream to fill the budget wait longer, the
# holder being let go by its client leaving.
UPSTREAM = {"read_timeout_s": 0.5}
HOLDING = {"read_timeout_s": 30}


@pytest.fixture(scope="module")
def fault() -> Iterator[FaultUpstream]:
    with FaultUpstream() as upstream:
        yield upstream


@dataclass
class Served:
    gateway: Gateway
    url: str
    fault: FaultUpstream


# The gateways the endings run against, by name: their limits make each stage reachable.
GATEWAYS: dict[str, dict[str, object]] = {
    # Bytes mode: every reservation is predicted from the headers.
    "bytes": {"limits": BYTES_LIMITS, "upstream": {"blocked_paths": ["/release_memory"]}},
    # One slot: a second request waits (and times out, or finds the queue full); nothing is predicted, so a
    # decode can pass the cap; one media thread, full decodes, so a decode can be left while it runs.
    "slots": {"limits": SLOT_LIMITS, "media": {"load_workers": 1, "decode": "full"}, "upstream": HOLDING},
    # Room for one body: a second waits for it.
    "bodies": {"limits": {**BYTES_LIMITS, "max_buffered_body_bytes": 1 << 20}, "upstream": HOLDING},
    # Engine mode: media chat goes to a real engine (the tiny tower, the reference responder).
    "engine": {"limits": BYTES_LIMITS, "media": {"processor": "qwen2_vl"}},
    # Nothing listens at the upstream's address.
    "refused": {"limits": BYTES_LIMITS, "upstream": {"url": f"http://127.0.0.1:{free_port()}"}},
}


@pytest.fixture(scope="module")
def gateways(fault: FaultUpstream) -> Iterator[Callable[[str], Served]]:
    """The gateway of each name, started the first time it is asked for and kept for the module."""
    with contextlib.ExitStack() as stack:
        started: dict[str, Served] = {}

        def get(name: str) -> Served:
            if name not in started:
                sections = merge({"server": SERVER, "media": MEDIA, "upstream": UPSTREAM}, GATEWAYS[name])
                if name == "engine":
                    engine = EngineApp(engine_settings(encoder=ENGINE_ENCODER))
                    served = stack.enter_context(
                        ServerThread(engine, config=ENGINE.server_config(engine, engine.settings))
                    )
                    sections = merge(sections, {"engine": {"url": served.url}})
                upstream = str(sections["upstream"].pop("url", fault.url))
                gateway, url = stack.enter_context(gateway_served(upstream, **sections))
                started[name] = Served(gateway, url, fault)
            return started[name]

        yield get


# --- how requests are sent: raw sockets, so that the test's own client leaves no garbage -----------------------


@contextlib.contextmanager
def logging_off() -> Iterator[None]:
    logging.disable(logging.CRITICAL)
    try:
        yield
    finally:
        logging.disable(logging.NOTSET)


def head(path: str, length: int | None, headers: dict[str, str] | None = None) -> str:
    extra = "".join(f"{name}: {value}\n" for name, value in (headers or {}).items())
    framing = "Transfer-Encoding: chunked\n" if length is None else f"Content-Length: {length}\n"
    return f"POST {path} HTTP/1.1\nHost: gateway\nContent-Type: application/json\n{framing}{extra}"


def exchange(url: str, body: bytes, headers: dict[str, str] | None = None, path: str = CHAT) -> int:
    sock = open_request(url, head(path, len(body), headers))
    try:
        sock.sendall(body)
        return read_response(sock)[0]
    finally:
        sock.close()


def send(url: str, body: bytes, headers: dict[str, str] | None = None) -> socket.socket:
    """The whole request, its connection left open."""
    sock = open_request(url, head(CHAT, len(body), headers))
    sock.sendall(body)
    return sock


def leave(sock: socket.socket) -> None:
    """The client goes away: a reset, so the gateway learns of it at once."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()


@cache
def jpeg() -> bytes:
    return image_bytes(64, 64)


@cache
def slow_jpeg() -> bytes:
    """A progressive 1500x1500 JPEG: 6.75 MB decoded, one full decode fits the cap, two do not."""
    out = io.BytesIO()
    Image.new("RGB", (1500, 1500), (200, 30, 90)).save(out, format="JPEG", progressive=True)
    return out.getvalue()


def padded(*urls: str, **extra: object) -> bytes:
    """A chat body carrying `urls`, with a text part large enough to find if it were held."""
    return chat_body(*urls, text=BODY_PAD, **extra)


# --- the endings ----------------------------------------------------------------------------------------------


def served_text(s: Served) -> None:
    assert exchange(s.url, padded()) == 200


def served_image(s: Served) -> None:
    assert exchange(s.url, padded(data_url(jpeg()))) == 200


def served_stream(s: Served) -> None:
    assert exchange(s.url, padded(data_url(jpeg()), stream=True), {"x-fault": "sse"}) == 200


def malformed_json(s: Served) -> None:
    assert exchange(s.url, padded()[:-1]) == 400


def malformed_json_large(s: Served) -> None:
    # Past the size where long literals are swapped out before parsing.
    assert exchange(s.url, chat_body(data_url(jpeg()) + "A" * (2 << 20))[:-1]) == 400


def invalid_base64(s: Served) -> None:
    assert exchange(s.url, padded("data:image/png;base64," + "!" * LARGE)) == 400


def not_an_image(s: Served) -> None:
    assert exchange(s.url, padded(data_url(b"\x00" * LARGE, "image/png"))) == 400


def not_an_image_of_two(s: Served) -> None:
    assert exchange(s.url, padded(data_url(jpeg()), data_url(b"\x00" * LARGE, "image/png"))) == 400


def truncated_jpeg(s: Served) -> None:
    assert exchange(s.url, padded(data_url(image_bytes(512, 512)[:-4000]))) == 400


def blocked_path(s: Served) -> None:
    assert exchange(s.url, padded(), path="/release_memory") == 403


def head_too_large(s: Served) -> None:
    sock = open_request(s.url, head(CHAT, 2, {"x-pad": "x" * (65 << 10)}))
    try:
        assert read_response(sock)[0] == 431
    finally:
        sock.close()


@cache
def mp4() -> bytes:
    return make_video("mpeg4", "mp4", frames=8)


def served_video(s: Served) -> None:
    assert exchange(s.url, video_body(mp4_url(mp4()), text=BODY_PAD)) == 200


def video_not_a_video(s: Served) -> None:
    assert exchange(s.url, video_body(mp4_url(b"\x00" * LARGE), text=BODY_PAD)) == 400


def video_truncated(s: Served) -> None:
    assert exchange(s.url, video_body(mp4_url(mp4()[: len(mp4()) // 2]), text=BODY_PAD)) == 400


def audio_not_audio(s: Served) -> None:
    assert exchange(s.url, audio_body(b"\x00" * LARGE)) == 400


def served_audio(s: Served) -> None:
    assert exchange(s.url, audio_body(make_audio(seconds=1.0))) == 200


def engine_served(s: Served) -> None:
    assert exchange(s.url, padded(data_url(jpeg()))) == 200


def engine_refused(s: Served) -> None:
    assert exchange(s.url, padded(data_url(image_bytes(1024, 1024)))) == 413


def bad_path(s: Served) -> None:
    assert exchange(s.url, padded(), path="/v1%2Fchat/completions") == 400


def blocked_url(s: Served) -> None:
    assert exchange(s.url, padded("http://169.254.169.254/latest/meta-data")) == 400


def failed_download(s: Served) -> None:
    assert exchange(s.url, padded(f"http://127.0.0.1:{free_port()}/image.jpg")) == 400


def downloaded_not_an_image(s: Served) -> None:
    # The fault upstream answers any GET with JSON.
    assert exchange(s.url, padded(s.fault.url + "/image.jpg")) == 400


def body_over_cap(s: Served) -> None:
    sock = open_request(s.url, head(CHAT, BYTES_LIMITS["max_request_body_bytes"] + 1))
    try:
        assert read_response(sock)[0] == 413
    finally:
        sock.close()


def chunked_over_cap(s: Served) -> None:
    sock = open_request(s.url, head(CHAT, None))
    try:
        chunk = b"x" * (1 << 20)
        with contextlib.suppress(OSError):  # the gateway may answer and close before all is sent
            for _ in range(BYTES_LIMITS["max_request_body_bytes"] // len(chunk) + 2):
                sock.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
        assert read_response(sock)[0] == 413
    finally:
        sock.close()


def too_many_items(s: Served) -> None:
    assert exchange(s.url, padded(*[data_url(jpeg())] * 9)) == 413


def predicted_over_cap(s: Served) -> None:
    assert exchange(s.url, padded(data_url(jpeg_header_claiming(4000, 3000)))) == 413


def decoded_over_cap(s: Served) -> None:
    # Each item fits the cap; together they pass it (nothing is predicted in slots mode).
    assert exchange(s.url, padded(*[data_url(image_bytes(800, 800, seed=i)) for i in range(6)])) == 413


@contextlib.contextmanager
def slot_held(s: Served) -> Iterator[None]:
    """The only slot held by a request the upstream does not answer; given back when it leaves."""
    before = s.fault.waiting["hang"]
    sock = open_request(s.url, head(CHAT, len(body := padded(data_url(jpeg()))), {"x-fault": "hang"}))
    try:
        sock.sendall(body)
        wait_until(lambda: s.fault.waiting["hang"] > before, 5, "the holder at the upstream")
        yield
    finally:
        leave(sock)
        wait_until(lambda: s.fault.waiting["hang"] == before, 5, "the holder gone from the upstream")
        wait_until(lambda: s.gateway.budget.in_use == 0, 5, "the slot free")


def budget_wait_timed_out(s: Served) -> None:
    with slot_held(s):
        assert exchange(s.url, padded(data_url(jpeg()))) == 429


def budget_queue_full(s: Served) -> None:
    with slot_held(s):
        waiter = send(s.url, padded(data_url(jpeg())))
        try:
            wait_until(lambda: s.gateway.budget.waiting == 1, 5, "the waiter in the queue")
            assert exchange(s.url, padded(data_url(jpeg()))) == 429
        finally:
            leave(waiter)


def left_while_queued(s: Served) -> None:
    with slot_held(s):
        waiter = send(s.url, padded(data_url(jpeg())))
        wait_until(lambda: s.gateway.budget.waiting == 1, 5, "the waiter in the queue")
        leave(waiter)
        wait_until(lambda: s.gateway.budget.waiting == 0, 5, "the waiter gone")


def left_while_decoding(s: Served) -> None:
    # Progressive JPEGs decoded one at a time: the first holds the budget for the 10-20 ms of its decode, and the
    # second does not fit (413). Polled every half millisecond, not every 10 ms, to see that window.
    sock = send(s.url, padded(*[data_url(slow_jpeg())] * 2))
    deadline = time.monotonic() + 5
    while s.gateway.budget.in_use == 0:
        assert time.monotonic() < deadline, "the decodes under way: not within 5 s"
        time.sleep(0.0005)
    leave(sock)
    wait_until(lambda: s.gateway.budget.in_use == 0, 10, "the reservation back")


@contextlib.contextmanager
def body_room_held(s: Served) -> Iterator[None]:
    """The room for bodies held by a text request the upstream does not answer."""
    before = s.fault.waiting["hang"]
    sock = send(s.url, chat_body(text="x" * (900 << 10)), {"x-fault": "hang"})
    try:
        wait_until(lambda: s.fault.waiting["hang"] > before, 5, "the holder at the upstream")
        yield
    finally:
        leave(sock)
        wait_until(lambda: s.fault.waiting["hang"] == before, 5, "the holder gone from the upstream")
        wait_until(lambda: s.gateway.admission.bodies.in_use == 0, 5, "the room for bodies free")


def body_wait_timed_out(s: Served) -> None:
    with body_room_held(s):
        assert exchange(s.url, padded(data_url(jpeg()))) == 429


def left_while_body_waits(s: Served) -> None:
    with body_room_held(s):
        waiter = send(s.url, padded(data_url(jpeg())))
        wait_until(lambda: s.gateway.admission.bodies.waiting == 1, 5, "the body waiting for room")
        leave(waiter)
        wait_until(lambda: s.gateway.admission.bodies.waiting == 0, 5, "the waiter gone")


def upstream_refused(s: Served) -> None:
    assert exchange(s.url, padded(data_url(jpeg()))) == 502


def upstream_refused_text(s: Served) -> None:
    assert exchange(s.url, padded()) == 502


def upstream_timed_out(s: Served) -> None:
    assert exchange(s.url, padded(data_url(jpeg())), {"x-fault": "hang"}) == 504


def upstream_closed(s: Served) -> None:
    assert exchange(s.url, padded(data_url(jpeg())), {"x-fault": "close"}) == 502


def upstream_garbage(s: Served) -> None:
    assert exchange(s.url, padded(data_url(jpeg())), {"x-fault": "garbage"}) == 502


def upstream_reset_mid_stream(s: Served) -> None:
    sock = send(s.url, padded(data_url(jpeg()), stream=True), {"x-fault": "reset"})
    with contextlib.suppress(OSError):
        while sock.recv(65536):
            pass
    sock.close()


def left_mid_body(s: Served) -> None:
    body = padded(data_url(jpeg()))
    sock = open_request(s.url, head(CHAT, len(body)))
    sock.sendall(body[: len(body) // 2])
    wait_until(lambda: s.gateway.admission.bodies.in_use > 0, 5, "the body being read")
    leave(sock)


def slow_body(s: Served) -> None:
    body = padded(data_url(jpeg()))
    sock = open_request(s.url, head(CHAT, len(body)))
    try:
        sock.sendall(body[: len(body) // 2])
        assert read_response(sock)[0] == 408  # server.body_idle_timeout_s
    finally:
        sock.close()


def left_awaiting_headers(s: Served) -> None:
    before = s.fault.waiting["hang"]
    sock = send(s.url, padded(data_url(jpeg())), {"x-fault": "hang"})
    wait_until(lambda: s.fault.waiting["hang"] > before, 5, "the request at the upstream")
    leave(sock)
    assert s.fault.wait_until(lambda f: f.waiting["hang"] == before, 5)


def left_mid_stream(s: Served) -> None:
    before = s.fault.waiting["stall"]
    sock = send(s.url, padded(data_url(jpeg()), stream=True), {"x-fault": "stall"})
    wait_until(lambda: s.fault.waiting["stall"] > before, 5, "the stream under way")
    leave(sock)
    assert s.fault.wait_until(lambda f: f.waiting["stall"] == before, 5)


ENDINGS: dict[str, tuple[str, Callable[[Served], None]]] = {
    "200 text": ("bytes", served_text),
    "200 image": ("bytes", served_image),
    "200 stream": ("bytes", served_stream),
    "400 malformed JSON": ("bytes", malformed_json),
    "400 malformed JSON, skeleton parse": ("bytes", malformed_json_large),
    "400 invalid base64": ("bytes", invalid_base64),
    "400 not an image": ("bytes", not_an_image),
    "400 not an image, second of two": ("bytes", not_an_image_of_two),
    "400 truncated JPEG": ("bytes", truncated_jpeg),
    "400 percent-encoded slash": ("bytes", bad_path),
    "403 blocked path": ("bytes", blocked_path),
    "431 head too large": ("bytes", head_too_large),
    "200 video": ("bytes", served_video),
    "400 not a video": ("bytes", video_not_a_video),
    "400 truncated video": ("bytes", video_truncated),
    "200 audio": ("bytes", served_audio),
    "400 not audio": ("bytes", audio_not_audio),
    "400 blocked URL": ("bytes", blocked_url),
    "400 download failed": ("bytes", failed_download),
    "400 download not an image": ("bytes", downloaded_not_an_image),
    "408 body stalled": ("bytes", slow_body),
    "413 declared body over cap": ("bytes", body_over_cap),
    "413 chunked body over cap": ("bytes", chunked_over_cap),
    "413 too many items": ("bytes", too_many_items),
    "413 predicted over cap": ("bytes", predicted_over_cap),
    "413 decoded over cap": ("slots", decoded_over_cap),
    "429 budget wait timed out": ("slots", budget_wait_timed_out),
    "429 budget queue full": ("slots", budget_queue_full),
    "429 body room wait timed out": ("bodies", body_wait_timed_out),
    "499 mid-body": ("bytes", left_mid_body),
    "499 waiting for body room": ("bodies", left_while_body_waits),
    "499 queued for the budget": ("slots", left_while_queued),
    "499 while decoding": ("slots", left_while_decoding),
    "499 awaiting upstream headers": ("bytes", left_awaiting_headers),
    "499 mid-stream": ("bytes", left_mid_stream),
    "200 engine mode": ("engine", engine_served),
    "413 engine mode, the engine refuses": ("engine", engine_refused),
    "502 upstream refused": ("refused", upstream_refused),
    "502 upstream refused, text": ("refused", upstream_refused_text),
    "502 upstream closed": ("bytes", upstream_closed),
    "502 upstream spoke garbage": ("bytes", upstream_garbage),
    "504 upstream timed out": ("bytes", upstream_timed_out),
    "200 then upstream reset mid-stream": ("bytes", upstream_reset_mid_stream),
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("ending", list(ENDINGS))
def test_each_ending_is_freed_by_reference_counting(gateways: Callable[[str], Served], ending: str) -> None:
    name, end = ENDINGS[ending]
    served = gateways(name)
    end(served)  # once first, for what is made once per process (pools, caches, connections)
    # Logging off while measuring: pytest keeps every log record for its report, and a record of an error
    # logged with its traceback would hold the request's frames.
    with collector_off(), logging_off():
        held = live(RequestInfo)
        for _ in range(ROUNDS):
            end(served)
        with contextlib.suppress(AssertionError):
            wait_until(lambda: live(RequestInfo) <= held, 10)
        left = live(RequestInfo) - held
        found = request_garbage(cyclic_garbage(), min_bytes=LARGE)
    assert not found, "\n".join(found)
    assert left <= 0, f"{left} finished requests' RequestInfo still held"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("stream", [False, True], ids=["before the response", "mid-stream"])
def test_a_drain_cut_is_freed_by_reference_counting(fault: FaultUpstream, stream: bool) -> None:
    """A request still running at the drain deadline is cut and answered (503, or an error event mid-stream);
    what it held goes with it. A gateway drains once, so each round has its own."""

    def cut_once() -> None:
        with gateway_served(fault.url, server={"drain_timeout_s": 0.2}) as (gateway, url):
            mode = "stall" if stream else "hang"
            before = fault.waiting[mode]
            sock = send(url, padded(data_url(jpeg()), stream=stream), {"x-fault": mode})
            try:
                wait_until(lambda: fault.waiting[mode] > before, 5, "the request at the upstream")
                gateway.start_draining()
                if not stream:
                    assert read_response(sock)[0] == 503
                    return
                answer = b""
                while not answer.endswith(b"\r\n0\r\n\r\n"):  # the stream's last chunk
                    chunk = sock.recv(65536)
                    assert chunk, answer
                    answer += chunk
                assert answer.startswith(b"HTTP/1.1 200 "), answer
                assert b"drain_timeout_s" in answer, answer
            finally:
                sock.close()

    cut_once()
    with collector_off(), logging_off():
        held = live(RequestInfo)
        for _ in range(ROUNDS):
            cut_once()
        left = live(RequestInfo) - held
        found = request_garbage(cyclic_garbage(), min_bytes=LARGE)
    assert not found, "\n".join(found)
    assert left <= 0, f"{left} finished requests' RequestInfo still held"
