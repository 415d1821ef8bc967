"""Named tower configurations, and reading one from a Hugging Face checkpoint's config.json.

The real presets carry the `vision_config` of the published checkpoints (Qwen/Qwen2-VL-2B-Instruct and
-7B-Instruct, Qwen/Qwen2.5-VL-3B-Instruct and -7B-Instruct, Qwen/Qwen3-VL-2B-Instruct, -4B-Instruct and
-8B-Instruct). `tiny`, `tiny-2.5` and `tiny-3` are small towers of the three architectures for CPU tests and the
embedded demo; `small` (Qwen2-VL, 4 blocks of 256, 1536 wide out) sits between them and 2B for CPU benchmarks.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

from engine_adapter.models.config import VisionTowerConfig

__all__ = ["DEFAULT_PRESET", "PRESETS", "config_from_checkpoint", "find_preset", "get_preset", "vision_config_from_hf"]

_QWEN2_VL_7B = VisionTowerConfig(
    name="qwen2-vl-7b",
    arch="qwen2_vl",
    depth=32,
    hidden_size=1280,
    num_heads=16,
    intermediate_size=1280 * 4,
    out_hidden_size=3584,
)
_QWEN2_5_VL_7B = VisionTowerConfig(
    name="qwen2.5-vl-7b",
    arch="qwen2_5_vl",
    depth=32,
    hidden_size=1280,
    num_heads=16,
    intermediate_size=3420,
    out_hidden_size=3584,
    window_size=112,
    fullatt_block_indexes=(7, 15, 23, 31),
    geometry_name="qwen2_5_vl",
)

# Qwen/Qwen3-VL-8B-Instruct's config.json `vision_config`: depth 27, hidden_size 1152, intermediate_size 4304,
# num_heads 16, out_hidden_size 4096, num_position_embeddings 2304, deepstack_visual_indexes [8, 16, 24], patch 16,
# temporal patch 2, spatial merge 2, hidden_act gelu_pytorch_tanh, no rope_parameters (transformers' default
# rope_theta 10000). The tower is transformers' Qwen3VLVisionConfig defaults but for out_hidden_size (3584 there).
_QWEN3_VL_8B = VisionTowerConfig(
    name="qwen3-vl-8b",
    arch="qwen3_vl",
    depth=27,
    hidden_size=1152,
    num_heads=16,
    intermediate_size=4304,
    out_hidden_size=4096,
    patch_size=16,
    num_position_embeddings=2304,
    deepstack_visual_indexes=(8, 16, 24),
    geometry_name="qwen3_vl",
)
# Qwen/Qwen3-VL-2B-Instruct's and -4B-Instruct's: depth 24, hidden_size 1024, intermediate_size 4096, num_heads 16,
# deepstack_visual_indexes [5, 11, 17], the rest as 8B's; out_hidden_size 2048 (2B) and 2560 (4B), their LLM's
# hidden size.
_QWEN3_VL_SMALL = replace(
    _QWEN3_VL_8B, depth=24, hidden_size=1024, intermediate_size=4096, deepstack_visual_indexes=(5, 11, 17)
)

# The 2B and 3B checkpoints' towers are those of their 7B siblings with a narrower output (their LLM's width).
PRESETS: dict[str, VisionTowerConfig] = {
    config.name: config
    for config in (
        replace(_QWEN2_VL_7B, name="qwen2-vl-2b", out_hidden_size=1536),
        _QWEN2_VL_7B,
        replace(_QWEN2_5_VL_7B, name="qwen2.5-vl-3b", out_hidden_size=2048),
        _QWEN2_5_VL_7B,
        replace(_QWEN3_VL_SMALL, name="qwen3-vl-2b", out_hidden_size=2048),
        replace(_QWEN3_VL_SMALL, name="qwen3-vl-4b", out_hidden_size=2560),
        _QWEN3_VL_8B,
        VisionTowerConfig(
            name="tiny",
            arch="qwen2_vl",
            depth=2,
            hidden_size=64,
            num_heads=4,
            intermediate_size=256,
            out_hidden_size=128,
        ),
        VisionTowerConfig(
            name="small",
            arch="qwen2_vl",
            depth=4,
            hidden_size=256,
            num_heads=4,
            intermediate_size=1024,
            out_hidden_size=1536,
        ),
        VisionTowerConfig(
            name="tiny-2.5",
            arch="qwen2_5_vl",
            depth=2,
            hidden_size=64,
            num_heads=4,
            intermediate_size=160,
            out_hidden_size=128,
            window_size=112,
            fullatt_block_indexes=(1,),
            geometry_name="qwen2_5_vl",
        ),
        VisionTowerConfig(
            name="tiny-3",
            arch="qwen3_vl",
            depth=4,
            hidden_size=64,
            num_heads=4,
            intermediate_size=160,
            out_hidden_size=128,
            patch_size=16,
            num_position_embeddings=64,
            deepstack_visual_indexes=(1, 2),
            geometry_name="qwen3_vl",
        ),
    )
}


DEFAULT_PRESET = "tiny"
"""The tower of an engine given neither a preset nor a checkpoint."""


def get_preset(name: str) -> VisionTowerConfig:
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown vision tower preset {name!r}; known: {', '.join(PRESETS)}") from None


def find_preset(config: VisionTowerConfig) -> VisionTowerConfig | None:
    """The preset of the same tower as `config` (every field equal but the name), if there is one."""
    for preset in PRESETS.values():
        if replace(config, name=preset.name) == preset:
            return preset
    return None


_ACTIVATIONS = {"qwen2_vl": "quick_gelu", "qwen2_5_vl": "silu", "qwen3_vl": "gelu_pytorch_tanh"}


def vision_config_from_hf(config: Mapping[str, Any], name: str = "checkpoint") -> VisionTowerConfig:
    """Build a tower config from a Hugging Face `config.json` (the whole file, with `model_type`).

    Missing keys take transformers' defaults for that model type. ValueError for anything else: another model
    type, a value of the wrong type, or dimensions no tower can have.
    """
    model_type = config.get("model_type") if isinstance(config, Mapping) else None
    vision = config.get("vision_config") if isinstance(config, Mapping) else None
    if not isinstance(model_type, str) or model_type not in _ACTIVATIONS or not isinstance(vision, Mapping):
        raise ValueError(
            f"config.json of {name!r} is not a Qwen2-VL, Qwen2.5-VL or Qwen3-VL model "
            f"(model_type={model_type!r}; supported: {', '.join(_ACTIVATIONS)})"
        )
    expected_act = _ACTIVATIONS[model_type]
    act = vision.get("hidden_act", expected_act)
    if act != expected_act:
        raise ValueError(
            f"config.json of {name!r}: vision hidden_act {act!r} is not supported (expected {expected_act!r})"
        )
    try:
        fields = _tower_fields(model_type, vision)
    except (TypeError, ValueError, AttributeError) as exc:
        raise ValueError(f"config.json of {name!r}: unusable vision_config ({exc})") from None
    return VisionTowerConfig(name=name, **fields)  # its own checks name the tower


def _tower_fields(model_type: str, vision: Mapping[str, Any]) -> dict[str, Any]:
    rope = vision.get("rope_parameters") or {}
    qwen3 = model_type == "qwen3_vl"
    common: dict[str, Any] = {
        "depth": int(vision.get("depth", 27 if qwen3 else 32)),
        "num_heads": int(vision.get("num_heads", 16)),
        "patch_size": int(vision.get("patch_size", vision.get("spatial_patch_size", 16 if qwen3 else 14))),
        "temporal_patch_size": int(vision.get("temporal_patch_size", 2)),
        "merge_size": int(vision.get("spatial_merge_size", 2)),
        "in_channels": int(vision.get("in_channels", vision.get("in_chans", 3))),
        "rope_theta": float(rope.get("rope_theta", 10000.0)),
    }
    if model_type == "qwen2_vl":
        embed_dim = int(vision.get("embed_dim", 1280))
        return common | {
            "arch": "qwen2_vl",
            "hidden_size": embed_dim,
            "intermediate_size": int(embed_dim * vision.get("mlp_ratio", 4)),
            "out_hidden_size": int(vision.get("hidden_size", 3584)),
            "geometry_name": "qwen2_vl",
        }
    if qwen3:  # transformers' Qwen3VLVisionConfig defaults
        return common | {
            "arch": "qwen3_vl",
            "hidden_size": int(vision.get("hidden_size", 1152)),
            "intermediate_size": int(vision.get("intermediate_size", 4304)),
            "out_hidden_size": int(vision.get("out_hidden_size", 3584)),
            "num_position_embeddings": int(vision.get("num_position_embeddings", 2304)),
            "deepstack_visual_indexes": tuple(int(i) for i in vision.get("deepstack_visual_indexes", (8, 16, 24))),
            "geometry_name": "qwen3_vl",
        }
    return common | {
        "arch": "qwen2_5_vl",
        "hidden_size": int(vision.get("hidden_size", 3584)),
        "intermediate_size": int(vision.get("intermediate_size", 3420)),
        "out_hidden_size": int(vision.get("out_hidden_size", 3584)),
        "window_size": int(vision.get("window_size", 112)),
        "fullatt_block_indexes": tuple(int(i) for i in vision.get("fullatt_block_indexes", (7, 15, 23, 31))),
        "geometry_name": "qwen2_5_vl",
    }


def config_from_checkpoint(directory: str | Path) -> VisionTowerConfig:
    """The tower config described by a checkpoint directory's config.json."""
    path = Path(directory) / "config.json"
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ValueError(f"checkpoint {str(directory)!r} has no config.json") from None
    except OSError as exc:
        raise ValueError(f"{path}: cannot be read ({exc.strerror or exc})") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path}: invalid JSON ({exc})") from None
    return vision_config_from_hf(data, name=str(directory))
