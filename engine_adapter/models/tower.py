"""What every vision tower offers the engine: forward over packed items plus per-item row and token counts."""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar

import torch
from torch import nn

from engine_adapter.models.config import Architecture, VisionTowerConfig
from engine_adapter.models.grid import Grid, encoder_tokens, grids_from_tensor, output_rows
from engine_adapter.models.layers import PatchEmbed, PatchMerger, VisionAttention, VisionBlock

__all__ = ["VisionTower"]


class VisionTower(nn.Module):
    """Base class of the towers.

    `forward(pixel_values [N, row_width], grid_thw [n_items, 3]) -> [sum_i t*h*w / merge**2, output_width]`:
    items are packed back to back in `pixel_values` in `grid_thw` order, and so are their output rows.

    Every tower has the same layers: the patch embedding, `depth` pre-norm blocks and the patch merger. An
    architecture differs in its norm (`norm(dim, eps)`) and its MLP (`mlp(dim, hidden)`), its merger
    (`merger(config)`, default `PatchMerger`) and patch embedding bias, any layers it adds, and in `forward`.
    """

    arch: ClassVar[Architecture]

    def __init__(
        self,
        config: VisionTowerConfig,
        *,
        norm: Callable[[int, float], nn.Module],
        mlp: Callable[[int, int], nn.Module],
        merger: Callable[[VisionTowerConfig], nn.Module] | None = None,
        patch_bias: bool = False,
    ) -> None:
        if config.arch != self.arch:
            raise ValueError(f"{type(self).__name__} needs a {self.arch} config, got {config.arch!r}")
        super().__init__()
        self.config = config
        dim, eps = config.hidden_size, config.norm_eps
        self.patch_embed = PatchEmbed(config.row_width, dim, bias=patch_bias)
        self.blocks = nn.ModuleList(
            VisionBlock(
                norm1=norm(dim, eps),
                attn=VisionAttention(dim, config.num_heads),
                norm2=norm(dim, eps),
                mlp=mlp(dim, config.intermediate_size),
            )
            for _ in range(config.depth)
        )
        self.merger = (
            PatchMerger(norm(dim, eps), dim, config.merge_unit, config.out_hidden_size)
            if merger is None
            else merger(config)
        )

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
