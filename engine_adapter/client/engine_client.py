"""The client the gateway uses to talk to the engine's internal API (see `engine_adapter.client.wire`)."""

from __future__ import annotations

from collections.abc import Coroutine
from typing import Any

import aiohttp
import orjson

from engine_adapter.client.wire import SUBMIT_CONTENT_TYPE
from serving.http_client_errors import HTTP_CLIENT_ERRORS, failure_of


class EngineRefusal(Exception):
    """The engine refused or failed a call; `status` and `reason` come from its error body when it sent one."""

    def __init__(self, status: int, message: str, reason: str, *, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.reason = reason
        self.retry_after_s = retry_after_s


class EngineClient:
    def __init__(
        self,
        url: str,
        *,
        auth_token: str | None = None,
        connect_timeout_s: float = 5.0,
        read_timeout_s: float = 600.0,
        max_connections: int = 256,
    ) -> None:
        self.base_url = url.rstrip("/")
        self.connect_timeout_s = connect_timeout_s
        self.read_timeout_s = read_timeout_s
        self.max_connections = max_connections
        self._headers = {"Authorization": f"Bearer {auth_token}"} if auth_token else {}
        self._session: aiohttp.ClientSession | None = None

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=self.max_connections, limit_per_host=0),
                # No total timeout: a response streams as long as it keeps sending.
                timeout=aiohttp.ClientTimeout(
                    total=None, sock_connect=self.connect_timeout_s, sock_read=self.read_timeout_s
                ),
                auto_decompress=False,
                cookie_jar=aiohttp.DummyCookieJar(),
                headers=self._headers,
                trust_env=False,
            )
        return self._session

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()

    async def submit(self, body: bytes, request_id: str) -> str:
        """Hand a request file to the engine; returns the engine's id once it admitted the request (202)."""
        headers = {"Content-Type": SUBMIT_CONTENT_TYPE, "X-Request-ID": request_id}
        async with self._call("POST", "/internal/v1/requests", data=body, headers=headers) as response:
            payload = await response.read()
            if response.status != 202:
                error = _error(response.status, payload, self.base_url)
                error.retry_after_s = _seconds(response.headers.get("Retry-After"))
                raise error
        job_id = orjson.loads(payload).get("id")
        if not isinstance(job_id, str):
            raise EngineRefusal(502, f"engine {self.base_url} accepted a request without an id", "engine_protocol")
        return job_id

    async def open_response(self, job_id: str, request_id: str) -> aiohttp.ClientResponse:
        """The LLM's answer for `job_id`, once it starts; the caller streams its body and closes it."""
        headers = {"X-Request-ID": request_id}
        response = await self._request("GET", f"/internal/v1/requests/{job_id}/response", headers=headers)
        if response.status >= 300 and _is_engine_error(response):
            payload = await response.read()
            response.close()
            raise _error(response.status, payload, self.base_url)
        return response

    async def cancel(self, job_id: str, request_id: str) -> None:
        """Best effort: free the request's buffer on the engine now rather than at its claim timeout."""
        headers = {"X-Request-ID": request_id}
        try:
            async with self._call("DELETE", f"/internal/v1/requests/{job_id}", headers=headers) as response:
                await response.read()
        except EngineRefusal:
            pass

    async def status(self) -> dict[str, Any]:
        """The engine's `GET /internal/v1/status`: its model, processor geometry, budgets and hand-off."""
        async with self._call("GET", "/internal/v1/status") as response:
            payload = await response.read()
            if response.status != 200:
                raise _error(response.status, payload, self.base_url)
        status = orjson.loads(payload)
        if not isinstance(status, dict):
            raise EngineRefusal(
                502, f"engine {self.base_url} answered its status with {type(status).__name__}", "engine_protocol"
            )
        return status

    def _call(
        self, method: str, path: str, *, data: bytes | None = None, headers: dict[str, str] | None = None
    ) -> _Call:
        return _Call(self._request(method, path, data=data, headers=headers))

    async def _request(
        self, method: str, path: str, *, data: bytes | None = None, headers: dict[str, str] | None = None
    ) -> aiohttp.ClientResponse:
        try:
            return await self.session.request(
                method, self.base_url + path, data=data, headers=headers, allow_redirects=False
            )
        except HTTP_CLIENT_ERRORS as exc:
            if failure_of(exc).timed_out:
                raise EngineRefusal(
                    504, f"engine {self.base_url} timed out: {type(exc).__name__}", "engine_timeout"
                ) from exc
            raise EngineRefusal(502, f"engine {self.base_url} unreachable: {exc}", "engine_unreachable") from exc


class _Call:
    """`async with client._call(...) as response:` releases the connection on the way out."""

    def __init__(self, request: Coroutine[None, None, aiohttp.ClientResponse]) -> None:
        self.request = request
        self.response: aiohttp.ClientResponse | None = None

    async def __aenter__(self) -> aiohttp.ClientResponse:
        self.response = await self.request
        return self.response

    async def __aexit__(self, *exc: object) -> None:
        if self.response is not None:
            self.response.release()


def _seconds(value: str | None) -> float | None:
    try:
        return float(value) if value is not None else None
    except ValueError:
        return None


def _is_engine_error(response: aiohttp.ClientResponse) -> bool:
    # Every refusal of the engine's own carries the header; any other answer is the LLM server's (its 401 or
    # 404 included) and passes through as it is.
    return response.headers.get("X-Mmgate-Engine-Error") == "1"


def _error(status: int, payload: bytes, base_url: str) -> EngineRefusal:
    try:
        error = orjson.loads(payload)["error"]
        return EngineRefusal(status, str(error["message"]), str(error.get("reason", "engine_error")))
    except (orjson.JSONDecodeError, KeyError, TypeError):
        text = payload[:200].decode("utf-8", "replace")
        return EngineRefusal(status, f"engine {base_url} answered {status}: {text}", "engine_error")
