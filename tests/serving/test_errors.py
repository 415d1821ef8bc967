"""serving.errors: the error boundary both processes answer errors through."""

from __future__ import annotations

import logging
from typing import Any, ClassVar

import orjson
import pytest

from serving.asgi import ClientDisconnected, Message, Scope
from serving.errors import ErrorBoundary, ServingError
from serving.headers import RawHeaders


class Teapot(ServingError):
    status_code = 418
    default_reason = "teapot"


class Other(ServingError):
    """Not the boundary's error type: answered as a bug."""


class Boundary(ErrorBoundary[ServingError]):
    handles: ClassVar[type[ServingError]] = Teapot
    error_headers: ClassVar[RawHeaders] = [(b"x-process", b"test")]

    def __init__(self, app: Any) -> None:
        super().__init__(app, logging.getLogger("test.boundary"))
        self.observed: list[str] = []
        self.left = 0

    def render(self, scope: Scope, error: ServingError) -> bytes:
        return orjson.dumps({"message": error.message, "reason": error.reason})

    def internal_error(self, scope: Scope) -> ServingError:
        return ServingError(f"bug on {scope['path']}")

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
