"""Helpers of the parity tests against transformers' vision towers."""

from __future__ import annotations

import torch


def randomize(model: torch.nn.Module, seed: int) -> None:
    """Non-trivial values everywhere, norms and biases included, so every copied tensor matters."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            is_norm = "norm" in name or "ln_q" in name
            param.copy_((1.0 + 0.1 * noise) if is_norm and name.endswith("weight") else 0.05 * noise)


def patch_rows(grids: list[tuple[int, int, int]], row_width: int, seed: int = 0) -> torch.Tensor:
    """Random `pixel_values` rows for items of these grids."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(sum(t * h * w for t, h, w in grids), row_width, generator=generator)


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape
    return (a - b).abs().max().item()
