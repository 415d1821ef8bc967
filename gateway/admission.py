"""Media admission on the admission routes: read the body within the bound on buffered bodies, parse, find the
media, reserve the process budget, load and count every item against the per-request cap, then forward the
original body byte for byte.

Requests without media go straight to the upstream and never wait for the budget.
"""

from __future__ import annotations

import time
from collections import Counter
from typing import TypeVar

from gateway.body_buffer import BodyBuffer, BodyHold, wait_s
from gateway.budget.base import MediaBudget, Reservation
from gateway.config import BudgetMode, LimitsSettings, ReleaseOn
from gateway.engine_mode import EngineMode
from gateway.errors import RequestTooLarge
from gateway.media.accounting import PER_REQUEST_KNOB, RequestAccount
from gateway.media.body import ParsedBody, PreparedBody, json_tokens, prepare_body
from gateway.media.forward import inline_downloads
from gateway.media.loader import MediaLoader
from gateway.media.parts import MediaRef, find_media
from gateway.media.plan import ItemPlan
from gateway.metrics import GatewayMetrics
from gateway.proxy import UpstreamProxy
from gateway.request_info import RequestInfo, request_info
from gateway.tenants import Tenants
from serving.asgi import Receive, Scope, Send, disconnect_signal, until_disconnect

T = TypeVar("T")

# How media threads name the work on a request's body in their errors.
BODY = "request body"
# A body of at most this many bytes and JSON tokens is parsed and walked on the event loop's thread: counting its
# tokens takes 0.3 ms a MiB, and parsing and walking 4,096 tokens at most about 2 ms (a body of small objects), less
# than a hop to a media thread and back costs a chat request. Any other body is read on a media thread.
LOOP_MAX_BYTES = 1 << 20
LOOP_MAX_TOKENS = 4096


class Admission:
    def __init__(
        self,
        *,
        limits: LimitsSettings,
        proxy: UpstreamProxy,
        budget: MediaBudget,
        loader: MediaLoader,
        metrics: GatewayMetrics,
        body_buffer_bytes: int | None,
        engine: EngineMode | None = None,
        tenants: Tenants | None = None,
    ) -> None:
        """`body_buffer_bytes`: this process's share of `limits.max_buffered_body_bytes`. `tenants`: whom the media
        budget queues a request with media under, and in which band (without it, the default tenant)."""
        self.limits = limits
        self.proxy = proxy
        self.budget = budget
        self.loader = loader
        self.metrics = metrics
        self.engine = engine
        self.tenants = tenants if tenants is not None and tenants.enabled else None
        self.bodies = BodyBuffer(body_buffer_bytes, timeout_s=limits.admission_timeout_s, metrics=metrics)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        # The body's bytes are held against the bound on buffered bodies from before they are read until the
        # request ends (it is forwarded from this copy); what parsing allocates, for as long as the parsed body
        # lives.
        body, parse = BodyHold(), BodyHold()
        try:
            raw = await self.bodies.read(scope, receive, body)  # its size bounded by RawBodyLimit
            await self._admit(scope, receive, send, raw, parse, holding=body.nbytes)
        finally:
            body.release()
            parse.release()
            request_info(scope).body_wait_s = wait_s(body, parse)

    async def _admit(
        self, scope: Scope, receive: Receive, send: Send, raw: bytearray, parse: BodyHold, *, holding: int
    ) -> None:
        """`holding`: what the body holds of the bound on buffered bodies."""
        info = request_info(scope)
        try:
            parsed, refs = await self._read(scope, receive, raw, parse, holding=holding)
            info.model = parsed.model()
            if refs:
                await self._admit_media(scope, receive, send, raw, parsed, refs)
                return
            del parsed, refs  # the body's bytes go upstream, not the objects parsed from them
        finally:
            parse.release()
        await self.proxy.forward(scope, receive, send, body=raw)

    async def _read(
        self, scope: Scope, receive: Receive, raw: bytearray, hold: BodyHold, *, holding: int
    ) -> tuple[ParsedBody, list[MediaRef]]:
        """Parse the body and find its media. What parsing will allocate is bounded from the body's tokens and
        taken from the bound on buffered bodies first; a body too large or with too many tokens to parse within a
        millisecond or two is read on a media thread, so that no request holds the event loop for long."""
        path = scope["path"]
        small = len(raw) <= LOOP_MAX_BYTES and json_tokens(raw) <= LOOP_MAX_TOKENS
        prepared = prepare_body(raw) if small else await self.loader.worker.run(BODY, lambda: prepare_body(raw))
        await self.bodies.take(
            scope,
            receive,
            prepared.parse_bytes,
            hold,
            holding=holding,
            what=f"parsing the request body ({prepared.tokens:,} JSON tokens)",
        )
        if small:
            return _read_document(prepared, path)
        return await self.loader.worker.run(BODY, lambda: _read_document(prepared, path))

    async def _admit_media(
        self, scope: Scope, receive: Receive, send: Send, raw: bytearray, parsed: ParsedBody, refs: list[MediaRef]
    ) -> None:
        info = request_info(scope)
        limits = self.limits
        if limits.max_media_items_per_request is not None and len(refs) > limits.max_media_items_per_request:
            raise RequestTooLarge(
                f"request has {len(refs):,} media items, over "
                f"limits.max_media_items_per_request={limits.max_media_items_per_request:,}",
                reason="too_many_items",
            )
        self._check_item_counts(refs)
        info.media_items = len(refs)
        if self.tenants is not None:
            info.tenant, info.band = self.tenants.resolve(scope)
        # What the request keeps of its items: engine mode's resized pixels, or what the media settings keep.
        keep = self.engine.admit(scope["path"], refs) if self.engine is not None else self.loader.keep
        plans = self.loader.plan(refs, keep)
        account = RequestAccount(
            limits.max_multimodal_cpu_bytes_per_request,
            raw_body_bytes=len(raw) if limits.charge_raw_body else 0,
        )
        account.charge(0, "raw body")  # a body alone over the cap is refused before it waits for anything
        # The body is read: `receive` reports only the client leaving, which the protocol's signal tells without a
        # task per wait.
        signal = disconnect_signal(scope)
        plans, nbytes = await until_disconnect(self._reservation_size(plans, account), receive, signal=signal)
        reservation = await until_disconnect(
            self._reserve(nbytes, info), receive, discard=Reservation.release, signal=signal
        )
        try:
            items = await until_disconnect(self.loader.load(plans, account), receive, signal=signal)
            del plans  # what the prediction opened goes with the load
            if self.engine is not None:
                self._counted(info, account)
                await self.engine.forward(
                    scope, receive, send, parsed=parsed, refs=refs, items=items, reservation=reservation
                )
            else:
                # Downloaded items go upstream as the bytes checked here, not as URLs to fetch again: the body is
                # walked for their URLs and they are encoded on a media thread (megabytes, for the event loop).
                forwarded = (
                    await self.loader.worker.run(BODY, lambda: inline_downloads(parsed, items, account))
                    if any(item.downloaded is not None for item in items)
                    else None
                )
                self._counted(info, account)
                del items
                on_response = reservation.release if limits.release_on is ReleaseOn.FIRST_BYTE else None
                await self.proxy.forward(scope, receive, send, body=forwarded or raw, on_response=on_response)
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

    async def _reserve(self, nbytes: int, info: RequestInfo) -> Reservation:
        started = time.perf_counter()
        try:
            return await self.budget.reserve(nbytes, tenant=info.tenant, band=info.band)
        finally:
            info.budget_wait_s = time.perf_counter() - started

    async def _reservation_size(self, plans: list[ItemPlan], account: RequestAccount) -> tuple[list[ItemPlan], int]:
        """The bytes to reserve, predicted from the items' headers where the budget counts bytes, and the plans as
        the prediction left them (with what it opened for the load)."""
        share = self.limits.max_multimodal_cpu_bytes_per_request or 0
        if self.budget.capacity is None or self.limits.budget_mode is BudgetMode.SLOTS:
            return plans, share
        predicted, plans = await self.loader.predict(plans)
        if predicted is None:
            return plans, share  # a download: reserve the worst case
        total = account.raw_body_bytes + predicted
        if account.cap is not None and total > account.cap:
            raise RequestTooLarge(
                f"media predicted from the headers reach {total:,} bytes, over {PER_REQUEST_KNOB}={account.cap:,}",
                reason="media_too_large",
            )
        return plans, total


def _read_document(prepared: PreparedBody, path: str) -> tuple[ParsedBody, list[MediaRef]]:
    parsed = prepared.parse()
    return parsed, find_media(path, parsed)
