"""Media admission on the admission routes: parse, find the media, reserve the process budget, load and count
every item against the per-request cap, then forward the original body byte for byte.

Requests without media go straight to the upstream and never wait for the budget.
"""

from __future__ import annotations

import time
from collections import Counter
from typing import TypeVar

from gateway.accounting import PER_REQUEST_KNOB, RequestAccount
from gateway.body_parse import parse_request_body
from gateway.budget import MediaBudget, Reservation
from gateway.config import BudgetMode, LimitsSettings, ReleaseOn
from gateway.engine_geometry import EngineGeometry
from gateway.engine_mode import ENGINE_ROUTES, EngineForwarder, refuse_uncovered_route, refuse_unencodable
from gateway.errors import RequestTooLarge
from gateway.media_loader import KeepPixels, MediaLoader
from gateway.media_parts import MediaRef, find_media
from gateway.metrics import GatewayMetrics
from gateway.proxy import UpstreamProxy
from gateway.queued_bodies import QueuedBodies
from gateway.request_info import RequestInfo, request_info
from serving.asgi import Receive, Scope, Send, disconnect_signal, read_body, until_disconnect

T = TypeVar("T")


class Admission:
    def __init__(
        self,
        *,
        limits: LimitsSettings,
        proxy: UpstreamProxy,
        budget: MediaBudget,
        loader: MediaLoader,
        metrics: GatewayMetrics,
        engine: EngineForwarder | None = None,
        engine_geometry: EngineGeometry | None = None,
    ) -> None:
        self.limits = limits
        self.proxy = proxy
        self.budget = budget
        self.loader = loader
        self.metrics = metrics
        self.engine = engine
        self.engine_geometry = engine_geometry
        self.queued_bodies = QueuedBodies(
            limits.max_queued_body_bytes, retry_after_s=limits.admission_timeout_s, metrics=metrics
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        info = request_info(scope)
        raw = await read_body(receive)  # bounded by RawBodyLimit
        parsed = parse_request_body(raw)
        info.model = parsed.model()
        refs = find_media(scope["path"], parsed)
        if not refs:
            await self.proxy.forward(scope, receive, send, body=raw)
            return
        limits = self.limits
        if limits.max_media_items_per_request is not None and len(refs) > limits.max_media_items_per_request:
            raise RequestTooLarge(
                f"request has {len(refs):,} media items, over "
                f"limits.max_media_items_per_request={limits.max_media_items_per_request:,}",
                reason="too_many_items",
            )
        self._check_item_counts(refs)
        info.media_items = len(refs)
        if self.engine is not None:
            refuse_uncovered_route(scope["path"])
        to_engine = self.engine is not None and scope["path"] in ENGINE_ROUTES
        keep: KeepPixels | None = None
        if to_engine:
            refuse_unencodable(refs)
            assert self.engine_geometry is not None
            keep = self.engine_geometry.require()
        account = RequestAccount(
            limits.max_multimodal_cpu_bytes_per_request,
            raw_body_bytes=len(raw) if limits.charge_raw_body else 0,
        )
        account.charge(0, "raw body")  # a body alone over the cap is refused before it waits for anything
        # The body is read: `receive` reports only the client leaving, which the protocol's signal tells without a
        # task per wait.
        signal = disconnect_signal(scope)
        reservation = await until_disconnect(
            self._reserve(refs, account, info, body_bytes=len(raw), keep=keep),
            receive,
            discard=Reservation.release,
            signal=signal,
        )
        try:
            items = await until_disconnect(self.loader.load(refs, account, keep=keep), receive, signal=signal)
            self._counted(info, account)
            if self.engine is not None and to_engine:
                await self.engine.forward(
                    scope, receive, send, parsed=parsed, refs=refs, items=items, reservation=reservation
                )
            else:
                del items
                on_response = reservation.release if limits.release_on is ReleaseOn.FIRST_BYTE else None
                await self.proxy.forward(scope, receive, send, body=raw, on_response=on_response)
        finally:
            self._counted(info, account)
            reservation.release()

    def _check_item_counts(self, refs: list[MediaRef]) -> None:
        """`limits.max_items.<modality>`: 413 naming the key, before anything is loaded."""
        counts = Counter(ref.modality for ref in refs)
        for modality, count in counts.items():
            limit = getattr(self.limits.max_items, modality.value)
            if limit is not None and count > limit:
                raise RequestTooLarge(
                    f"request has {count:,} {modality.value} items, over limits.max_items.{modality.value}={limit:,}",
                    reason="too_many_items",
                )

    def _counted(self, info: RequestInfo, account: RequestAccount) -> None:
        if info.media_counted_bytes is None:
            info.media_counted_bytes = account.total
            self.metrics.media_counted_bytes.observe(account.total)

    async def _reserve(
        self,
        refs: list[MediaRef],
        account: RequestAccount,
        info: RequestInfo,
        *,
        body_bytes: int,
        keep: KeepPixels | None,
    ) -> Reservation:
        with self.queued_bodies.hold(body_bytes):
            nbytes = await self._reservation_size(refs, account, keep)
            started = time.perf_counter()
            reservation = await self.budget.reserve(nbytes)
        info.budget_wait_s = time.perf_counter() - started
        return reservation

    async def _reservation_size(self, refs: list[MediaRef], account: RequestAccount, keep: KeepPixels | None) -> int:
        share = self.limits.max_multimodal_cpu_bytes_per_request or 0
        if self.budget.capacity is None or self.limits.budget_mode is BudgetMode.SLOTS:
            return share
        predicted = await self.loader.predict(refs, keep=keep)
        if predicted is None:
            return share  # a download or an undecodable modality: reserve the worst case
        total = account.raw_body_bytes + predicted
        if account.cap is not None and total > account.cap:
            raise RequestTooLarge(
                f"media predicted from the headers reach {total:,} bytes, over {PER_REQUEST_KNOB}={account.cap:,}",
                reason="media_too_large",
            )
        return total
