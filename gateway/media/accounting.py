"""One request's running count of CPU bytes against `limits.max_multimodal_cpu_bytes_per_request`, and the
per-frame charge of a decode running on a media thread against it."""

from __future__ import annotations

import threading
from typing import Any

from gateway.errors import RequestTooLarge
from gateway.media.storage import StorageCounter
from gateway.processors.base import Processed, request_bytes

PER_REQUEST_KNOB = "limits.max_multimodal_cpu_bytes_per_request"


class RequestAccount:
    """Starts from the raw body (when charged) and grows with every counted item; passing the cap raises 413.

    `what` names the stage in the message: "decoded media", "downloaded media", "processed tensors". Thread-safe:
    the items of a request are charged from the media threads that load them.
    """

    def __init__(self, cap: int | None, *, raw_body_bytes: int = 0) -> None:
        self.cap = cap
        self.raw_body_bytes = raw_body_bytes
        self.total = raw_body_bytes
        self.storage = StorageCounter()
        self._lock = threading.Lock()
        self._passed: str | None = None
        self._processed: list[Processed] = []

    def charge_processed(self, item: Processed, what: str) -> int:
        """Charge what the model server's processor holds at once for the request's items with `item` added
        (`request_bytes`: one item its peak, several their held bytes and the largest working memory); returns
        the bytes added."""
        with self._lock:
            before = request_bytes(self._processed)
            self._processed.append(item)
            added = request_bytes(self._processed) - before
            self.total += added
            self._check(what)
        return added

    def charge(self, nbytes: int, what: str) -> None:
        with self._lock:
            self.total += nbytes
            self._check(what)

    def count_storage(self, obj: Any, what: str = "decoded media") -> int:
        """Charge the CPU storage of `obj` that is not counted yet (views of counted buffers add nothing)."""
        with self._lock:
            added = self.storage.add(obj)
            self.total += added
            self._check(what)
        return added

    def settle(self, predicted: int, obj: Any, what: str = "decoded media") -> None:
        """`obj` is what `predicted` bytes were charged for ahead of time (the decode's peak, which it held): its
        storage is counted as seen, and only what it holds beyond the prediction adds to the total."""
        with self._lock:
            self.total += max(0, self.storage.add(obj) - predicted)
            self._check(what)

    def _check(self, what: str) -> None:
        if self._passed is None:
            if self.cap is None or self.total <= self.cap:
                return
            raw = f" (raw body {self.raw_body_bytes:,} included)" if self.raw_body_bytes else ""
            self._passed = f"{what} reached {self.total:,} bytes{raw}, over {PER_REQUEST_KNOB}={self.cap:,}"
        # Items charged at once from several threads: each is refused with the charge that passed the cap.
        raise RequestTooLarge(self._passed, reason="media_too_large")


class PrepaidCharge:
    """The per-frame charge of a decode running on a media thread, whose predicted bytes were charged to the
    request's account before it started: frames draw from that prepaid amount first; anything past it (a header
    that understated what the stream holds) is charged to the account from the decode's thread, so passing the cap
    stops the decode before the next frame."""

    def __init__(self, account: RequestAccount, prepaid: int, what: str) -> None:
        self.account = account
        self.left = prepaid
        self.what = what

    def __call__(self, nbytes: int) -> None:
        drawn = min(nbytes, self.left)
        self.left -= drawn
        if nbytes > drawn:
            self.account.charge(nbytes - drawn, self.what)
