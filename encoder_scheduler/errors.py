"""Errors raised by the encoder scheduler."""

from __future__ import annotations


class AdmissionError(ValueError):
    """A request can never be scheduled under the configured budgets.

    Raised by `EncoderScheduler.submit`. `knob` names the configuration key that refused the request
    (for example ``encoder.max_resident_bytes``); `required` and `limit` are the two numbers compared.
    """

    def __init__(self, message: str, *, knob: str, required: int, limit: int) -> None:
        super().__init__(message)
        self.knob = knob
        self.required = required
        self.limit = limit


class _MessageKeyError(KeyError):
    def __str__(self) -> str:
        # KeyError's str() is the repr of its argument; a sentence reads better in logs.
        return str(self.args[0]) if self.args else self.__class__.__name__


class UnknownRequestError(_MessageKeyError):
    """The request id is not live: never submitted, or already released (cancelled)."""


class MissingInputError(_MessageKeyError):
    """A required encoder input field is missing from a selected item."""
