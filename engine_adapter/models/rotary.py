"""2-D rotary position embedding of the Qwen2-VL-family vision towers.

Each head's dimensions are split in two halves that rotate together (the rotate-half convention); within the
frequencies, the first quarter of the head dim encodes the patch row and the second quarter the patch column.
"""

from __future__ import annotations

import torch

__all__ = ["apply_rotary", "rotary_cos_sin"]


def rotary_cos_sin(
    positions: torch.Tensor, head_dim: int, theta: float, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [N, head_dim] (float32) for (row, column) positions [N, 2]."""
    spatial = head_dim // 2
    # Computed on the host in float32 exactly like the reference so angles agree bit for bit.
    inv_freq = 1.0 / (theta ** (torch.arange(0, spatial, 2, dtype=torch.float32) / spatial))
    angles = positions.to(device=device, dtype=torch.float32)[..., None] * inv_freq.to(device)
    angles = angles.flatten(1)  # [N, rows | cols] = head_dim / 2
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat([-second, first], dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [N, heads, head_dim] in float32 and return it in x's dtype."""
    xf = x.float()
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    return (xf * cos + _rotate_half(xf) * sin).to(x.dtype)
