"""Qwen2.5-VL vision tower: RMSNorm blocks with a SwiGLU MLP, 2-D rotary, window attention.

Most blocks attend inside windows of window_tokens x window_tokens merged tokens; the blocks listed in
`fullatt_block_indexes` attend over the whole frame. The rows are permuted once so that every window is
contiguous, stay in that order through all blocks (frames stay contiguous too, so full attention still sees
whole frames) and the merged output is put back in the original order at the end.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine_adapter.models.config import VisionTowerConfig
from engine_adapter.models.grid import frame_seqlens, rotary_positions, window_order
from engine_adapter.models.layers import RMSNorm
from engine_adapter.models.rotary import rotary_cos_sin
from engine_adapter.models.tower import VisionTower

__all__ = ["Qwen25VisionTower"]


class SwiGLUMLP(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden)
        self.up_proj = nn.Linear(dim, hidden)
        self.down_proj = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        return out


class Qwen25VisionTower(VisionTower):
    arch = "qwen2_5_vl"

    def __init__(self, config: VisionTowerConfig) -> None:
        super().__init__(config, norm=RMSNorm, mlp=SwiGLUMLP)
        self._full_attention = frozenset(config.fullatt_block_indexes)

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        grids = self._read_inputs(pixel_values, grid_thw)
        config = self.config
        unit = config.merge_unit
        order, window_seqlens = window_order(grids, config.merge_size, config.window_tokens)

        positions = rotary_positions(grids, config.merge_size)
        n = positions.shape[0]
        positions = positions.view(n // unit, unit, 2)[order].view(n, 2)

        x = self.patch_embed(pixel_values)
        order = order.to(x.device)
        x = x.view(n // unit, unit, -1)[order].view(n, -1)
        cos, sin = rotary_cos_sin(positions, config.head_dim, config.rope_theta, x.device)

        seqlens = frame_seqlens(grids)
        for index, block in enumerate(self.blocks):
            x = block(x, cos, sin, seqlens if index in self._full_attention else window_seqlens)

        merged: torch.Tensor = self.merger(x)
        out = torch.empty_like(merged)
        out[order] = merged  # undo the window permutation
        return out
