"""serving.errors: the error boundary both processes answer errors through."""

from __future__ import annotations

import asyncio
import logging
import signal
from typing import Any, ClassVar

import httpx
import orjson
import pytest

from serving.asgi import ClientDisconnected, Exchange, Message, Scope
from serving.drain import Drain
from serving.errors import ErrorBoundary, ServingError
from serving.headers import RawHeaders
from tests.observe import assert_freed_with_each_request
from tests.servers import ServerThread
from tests.stub_asgi import answer_ok


class Teapot(ServingError):
    status_code = 418
    default_reason = "teapot"


class Other(ServingError):
    """Not the boundary's error type: answered as a bug."""


class Boundary(ErrorBoundary[ServingError]):
    handles: ClassVar[type[ServingError]] = Teapot
    error_headers: ClassVar[RawHeaders] = [(b"x-process", b"test")]

    def __init__(self, app: Any, drain: Drain | None = None) -> None:
        super().__init__(app, logging.getLogger("test.boundary"), drain=drain)
        self.observed: list[str] = []
        self.left = 0

    def render(self, scope: Scope, error: ServingError) -> bytes:
        return orjson.dumps({"message": error.message, "reason": error.reason})

    def internal_error(self, scope: Scope) -> ServingError:
        return ServingError(f"bug on {scope['path']}")

    def drain_cut(self, scope: Scope) -> ServingError:
        return ServingError("shut down", reason="drain_timeout")

    def observe(self, scope: Scope, error: ServingError) -> None:
        self.observed.append(error.reason)

    def client_left(self, scope: Scope) -> None:
        self.left += 1


async def run(boundary: Boundary) -> list[Message]:
    sent: list[Message] = []

    async def receive() -> Message:
        return {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        sent.append(message)

    await boundary({"type": "http", "method": "GET", "path": "/p", "headers": []}, receive, send)
    return sent


async def test_a_handled_error_is_answered_with_its_status_body_and_headers() -> None:
    async def app(scope: Any, receive: Any, send: Any) -> None:
        raise Teapot("short and stout", headers={"retry-after": "3"})

    boundary = Boundary(app)
    start, body = await run(boundary)
    assert start["status"] == 418
    assert orjson.loads(body["body"]) == {"message": "short and stout", "reason": "teapot"}
    headers = start["headers"]
    assert (b"content-type", b"application/json") in headers
    assert (b"content-length", str(len(body["body"])).encode()) in headers
    assert headers.index((b"x-process", b"test")) < headers.index((b"retry-after", b"3"))
    assert boundary.observed == ["teapot"]


@pytest.mark.parametrize("raised", [RuntimeError("boom"), Other("not handled")])
async def test_anything_else_is_a_bug_answered_with_the_internal_error(
    raised: Exception, caplog: pytest.LogCaptureFixture
) -> None:
    async def app(scope: Any, receive: Any, send: Any) -> None:
        raise raised

    boundary = Boundary(app)
    with caplog.at_level(logging.ERROR, logger="test.boundary"):
        start, body = await run(boundary)
    assert start["status"] == 500
    assert orjson.loads(body["body"]) == {"message": "bug on /p", "reason": "internal"}
    assert boundary.observed == ["internal"]
    assert "GET /p: unexpected error" in caplog.text


@pytest.mark.parametrize("raised", [Teapot("late"), RuntimeError("late bug")])
async def test_after_the_response_started_the_error_propagates(raised: Exception) -> None:
    async def app(scope: Any, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})
        raise raised

    boundary = Boundary(app)
    with pytest.raises(type(raised)):
        await run(boundary)
    assert len(boundary.observed) == 1


async def test_a_client_that_left_gets_no_answer() -> None:
    async def app(scope: Any, receive: Any, send: Any) -> None:
        raise ClientDisconnected

    boundary = Boundary(app)
    assert await run(boundary) == []
    assert boundary.left == 1
    assert boundary.observed == []


# The drain deadline.


class Held:
    """An app that starts its response as told, then waits until cancelled; records what it got to do."""

    def __init__(self, *, start: bytes | None, chunk: bytes = b"") -> None:
        self.content_type = start
        self.chunk = chunk
        self.waiting = asyncio.Event()
        self.cancelled = False

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if self.content_type is not None:
            headers = [(b"content-type", self.content_type)]
            await send({"type": "http.response.start", "status": 200, "headers": headers})
            await send({"type": "http.response.body", "body": self.chunk, "more_body": True})
        self.waiting.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            self.cancelled = True
            raise


async def drained(boundary: Boundary, app: Held, drain: Drain) -> list[Message]:
    request = asyncio.create_task(run(boundary))
    await app.waiting.wait()
    drain.start()
    return await asyncio.wait_for(request, timeout=30)


async def test_a_request_running_at_the_drain_deadline_is_answered_in_full() -> None:
    drain = Drain(0.05)
    app = Held(start=None)
    boundary = Boundary(app, drain)
    start, body = await drained(boundary, app, drain)
    assert app.cancelled
    assert start["status"] == 500  # ServingError's status in this test's boundary
    assert orjson.loads(body["body"]) == {"message": "shut down", "reason": "drain_timeout"}
    assert boundary.observed == ["drain_timeout"]


async def test_an_event_stream_cut_by_the_drain_ends_with_an_error_event() -> None:
    drain = Drain(0.05)
    app = Held(start=b"text/event-stream; charset=utf-8", chunk=b'data: {"n": 1}\n\n')
    boundary = Boundary(app, drain)
    start, first, last = await drained(boundary, app, drain)
    assert start["status"] == 200
    assert first["more_body"]
    assert last == {
        "type": "http.response.body",
        "body": b'data: {"message":"shut down","reason":"drain_timeout"}\n\n',
        "more_body": False,
    }


async def test_another_started_response_cut_by_the_drain_is_left_incomplete(
    caplog: pytest.LogCaptureFixture,
) -> None:
    drain = Drain(0.05)
    app = Held(start=b"application/json", chunk=b'{"partial": ')
    boundary = Boundary(app, drain)
    with caplog.at_level(logging.WARNING, logger="test.boundary"):
        sent = await drained(boundary, app, drain)
    # No final body message: the server closes the connection instead of ending a body that looks whole.
    assert [message.get("more_body") for message in sent] == [None, True]
    assert "cut by the drain mid-response" in caplog.text
    assert boundary.observed == ["drain_timeout"]


async def test_requests_that_start_while_draining_share_the_deadline() -> None:
    drain = Drain(0.2)
    drain.start()
    app = Held(start=None)
    start, _ = await asyncio.wait_for(run(Boundary(app, drain)), timeout=30)
    assert app.cancelled
    assert start["status"] == 500


async def test_a_request_that_finishes_before_the_deadline_is_untouched() -> None:
    drain = Drain(30)

    async def app(scope: Any, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 204, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    drain.start()
    boundary = Boundary(app, drain)
    assert [message.get("status") for message in await run(boundary)] == [204, None]
    assert boundary.observed == []


async def test_the_app_s_own_timeout_is_not_a_drain_cut() -> None:
    drain = Drain(30)

    async def app(scope: Any, receive: Any, send: Any) -> None:
        async with asyncio.timeout(0.01):
            await asyncio.Event().wait()

    drain.start()
    boundary = Boundary(app, drain)
    start, _ = await run(boundary)
    assert start["status"] == 500
    assert boundary.observed == ["internal"]


async def test_the_drain_starts_from_a_signal_handler() -> None:
    drain = Drain(0.05)
    app = Held(start=None)
    boundary = Boundary(app, drain)
    previous = signal.signal(signal.SIGUSR1, lambda sig, frame: drain.start())
    try:
        request = asyncio.create_task(run(boundary))
        await app.waiting.wait()
        signal.raise_signal(signal.SIGUSR1)
        start, _ = await asyncio.wait_for(request, timeout=30)
    finally:
        signal.signal(signal.SIGUSR1, previous)
    assert app.cancelled
    assert start["status"] == 500
    assert boundary.observed == ["drain_timeout"]


def test_a_request_it_follows_itself_is_freed_without_the_garbage_collector() -> None:
    with ServerThread(Boundary(answer_ok), lifespan="off") as server, httpx.Client() as client:

        def get() -> None:
            assert client.get(server.url + "/p").status_code == 200

        assert_freed_with_each_request(get, Exchange)
