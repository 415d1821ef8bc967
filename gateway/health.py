"""`/healthz` (the process is alive) and `/readyz` (the upstream, and in engine mode the engine, answer;
the result is cached briefly)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

import aiohttp
import orjson

from gateway.config import UpstreamSettings
from serving.asgi import Receive, Scope, Send, send_response

Probe = Callable[[], Awaitable[tuple[bool, str]]]
Readiness = dict[str, tuple[bool, str]]


class Health:
    def __init__(
        self,
        session: Callable[[], aiohttp.ClientSession],
        settings: UpstreamSettings,
        extra_probes: dict[str, Probe] | None = None,
    ) -> None:
        self.session = session
        self.probe_url = str(settings.url).rstrip("/") + settings.ready_path
        self.cache_s = settings.ready_cache_s
        self.probe_timeout = aiohttp.ClientTimeout(total=2.0, sock_connect=min(2.0, settings.connect_timeout_s))
        self.probes: dict[str, Probe] = {"upstream": self._check_upstream, **(extra_probes or {})}
        self.draining = False
        self._last: tuple[float, Readiness] | None = None
        self._probe: asyncio.Future[Readiness] | None = None

    async def healthz(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send_response(send, 200, b'{"status":"ok"}')

    async def readyz(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.draining:
            await send_response(send, 503, b'{"status":"draining"}')
            return
        readiness = await self.readiness()
        ready = all(ok for ok, _ in readiness.values())
        body = orjson.dumps(
            {"status": "ready" if ready else "not_ready", **{name: detail for name, (_, detail) in readiness.items()}}
        )
        await send_response(send, 200 if ready else 503, body)

    async def readiness(self) -> Readiness:
        now = time.monotonic()
        if self._last is not None and now - self._last[0] < self.cache_s:
            return self._last[1]
        # Concurrent probes of a cold cache share one round of calls.
        if self._probe is None or self._probe.done():
            self._probe = asyncio.ensure_future(self._check_all())
        readiness = await asyncio.shield(self._probe)
        self._last = (time.monotonic(), readiness)
        return readiness

    async def _check_all(self) -> Readiness:
        results = await asyncio.gather(*(probe() for probe in self.probes.values()))
        return dict(zip(self.probes, results, strict=True))

    async def _check_upstream(self) -> tuple[bool, str]:
        try:
            async with self.session().get(self.probe_url, timeout=self.probe_timeout) as response:
                await response.read()
                return 200 <= response.status < 300, f"{self.probe_url}: {response.status}"
        except (TimeoutError, aiohttp.ClientError) as exc:
            return False, f"{self.probe_url}: {type(exc).__name__}"
