"""Building blocks shared by the vision towers.

Module and parameter names follow the Hugging Face checkpoints (`patch_embed.proj`, `blocks.N.attn.qkv`,
`merger.mlp.0`, ...) so a checkpoint's visual tensors map onto these modules one to one.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from engine_adapter.models.attention import packed_attention
from engine_adapter.models.rotary import apply_rotary

__all__ = ["PatchEmbed", "PatchMerger", "RMSNorm", "VisionAttention", "VisionBlock", "quick_gelu"]


def quick_gelu(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(1.702 * x)


class RMSNorm(nn.Module):
    """Root-mean-square norm computed in float32 (Qwen2.5-VL)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class PatchEmbed(nn.Module):
    """The checkpoints' Conv3d patch embedding, computed as one matmul.

    The conv's kernel equals its stride and each input row holds exactly one kernel window in (channel, time,
    row, column) order, so the conv is a linear map of the row. Checkpoints store the 5-D conv weight; the
    loader flattens it into this Linear's [hidden, row_width] weight.
    """

    def __init__(self, row_width: int, hidden_size: int, *, bias: bool = False) -> None:
        super().__init__()
        self.proj = nn.Linear(row_width, hidden_size, bias=bias)  # Qwen3-VL's conv has a bias

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.proj(pixel_values.to(self.proj.weight.dtype))
        return out


class VisionAttention(nn.Module):
    def __init__(self, hidden_size: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.qkv = nn.Linear(hidden_size, 3 * hidden_size, bias=True)
        self.proj = nn.Linear(hidden_size, hidden_size, bias=True)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, seqlens: Sequence[int]) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv(x).view(n, 3, self.num_heads, -1).unbind(1)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        attended = packed_attention(q, k, v, seqlens)
        out: torch.Tensor = self.proj(attended.reshape(n, -1))
        return out


class VisionBlock(nn.Module):
    """Pre-norm transformer block: x + attn(norm1(x)), then x + mlp(norm2(x))."""

    def __init__(self, norm1: nn.Module, attn: VisionAttention, norm2: nn.Module, mlp: nn.Module) -> None:
        super().__init__()
        self.norm1 = norm1
        self.attn = attn
        self.norm2 = norm2
        self.mlp = mlp

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, seqlens: Sequence[int]) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, seqlens)
        out: torch.Tensor = x + self.mlp(self.norm2(x))
        return out


class PatchMerger(nn.Module):
    """Folds each merge_size x merge_size group of adjacent rows into one row of the LLM's width."""

    def __init__(self, norm: nn.Module, hidden_size: int, merge_unit: int, out_hidden_size: int) -> None:
        super().__init__()
        self.ln_q = norm
        self.merged_size = hidden_size * merge_unit
        self.mlp = nn.Sequential(
            nn.Linear(self.merged_size, self.merged_size),
            nn.GELU(),
            nn.Linear(self.merged_size, out_hidden_size),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.mlp(self.ln_q(x).view(-1, self.merged_size))
        return out
