"""Per-iteration and resident encoder budgets."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class EncoderBudget:
    """Encoder budgets (config keys ``encoder.max_num_items``, ``encoder.max_num_tokens``,
    ``encoder.max_resident_bytes``).

    max_num_items: items (images or videos) encoded per iteration.
    max_num_tokens: encoder tokens (pre-merger attention tokens) per iteration. A single item above it still
        runs, alone in its iteration; see `EncoderScheduler.effective_max_num_tokens`.
    max_resident_bytes: bytes of all allocated request output buffers of live requests; None means unbounded.
    """

    max_num_items: int
    max_num_tokens: int
    max_resident_bytes: int | None

    def __post_init__(self) -> None:
        for name in ("max_num_items", "max_num_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"encoder.{name} must be a positive integer, got {value!r}")
        limit = self.max_resident_bytes
        if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
            raise ValueError(f"encoder.max_resident_bytes must be a positive integer or None, got {limit!r}")
