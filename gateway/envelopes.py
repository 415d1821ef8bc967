"""Turns a `GatewayError` into the error envelope of the route it happened on.

OpenAI routes: trtllm-serve's flat `ErrorResponse` by default, OpenAI's nested form with
`errors.openai_envelope: openai`. `/v1/messages`: Anthropic's envelope, always.
"""

from __future__ import annotations

import re
from enum import StrEnum

import orjson

from gateway.config import EngineModeSettings, OpenAIEnvelope, RedisSettings, UpstreamSettings
from gateway.errors import GatewayError
from serving.settings_types import Section

ANTHROPIC_ROUTES = frozenset({"/v1/messages", "/v1/messages/count_tokens"})


class Dialect(StrEnum):
    TRTLLM = "trtllm"
    OPENAI = "openai"
    ANTHROPIC = "anthropic"


def dialect_for(path: str, openai_envelope: OpenAIEnvelope) -> Dialect:
    if path in ANTHROPIC_ROUTES:
        return Dialect.ANTHROPIC
    return Dialect.OPENAI if openai_envelope is OpenAIEnvelope.OPENAI else Dialect.TRTLLM


def error_body(error: GatewayError, dialect: Dialect, *, message: str | None = None) -> bytes:
    """`message`: what the client is told instead of the error's own message (`client_message`)."""
    if message is None:
        message = error.message
    if dialect is Dialect.ANTHROPIC:
        return orjson.dumps({"type": "error", "error": {"type": error.anthropic_type, "message": message}})
    if dialect is Dialect.OPENAI:
        return orjson.dumps(
            {
                "error": {
                    "message": message,
                    "type": error.openai_type,
                    "param": None,
                    "code": error.openai_code,
                }
            }
        )
    return orjson.dumps(
        {
            "object": "error",
            "message": message,
            "type": error.openai_type,
            "param": None,
            "code": error.status_code,
        }
    )


# Setting names (`upstream.read_timeout_s=600`) a message may keep: they say which knob was hit, not where.
_SECTIONS: dict[str, type[Section]] = {
    "upstream": UpstreamSettings,
    "engine": EngineModeSettings,
    "redis": RedisSettings,
}
_SETTING = re.compile(
    r"(?<![\w./:@-])((?:"
    + "|".join(rf"{name}\.(?:{'|'.join(sorted(section.model_fields))})" for name, section in _SECTIONS.items())
    + r")(?:=[0-9a-z][0-9a-z.,_]*)?)"
)


def client_message(error: GatewayError, request_id: str) -> str:
    """The message a client gets without internal detail (`errors.expose_internal` off): a failure of something
    behind the gateway (its message names internal URLs and addresses) says what failed, the settings its message
    names and the request id the gateway's log has the detail under; any other error keeps its message."""
    generic = error.public
    if generic is None:
        return error.message
    settings = list(dict.fromkeys(match.group(1).rstrip(".,") for match in _SETTING.finditer(error.message)))
    named = f" ({', '.join(settings)})" if settings else ""
    return f"{generic}{named}; request id {request_id}"
