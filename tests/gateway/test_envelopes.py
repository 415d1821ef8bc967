from __future__ import annotations

import orjson
import pytest

from gateway.config import OpenAIEnvelope
from gateway.envelopes import Dialect, dialect_for, error_body
from gateway.errors import (
    BadGateway,
    BadRequest,
    Forbidden,
    GatewayError,
    GatewayTimeout,
    InternalError,
    RateLimited,
    RequestTooLarge,
)

MESSAGE = "decoded media reached 76,027,401 bytes, over limits.max_multimodal_cpu_bytes_per_request=67,108,864"


def test_trtllm_flat_envelope_exact() -> None:
    body = error_body(RequestTooLarge(MESSAGE), Dialect.TRTLLM)
    assert body == orjson.dumps(
        {"object": "error", "message": MESSAGE, "type": "RequestTooLargeError", "param": None, "code": 413}
    )


def test_openai_nested_envelope_exact() -> None:
    body = error_body(RequestTooLarge(MESSAGE), Dialect.OPENAI)
    assert orjson.loads(body) == {
        "error": {
            "message": MESSAGE,
            "type": "RequestTooLargeError",
            "param": None,
            "code": "request_too_large",
        }
    }


def test_anthropic_envelope_exact() -> None:
    body = error_body(RequestTooLarge(MESSAGE), Dialect.ANTHROPIC)
    assert orjson.loads(body) == {"type": "error", "error": {"type": "request_too_large", "message": MESSAGE}}


@pytest.mark.parametrize(
    ("error", "status", "openai_type", "anthropic_type"),
    [
        (RequestTooLarge("m"), 413, "RequestTooLargeError", "request_too_large"),
        (BadRequest("m"), 400, "BadRequestError", "invalid_request_error"),
        (RateLimited("m", retry_after_s=3), 429, "RateLimitError", "rate_limit_error"),
        (BadGateway("m"), 502, "BadGatewayError", "api_error"),
        (GatewayTimeout("m"), 504, "GatewayTimeoutError", "api_error"),
        (InternalError("m"), 500, "InternalServerError", "api_error"),
        (Forbidden("m"), 403, "PermissionDeniedError", "permission_error"),
    ],
)
def test_error_table(error: GatewayError, status: int, openai_type: str, anthropic_type: str) -> None:
    assert error.status_code == status
    assert orjson.loads(error_body(error, Dialect.TRTLLM))["type"] == openai_type
    assert orjson.loads(error_body(error, Dialect.TRTLLM))["code"] == status
    assert orjson.loads(error_body(error, Dialect.OPENAI))["error"]["type"] == openai_type
    assert orjson.loads(error_body(error, Dialect.ANTHROPIC))["error"]["type"] == anthropic_type


def test_rate_limited_carries_retry_after() -> None:
    error = RateLimited("wait", retry_after_s=2.4)
    assert (b"retry-after", b"2") in error.raw_headers()


def test_dialect_by_route() -> None:
    assert dialect_for("/v1/messages", OpenAIEnvelope.OPENAI) is Dialect.ANTHROPIC
    assert dialect_for("/v1/chat/completions", OpenAIEnvelope.TRTLLM) is Dialect.TRTLLM
    assert dialect_for("/v1/responses", OpenAIEnvelope.OPENAI) is Dialect.OPENAI
