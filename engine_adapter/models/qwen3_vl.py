"""Qwen3-VL vision tower: LayerNorm blocks with a tanh-GELU MLP, learned positions plus 2-D rotary, full
attention per frame, and DeepStack.

The patch embedding (with a bias) is added to a learned side x side position table resampled bilinearly to each
item's grid. The blocks listed in `deepstack_visual_indexes` hand their output to their own patch merger, whose
LayerNorm runs after the merge_size x merge_size rows are folded into one (`use_postshuffle_norm`). The output
row is the main merger's features followed by each DeepStack merger's in block order, `out_hidden_size` each:
the layout vLLM's Qwen3-VL takes as `image_embeds` and splits into its visual and DeepStack parts.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine_adapter.models.config import VisionTowerConfig
from engine_adapter.models.grid import frame_seqlens, position_taps, rotary_positions
from engine_adapter.models.rotary import rotary_cos_sin
from engine_adapter.models.tower import VisionTower

__all__ = ["Qwen3PatchMerger", "Qwen3VisionTower"]

NORM_EPS = 1e-6


class TanhGELUMLP(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.linear_fc1 = nn.Linear(dim, hidden)
        self.linear_fc2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.linear_fc2(F.gelu(self.linear_fc1(x), approximate="tanh"))
        return out


class Qwen3PatchMerger(nn.Module):
    """Folds merge_size x merge_size adjacent rows into one of out_hidden_size; its LayerNorm runs on each row
    before the fold, or with `postshuffle_norm` (the DeepStack mergers) on the folded row."""

    def __init__(self, config: VisionTowerConfig, *, postshuffle_norm: bool = False) -> None:
        super().__init__()
        self.merged_size = config.hidden_size * config.merge_unit
        self.postshuffle_norm = postshuffle_norm
        self.norm = nn.LayerNorm(self.merged_size if postshuffle_norm else config.hidden_size, eps=NORM_EPS)
        self.linear_fc1 = nn.Linear(self.merged_size, self.merged_size)
        self.linear_fc2 = nn.Linear(self.merged_size, config.out_hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.postshuffle_norm:
            x = self.norm(x.view(-1, self.merged_size))
        else:
            x = self.norm(x).view(-1, self.merged_size)
        out: torch.Tensor = self.linear_fc2(F.gelu(self.linear_fc1(x)))
        return out


def _layer_norm(dim: int, eps: float) -> nn.Module:
    return nn.LayerNorm(dim, eps=eps)


class Qwen3VisionTower(VisionTower):
    arch = "qwen3_vl"

    def __init__(self, config: VisionTowerConfig) -> None:
        super().__init__(config, norm=_layer_norm, mlp=TanhGELUMLP, merger=Qwen3PatchMerger, patch_bias=True)
        self.pos_embed = nn.Embedding(config.num_position_embeddings, config.hidden_size)
        self.deepstack_merger_list = nn.ModuleList(
            Qwen3PatchMerger(config, postshuffle_norm=True) for _ in config.deepstack_visual_indexes
        )
        self._deepstack_slot = {block: k for k, block in enumerate(config.deepstack_visual_indexes)}

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        grids = self._read_inputs(pixel_values, grid_thw)
        config = self.config
        x: torch.Tensor = self.patch_embed(pixel_values)
        indices, weights = position_taps(grids, config.merge_size, config.position_side)
        # The weighted sum of each row's 4 table entries, without materializing the [N, 4, hidden] gather.
        positions = F.embedding_bag(
            indices.to(x.device),
            self.pos_embed.weight,
            mode="sum",
            per_sample_weights=weights.to(device=x.device, dtype=self.pos_embed.weight.dtype),
            offsets=None,
        )
        x = x + positions.to(x.dtype)
        cos, sin = rotary_cos_sin(
            rotary_positions(grids, config.merge_size), config.head_dim, config.rope_theta, x.device
        )
        seqlens = frame_seqlens(grids)
        width = config.out_hidden_size
        out = x.new_empty(x.shape[0] // config.merge_unit, config.output_width)
        for index, block in enumerate(self.blocks):
            x = block(x, cos, sin, seqlens)
            slot = self._deepstack_slot.get(index)
            if slot is not None:
                out[:, (1 + slot) * width : (2 + slot) * width] = self.deepstack_merger_list[slot](x)
        out[:, :width] = self.merger(x)
        return out
