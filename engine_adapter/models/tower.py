"""What every vision tower offers the engine: forward over packed items plus per-item row and token counts."""

from __future__ import annotations

import torch
from torch import nn

from engine_adapter.models.config import VisionTowerConfig
from engine_adapter.models.grid import Grid, encoder_tokens, grids_from_tensor, output_rows

__all__ = ["VisionTower"]


class VisionTower(nn.Module):
    """Base class of the towers.

    `forward(pixel_values [N, row_width], grid_thw [n_items, 3]) -> [sum_i t*h*w / merge**2, out_hidden]`:
    items are packed back to back in `pixel_values` in `grid_thw` order, and so are their output rows.
    """

    def __init__(self, config: VisionTowerConfig) -> None:
        super().__init__()
        self.config = config

    def output_rows(self, grid_thw: torch.Tensor) -> list[int]:
        """Embedding rows each item produces (t * h * w / merge_size**2)."""
        return output_rows(grids_from_tensor(grid_thw, self.config.merge_size), self.config.merge_size)

    def encoder_tokens(self, grid_thw: torch.Tensor) -> list[int]:
        """Encoder tokens (input rows, t * h * w) per item: what the scheduler's token budget counts."""
        return encoder_tokens(grids_from_tensor(grid_thw, self.config.merge_size))

    @property
    def dtype(self) -> torch.dtype:
        return next(self.parameters()).dtype

    @property
    def device(self) -> torch.device:
        return next(self.parameters()).device

    def _read_inputs(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> list[Grid]:
        grids = grids_from_tensor(grid_thw, self.config.merge_size)
        rows = sum(encoder_tokens(grids))
        expected = (rows, self.config.row_width)
        if tuple(pixel_values.shape) != expected:
            raise ValueError(
                f"pixel_values has shape {tuple(pixel_values.shape)}, "
                f"but grid_thw {[list(g) for g in grids]} needs {expected}"
            )
        return grids
