from __future__ import annotations

import pytest
import torch

from encoder_scheduler import RequestBuffer


def test_buffer_is_one_contiguous_allocation_sized_from_offsets() -> None:
    buffer = RequestBuffer((0, 2, 5, 6), 3, torch.bfloat16)
    assert buffer.tensor.shape == (6, 3)
    assert buffer.tensor.is_contiguous()
    assert buffer.nbytes == 6 * 3 * 2
    assert buffer.offsets == (0, 2, 5, 6)
    assert buffer.rows(1).data_ptr() == buffer.tensor.data_ptr() + 2 * 3 * 2


def test_write_copies_into_the_item_row_range_in_any_order() -> None:
    buffer = RequestBuffer((0, 2, 5), 2, torch.float32)
    second = torch.arange(6, dtype=torch.float32).reshape(3, 2)
    first = -torch.ones(2, 2)
    assert buffer.write(1, second) is False
    assert buffer.num_written == 1
    assert not buffer.complete
    assert buffer.write(0, first) is True
    assert buffer.complete
    assert torch.equal(buffer.tensor, torch.cat([first, second]))
    # A copy, not a reference: changing the encoder's output afterwards does not reach the buffer.
    second.fill_(100)
    assert buffer.tensor[2:].max().item() == 5


def test_write_validates_shape_dtype_index_and_repeats() -> None:
    buffer = RequestBuffer((0, 2, 5), 2, torch.float32)
    with pytest.raises(ValueError, match=r"shape \(3, 2\) != declared \(2, 2\)"):
        buffer.write(0, torch.zeros(3, 2))
    with pytest.raises(ValueError, match="declared"):
        buffer.write(0, torch.zeros(2, 3))
    with pytest.raises(ValueError, match="declared"):
        buffer.write(0, torch.zeros(4))
    with pytest.raises(TypeError, match="dtype"):
        buffer.write(0, torch.zeros(2, 2, dtype=torch.float16))
    with pytest.raises(TypeError, match=r"torch\.Tensor"):
        buffer.write(0, [[0.0, 0.0], [0.0, 0.0]])  # type: ignore[arg-type]
    with pytest.raises(IndexError):
        buffer.write(2, torch.zeros(1, 2))
    assert buffer.num_written == 0
    buffer.write(0, torch.zeros(2, 2))
    with pytest.raises(ValueError, match="already recorded"):
        buffer.write(0, torch.zeros(2, 2))
