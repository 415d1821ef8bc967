"""Qwen2.5-VL vision tower: parity with transformers (window attention, padding, video), batching, presets."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
import torch
from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLVisionConfig
from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel

from engine_adapter.models import Qwen25VisionTower, VisionTowerConfig, get_preset, vision_config_from_hf
from engine_adapter.models.grid import window_order
from processor_geometry import QWEN2_5_VL
from tests.engine_adapter import transformers_parity as parity

TOLERANCE = 1e-4
TINY = get_preset("tiny-2.5")


def hf_vision_config(config: VisionTowerConfig) -> Qwen2_5_VLVisionConfig:
    return Qwen2_5_VLVisionConfig(
        depth=config.depth,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        out_hidden_size=config.out_hidden_size,
        num_heads=config.num_heads,
        patch_size=config.patch_size,
        temporal_patch_size=config.temporal_patch_size,
        spatial_merge_size=config.merge_size,
        in_channels=config.in_channels,
        window_size=config.window_size,
        fullatt_block_indexes=list(config.fullatt_block_indexes),
    )


def make_towers(
    config: VisionTowerConfig,
) -> tuple[Qwen2_5_VisionTransformerPretrainedModel, Qwen25VisionTower]:
    return parity.build_towers(
        Qwen2_5_VisionTransformerPretrainedModel, hf_vision_config(config), config, Qwen25VisionTower, 2
    )


@pytest.fixture(scope="module")
def towers() -> tuple[Qwen2_5_VisionTransformerPretrainedModel, Qwen25VisionTower]:
    return make_towers(TINY)


# The tiny tower's window is 112 px = 4 x 4 merged tokens = 8 x 8 patches.
GRIDS = {
    "224x224 (merged 8x8: exact multiple of the window)": [(1, 16, 16)],
    "448x448 (merged 16x16: exact multiple)": [(1, 32, 32)],
    "non-square (merged 11x18: partial windows)": [(1, 22, 36)],
    "smaller than one window": [(1, 6, 4)],
    "tall-thin": [(1, 72, 2)],
    "video-t2 with partial windows": [(2, 10, 12)],
    "mixed-batch": [(1, 16, 16), (1, 22, 36), (2, 10, 12), (1, 6, 4)],
}


@pytest.mark.parametrize("case", list(GRIDS))
def test_parity_with_transformers(towers: tuple[Any, Qwen25VisionTower], case: str) -> None:
    parity.assert_on_grids(*towers, GRIDS[case], TOLERANCE)  # measured: ~1.4e-6


@pytest.mark.parametrize("num_frames", [2, 4])
def test_parity_on_a_video(towers: tuple[Any, Qwen25VisionTower], num_frames: int) -> None:
    parity.assert_on_a_video(*towers, QWEN2_5_VL, (num_frames, 140, 280), [num_frames // 2, 10, 20], TOLERANCE)


def test_parity_with_a_deeper_tower_and_several_full_attention_blocks() -> None:
    config = replace(TINY, name="tiny-2.5-deep", depth=5, fullatt_block_indexes=(0, 3), window_size=56)
    reference, ours = make_towers(config)
    grids = [(1, 14, 10), (2, 8, 8)]
    expected, got = parity.outputs(reference, ours, rows_for(grids, seed=5), torch.tensor(grids))
    assert parity.max_diff(got, expected) <= TOLERANCE


def test_batched_items_equal_items_encoded_alone(towers: tuple[Any, Qwen25VisionTower]) -> None:
    _, ours = towers
    grids = [(1, 16, 16), (1, 22, 36), (2, 10, 12), (1, 6, 4), (1, 16, 16)]
    assert parity.assert_batch_equals_items_alone(ours, grids) == [64, 198, 60, 6, 64]


def test_window_layout() -> None:
    # merged 9 x 7 with 4 x 4 windows: rows of windows 4, 4, 1 tall; columns 4, 3 wide.
    order, seqlens = window_order([(1, 18, 14)], merge_size=2, window_tokens=4)
    assert seqlens == [4 * n for n in (16, 12, 16, 12, 4, 3)]
    assert sorted(order.tolist()) == list(range(63))
    assert order[:16].tolist() == [r * 7 + c for r in range(4) for c in range(4)]
    # An exact multiple makes no empty windows; a second item's indices follow the first's.
    order, seqlens = window_order([(1, 16, 16), (2, 4, 4)], merge_size=2, window_tokens=4)
    assert seqlens == [64, 64, 64, 64, 16, 16]
    assert order[64:].tolist() == list(range(64, 72))


def test_window_and_full_attention_segments_without_a_mask(
    towers: tuple[Any, Qwen25VisionTower], monkeypatch: pytest.MonkeyPatch
) -> None:
    _, ours = towers
    calls = parity.record_attention(monkeypatch)
    with torch.inference_mode():
        ours(rows_for([(1, 18, 14)]), torch.tensor([[1, 18, 14]]))
    assert all(without_mask for _, without_mask in calls)
    assert all(shape[:2] == (1, TINY.num_heads) for shape, _ in calls)
    windows = [64, 48, 64, 48, 16, 12]
    assert TINY.fullatt_block_indexes == (1,)
    assert [shape[2] for shape, _ in calls] == [*windows, 252]  # block 0 by window, block 1 over the whole image


def test_rows_tokens_and_validation(towers: tuple[Any, Qwen25VisionTower]) -> None:
    _, ours = towers
    assert ours.encoder_tokens(torch.tensor([[1, 16, 16], [2, 10, 12]])) == [256, 240]
    assert ours.output_rows(torch.tensor([[1, 16, 16], [2, 10, 12]])) == [64, 60]
    with pytest.raises(ValueError, match="needs"):
        ours(torch.zeros(10, 1176), torch.tensor([[1, 16, 16]]))


# --- presets ---------------------------------------------------------------------------------------------

# vision_config blocks of Qwen/Qwen2.5-VL-3B-Instruct and Qwen/Qwen2.5-VL-7B-Instruct config.json
_COMMON = {
    "depth": 32,
    "hidden_act": "silu",
    "hidden_size": 1280,
    "intermediate_size": 3420,
    "num_heads": 16,
    "in_chans": 3,
    "patch_size": 14,
    "spatial_merge_size": 2,
    "spatial_patch_size": 14,
    "window_size": 112,
    "fullatt_block_indexes": [7, 15, 23, 31],
    "temporal_patch_size": 2,
}
HF_VISION_CONFIGS: dict[str, dict[str, Any]] = {
    "qwen2.5-vl-3b": {**_COMMON, "out_hidden_size": 2048, "tokens_per_second": 2},
    "qwen2.5-vl-7b": {**_COMMON, "out_hidden_size": 3584, "tokens_per_second": 2},
}


@pytest.mark.parametrize("name", list(HF_VISION_CONFIGS))
def test_presets_match_checkpoint_configs_and_transformers_shapes(name: str) -> None:
    preset = get_preset(name)
    vision = HF_VISION_CONFIGS[name]
    assert vision_config_from_hf({"model_type": "qwen2_5_vl", "vision_config": vision}, name=name) == preset
    hf_config = Qwen2_5_VLVisionConfig(**parity.hf_config_arguments(vision))
    assert tuple(hf_config.fullatt_block_indexes) == preset.fullatt_block_indexes
    parity.assert_same_parameters_as_transformers(
        Qwen2_5_VisionTransformerPretrainedModel, hf_config, Qwen25VisionTower, preset
    )
    assert preset.window_tokens == 4


def test_config_validation() -> None:
    with pytest.raises(ValueError, match="window_size must be a positive multiple"):
        replace(TINY, window_size=100)
    with pytest.raises(ValueError, match=r"fullatt_block_indexes \[2\] outside 0\.\.1"):
        replace(TINY, fullatt_block_indexes=(2,))
    with pytest.raises(ValueError, match="head_dim"):
        replace(TINY, hidden_size=72, num_heads=12)
    with pytest.raises(ValueError, match="hidden_act 'gelu'"):
        vision_config_from_hf({"model_type": "qwen2_5_vl", "vision_config": {"hidden_act": "gelu"}})
    with pytest.raises(ValueError, match=r"not a Qwen2-VL, Qwen2\.5-VL or Qwen3-VL model"):
        vision_config_from_hf({"model_type": "llava", "vision_config": {}})


def rows_for(grids: list[tuple[int, int, int]], seed: int = 0) -> torch.Tensor:
    return parity.patch_rows(grids, TINY.row_width, seed)
