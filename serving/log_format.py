"""How a log record reads on stderr, chosen by both processes' `server.log_format`: `json`, one JSON object a line
(`ts`, `level`, `logger`, `message`, and `exc_info` with the traceback when there is one) for log shippers; or
`text`, `2025-06-01 12:00:00,123 INFO mmgate.gateway: message` and the traceback on the lines after, for a
terminal."""

from __future__ import annotations

import logging
from enum import StrEnum
from typing import Any

import orjson

from serving.access_log import timestamp

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class LogFormat(StrEnum):
    JSON = "json"
    TEXT = "text"


class JsonFormatter(logging.Formatter):
    """A log record as one JSON line: `ts`, `level`, `logger`, `message`, and `exc_info` (the traceback) and
    `stack_info` when the record has them. Newlines in any of them are escaped, so a record is always one line."""

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "ts": timestamp(record.created),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        if record.exc_info:
            line["exc_info"] = self.formatException(record.exc_info)
        elif record.exc_text:
            line["exc_info"] = record.exc_text
        if record.stack_info:
            line["stack_info"] = self.formatStack(record.stack_info)
        return orjson.dumps(line, default=str).decode()


def formatter(log_format: LogFormat) -> logging.Formatter:
    return JsonFormatter() if log_format is LogFormat.JSON else logging.Formatter(TEXT_FORMAT)


def failure_line(message: str, log_format: LogFormat, *, logger: str = "mmgate") -> str:
    """Why the process stops, written as its last line on stderr where logging may not be set up (a configuration
    that does not load): one JSON log line at level error in the json format, the bare message in the text one."""
    if log_format is LogFormat.TEXT:
        return message
    record = logging.makeLogRecord({"name": logger, "levelno": logging.ERROR, "levelname": "ERROR", "msg": message})
    return JsonFormatter().format(record)
