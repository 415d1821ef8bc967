from __future__ import annotations

import pytest

from encoder_scheduler import EncoderBudget


def test_budget_fields_are_readable() -> None:
    budget = EncoderBudget(max_num_items=8, max_num_tokens=16384, max_resident_bytes=256 << 20)
    assert (budget.max_num_items, budget.max_num_tokens, budget.max_resident_bytes) == (8, 16384, 256 << 20)
    assert EncoderBudget(1, 1, None).max_resident_bytes is None


@pytest.mark.parametrize(
    ("items", "tokens", "resident", "knob"),
    [
        (0, 1, 1, "encoder.max_num_items"),
        (1, 0, 1, "encoder.max_num_tokens"),
        (1, 1, 0, "encoder.max_resident_bytes"),
        (True, 1, 1, "encoder.max_num_items"),
    ],
)
def test_budget_rejects_invalid_values_naming_the_knob(items: int, tokens: int, resident: int, knob: str) -> None:
    with pytest.raises(ValueError, match=knob):
        EncoderBudget(items, tokens, resident)
