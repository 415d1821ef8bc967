"""The engine's one exception tree; each error is one response `{"error": {"message", "code", "reason"}}`."""

from __future__ import annotations

import orjson

from serving.errors import ServingError


class EngineError(ServingError):
    """A refusal or failure the caller is told about. `reason` is a short stable label (metrics, logs)."""

    def body(self) -> bytes:
        return orjson.dumps({"error": {"message": self.message, "code": self.status_code, "reason": self.reason}})


class BadRequest(EngineError):
    """A submit file that is malformed, or whose items do not fit the engine's processor geometry."""

    status_code = 400
    default_reason = "bad_request"


class Unauthorized(EngineError):
    status_code = 401
    default_reason = "unauthorized"

    def __init__(self, message: str) -> None:
        super().__init__(message, headers={"www-authenticate": "Bearer"})


class NotFound(EngineError):
    status_code = 404
    default_reason = "not_found"


class Conflict(EngineError):
    """The response of a request was already claimed by another call."""

    status_code = 409
    default_reason = "already_claimed"


class Gone(EngineError):
    """The request finished, was cancelled, or its buffer was already released."""

    status_code = 410
    default_reason = "gone"


class TooLarge(EngineError):
    """A body or a request's encoder footprint over its cap."""

    status_code = 413
    default_reason = "too_large"


class TooManyRequests(EngineError):
    """Pending encoder inputs are at their cap; the caller may retry later."""

    status_code = 429
    default_reason = "queue_full"

    def __init__(self, message: str, *, retry_after_s: float = 1.0, reason: str | None = None) -> None:
        super().__init__(message, reason=reason, headers={"retry-after": str(max(1, round(retry_after_s)))})


class InternalError(EngineError):
    """An engine failure (the encoder raised, a bug): never something a caller can cause."""


class BadGateway(EngineError):
    """The hand-off backend is unreachable or broke the exchange."""

    status_code = 502
    default_reason = "handoff_unreachable"


class Unavailable(EngineError):
    """The engine is draining and takes no new work."""

    status_code = 503
    default_reason = "draining"


class GatewayTimeout(EngineError):
    """The hand-off backend did not answer within its timeout."""

    status_code = 504
    default_reason = "handoff_timeout"
