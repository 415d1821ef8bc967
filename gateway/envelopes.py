"""Turns a `GatewayError` into the error envelope of the route it happened on.

OpenAI routes: trtllm-serve's flat `ErrorResponse` by default, OpenAI's nested form with
`errors.openai_envelope: openai`. `/v1/messages`: Anthropic's envelope, always.
"""

from __future__ import annotations

from enum import StrEnum

import orjson

from gateway.config import OpenAIEnvelope
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


def error_body(error: GatewayError, dialect: Dialect) -> bytes:
    if dialect is Dialect.ANTHROPIC:
        return orjson.dumps({"type": "error", "error": {"type": error.anthropic_type, "message": error.message}})
    if dialect is Dialect.OPENAI:
        return orjson.dumps(
            {
                "error": {
                    "message": error.message,
                    "type": error.openai_type,
                    "param": None,
                    "code": error.openai_code,
                }
            }
        )
    return orjson.dumps(
        {
            "object": "error",
            "message": error.message,
            "type": error.openai_type,
            "param": None,
            "code": error.status_code,
        }
    )
