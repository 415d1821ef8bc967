"""One iteration's encoder schedule."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import overload


@dataclass(frozen=True, slots=True)
class SchedulePlan(Sequence[tuple[str, int]]):
    """The work `EncoderScheduler.schedule` selected for one iteration.

    The plan is a sequence of ``(request_id, item_index)`` pairs: the items to encode now, in FCFS order
    (started requests first, in start order, then newly started ones in submit order; each request's items in
    prompt order).
    Items resolved from the encoder cache are not in it: they were already copied into their request's buffer
    during `schedule` and are listed in `cache_hits`, so an empty plan may still have started requests, hits
    and ready requests.

    work: the items to encode (the sequence itself).
    runs: the same items as ``(request_id, start, stop)`` runs of adjacent item indices of one request, for
        packing each run's inputs as one slice.
    num_tokens: encoder tokens of the items to encode.
    token_budget: the token limit this iteration ran under (``max_num_tokens``, or one oversized item's cost
        when that item runs alone; None under the DISABLED policy).
    started: requests whose first item was scheduled (or resolved) now, in FCFS order; their buffers were
        allocated and charged now.
    cache_hits: ``(request_id, item_index)`` pairs resolved from the cache now.
    ready: requests that became ready during `schedule` (every remaining item was a cache hit); they need no
        `record` calls.
    """

    work: tuple[tuple[str, int], ...]
    runs: tuple[tuple[str, int, int], ...]
    num_tokens: int
    token_budget: int | None
    started: tuple[str, ...]
    cache_hits: tuple[tuple[str, int], ...]
    ready: tuple[str, ...]

    @overload
    def __getitem__(self, index: int) -> tuple[str, int]: ...

    @overload
    def __getitem__(self, index: slice) -> tuple[tuple[str, int], ...]: ...

    def __getitem__(self, index: int | slice) -> tuple[str, int] | tuple[tuple[str, int], ...]:
        return self.work[index]

    def __len__(self) -> int:
        return len(self.work)

    def __iter__(self) -> Iterator[tuple[str, int]]:
        return iter(self.work)
