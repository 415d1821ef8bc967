"""Media admission through the real gateway and a real stub upstream on loopback."""

from __future__ import annotations

import asyncio
import base64
import random
import threading
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import orjson
import pytest

import gateway.media.image.loader
from gateway.media.image.decode import OpenedImage
from gateway.processors import load
from tests.conftest import (
    GatewayFactory,
)
from tests.gateway.media_factory import (
    chat_body,
    data_url,
    image_bytes,
    jpeg_header_claiming,
    messages_body,
    responses_body,
)
from tests.gateway.stub_upstream import StubUpstream
from tests.observe import collector_off, metric, until, wait_until

SIDE = 64
MIB = 1 << 20
DECODED = SIDE * SIDE * 4  # 16,384 bytes per 64x64 image: Pillow holds an RGB pixel in 4 bytes
# A budget of one slot: one request with media at a time.
ONE_SLOT = {
    "budget_mode": "slots",
    "max_multimodal_cpu_bytes": 1 << 20,
    "max_multimodal_cpu_bytes_per_request": 1 << 20,
}


def hold_the_slot(url: str) -> threading.Thread:
    """A request with one image, sent from a thread of its own; returns once it holds budget."""
    holder = threading.Thread(
        target=lambda: httpx.post(url + "/v1/chat/completions", content=chat_body(*images(1)), timeout=30)
    )
    holder.start()
    wait_until(lambda: metric(url, "mmgate_budget_in_use_bytes") > 0, 5, "the holder's reservation")
    return holder


def post_concurrently(url: str, bodies: list[bytes]) -> list[int]:
    """POST every body to the chat route at once; their status codes, in order."""

    async def run() -> list[int]:
        async with httpx.AsyncClient(timeout=30) as client:
            responses = await asyncio.gather(*(client.post(url + "/v1/chat/completions", content=b) for b in bodies))
            return [r.status_code for r in responses]

    return asyncio.run(run())


def images(n: int, side: int = SIDE) -> list[str]:
    return [data_url(image_bytes(side, side, seed=i)) for i in range(n)]


def test_request_under_the_cap_is_forwarded_byte_for_byte(
    stub: tuple[StubUpstream, str], make_gateway: GatewayFactory
) -> None:
    app, upstream = stub
    body = chat_body(*images(3))
    with make_gateway(upstream) as (_, url):
        response = httpx.post(url + "/v1/chat/completions", content=body)
        decodes = metric(url, "mmgate_media_decode_seconds_count", modality="image")
        items = metric(url, "mmgate_media_items_total", modality="image", source="data_url")
        in_use = metric(url, "mmgate_budget_in_use_bytes")
    assert response.status_code == 200
    assert app.state.requests[0].body == body
    assert decodes == 3
    assert items == 3
    assert in_use == 0


def test_cap_cancels_the_remaining_items(stub: tuple[StubUpstream, str], make_gateway: GatewayFactory) -> None:
    app, upstream = stub
    body = chat_body(*images(40))
    cap = 10 * DECODED  # room for about ten decoded images
    limits = {
        "budget_mode": "slots",
        "max_multimodal_cpu_bytes_per_request": cap,
        "charge_raw_body": False,
        "max_multimodal_cpu_bytes": cap,
        "max_buffered_body_bytes": MIB,  # the body fits; the media are what pass the cap
    }
    with make_gateway(upstream, limits=limits, media={"load_workers": 2}) as (_, url):
        response = httpx.post(url + "/v1/chat/completions", content=body)
        decodes = metric(url, "mmgate_media_decode_seconds_count", modality="image")
        rejections = metric(url, "mmgate_rejections_total", reason="media_too_large")
    assert response.status_code == 413
    error = response.json()
    assert error["type"] == "RequestTooLargeError"
    assert (
        error["message"] == f"decoded media reached {11 * DECODED:,} bytes, over "
        f"limits.max_multimodal_cpu_bytes_per_request={cap:,}"
    )
    assert decodes < 40
    assert decodes <= 10 + 2  # what fit, plus at most the decodes already running
    assert rejections == 1
    assert app.state.requests == []


def test_raw_body_is_charged(stub: tuple[StubUpstream, str], make_gateway: GatewayFactory) -> None:
    _, upstream = stub
    body = chat_body(*images(2))
    cap = 2 * DECODED + len(body) // 2  # both images fit, but not with the whole body on top
    limits = {"budget_mode": "slots", "max_multimodal_cpu_bytes_per_request": cap, "max_multimodal_cpu_bytes": cap}
    with make_gateway(upstream, limits=limits) as (_, url):
        charged = httpx.post(url + "/v1/chat/completions", content=body)
    with make_gateway(upstream, limits={**limits, "charge_raw_body": False}) as (_, url):
        uncharged = httpx.post(url + "/v1/chat/completions", content=body)
    assert charged.status_code == 413
    assert f"(raw body {len(body):,} included)" in charged.json()["message"]
    assert uncharged.status_code == 200


def test_header_bomb_is_refused_without_decoding(stub: tuple[StubUpstream, str], make_gateway: GatewayFactory) -> None:
    _, upstream = stub
    body = chat_body(data_url(jpeg_header_claiming(40000, 40000)))
    with make_gateway(upstream) as (_, url):
        response = httpx.post(url + "/v1/chat/completions", content=body)
        decodes = metric(url, "mmgate_media_decode_seconds_count", modality="image")
    assert response.status_code == 413
    assert "40000x40000 = 1,600,000,000 pixels, over limits.max_image_pixels=178,956,970" in response.json()["message"]
    assert decodes == 0  # refused from the header: no decode started


def test_predicted_bytes_refuse_before_decoding(stub: tuple[StubUpstream, str], make_gateway: GatewayFactory) -> None:
    _, upstream = stub
    body = chat_body(data_url(image_bytes(512, 512)))
    limits = {
        "budget_mode": "slots",
        "max_multimodal_cpu_bytes_per_request": 512 * 512 * 2,
        "max_multimodal_cpu_bytes": 1 << 30,
    }
    with make_gateway(upstream, limits={**limits, "charge_raw_body": False}) as (_, url):
        response = httpx.post(url + "/v1/chat/completions", content=body)
        decodes = metric(url, "mmgate_media_decode_seconds_count", modality="image")
    assert response.status_code == 413
    assert response.json()["message"].startswith(f"decoded media reached {512 * 512 * 4:,} bytes")
    assert decodes == 0


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("data:image/jpeg;base64,!!!notbase64!!!", "messages[0].content[1].image_url: invalid base64 data"),
        ("data:image/jpeg,rawbytes", "only base64 data URLs are accepted"),
        ("data:text/plain;base64," + base64.b64encode(b"hello").decode(), "not an image in an accepted format"),
    ],
)
def test_bad_data_urls_are_400(
    stub: tuple[StubUpstream, str], make_gateway: GatewayFactory, url: str, message: str
) -> None:
    app, upstream = stub
    with make_gateway(upstream) as (_, gateway_url):
        response = httpx.post(gateway_url + "/v1/chat/completions", content=chat_body(url))
    assert response.status_code == 400
    assert response.json()["type"] == "BadRequestError"
    assert message in response.json()["message"]
    assert app.state.requests == []


def test_truncated_jpeg_is_400(stub: tuple[StubUpstream, str], make_gateway: GatewayFactory) -> None:
    _, upstream = stub
    data = image_bytes(256, 256)
    with make_gateway(upstream) as (_, url):
        response = httpx.post(url + "/v1/chat/completions", content=chat_body(data_url(data[: len(data) // 2])))
        header_only = None
    with make_gateway(upstream, media={"decode": "header"}) as (_, url):
        header_only = httpx.post(url + "/v1/chat/completions", content=chat_body(data_url(data[: len(data) // 2])))
    assert response.status_code == 400
    assert "image cannot be decoded" in response.json()["message"]
    assert header_only.status_code == 200  # media.decode: header trusts the header


def test_malformed_json_is_400(stub: tuple[StubUpstream, str], make_gateway: GatewayFactory) -> None:
    _, upstream = stub
    with make_gateway(upstream) as (_, url):
        response = httpx.post(url + "/v1/messages", content=b'{"messages": [')
    assert response.status_code == 400
    assert response.json()["error"]["type"] == "invalid_request_error"


def test_messages_route_413_uses_the_anthropic_envelope(
    stub: tuple[StubUpstream, str], make_gateway: GatewayFactory
) -> None:
    _, upstream = stub
    body = messages_body(*(image_bytes(SIDE, SIDE, seed=i) for i in range(4)))
    limits = {"max_multimodal_cpu_bytes_per_request": 2 * DECODED, "charge_raw_body": False}
    # The bound on buffered bodies (which follows the total) holds the body; the media are what pass the cap.
    limits |= {"max_multimodal_cpu_bytes": 2 * DECODED, "max_buffered_body_bytes": MIB}
    with make_gateway(upstream, limits=limits) as (_, url):
        response = httpx.post(url + "/v1/messages", content=body)
    assert response.status_code == 413
    error = response.json()
    assert error["type"] == "error"
    assert error["error"]["type"] == "request_too_large"
    assert f"limits.max_multimodal_cpu_bytes_per_request={2 * DECODED:,}" in error["error"]["message"]


def test_responses_route_is_accounted(stub: tuple[StubUpstream, str], make_gateway: GatewayFactory) -> None:
    app, upstream = stub
    limits = {"budget_mode": "slots", "max_multimodal_cpu_bytes_per_request": 2 * DECODED, "charge_raw_body": False}
    with make_gateway(upstream, limits={**limits, "max_multimodal_cpu_bytes": 4 * DECODED}) as (_, url):
        ok = httpx.post(url + "/v1/responses", content=responses_body(*images(2)))
        too_many = httpx.post(url + "/v1/responses", content=responses_body(*images(3)))
        decodes = metric(url, "mmgate_media_decode_seconds_count", modality="image")
    assert ok.status_code == 200
    assert too_many.status_code == 413
    assert 2 <= decodes <= 4  # the first request's two; the second's third image was refused from its header
    assert too_many.json()["message"].startswith(f"decoded media reached {3 * DECODED:,} bytes")
    assert [s.path for s in app.state.requests] == ["/v1/responses"]


def test_item_count_cap(stub: tuple[StubUpstream, str], make_gateway: GatewayFactory) -> None:
    _, upstream = stub
    with make_gateway(upstream, limits={"max_media_items_per_request": 2}) as (_, url):
        response = httpx.post(url + "/v1/chat/completions", content=chat_body(*images(3)))
    assert response.status_code == 413
    assert response.json()["message"] == "request has 3 media items, over limits.max_media_items_per_request=2"


def test_processed_tensors_are_checked(stub: tuple[StubUpstream, str], make_gateway: GatewayFactory) -> None:
    _, upstream = stub
    body = chat_body(data_url(image_bytes(448, 448)))
    # Decoded 448x448 is 602,112 bytes; Qwen2-VL's processor returns 1024 rows x 1176 x 4 = 4,816,896 bytes of it,
    # and holds more at its peak, which is what is charged.
    qwen = load("qwen2_vl").image(448, 448)
    assert qwen.returned == 1024 * 1176 * 4 + 24  # pixel_values, and image_grid_thw's 3 int64
    limits = {
        "budget_mode": "slots",
        "max_multimodal_cpu_bytes_per_request": 2 << 20,
        "charge_raw_body": False,
        "max_multimodal_cpu_bytes": 2 << 20,
    }
    with make_gateway(upstream, limits=limits) as (_, url):
        plain = httpx.post(url + "/v1/chat/completions", content=body)
    with make_gateway(upstream, limits=limits, media={"processor": "qwen2_vl"}) as (_, url):
        processed = httpx.post(url + "/v1/chat/completions", content=body)
    assert plain.status_code == 200
    assert processed.status_code == 413
    assert processed.json()["message"] == (
        f"processed tensors (media.processor=qwen2_vl) reached {448 * 448 * 4 + qwen.peak:,} bytes, "
        f"over limits.max_multimodal_cpu_bytes_per_request={2 << 20:,}"
    )


def test_six_requests_through_two_slots(stub: tuple[StubUpstream, str], make_gateway: GatewayFactory) -> None:
    app, upstream = stub
    app.state.hold_s = 0.3  # each request keeps its slot until the upstream answers
    limits = {
        "budget_mode": "slots",
        "max_multimodal_cpu_bytes": 2 << 20,
        "max_multimodal_cpu_bytes_per_request": 1 << 20,
    }
    with make_gateway(upstream, limits=limits) as (_, url):
        statuses = post_concurrently(url, [chat_body(*images(1)) for _ in range(6)])
        waited = metric(url, "mmgate_budget_wait_seconds_count")
    assert statuses == [200] * 6
    assert app.state.max_active == 2
    assert waited == 6


def test_text_requests_pass_while_slots_are_full(stub: tuple[StubUpstream, str], make_gateway: GatewayFactory) -> None:
    app, upstream = stub
    app.state.hold_s = 1.0
    limits = ONE_SLOT
    with make_gateway(upstream, limits=limits) as (_, url):
        holder = hold_the_slot(url)
        text = httpx.post(url + "/v1/chat/completions", content=chat_body(), timeout=30)
        holder.join()
        waits = metric(url, "mmgate_budget_wait_seconds_count")
    assert text.status_code == 200
    # Not held back by the slot holder: it was at the upstream together with it, and never asked for the budget
    # (the holder's is the only wait observed).
    assert app.state.max_active == 2
    assert waits == 1


def test_budget_timeout_is_429_with_retry_after(
    stub: tuple[StubUpstream, str], make_gateway: GatewayFactory, caplog: pytest.LogCaptureFixture
) -> None:
    app, upstream = stub
    app.state.hold_s = 1.5
    limits = {**ONE_SLOT, "admission_timeout_s": 0.3}
    caplog.set_level("INFO", logger="mmgate.access")
    with make_gateway(upstream, limits=limits, server={"access_log": True}) as (_, url):
        holder = hold_the_slot(url)
        body = messages_body(image_bytes(SIDE, SIDE))
        refused = httpx.post(url + "/v1/messages", content=body, headers={"x-request-id": "timed-out"}, timeout=30)
        holder.join()
        in_use = metric(url, "mmgate_budget_in_use_bytes")
    (line,) = [
        orjson.loads(record.getMessage())
        for record in caplog.records
        if record.name == "mmgate.access" and orjson.loads(record.getMessage())["request_id"] == "timed-out"
    ]
    # The wait that ended in the timeout is logged: never early, and no null for a request that waited.
    assert line["budget_wait_s"] >= 0.3 * 0.9
    assert refused.status_code == 429
    assert refused.headers["retry-after"] == "1"
    assert refused.json()["error"]["type"] == "rate_limit_error"
    assert "limits.admission_timeout_s=0.3" in refused.json()["error"]["message"]
    assert in_use == 0


def test_queue_cap_is_429_at_once(stub: tuple[StubUpstream, str], make_gateway: GatewayFactory) -> None:
    app, upstream = stub
    app.state.gated = True  # the upstream holds each request until the test lets it through
    limits = {**ONE_SLOT, "max_queued_requests": 1}
    with make_gateway(upstream, limits=limits) as (_, url):

        async def run() -> tuple[list[httpx.Response], float]:
            async with httpx.AsyncClient(timeout=30) as client:
                post = lambda: client.post(url + "/v1/chat/completions", content=chat_body(*images(1)))  # noqa: E731
                first = asyncio.ensure_future(post())
                await until(lambda: app.state.at_gate == 1, what="the first request holding the slot")
                second = asyncio.ensure_future(post())
                await until(lambda: metric(url, "mmgate_budget_waiting_requests") == 1, what="the second one queued")
                started = time.perf_counter()
                third = await post()
                refused_after = time.perf_counter() - started
                app.state.open_gate(2)
                return [await first, await second, third], refused_after

        (first, second, third), refused_after = asyncio.run(run())
        waits = metric(url, "mmgate_budget_wait_seconds_count")
    assert (first.status_code, second.status_code, third.status_code) == (200, 200, 429)
    assert "limits.max_queued_requests=1" in third.json()["message"]
    # Refused on arrival: it never waited for the budget (the first two's are the only waits observed). The time
    # is a backstop, far below the 30 s admission timeout that would be the other way to a 429.
    assert waits == 2
    assert refused_after < 10


def test_client_disconnect_while_waiting_frees_its_place(
    stub: tuple[StubUpstream, str], make_gateway: GatewayFactory
) -> None:
    app, upstream = stub
    app.state.gated = True  # the upstream holds the slot holder until the test lets it through
    limits = ONE_SLOT
    with make_gateway(upstream, limits=limits) as (_, url):

        def waiting() -> float:
            return metric(url, "mmgate_budget_waiting_requests")

        async def run() -> tuple[bool, int]:
            async with httpx.AsyncClient(timeout=30) as client:
                holder = asyncio.ensure_future(client.post(url + "/v1/chat/completions", content=chat_body(*images(1))))
                await until(lambda: app.state.at_gate == 1, what="the holder holding the slot")
                async with httpx.AsyncClient(timeout=30) as leaving:
                    leaver = asyncio.ensure_future(
                        leaving.post(url + "/v1/chat/completions", content=chat_body(*images(2)))
                    )
                    await until(lambda: waiting() == 1, what="the leaver in the queue")
                    leaver.cancel()
                await until(lambda: waiting() == 0, what="the leaver out of the queue")
                holder_still_held = not holder.done()
                app.state.open_gate()
                return holder_still_held, (await holder).status_code

        holder_still_held, holder_status = asyncio.run(run())
        decodes = metric(url, "mmgate_media_decode_seconds_count", modality="image")
    assert holder_still_held  # the leaver left the queue on its own, not when the holder finished
    assert holder_status == 200
    assert decodes == 1  # only the holder's image: nothing of the leaver's request was decoded
    assert len(app.state.requests) == 1


def test_bytes_mode_lets_small_requests_share(stub: tuple[StubUpstream, str], make_gateway: GatewayFactory) -> None:
    app, upstream = stub
    # Slots mode would allow one request at a time (one 1 MiB slot); in bytes mode each small request
    # reserves only its raw body and decoded bytes.
    limits = {
        "max_multimodal_cpu_bytes": 1 << 20,
        "max_multimodal_cpu_bytes_per_request": 1 << 20,
        "budget_mode": "bytes",
    }
    app.state.gated = True  # the upstream holds each request until all four are there

    def open_once_all_arrived() -> None:
        try:
            wait_until(lambda: app.state.at_gate == 4, 10, "the four requests at the upstream at once")
        finally:
            app.state.open_gate(4)

    with make_gateway(upstream, limits=limits) as (_, url):
        opener = threading.Thread(target=open_once_all_arrived)
        opener.start()
        statuses = post_concurrently(url, [chat_body(*images(1)) for _ in range(4)])
        opener.join()
    assert statuses == [200] * 4
    assert app.state.max_active == 4


def test_release_on_complete_holds_until_the_response_ends(
    stub: tuple[StubUpstream, str], make_gateway: GatewayFactory
) -> None:
    app, upstream = stub
    limits = ONE_SLOT
    body = orjson.loads(chat_body(*images(1)))
    body["stream"] = True
    for release_on, held_during_stream in (("first_byte", 0), ("complete", 1 << 20)):
        app.state.sse_release.clear()
        with (
            make_gateway(upstream, limits={**limits, "release_on": release_on}) as (_, url),
            httpx.stream("POST", url + "/v1/chat/completions", content=orjson.dumps(body), timeout=30) as response,
        ):
            lines = response.iter_lines()
            assert next(lines) == 'data: {"n": 1}'
            assert metric(url, "mmgate_budget_in_use_bytes") == held_during_stream
            app.state.sse_release.set()
            list(lines)
            wait_until(lambda: metric(url, "mmgate_budget_in_use_bytes") == 0, 10, "the budget released")


def test_budget_returns_to_zero_after_a_thousand_mixed_requests(
    stub: tuple[StubUpstream, str], make_gateway: GatewayFactory
) -> None:
    _, upstream = stub
    rng = random.Random(7)
    good = chat_body(*images(1))
    many = chat_body(*images(6))
    corrupt = chat_body("data:image/jpeg;base64," + base64.b64encode(b"\xff\xd8\xff" + bytes(100)).decode())
    limits = {
        "max_multimodal_cpu_bytes": 2 * (4 * DECODED + 8192),
        "max_multimodal_cpu_bytes_per_request": 4 * DECODED + 8192,
        "admission_timeout_s": 0.5,
        "max_queued_requests": 20,
        "charge_raw_body": False,
    }
    outcomes: dict[Any, int] = {}
    with make_gateway(upstream, limits=limits, media={"load_workers": 2}) as (_, url):

        async def one(client: httpx.AsyncClient, kind: str) -> None:
            body = {"good": good, "many": many, "corrupt": corrupt, "text": chat_body(), "leave": good}[kind]
            request = client.post(url + "/v1/chat/completions", content=body)
            if kind == "leave":
                task = asyncio.ensure_future(request)
                await asyncio.sleep(rng.random() * 0.01)
                task.cancel()
                outcome: Any = "cancelled"
            else:
                try:
                    outcome = (await request).status_code
                except httpx.HTTPError as exc:
                    outcome = type(exc).__name__
            outcomes[(kind, outcome)] = outcomes.get((kind, outcome), 0) + 1

        async def run() -> None:
            kinds = rng.choices(["good", "many", "corrupt", "text", "leave"], weights=[5, 2, 1, 2, 2], k=1000)
            semaphore = asyncio.Semaphore(24)
            async with httpx.AsyncClient(timeout=30, limits=httpx.Limits(max_connections=64)) as client:

                async def limited(kind: str) -> None:
                    async with semaphore:
                        await one(client, kind)

                await asyncio.gather(*(limited(kind) for kind in kinds))

        asyncio.run(run())
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and (
            metric(url, "mmgate_budget_in_use_bytes") or metric(url, "mmgate_budget_waiting_requests")
        ):
            time.sleep(0.05)
        in_use = metric(url, "mmgate_budget_in_use_bytes")
        waiting = metric(url, "mmgate_budget_waiting_requests")
    assert in_use == 0
    assert waiting == 0
    assert outcomes.get(("many", 413), 0) > 0
    assert outcomes.get(("corrupt", 400), 0) > 0
    assert outcomes.get(("good", 200), 0) > 0
    assert sum(outcomes.values()) == 1000


def strings_body(count: int, pad: int = 0) -> bytes:
    """A text-only chat body with `count` short strings (and a text of `pad` bytes)."""
    content = [{"type": "text", "text": "a" * pad}]
    return orjson.dumps({"model": "m", "messages": [{"role": "user", "content": content}], "stop": ["ab"] * count})


READ_CASES = {
    # name: (body, read on the event loop's thread)
    "a chat": (chat_body(text="What is in this picture?"), True),
    "a chat with one photograph": (chat_body(data_url(image_bytes(640, 480))), True),
    "5,000 short strings in 25 KB": (strings_body(5_000), False),
    "199,980 short strings past 1 MiB": (strings_body(199_980, pad=60_000), False),
    "one 2 MiB text": (chat_body(text="a" * (2 * MIB)), False),
}


@pytest.mark.parametrize("case", list(READ_CASES))
def test_a_body_is_parsed_on_the_event_loop_only_when_that_is_quick(
    stub: tuple[StubUpstream, str], make_gateway: GatewayFactory, monkeypatch: pytest.MonkeyPatch, case: str
) -> None:
    """Parsing and walking a body with many JSON tokens, or a large one, holds the interpreter for tens of
    milliseconds (a 1 MiB body of 200,000 strings took about 100 ms on the event loop, and 32 such clients kept
    `/healthz` waiting 2 s): such a body is read on a media thread; a small one where it arrived."""
    import gateway.admission

    body, on_loop = READ_CASES[case]
    threads: list[str] = []
    read = gateway.admission._read_document

    def recorded(prepared: Any, path: str) -> Any:
        threads.append(threading.current_thread().name)
        return read(prepared, path)

    monkeypatch.setattr(gateway.admission, "_read_document", recorded)
    _, upstream = stub
    with make_gateway(upstream) as (_, url):
        response = httpx.post(url + "/v1/chat/completions", content=body, timeout=30)
    assert response.status_code == 200, response.text
    assert len(threads) == 1
    assert threads[0].startswith("mmgate-media") is not on_loop, threads


def test_what_the_prediction_opened_is_let_go_before_the_request_is_forwarded(
    stub: tuple[StubUpstream, str], make_gateway: GatewayFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A request's only JPEG with a short header is opened from its head for the reservation, and its load reads
    the whole file through that image, which its plan carries from the one to the other: once loaded, nothing holds
    it (or the file's bytes it read) while the request waits at the upstream, and by reference counting alone."""
    app, upstream = stub
    opened: list[weakref.ref[OpenedImage]] = []
    open_image = gateway.media.image.loader.open_image

    def recording(*args: Any, **kwargs: Any) -> OpenedImage:
        image = open_image(*args, **kwargs)
        opened.append(weakref.ref(image))
        return image

    monkeypatch.setattr(gateway.media.image.loader, "open_image", recording)
    app.state.gated = True  # the upstream holds the request until the test has looked
    body = chat_body(data_url(image_bytes(640, 480)))
    with collector_off(), make_gateway(upstream) as (_, url), ThreadPoolExecutor(1) as client:
        sent = client.submit(httpx.post, url + "/v1/chat/completions", content=body, timeout=30)
        try:
            wait_until(lambda: app.state.at_gate == 1, what="the request at the upstream")
            held = [ref() is not None for ref in opened]
        finally:
            app.state.open_gate()
        response = sent.result()
    assert response.status_code == 200, response.text
    assert held == [False]  # one open, the prediction's, and it is gone
