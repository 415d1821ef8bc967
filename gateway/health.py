"""`/healthz` (the process is alive) and `/readyz` (the upstream answers; result cached briefly)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import aiohttp
import orjson

from gateway.asgi import Receive, Scope, Send, send_response
from gateway.config import UpstreamSettings


class Health:
    def __init__(self, session: Callable[[], aiohttp.ClientSession], settings: UpstreamSettings) -> None:
        self.session = session
        self.probe_url = str(settings.url).rstrip("/") + settings.ready_path
        self.cache_s = settings.ready_cache_s
        self.probe_timeout = aiohttp.ClientTimeout(total=2.0, sock_connect=min(2.0, settings.connect_timeout_s))
        self.draining = False
        self._last: tuple[float, bool, str] | None = None
        self._probe: asyncio.Future[tuple[bool, str]] | None = None

    async def healthz(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send_response(send, 200, b'{"status":"ok"}')

    async def readyz(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.draining:
            await send_response(send, 503, b'{"status":"draining"}')
            return
        ready, detail = await self.upstream_ready()
        body = orjson.dumps({"status": "ready" if ready else "not_ready", "upstream": detail})
        await send_response(send, 200 if ready else 503, body)

    async def upstream_ready(self) -> tuple[bool, str]:
        now = time.monotonic()
        if self._last is not None and now - self._last[0] < self.cache_s:
            return self._last[1], self._last[2]
        # Concurrent probes of a cold cache share one upstream call.
        if self._probe is None or self._probe.done():
            self._probe = asyncio.ensure_future(self._check())
        ready, detail = await asyncio.shield(self._probe)
        self._last = (time.monotonic(), ready, detail)
        return ready, detail

    async def _check(self) -> tuple[bool, str]:
        try:
            async with self.session().get(self.probe_url, timeout=self.probe_timeout) as response:
                await response.read()
                return 200 <= response.status < 300, f"{self.probe_url}: {response.status}"
        except (TimeoutError, aiohttp.ClientError) as exc:
            return False, f"{self.probe_url}: {type(exc).__name__}"
