"""`serving.access_log.LineHandler`: bare lines, one write for the lines of a loop turn."""

from __future__ import annotations

import asyncio
import io
import logging
import os

import httpx
import pytest

from serving.access_log import LineHandler, RequestLog, log_line, request_id
from serving.asgi import Exchange
from tests.observe import assert_freed_with_each_request
from tests.servers import ServerThread
from tests.stub_asgi import answer_ok


class CountingStream(io.StringIO):
    def __init__(self) -> None:
        super().__init__()
        self.writes: list[str] = []

    def write(self, text: str) -> int:
        self.writes.append(text)
        return super().write(text)


def _logger(stream: CountingStream) -> tuple[logging.Logger, LineHandler]:
    logger = logging.Logger("test.access", logging.INFO)
    handler = LineHandler(stream)
    logger.addHandler(handler)
    return logger, handler


def test_off_a_loop_each_line_is_written_at_once_as_logged() -> None:
    stream = CountingStream()
    logger, _ = _logger(stream)
    logger.info('{"a": 1}')
    logger.info("second %s", "line")
    assert stream.writes == ['{"a": 1}\n', "second line\n"]


async def test_the_lines_of_one_loop_turn_are_written_together_at_its_end() -> None:
    stream = CountingStream()
    logger, handler = _logger(stream)
    for n in range(3):
        logger.info("line %d", n)
    assert stream.writes == []  # held until the turn ends
    await asyncio.sleep(0)
    assert stream.writes == ["line 0\nline 1\nline 2\n"]
    logger.info("next turn")
    await asyncio.sleep(0)
    assert stream.writes[1:] == ["next turn\n"]
    logger.info("held at shutdown")
    handler.flush()  # what logging.shutdown() calls: nothing held is lost
    assert stream.getvalue().endswith("next turn\nheld at shutdown\n")
    await asyncio.sleep(0)
    assert len(stream.writes) == 3  # the turn's own write finds nothing left


def _line_logger(name: str, stream: io.StringIO, *, propagate: bool = False) -> logging.Logger:
    logger = logging.getLogger(name)
    logger.handlers[:] = [LineHandler(stream)]
    logger.setLevel(logging.INFO)
    logger.propagate = propagate
    return logger


@pytest.mark.parametrize("on_loop", [False, True])
def test_log_line_writes_what_logger_info_writes(on_loop: bool) -> None:
    """`log_line` bypasses the record where a lone LineHandler is all that would see it: the stream gets the same
    lines, in order, as through `logger.info`, on an event loop (written at the turn's end) and off one."""
    direct, through_logging = io.StringIO(), io.StringIO()
    fast = _line_logger("mmgate.test.fast", direct)
    slow = _line_logger("mmgate.test.slow", through_logging)
    lines = ['{"a": 1}', "two", '{"%s": "%d"}']

    def write() -> None:
        for line in lines:
            log_line(fast, line)
            slow.info(line)

    if on_loop:

        async def on_the_loop() -> None:
            write()
            await asyncio.sleep(0)

        asyncio.run(on_the_loop())
    else:
        write()
    assert direct.getvalue() == through_logging.getvalue() == "".join(line + "\n" for line in lines)


def test_log_line_goes_through_logging_where_others_would_see_the_record(caplog: pytest.LogCaptureFixture) -> None:
    stream = io.StringIO()
    logger = _line_logger("mmgate.test.propagating", stream, propagate=True)
    with caplog.at_level(logging.INFO, logger="mmgate.test.propagating"):
        log_line(logger, "seen by both")
    assert stream.getvalue() == "seen by both\n"
    assert [record.getMessage() for record in caplog.records] == ["seen by both"]


def new_id() -> str:
    return request_id({"headers": [(b"x-request-id", b"bad\x01id")]})


def test_new_request_ids_are_32_hex_digits_and_distinct() -> None:
    ids = [new_id() for _ in range(768)]
    assert all(len(value) == 32 and int(value, 16) >= 0 for value in ids)
    assert len(set(ids)) == len(ids)


def test_a_callers_printable_request_id_is_kept() -> None:
    assert request_id({"headers": [(b"X-Request-ID", b"req-7")]}) == "req-7"
    assert request_id({"headers": [(b"x-request-id", b"x" * 129)]}) != "x" * 129


def test_a_forked_process_draws_ids_its_parent_does_not() -> None:
    new_id()  # a generator that kept state across the fork would give the child the parent's next ids
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        os.close(read)
        os.write(write, "".join(new_id() for _ in range(4)).encode())
        os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as pipe:
        child = pipe.read().decode()
    os.waitpid(pid, 0)
    parent = "".join(new_id() for _ in range(4))
    assert len(child) == len(parent) == 128
    assert child != parent


def test_a_logged_request_is_freed_without_the_garbage_collector() -> None:
    with ServerThread(RequestLog(answer_ok), lifespan="off") as server, httpx.Client() as client:

        def get() -> None:
            assert client.get(server.url + "/p").status_code == 200

        assert_freed_with_each_request(get, Exchange)
