"""Qwen2-VL-family vision towers (our own torch code), their presets and weight loading."""

from engine_adapter.models.config import ARCHITECTURES, Architecture, VisionTowerConfig
from engine_adapter.models.loading import (
    CheckpointError,
    LoadedTower,
    build_vision_tower,
    create_tower,
    init_random_weights,
    load_checkpoint,
    load_state_dict,
)
from engine_adapter.models.presets import PRESETS, config_from_checkpoint, get_preset, vision_config_from_hf
from engine_adapter.models.qwen2_5_vl import Qwen25VisionTower
from engine_adapter.models.qwen2_vl import Qwen2VisionTower
from engine_adapter.models.tower import VisionTower

__all__ = [
    "ARCHITECTURES",
    "PRESETS",
    "Architecture",
    "CheckpointError",
    "LoadedTower",
    "Qwen2VisionTower",
    "Qwen25VisionTower",
    "VisionTower",
    "VisionTowerConfig",
    "build_vision_tower",
    "config_from_checkpoint",
    "create_tower",
    "get_preset",
    "init_random_weights",
    "load_checkpoint",
    "load_state_dict",
    "vision_config_from_hf",
]
