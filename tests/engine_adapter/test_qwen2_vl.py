"""Qwen2-VL vision tower: parity with transformers' tower, batching, attention segments, presets."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image
from transformers.models.qwen2_vl.configuration_qwen2_vl import Qwen2VLVisionConfig
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VisionTransformerPretrainedModel

from engine_adapter.models import Qwen2VisionTower, VisionTowerConfig, get_preset, vision_config_from_hf
from engine_adapter.processor import process_image
from processor_geometry import QWEN2_VL, resize_for_model
from tests.engine_adapter import transformers_parity as parity

TOLERANCE = 1e-4
TINY = get_preset("tiny")


def hf_vision_config(config: VisionTowerConfig) -> Qwen2VLVisionConfig:
    return Qwen2VLVisionConfig(
        depth=config.depth,
        embed_dim=config.hidden_size,
        hidden_size=config.out_hidden_size,
        mlp_ratio=config.intermediate_size // config.hidden_size,
        num_heads=config.num_heads,
        patch_size=config.patch_size,
        temporal_patch_size=config.temporal_patch_size,
        spatial_merge_size=config.merge_size,
        in_channels=config.in_channels,
    )


@pytest.fixture(scope="module")
def towers() -> tuple[Qwen2VisionTransformerPretrainedModel, Qwen2VisionTower]:
    torch.manual_seed(0)
    return parity.build_towers(Qwen2VisionTransformerPretrainedModel, hf_vision_config(TINY), TINY, Qwen2VisionTower, 1)


GRIDS = {
    "224x224": [(1, 16, 16)],
    "non-square": [(1, 22, 36)],
    "tall-thin": [(1, 72, 2)],
    "smallest": [(1, 2, 2)],
    "video-t2": [(2, 8, 12)],
    "mixed-batch": [(1, 16, 16), (1, 22, 36), (2, 8, 12), (1, 4, 4)],
}


@pytest.mark.parametrize("case", list(GRIDS))
def test_parity_with_transformers(towers: tuple[Any, Qwen2VisionTower], case: str) -> None:
    parity.assert_on_grids(*towers, GRIDS[case], TOLERANCE)  # measured: ~1.4e-6


def test_parity_end_to_end_from_an_image(towers: tuple[Any, Qwen2VisionTower]) -> None:
    """transformers' processor + tower vs the gateway's resize + our processor + our tower."""
    reference, ours = towers
    image = Image.fromarray(np.random.default_rng(3).integers(0, 256, (200, 330, 3), dtype=np.uint8))
    geometry = QWEN2_VL.with_pixels(max_pixels=28 * 28 * 128)
    hf_inputs = Qwen2VLImageProcessorPil(min_pixels=geometry.min_pixels, max_pixels=geometry.max_pixels)(
        images=image, return_tensors="pt"
    )
    processed = process_image(resize_for_model(image, geometry), geometry)
    with torch.inference_mode():
        expected = reference(hf_inputs["pixel_values"], hf_inputs["image_grid_thw"]).pooler_output
        got = ours(processed.pixel_values, processed.grid_thw)
    assert parity.max_diff(got, expected) <= TOLERANCE


@pytest.mark.parametrize("num_frames", [2, 4])
def test_parity_on_a_video(towers: tuple[Any, Qwen2VisionTower], num_frames: int) -> None:
    """2 frames are one temporal patch (grid t=1); 4 frames are two (t=2), attended frame by frame."""
    parity.assert_on_a_video(*towers, QWEN2_VL, (num_frames, 112, 168), [num_frames // 2, 8, 12], TOLERANCE)


def test_batched_items_equal_items_encoded_alone(towers: tuple[Any, Qwen2VisionTower]) -> None:
    _, ours = towers
    parity.assert_batch_equals_items_alone(ours, [(1, 16, 16), (1, 22, 36), (2, 8, 12), (1, 4, 4), (1, 16, 16)])


def test_attention_is_per_frame_without_a_mask(
    towers: tuple[Any, Qwen2VisionTower], monkeypatch: pytest.MonkeyPatch
) -> None:
    _, ours = towers
    calls = parity.record_attention(monkeypatch)
    grids = [(1, 16, 16), (2, 8, 12)]
    with torch.inference_mode():
        ours(rows_for(grids), torch.tensor(grids))
    per_block = [(1, TINY.num_heads, n, TINY.head_dim) for n in (256, 96, 96)]
    assert calls == [(shape, True) for shape in per_block] * TINY.depth


def test_rows_and_tokens_per_item(towers: tuple[Any, Qwen2VisionTower]) -> None:
    _, ours = towers
    grid_thw = torch.tensor([[1, 16, 16], [2, 8, 12], [1, 74, 74]])
    assert ours.encoder_tokens(grid_thw) == [256, 192, 5476]
    assert ours.output_rows(grid_thw) == [64, 48, 1369]


def test_rejects_inconsistent_inputs(towers: tuple[Any, Qwen2VisionTower]) -> None:
    _, ours = towers
    with pytest.raises(ValueError, match=r"pixel_values has shape \(255, 1176\).*needs \(256, 1176\)"):
        ours(torch.zeros(255, 1176), torch.tensor([[1, 16, 16]]))
    with pytest.raises(ValueError, match=r"needs \(256, 1176\)"):
        ours(torch.zeros(256, 1000), torch.tensor([[1, 16, 16]]))
    with pytest.raises(ValueError, match="multiples of merge_size=2"):
        ours(torch.zeros(15, 1176), torch.tensor([[1, 3, 5]]))
    with pytest.raises(ValueError, match=r"\[n_items, 3\]"):
        ours(torch.zeros(256, 1176), torch.tensor([1, 16, 16]))
    with pytest.raises(TypeError, match="integer"):
        ours(torch.zeros(256, 1176), torch.tensor([[1.0, 16.0, 16.0]]))


# --- presets against the published checkpoints' config.json and transformers' tower ---------------------

# vision_config blocks of Qwen/Qwen2-VL-2B-Instruct and Qwen/Qwen2-VL-7B-Instruct config.json
HF_VISION_CONFIGS: dict[str, dict[str, Any]] = {
    "qwen2-vl-2b": {
        "depth": 32,
        "embed_dim": 1280,
        "mlp_ratio": 4,
        "num_heads": 16,
        "in_chans": 3,
        "hidden_size": 1536,
        "patch_size": 14,
        "spatial_merge_size": 2,
        "spatial_patch_size": 14,
        "temporal_patch_size": 2,
    },
    "qwen2-vl-7b": {
        "depth": 32,
        "embed_dim": 1280,
        "mlp_ratio": 4,
        "num_heads": 16,
        "in_chans": 3,
        "hidden_size": 3584,
        "patch_size": 14,
        "spatial_merge_size": 2,
        "spatial_patch_size": 14,
        "temporal_patch_size": 2,
    },
}


@pytest.mark.parametrize("name", list(HF_VISION_CONFIGS))
def test_presets_match_checkpoint_configs_and_transformers_shapes(name: str) -> None:
    preset = get_preset(name)
    vision = HF_VISION_CONFIGS[name]
    parsed = vision_config_from_hf({"model_type": "qwen2_vl", "vision_config": vision}, name=name)
    assert parsed == preset
    hf_config = Qwen2VLVisionConfig(**parity.hf_config_arguments(vision))
    reference, ours = parity.assert_same_parameters_as_transformers(
        Qwen2VisionTransformerPretrainedModel, hf_config, Qwen2VisionTower, preset
    )
    assert sum(p.numel() for p in ours.parameters()) == sum(p.numel() for p in reference.parameters())


def test_tiny_preset_is_small_and_qwen2_vl() -> None:
    assert (TINY.arch, TINY.depth, TINY.hidden_size, TINY.num_heads, TINY.out_hidden_size) == (
        "qwen2_vl",
        2,
        64,
        4,
        128,
    )
    with pytest.raises(ValueError, match="qwen2_vl towers have no window attention"):
        replace(TINY, window_size=112)
    with pytest.raises(ValueError, match="unknown vision tower preset 'huge'"):
        get_preset("huge")


def rows_for(grids: list[tuple[int, int, int]], seed: int = 0) -> torch.Tensor:
    return parity.patch_rows(grids, TINY.row_width, seed)
