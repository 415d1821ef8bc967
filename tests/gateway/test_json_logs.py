"""The JSON access log both processes write, probes left out on request, and uvicorn's lines as JSON."""

from __future__ import annotations

import io
import logging
import re
import sys
import threading
from datetime import UTC, datetime

import httpx
import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st

from serving.access_log import round_to_microsecond, timestamp
from serving.log_format import JsonFormatter
from serving.server import configure_logging
from tests.conftest import EngineFactory, GatewayFactory
from tests.gateway.stub_upstream import StubUpstream


def access_lines(caplog: pytest.LogCaptureFixture) -> list[dict[str, object]]:
    return [orjson.loads(r.getMessage()) for r in caplog.records if r.name == "mmgate.access"]


def test_timestamp_is_utc_with_milliseconds() -> None:
    assert timestamp(0.25) == "1970-01-01T00:00:00.250Z"


@given(st.floats(min_value=0, max_value=4e9) | st.integers(0, 4_000_000_000).map(lambda s: s + 0.9999995))
def test_timestamp_writes_what_datetime_isoformat_writes(epoch_s: float) -> None:
    # The date and time part is kept for the second; rounding to microseconds may carry into the next second.
    expected = datetime.fromtimestamp(epoch_s, UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")
    assert timestamp(epoch_s) == expected


def test_gateway_leaves_probes_out_when_asked(
    stub: tuple[StubUpstream, str], make_gateway: GatewayFactory, caplog: pytest.LogCaptureFixture
) -> None:
    _, upstream = stub
    caplog.set_level(logging.INFO, logger="mmgate.access")
    for probes in (True, False):
        caplog.clear()
        server = {"access_log": True, "access_log_probes": probes}
        with make_gateway(upstream, server=server) as (_, url):
            for path in ("/healthz", "/readyz", "/metrics", "/v1/models"):
                httpx.get(url + path)
        logged = [line["path"] for line in access_lines(caplog)]
        assert logged == (["/healthz", "/readyz", "/metrics", "/v1/models"] if probes else ["/v1/models"])


def test_engine_logs_requests_and_leaves_probes_out_when_asked(
    make_engine: EngineFactory, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="mmgate.access")
    for probes in (True, False):
        caplog.clear()
        with make_engine(server={"access_log_probes": probes}) as (_, url):
            for path in ("/healthz", "/metrics", "/internal/v1/status"):
                httpx.get(url + path, headers={"x-request-id": "probe", "user-agent": "kubelet"})
        lines = access_lines(caplog)
        assert [line["path"] for line in lines] == (
            ["/healthz", "/metrics", "/internal/v1/status"] if probes else ["/internal/v1/status"]
        )
        status = lines[-1]
        assert status["request_id"] == "probe"
        assert status["user_agent"] == "kubelet"
        assert status["status"] == 200
        assert status["method"] == "GET"
        assert status["body_bytes"] == 0
        assert status["response_bytes"] > 0
        assert re.fullmatch(r"127\.0\.0\.1:\d+", str(status["client"]))
    caplog.clear()
    with make_engine(server={"access_log": False}) as (_, url):
        httpx.get(url + "/internal/v1/status")
    assert not access_lines(caplog)


def test_uvicorn_lines_are_json(monkeypatch: pytest.MonkeyPatch) -> None:
    err = io.StringIO()
    monkeypatch.setattr(sys, "stderr", err)
    monkeypatch.setattr(sys, "excepthook", sys.excepthook)
    monkeypatch.setattr(threading, "excepthook", threading.excepthook)
    root, uvicorn_log = logging.getLogger(), logging.getLogger("uvicorn")
    saved = (list(root.handlers), root.level, list(uvicorn_log.handlers), uvicorn_log.propagate)
    try:
        configure_logging("info")
        logging.getLogger("uvicorn.error").warning("Started server process [%d]", 7)
    finally:
        root.handlers[:], uvicorn_log.handlers[:], uvicorn_log.propagate = saved[0], saved[2], saved[3]
        root.setLevel(saved[1])
        logging.captureWarnings(False)
    line = orjson.loads(err.getvalue().strip().splitlines()[-1])
    assert set(line) == {"ts", "level", "logger", "message"}
    assert line["level"] == "warning"
    assert line["logger"] == "uvicorn.error"
    assert line["message"] == "Started server process [7]"
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", line["ts"])


def test_json_formatter_carries_the_traceback() -> None:
    try:
        raise ValueError("boom")
    except ValueError:
        record = logging.LogRecord("uvicorn.error", logging.ERROR, __file__, 1, "failed", None, sys.exc_info())
    line = orjson.loads(JsonFormatter().format(record))
    assert "ValueError: boom" in line["exc_info"]


@given(st.floats(min_value=0, max_value=1e6))
def test_durations_are_written_to_the_microsecond(seconds: float) -> None:
    written = round_to_microsecond(seconds)
    assert abs(written - round(seconds, 6)) <= 1.000001e-6  # a tie may fall the other way
    assert round(written, 6) == written  # no digit past the microsecond
