"""Encoder scheduling policies."""

from __future__ import annotations

import enum


class SchedulingPolicy(enum.StrEnum):
    """How waiting requests start encoding.

    DEFAULT: at most ``max_new_requests`` requests (the hand-off consumer's free capacity) start per
    iteration, within the item, token and resident-byte budgets.
    EAGER: waiting requests start ahead of consumer capacity (``max_new_requests`` is ignored), still within
    every budget.
    DISABLED: the legacy, unprotected path. Each request is scheduled whole in the iteration it starts; there
    are no item, token or byte budgets and no admission refusal. ``max_new_requests`` is still honoured, as
    legacy inline encoding happened when the consumer took the request.
    """

    DEFAULT = "DEFAULT"
    EAGER = "EAGER"
    DISABLED = "DISABLED"

    @classmethod
    def _missing_(cls, value: object) -> SchedulingPolicy | None:
        # Config files spell it any case: `policy: eager`.
        if isinstance(value, str):
            return cls.__members__.get(value.strip().upper())
        return None
