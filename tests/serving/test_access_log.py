"""`serving.access_log.LineHandler`: bare lines, one write for the lines of a loop turn."""

from __future__ import annotations

import asyncio
import io
import logging

from serving.access_log import LineHandler


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
