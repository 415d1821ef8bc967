"""Qwen2-VL-family vision towers (our own torch code), their presets and weight loading."""

from engine_adapter.models.config import ARCHITECTURES, Architecture, VisionTowerConfig
from engine_adapter.models.loading import (
    CheckpointError,
    ConfigMismatchError,
    LoadedTower,
    NoTowerConfigError,
    build_vision_tower,
    checkpoint_config,
    create_tower,
    init_random_weights,
    load_checkpoint,
    load_state_dict,
    tower_config,
)
from engine_adapter.models.presets import (
    DEFAULT_PRESET,
    PRESETS,
    config_from_checkpoint,
    find_preset,
    get_preset,
    vision_config_from_hf,
)
from engine_adapter.models.qwen2_5_vl import Qwen25VisionTower
from engine_adapter.models.qwen2_vl import Qwen2VisionTower
from engine_adapter.models.qwen3_vl import Qwen3VisionTower
from engine_adapter.models.tower import VisionTower

__all__ = [
    "ARCHITECTURES",
    "DEFAULT_PRESET",
    "PRESETS",
    "Architecture",
    "CheckpointError",
    "ConfigMismatchError",
    "LoadedTower",
    "NoTowerConfigError",
    "Qwen2VisionTower",
    "Qwen3VisionTower",
    "Qwen25VisionTower",
    "VisionTower",
    "VisionTowerConfig",
    "build_vision_tower",
    "checkpoint_config",
    "config_from_checkpoint",
    "create_tower",
    "find_preset",
    "get_preset",
    "init_random_weights",
    "load_checkpoint",
    "load_state_dict",
    "tower_config",
    "vision_config_from_hf",
]
