"""Turns a `GatewayError` into the error envelope of the route it happened on.

OpenAI routes: trtllm-serve's flat `ErrorResponse` by default, OpenAI's nested form with
`errors.openai_envelope: openai`. `/v1/messages`: Anthropic's envelope, always.
"""

from __future__ import annotations

import re
from enum import StrEnum

import orjson

from gateway.config import EngineModeSettings, OpenAIEnvelope, UpstreamSettings
from gateway.errors import GatewayError

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


# What a client is told of a failure between the gateway and the servers behind it, with `errors.expose_internal`
# off: the messages raised name internal URLs and addresses; these do not. The full message goes to the log.
_INTERNAL_FAILURES = {
    502: "the upstream model server is unreachable or failed",
    504: "the upstream model server timed out",
}
# Setting names (`upstream.read_timeout_s=600`) a message may keep: they say which knob was hit, not where.
_SETTING = re.compile(
    r"(?<![\w./:@-])((?:upstream\.(?:"
    + "|".join(sorted(UpstreamSettings.model_fields))
    + r")|engine\.(?:"
    + "|".join(sorted(EngineModeSettings.model_fields))
    + r"))(?:=[0-9][0-9.,]*)?)"
)


def client_message(error: GatewayError, request_id: str) -> str:
    """The message a client gets without internal detail: a 502 or 504 says what failed, the settings its message
    names and the request id the gateway's log has the detail under; any other error keeps its message."""
    generic = _INTERNAL_FAILURES.get(error.status_code)
    if generic is None:
        return error.message
    settings = list(dict.fromkeys(match.group(1).rstrip(".,") for match in _SETTING.finditer(error.message)))
    named = f" ({', '.join(settings)})" if settings else ""
    return f"{generic}{named}; request id {request_id}"
