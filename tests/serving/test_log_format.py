"""serving.log_format and `serving.server.configure_logging`: every line on stderr one JSON object by default (the
processes' loggers, uvicorn's, warnings, uncaught exceptions, a traceback folded into the line), or plain text."""

from __future__ import annotations

import logging
import re
import sys
import threading
import warnings
from collections.abc import Iterator

import orjson
import pytest

from serving.log_format import JsonFormatter, LogFormat, failure_line
from serving.server import configure_logging

TEXT_LINE = re.compile(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} [A-Z]+ [\w.]+: ")
Stderr = pytest.CaptureFixture[str]


@pytest.fixture
def stderr(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> Iterator[Stderr]:
    """What `configure_logging`, called in the test, writes to stderr; what it changes is put back afterwards."""
    monkeypatch.setattr(sys, "excepthook", sys.excepthook)
    monkeypatch.setattr(threading, "excepthook", threading.excepthook)
    root, served = logging.getLogger(), logging.getLogger("uvicorn")
    saved = (list(root.handlers), root.level, list(served.handlers), served.propagate)
    # uvicorn sets its loggers' levels from the log level each server of an earlier test was given.
    levels = {name: logging.getLogger(name).level for name in ("uvicorn", "uvicorn.error")}
    for name in levels:
        logging.getLogger(name).setLevel(logging.NOTSET)
    try:
        yield capsys
    finally:
        root.handlers[:], served.handlers[:], served.propagate = saved[0], saved[2], saved[3]
        root.setLevel(saved[1])
        for name, level in levels.items():
            logging.getLogger(name).setLevel(level)
        logging.captureWarnings(False)


def lines(err: Stderr) -> list[str]:
    return err.readouterr().err.splitlines()


def log_everything() -> None:
    """A line from each source the processes have."""
    logging.getLogger("mmgate.gateway").info("gateway forwarding to %s", "http://u:1")
    logging.getLogger("uvicorn.error").info("Started server process [%d]", 7)
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.warn("a deprecated call", DeprecationWarning, stacklevel=1)
    try:
        raise ValueError("boom\nsecond line")
    except ValueError:
        logging.getLogger("mmgate").exception("a request failed")
    thread = threading.Thread(target=lambda: 1 / 0, name="worker-thread")
    thread.start()
    thread.join()


def test_every_line_is_one_json_object(stderr: Stderr) -> None:
    configure_logging("info")
    log_everything()
    logged = [orjson.loads(line) for line in lines(stderr)]
    assert [line["logger"] for line in logged] == ["mmgate.gateway", "uvicorn.error", "py.warnings", "mmgate", "mmgate"]
    assert all({"ts", "level", "logger", "message"} <= set(line) for line in logged)
    assert logged[0]["message"] == "gateway forwarding to http://u:1"
    assert (logged[2]["level"], "a deprecated call" in logged[2]["message"]) == ("warning", True)
    assert logged[3]["message"] == "a request failed"
    assert "ValueError: boom\nsecond line" in logged[3]["exc_info"]
    assert logged[4]["message"] == "uncaught exception in thread worker-thread: division by zero"
    assert "ZeroDivisionError" in logged[4]["exc_info"]


def test_text_lines_are_not_json(stderr: Stderr) -> None:
    configure_logging("info", log_format=LogFormat.TEXT)
    log_everything()
    written = lines(stderr)
    starts = [line for line in written if TEXT_LINE.match(line)]
    assert [line.split(" ", 3)[3].split(":")[0] for line in starts] == [
        "mmgate.gateway",
        "uvicorn.error",
        "py.warnings",
        "mmgate",
        "mmgate",
    ]
    assert len(written) > len(starts)  # the tracebacks' lines
    for line in written:
        with pytest.raises(orjson.JSONDecodeError):
            orjson.loads(line)


def test_configuring_again_replaces_the_handler(stderr: Stderr) -> None:
    configure_logging("info", log_format=LogFormat.TEXT)
    configure_logging("warning")
    logging.getLogger("mmgate").info("not at warning")
    logging.getLogger("mmgate").warning("once")
    [line] = lines(stderr)
    assert orjson.loads(line)["message"] == "once"


def test_an_uncaught_exception_is_one_line(stderr: Stderr) -> None:
    configure_logging("info")
    try:
        raise RuntimeError("no")
    except RuntimeError as exc:
        sys.excepthook(RuntimeError, exc, exc.__traceback__)
    [line] = lines(stderr)
    logged = orjson.loads(line)
    assert (logged["level"], logged["message"]) == ("critical", "uncaught exception: no")
    assert "RuntimeError: no" in logged["exc_info"]


def test_a_failure_line_is_a_json_log_line_or_the_bare_message() -> None:
    logged = orjson.loads(failure_line("mmgate gateway: invalid configuration:\n  server.port", LogFormat.JSON))
    assert set(logged) == {"ts", "level", "logger", "message"}
    assert (logged["level"], logged["logger"]) == ("error", "mmgate")
    assert logged["message"] == "mmgate gateway: invalid configuration:\n  server.port"
    assert failure_line("mmgate gateway: 100% wrong", LogFormat.TEXT) == "mmgate gateway: 100% wrong"


def test_json_formatter_folds_the_stack_into_the_line() -> None:
    record = logging.LogRecord("mmgate", logging.INFO, __file__, 1, "here", None, None, sinfo="Stack:\n  line 1")
    line = JsonFormatter().format(record)
    assert "\n" not in line
    assert orjson.loads(line)["stack_info"] == "Stack:\n  line 1"
