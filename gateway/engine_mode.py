"""Engine mode (`engine.url` set): chat requests with media go through the engine process instead of straight
upstream. `EngineMode` is all of it the admission path sees: which requests it takes, the resize for the engine's
model (`EngineGeometry`, read from the engine), and the forwarding.

The loaders have decoded every image and the sampled frames of every video, resized for the engine's model
(gateway/media/resize.py); here each item is sent as uint8 pixels (`engine_adapter.client.wire`): an image
`[h, w, 3]`, a video one `[t, h, w, 3]` item, with the request's media parts replaced by item references. The
gateway's budget is released at the engine's 202; the engine's answer is streamed to the client, and a client
that leaves cancels the request on the engine, which frees its embedding buffer.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import aiohttp

from engine_adapter.client import EngineClient, EngineRefusal, WireItem, encode_submit, item_part
from gateway.budget.base import Reservation
from gateway.engine_geometry import EngineGeometry
from gateway.errors import (
    BadGateway,
    BadRequest,
    GatewayError,
    GatewayTimeout,
    RateLimited,
    RequestTooLarge,
    ServiceUnavailable,
)
from gateway.health import Check, http_check
from gateway.media.base import LoadedItem
from gateway.media.body import ParsedBody
from gateway.media.parts import MediaRef, Modality
from gateway.media.plan import Keep
from gateway.metrics import GatewayMetrics
from gateway.request_info import request_info
from serving.asgi import Receive, Scope, Send, disconnect_signal, relay_body, until_disconnect
from serving.headers import end_to_end

ENGINE_ROUTES = frozenset({"/v1/chat/completions"})
_PROBE_TIMEOUT = aiohttp.ClientTimeout(total=2.0)


def engine_document(parsed: ParsedBody, refs: list[MediaRef]) -> dict[str, Any]:
    """The request as the engine gets it: media parts become item references, long strings are restored."""
    document = parsed.document
    for index, ref in enumerate(refs):
        container = document
        for key in ref.path[:-1]:
            container = container[key]
        container[ref.path[-1]] = item_part(index)
    restored: dict[str, Any] = _restore(document, parsed)
    return restored


def _restore(node: Any, parsed: ParsedBody) -> Any:
    if isinstance(node, dict):
        return {key: _restore(value, parsed) for key, value in node.items()}
    if isinstance(node, list):
        return [_restore(value, parsed) for value in node]
    if isinstance(node, str):
        value = parsed.resolve(node)
        return value if isinstance(value, str) else bytes(value).decode("utf-8")
    return node


ENCODED_MODALITIES = frozenset({Modality.IMAGE, Modality.VIDEO})


class EngineMode:
    def __init__(self, client: EngineClient, executor: ThreadPoolExecutor, *, metrics: GatewayMetrics) -> None:
        self.client = client
        self.executor = executor
        self.metrics = metrics
        self.geometry = EngineGeometry(client)

    def admit(self, path: str, refs: list[MediaRef]) -> Keep:
        """What a request with media on `path` keeps of its items: their pixels resized for the engine's model.
        Refused before anything is reserved or decoded: another admission route than the chat route (the upstream
        behind an engine is not given the media to load), an item the engine's towers cannot encode (audio), and
        any request while the engine has not reported its geometry (503)."""
        if path not in ENGINE_ROUTES:
            raise BadRequest(
                f"{path} with media is not served in engine mode (engine.url is set): engine mode covers "
                f"{', '.join(sorted(ENGINE_ROUTES))} only; send images and videos through the chat route",
                reason="unsupported_route",
            )
        for ref in refs:
            if ref.modality not in ENCODED_MODALITIES:
                raise BadRequest(
                    f"{ref.locator}: the engine in front of this model encodes images and videos, not "
                    f"{ref.modality.value}: its vision towers have no {ref.modality.value} encoder (engine.url is set)",
                    reason="unsupported_media",
                )
        return Keep(resize=self.geometry.require())

    async def readiness(self) -> Check:
        """Ready once the engine answers and has reported its model's geometry, which every request with media
        needs; while it has not, the probe asks for it."""
        check = await http_check(self.client.session, f"{self.client.base_url}/healthz", _PROBE_TIMEOUT)
        if not check.ok:
            return check
        if self.geometry.resize is None:
            await self.geometry.refresh()
        geometry = self.geometry.geometry
        if geometry is None:
            return Check(False, "answers, but has not reported its model's geometry", check.where)
        return Check(True, f"{check.detail}, {geometry.name} geometry", check.where)

    async def start(self) -> None:
        await self.geometry.start()

    async def aclose(self) -> None:
        await self.geometry.aclose()
        await self.client.aclose()

    async def forward(
        self,
        scope: Scope,
        receive: Receive,
        send: Send,
        *,
        parsed: ParsedBody,
        refs: list[MediaRef],
        items: list[LoadedItem],
        reservation: Reservation,
    ) -> None:
        info = request_info(scope)
        wire_items = []
        for ref, item in zip(refs, items, strict=True):
            assert item.resized is not None  # every item was loaded keeping its resize (`admit`)
            pixels, sha256 = item.resized
            wire_items.append(WireItem(ref.modality.value, ref.locator, sha256, pixels))
        document = engine_document(parsed, refs)
        loop = asyncio.get_running_loop()
        body = await loop.run_in_executor(self.executor, encode_submit, info.request_id, document, wire_items)
        del wire_items, document
        # The request body was read before admission: `receive` reports only the client leaving, which the
        # protocol's signal tells without a task per wait.
        signal = disconnect_signal(scope)
        started = time.perf_counter()
        job_id = await until_disconnect(
            self._engine_call(self.client.submit(body, info.request_id)), receive, signal=signal
        )
        # Admitted: the pixels are the engine's to hold now, and so is the memory they stand for.
        del body
        items.clear()
        reservation.release()
        completed = False
        try:
            response = await until_disconnect(
                self._engine_call(self.client.open_response(job_id, info.request_id)), receive, signal=signal
            )
            # The engine's answer starts: from the submit, what the upstream's time to first byte is elsewhere.
            info.upstream_ttfb_s = time.perf_counter() - started
            self.metrics.upstream_ttfb_by(info.route).observe(info.upstream_ttfb_s)
            try:
                await send(
                    {
                        "type": "http.response.start",
                        "status": response.status,
                        "headers": end_to_end(response.raw_headers),
                    }
                )
                completed = await relay_body(response.content.iter_any(), receive, send, signal=signal)
                info.client_disconnected = not completed
            finally:
                response.close()
        finally:
            if not completed:
                await self.client.cancel(job_id, info.request_id)

    @staticmethod
    async def _engine_call(call: Any) -> Any:
        try:
            return await call
        except EngineRefusal as error:
            raise engine_error(error) from None


def _credentials_refused(error: EngineRefusal) -> GatewayError:
    # The gateway's own credentials were refused: a 502 with the gateway's reason, not the engine's.
    return BadGateway(f"the engine refused the gateway's credentials (engine.auth_token): {error.message}")


# The engine's status -> the gateway's error for it; any other status is a 502 with the engine's reason.
_ENGINE_ERRORS: dict[int, Callable[[EngineRefusal], GatewayError]] = {
    400: lambda error: BadRequest(error.message, reason=error.reason),
    413: lambda error: RequestTooLarge(error.message, reason=error.reason),
    429: lambda error: RateLimited(error.message, retry_after_s=error.retry_after_s or 1.0, reason=error.reason),
    503: lambda error: ServiceUnavailable(error.message, reason=error.reason),
    504: lambda error: GatewayTimeout(error.message, reason=error.reason),
    401: _credentials_refused,
    403: _credentials_refused,
}


def engine_error(error: EngineRefusal) -> GatewayError:
    """The engine's refusal in the gateway's exception tree, so the client gets it in the route's envelope."""
    translate = _ENGINE_ERRORS.get(error.status)
    if translate is None:
        return BadGateway(error.message, reason=error.reason)
    return translate(error)
