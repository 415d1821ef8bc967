"""Architecture description of a Qwen2-VL-family vision tower (Qwen2-VL, Qwen2.5-VL, Qwen3-VL)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from processor_geometry import ProcessorGeometry, get_geometry

__all__ = ["ARCHITECTURES", "Architecture", "VisionTowerConfig"]

Architecture = Literal["qwen2_vl", "qwen2_5_vl", "qwen3_vl"]
ARCHITECTURES: tuple[Architecture, ...] = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")


@dataclass(frozen=True, slots=True)
class VisionTowerConfig:
    """Dimensions of one vision tower.

    Names follow Qwen2.5-VL's `vision_config`: for Qwen2-VL, `hidden_size` is its `embed_dim`,
    `intermediate_size` is `embed_dim * mlp_ratio` and `out_hidden_size` is its `hidden_size` (the LLM width).
    """

    name: str
    arch: Architecture
    depth: int
    hidden_size: int
    num_heads: int
    intermediate_size: int
    out_hidden_size: int
    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2
    in_channels: int = 3
    window_size: int = 0
    """Qwen2.5-VL attention window side in pixels (112 = 4 x 4 merged tokens); 0 for Qwen2-VL."""
    fullatt_block_indexes: tuple[int, ...] = ()
    """Qwen2.5-VL blocks that attend over the whole frame instead of one window."""
    num_position_embeddings: int = 0
    """Qwen3-VL learned position table size (a square: side x side entries, resampled to each grid); 0 before."""
    deepstack_visual_indexes: tuple[int, ...] = ()
    """Qwen3-VL blocks whose output goes through its own patch merger (DeepStack), in increasing order."""
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6
    geometry_name: str = "qwen2_vl"
    """The processor geometry (`processor_geometry`) that feeds this tower."""

    def __post_init__(self) -> None:
        if self.arch not in ARCHITECTURES:
            raise ValueError(f"tower {self.name!r}: unknown architecture {self.arch!r}; known: {ARCHITECTURES}")
        for field in (
            "depth", "hidden_size", "num_heads", "intermediate_size", "out_hidden_size",
            "patch_size", "temporal_patch_size", "merge_size", "in_channels",
        ):  # fmt: skip
            if getattr(self, field) <= 0:
                raise ValueError(f"tower {self.name!r}: {field} must be positive")
        if self.hidden_size % self.num_heads:
            raise ValueError(f"tower {self.name!r}: hidden_size must be divisible by num_heads")
        if self.head_dim % 4:
            # 2-D rotary: a quarter of the head dim carries row frequencies, a quarter column ones, twice.
            raise ValueError(f"tower {self.name!r}: head_dim ({self.head_dim}) must be divisible by 4")
        if self.arch == "qwen2_5_vl":
            unit = self.patch_size * self.merge_size
            if self.window_size <= 0 or self.window_size % unit:
                raise ValueError(
                    f"tower {self.name!r}: window_size must be a positive multiple of "
                    f"patch_size * merge_size ({unit}), got {self.window_size}"
                )
            bad = [i for i in self.fullatt_block_indexes if not 0 <= i < self.depth]
            if bad:
                raise ValueError(f"tower {self.name!r}: fullatt_block_indexes {bad} outside 0..{self.depth - 1}")
        elif self.window_size or self.fullatt_block_indexes:
            raise ValueError(f"tower {self.name!r}: {self.arch} towers have no window attention")
        if self.arch == "qwen3_vl":
            side = math.isqrt(self.num_position_embeddings)
            if self.num_position_embeddings <= 0 or side * side != self.num_position_embeddings:
                raise ValueError(
                    f"tower {self.name!r}: num_position_embeddings must be a positive square, "
                    f"got {self.num_position_embeddings}"
                )
            indexes = self.deepstack_visual_indexes
            if any(not 0 <= i < self.depth for i in indexes) or list(indexes) != sorted(set(indexes)):
                raise ValueError(
                    f"tower {self.name!r}: deepstack_visual_indexes {list(indexes)} must be distinct blocks "
                    f"0..{self.depth - 1} in increasing order"
                )
        elif self.num_position_embeddings or self.deepstack_visual_indexes:
            raise ValueError(f"tower {self.name!r}: {self.arch} towers have no learned positions or DeepStack")
        geometry = self.geometry
        if (geometry.patch_size, geometry.temporal_patch_size, geometry.merge_size, geometry.channels) != (
            self.patch_size,
            self.temporal_patch_size,
            self.merge_size,
            self.in_channels,
        ):
            raise ValueError(f"tower {self.name!r}: patch geometry disagrees with processor {geometry.name!r}")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def output_width(self) -> int:
        """Width of one embedding row the tower outputs: out_hidden_size, times 1 + the DeepStack layers for
        Qwen3-VL (the main merger's features, then each DeepStack merger's, side by side)."""
        return self.out_hidden_size * (1 + len(self.deepstack_visual_indexes))

    @property
    def position_side(self) -> int:
        """Side of the Qwen3-VL learned position grid (0 for the other architectures)."""
        return math.isqrt(self.num_position_embeddings)

    @property
    def row_width(self) -> int:
        """Width of one input row: in_channels * temporal_patch_size * patch_size**2."""
        return self.in_channels * self.temporal_patch_size * self.patch_size * self.patch_size

    @property
    def merge_unit(self) -> int:
        """Patches folded into one output row."""
        return self.merge_size * self.merge_size

    @property
    def window_tokens(self) -> int:
        """Side of an attention window in merged tokens (Qwen2.5-VL)."""
        return self.window_size // (self.patch_size * self.merge_size)

    @property
    def geometry(self) -> ProcessorGeometry:
        return get_geometry(self.geometry_name)
