"""Qwen2-VL vision tower: LayerNorm blocks with a QuickGELU MLP, 2-D rotary, full attention per frame."""

from __future__ import annotations

import torch
from torch import nn

from engine_adapter.models.config import VisionTowerConfig
from engine_adapter.models.grid import frame_seqlens, rotary_positions
from engine_adapter.models.layers import PatchEmbed, PatchMerger, VisionAttention, VisionBlock, quick_gelu
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


class Qwen2VisionTower(VisionTower):
    def __init__(self, config: VisionTowerConfig) -> None:
        if config.arch != "qwen2_vl":
            raise ValueError(f"Qwen2VisionTower needs a qwen2_vl config, got {config.arch!r}")
        super().__init__(config)
        dim, eps = config.hidden_size, config.norm_eps
        self.patch_embed = PatchEmbed(config.row_width, dim)
        self.blocks = nn.ModuleList(
            VisionBlock(
                norm1=nn.LayerNorm(dim, eps=eps),
                attn=VisionAttention(dim, config.num_heads),
                norm2=nn.LayerNorm(dim, eps=eps),
                mlp=QuickGELUMLP(dim, config.intermediate_size),
            )
            for _ in range(config.depth)
        )
        self.merger = PatchMerger(nn.LayerNorm(dim, eps=eps), dim, config.merge_unit, config.out_hidden_size)

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
