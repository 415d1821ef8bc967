"""Qwen2-VL vision tower: LayerNorm blocks with a QuickGELU MLP, 2-D rotary, full attention per frame."""

from __future__ import annotations

import torch
from torch import nn

from engine_adapter.models.config import VisionTowerConfig
from engine_adapter.models.grid import frame_seqlens, rotary_positions
from engine_adapter.models.layers import quick_gelu
from engine_adapter.models.rotary import rotary_cos_sin
from engine_adapter.models.tower import VisionTower

__all__ = ["Qwen2VisionTower"]


class QuickGELUMLP(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.fc2(quick_gelu(self.fc1(x)))
        return out


def _layer_norm(dim: int, eps: float) -> nn.Module:
    return nn.LayerNorm(dim, eps=eps)


class Qwen2VisionTower(VisionTower):
    arch = "qwen2_vl"

    def __init__(self, config: VisionTowerConfig) -> None:
        super().__init__(config, norm=_layer_norm, mlp=QuickGELUMLP)

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        grids = self._read_inputs(pixel_values, grid_thw)
        config = self.config
        x = self.patch_embed(pixel_values)
        cos, sin = rotary_cos_sin(
            rotary_positions(grids, config.merge_size), config.head_dim, config.rope_theta, x.device
        )
        seqlens = frame_seqlens(grids)
        for block in self.blocks:
            x = block(x, cos, sin, seqlens)
        out: torch.Tensor = self.merger(x)
        return out
