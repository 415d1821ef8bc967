"""Contiguous per-request encoder output buffers."""

from __future__ import annotations

import torch


class RequestBuffer:
    """One request's ``[total_rows, width]`` output buffer, filled item by item.

    The buffer is sized from the declared item lengths and is the request's final storage: `write` copies each
    item's output into its own row range, and the tensor is handed out by reference, so nothing downstream has
    to concatenate per-item pieces (and briefly hold two copies).
    """

    __slots__ = ("_offsets", "_remaining", "_tensor", "_written")

    def __init__(
        self,
        offsets: tuple[int, ...],
        width: int,
        dtype: torch.dtype,
        device: torch.device | str | None = None,
    ) -> None:
        self._offsets = offsets
        self._tensor = torch.empty((offsets[-1], width), dtype=dtype, device=device)
        self._written = bytearray(len(offsets) - 1)
        self._remaining = len(offsets) - 1

    @property
    def tensor(self) -> torch.Tensor:
        return self._tensor

    @property
    def offsets(self) -> tuple[int, ...]:
        """Row offsets: item ``i`` owns rows ``offsets[i]:offsets[i + 1]``."""
        return self._offsets

    @property
    def nbytes(self) -> int:
        return self._tensor.numel() * self._tensor.element_size()

    @property
    def complete(self) -> bool:
        return self._remaining == 0

    @property
    def num_written(self) -> int:
        return len(self._written) - self._remaining

    def is_written(self, index: int) -> bool:
        return bool(self._written[index])

    def rows(self, index: int) -> torch.Tensor:
        """A view of item `index`'s row range."""
        return self._tensor[self._offsets[index] : self._offsets[index + 1]]

    def write(self, index: int, output: torch.Tensor) -> bool:
        """Validate `output` against item `index`'s declared shape and dtype and copy it into the item's rows.

        Returns True when this write completed the buffer. Each item is written exactly once.
        """
        if not 0 <= index < len(self._written):
            raise IndexError(f"item index {index} out of range for a request of {len(self._written)} items")
        if self._written[index]:
            raise ValueError(f"item {index} was already recorded")
        start = self._offsets[index]
        stop = self._offsets[index + 1]
        tensor = self._tensor
        if not isinstance(output, torch.Tensor):
            raise TypeError(f"item {index}: encoder output must be a torch.Tensor, got {type(output).__name__}")
        if output.dtype != tensor.dtype:
            raise TypeError(f"item {index}: encoder output dtype {output.dtype} != request dtype {tensor.dtype}")
        if output.dim() != 2 or output.shape[0] != stop - start or output.shape[1] != tensor.shape[1]:
            raise ValueError(
                f"item {index}: encoder output shape {tuple(output.shape)} != declared "
                f"({stop - start}, {tensor.shape[1]})"
            )
        tensor[start:stop].copy_(output)
        self._written[index] = 1
        self._remaining -= 1
        return self._remaining == 0
