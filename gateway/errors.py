"""The gateway's one exception tree. `gateway.envelopes` turns each into the route's error envelope."""

from __future__ import annotations

from typing import ClassVar

from serving.errors import ServingError


class GatewayError(ServingError):
    """A refusal or failure the client is told about. `reason` labels `mmgate_rejections_total`; the OpenAI and
    Anthropic error types name it in the route's envelope. `public`: for a failure of something behind the gateway,
    whose message names internal addresses, what a client is told instead (`errors.expose_internal` off)."""

    openai_type: str = "InternalServerError"
    openai_code: str = "internal_error"
    anthropic_type: str = "api_error"
    public: ClassVar[str | None] = None


class RequestTooLarge(GatewayError):
    """A raw body, decoded media, processed tensors or an item count over its cap."""

    status_code = 413
    openai_type = "RequestTooLargeError"
    openai_code = "request_too_large"
    anthropic_type = "request_too_large"
    default_reason = "too_large"


class BadRequest(GatewayError):
    """Malformed JSON, a bad data URL, undecodable or disallowed media, a blocked or failed media URL."""

    status_code = 400
    openai_type = "BadRequestError"
    openai_code = "bad_request"
    anthropic_type = "invalid_request_error"
    default_reason = "bad_request"


class Forbidden(GatewayError):
    """A path the gateway does not forward (not public, or in `upstream.blocked_paths`)."""

    status_code = 403
    openai_type = "PermissionDeniedError"
    openai_code = "forbidden"
    anthropic_type = "permission_error"
    default_reason = "blocked_path"


class NotFound(GatewayError):
    """A path the gateway's metrics listener does not serve."""

    status_code = 404
    openai_type = "NotFoundError"
    openai_code = "not_found"
    anthropic_type = "not_found_error"
    default_reason = "not_found"


class RateLimited(GatewayError):
    """The process budget could not be had in time, or too many requests are already waiting for it."""

    status_code = 429
    openai_type = "RateLimitError"
    openai_code = "rate_limit_exceeded"
    anthropic_type = "rate_limit_error"
    default_reason = "rate_limited"

    def __init__(self, message: str, *, retry_after_s: float, reason: str | None = None):
        super().__init__(message, reason=reason, headers={"retry-after": str(max(1, round(retry_after_s)))})
        self.retry_after_s = retry_after_s


class BadGateway(GatewayError):
    status_code = 502
    public = "the upstream model server is unreachable or failed"
    openai_type = "BadGatewayError"
    openai_code = "bad_gateway"
    anthropic_type = "api_error"
    default_reason = "upstream_unreachable"


class GatewayTimeout(GatewayError):
    status_code = 504
    public = "the upstream model server timed out"
    openai_type = "GatewayTimeoutError"
    openai_code = "gateway_timeout"
    anthropic_type = "api_error"
    default_reason = "upstream_timeout"


class ServiceUnavailable(GatewayError):
    """The gateway or the engine is draining and takes no new work."""

    status_code = 503
    openai_type = "ServiceUnavailableError"
    openai_code = "service_unavailable"
    anthropic_type = "overloaded_error"
    default_reason = "unavailable"


class DrainCut(ServiceUnavailable):
    """The gateway was shutting down and the request was still running at `server.drain_timeout_s`."""

    default_reason = "drain_timeout"


class EngineNotReady(ServiceUnavailable):
    """Engine mode: the engine has not reported its model's geometry yet."""

    default_reason = "engine_geometry_unknown"
    public = "the engine has not reported its model's image geometry yet"


class InternalError(GatewayError):
    """A gateway bug: never something a client can cause."""
