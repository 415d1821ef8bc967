"""`/healthz` (the process is alive) and `/readyz` (every request kind can be served: the upstream answers, in
engine mode the engine answers and has reported its model's geometry; the result is cached briefly).

A check names what it reached only where the reader may see internal addresses: on the metrics listener, or with
`errors.expose_internal`; on the public port it says how it went.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import aiohttp
import orjson

from gateway.config import UpstreamSettings
from serving.asgi import Receive, Scope, Send, send_response


@dataclass(frozen=True, slots=True)
class Check:
    """One line of `/readyz`: whether it holds, how it went, and the internal address it was checked at."""

    ok: bool
    detail: str
    where: str | None = None

    def line(self, internal: bool) -> str:
        return f"{self.where}: {self.detail}" if internal and self.where else self.detail


Probe = Callable[[], Awaitable[Check]]
Readiness = dict[str, Check]


class Health:
    def __init__(
        self,
        session: Callable[[], aiohttp.ClientSession],
        settings: UpstreamSettings,
        extra_probes: dict[str, Probe] | None = None,
        *,
        expose_internal: bool = False,
    ) -> None:
        self.session = session
        self.probe_url = str(settings.url).rstrip("/") + settings.ready_path
        self.cache_s = settings.ready_cache_s
        self.probe_timeout = aiohttp.ClientTimeout(total=2.0, sock_connect=min(2.0, settings.connect_timeout_s))
        self.probes: dict[str, Probe] = {"upstream": self._check_upstream, **(extra_probes or {})}
        self.expose_internal = expose_internal
        self.draining = False
        self._last: tuple[float, Readiness] | None = None
        self._probe: asyncio.Future[Readiness] | None = None

    async def healthz(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send_response(send, 200, b'{"status":"ok"}')

    async def readyz(self, scope: Scope, receive: Receive, send: Send, *, internal: bool = False) -> None:
        """`internal`: the reader may see internal addresses (the metrics listener)."""
        if self.draining:
            await send_response(send, 503, b'{"status":"draining"}')
            return
        readiness = await self.readiness()
        ready = all(check.ok for check in readiness.values())
        named = internal or self.expose_internal
        lines = {name: check.line(named) for name, check in readiness.items()}
        body = orjson.dumps({"status": "ready" if ready else "not_ready", **lines})
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

    async def _check_upstream(self) -> Check:
        return await http_check(self.session(), self.probe_url, self.probe_timeout)


async def http_check(session: aiohttp.ClientSession, url: str, limits: aiohttp.ClientTimeout) -> Check:
    """GET `url` within `limits`: ready on a 2xx."""
    try:
        async with session.get(url, timeout=limits) as response:
            await response.read()
            return Check(200 <= response.status < 300, str(response.status), url)
    except (TimeoutError, aiohttp.ClientError) as exc:
        return Check(False, type(exc).__name__, url)
