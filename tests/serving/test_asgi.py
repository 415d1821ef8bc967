"""serving.asgi.BodyCap: the Content-Length is checked before a byte is read, the count as the body arrives."""

from __future__ import annotations

from typing import Any

import pytest

from serving.asgi import BodyCap, Message


class Refused(Exception):
    pass


class Malformed(Exception):
    pass


CAP = BodyCap(100, "x.cap", Refused, Malformed)


def receiver(chunks: list[bytes]) -> tuple[Any, list[int]]:
    reads: list[int] = []
    messages = [{"type": "http.request", "body": c, "more_body": i < len(chunks) - 1} for i, c in enumerate(chunks)]

    async def receive() -> Message:
        reads.append(1)
        return messages.pop(0)

    return receive, reads


async def read(chunks: list[bytes], headers: list[tuple[bytes, bytes]], max_bytes: int = 100) -> bytes:
    receive, _ = receiver(chunks)
    scope = {"type": "http", "headers": headers}
    return await BodyCap(max_bytes, "x.cap", Refused, Malformed).read(scope, receive)


async def test_a_body_within_the_cap_is_read_whole() -> None:
    assert await read([b"ab", b"cd"], [(b"content-length", b"4")]) == b"abcd"
    assert await read([b"ab", b"cd"], []) == b"abcd"


async def test_declared_length_over_the_cap_is_refused_before_reading() -> None:
    receive, reads = receiver([b"a" * 101])
    scope = {"type": "http", "headers": [(b"Content-Length", b"101")]}
    with pytest.raises(Refused, match=r"request body is 101 bytes \(Content-Length\), over x.cap=100"):
        await CAP.read(scope, receive)
    assert reads == []


@pytest.mark.parametrize("value", [b"ten", b"-5", b"", b"1e3"])
async def test_a_malformed_content_length_is_refused_before_reading(value: bytes) -> None:
    receive, reads = receiver([b"a"])
    scope = {"type": "http", "headers": [(b"content-length", value)]}
    with pytest.raises(Malformed, match="invalid Content-Length header"):
        await CAP.read(scope, receive)
    assert reads == []


async def test_an_undeclared_body_is_refused_as_soon_as_it_passes_the_cap() -> None:
    receive, reads = receiver([b"a" * 60, b"b" * 60, b"c" * 60])
    scope = {"type": "http", "headers": []}
    with pytest.raises(Refused, match=r"request body passed x.cap=100 at 120 bytes"):
        await CAP.read(scope, receive)
    assert len(reads) == 2
