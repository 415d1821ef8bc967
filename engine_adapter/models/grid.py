"""Per-item grid arithmetic shared by the towers: row counts, attention segments, rotary positions, windows.

Everything is computed on the host from `grid_thw` (one (t, h, w) patch grid per item) as Python ints or small
index tensors, so a forward pass reads the grid once and never synchronizes with the device again.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = [
    "Grid",
    "encoder_tokens",
    "frame_seqlens",
    "grids_from_tensor",
    "output_rows",
    "position_taps",
    "rotary_positions",
    "window_order",
]

Grid = tuple[int, int, int]


def grids_from_tensor(grid_thw: torch.Tensor, merge_size: int) -> list[Grid]:
    """Read and validate an [n_items, 3] integer grid tensor."""
    if grid_thw.ndim != 2 or grid_thw.shape[1] != 3:
        raise ValueError(f"grid_thw must have shape [n_items, 3], got {tuple(grid_thw.shape)}")
    if grid_thw.dtype.is_floating_point or grid_thw.dtype.is_complex:
        raise TypeError(f"grid_thw must be an integer tensor, got {grid_thw.dtype}")
    grids: list[Grid] = []
    for t, h, w in grid_thw.tolist():
        if t <= 0 or h <= 0 or w <= 0 or h % merge_size or w % merge_size:
            raise ValueError(
                f"grid (t={t}, h={h}, w={w}) is invalid: all must be positive, "
                f"h and w multiples of merge_size={merge_size}"
            )
        grids.append((int(t), int(h), int(w)))
    return grids


def encoder_tokens(grids: list[Grid]) -> list[int]:
    """Input rows (encoder tokens) per item: t * h * w."""
    return [t * h * w for t, h, w in grids]


def output_rows(grids: list[Grid], merge_size: int) -> list[int]:
    """Output embedding rows per item: t * h * w / merge_size**2."""
    unit = merge_size * merge_size
    return [t * h * w // unit for t, h, w in grids]


def frame_seqlens(grids: list[Grid]) -> list[int]:
    """Full-attention segments: every frame (temporal patch) of every item attends only to itself."""
    return [h * w for t, h, w in grids for _ in range(t)]


def rotary_positions(grids: list[Grid], merge_size: int) -> torch.Tensor:
    """(row, column) patch coordinates [N, 2] in input-row order (merge_size x merge_size groups)."""
    parts: list[torch.Tensor] = []
    for t, h, w in grids:
        rows = torch.arange(h).view(h // merge_size, merge_size, 1, 1).expand(-1, -1, w // merge_size, merge_size)
        cols = torch.arange(w).view(1, 1, w // merge_size, merge_size).expand(h // merge_size, merge_size, -1, -1)
        # Row order is (block_h, block_w, merge_h, merge_w): swap the middle axes.
        pos = torch.stack([rows.transpose(1, 2).reshape(-1), cols.transpose(1, 2).reshape(-1)], dim=-1)
        parts.append(pos.repeat(t, 1))
    return torch.cat(parts, dim=0)


def window_order(grids: list[Grid], merge_size: int, window_tokens: int) -> tuple[torch.Tensor, list[int]]:
    """Qwen2.5-VL window layout.

    Returns the permutation of merged tokens that makes every window contiguous (frames stay in order, windows
    run row-major inside a frame) and the window lengths in patches. Windows are window_tokens x window_tokens
    merged tokens; those on the bottom and right edges are smaller when the grid is not a multiple.
    """
    order: list[torch.Tensor] = []
    seqlens: list[int] = []
    offset = 0
    unit = merge_size * merge_size
    for t, h, w in grids:
        gh, gw = h // merge_size, w // merge_size
        index = torch.arange(t * gh * gw).view(t, gh, gw)
        pad_h, pad_w = -gh % window_tokens, -gw % window_tokens
        padded = F.pad(index, (0, pad_w, 0, pad_h), value=-1)
        nh, nw = (gh + pad_h) // window_tokens, (gw + pad_w) // window_tokens
        windows = padded.view(t, nh, window_tokens, nw, window_tokens).permute(0, 1, 3, 2, 4)
        windows = windows.reshape(t * nh * nw, window_tokens * window_tokens)
        valid = windows >= 0
        order.append(windows[valid] + offset)
        seqlens.extend((valid.sum(dim=1) * unit).tolist())
        offset += t * gh * gw
    return torch.cat(order), seqlens


def position_taps(grids: list[Grid], merge_size: int, side: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen3-VL learned positions: per input row, the 4 entries of the side x side table and their weights that
    bilinearly resample the table to the item's h x w grid (corners aligned), as indices [N, 4] (int64) and
    weights [N, 4] (float32), in input-row order (every frame of a video gets the same positions).

    The arithmetic is transformers' (`get_vision_interpolation_indices_and_weights`, bilinear, align_corners):
    source coordinate `index * (side - 1) / max(size - 1, 1)` in float32, taps floor and floor + 1 clamped to
    the table, weights `max(0, 1 - distance)`.
    """
    positions = rotary_positions(grids, merge_size)  # [N, 2] (row, column)
    sizes = torch.cat([torch.tensor([[h, w]]).expand(t * h * w, 2) for t, h, w in grids])
    src = positions.to(torch.float32) * (side - 1) / torch.clamp(sizes - 1, min=1)
    floor = torch.floor(src)
    offsets = torch.arange(2)
    taps = (floor.long()[..., None] + offsets).clamp(0, side - 1)  # [N, 2 axes, 2 taps]
    weights = (1 - (src[..., None] - floor[..., None] - offsets).abs()).clamp(min=0)
    indices = (taps[:, 0, :, None] * side + taps[:, 1, None, :]).reshape(-1, 4)
    return indices, (weights[:, 0, :, None] * weights[:, 1, None, :]).reshape(-1, 4)
