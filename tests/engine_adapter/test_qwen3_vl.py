"""Qwen3-VL vision tower: parity with transformers' `Qwen3VLVisionModel` (main output and every DeepStack output),
learned-position resampling, presets, real-weight loading, and the widened rows through the engine: its buffer,
its admission check, the vLLM hand-off split and the reference responder.

Parity is measured against transformers in eager attention and bounded by a small factor of transformers' own
eager-vs-sdpa difference on the same inputs (fp32, CPU). `tests/bench/bench_qwen3_vl_parity.py` runs the
published widths.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import torch
from PIL import Image
from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration
from transformers.models.qwen3_vl.configuration_qwen3_vl import Qwen3VLVisionConfig
from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel
from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor
from transformers.vision_utils import get_vision_interpolation_indices_and_weights

from engine_adapter.config import EngineSettings
from engine_adapter.encoder import VisionEncoder
from engine_adapter.handoff import check_handoff
from engine_adapter.models import (
    PRESETS,
    Qwen3VisionTower,
    VisionTowerConfig,
    build_vision_tower,
    get_preset,
    vision_config_from_hf,
)
from engine_adapter.models.grid import position_taps
from engine_adapter.processor import normalize_frames, patchify, process_image, process_video
from processor_geometry import QWEN3_VL, resize_for_model
from serving.settings_loader import ConfigError
from tests.conftest import EngineFactory
from tests.engine_adapter import transformers_parity as parity
from tests.engine_adapter.conftest import REQUESTS, admitted, pixels, status, submit, submit_body, wait_idle
from tests.engine_adapter.stub_llm import Refusal, StubLLM, split_deepstack

TINY = get_preset("tiny-3")
FACTOR = 6.0
"""Ours vs eager is bounded by FACTOR x transformers' sdpa vs eager. Measured on these cases: 3-4.3x, nearly all
of it from the patch embedding (our matmul vs transformers' Conv3d differ by ~8e-7 relative on its output)."""
FLOOR = 1e-7
"""Below float32's epsilon a relative difference carries no signal: the bound is at least FACTOR x FLOOR."""


def hf_vision_config(config: VisionTowerConfig) -> Qwen3VLVisionConfig:
    return Qwen3VLVisionConfig(
        depth=config.depth,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_heads=config.num_heads,
        out_hidden_size=config.out_hidden_size,
        patch_size=config.patch_size,
        temporal_patch_size=config.temporal_patch_size,
        spatial_merge_size=config.merge_size,
        in_channels=config.in_channels,
        num_position_embeddings=config.num_position_embeddings,
        deepstack_visual_indexes=list(config.deepstack_visual_indexes),
    )


Towers = tuple[Qwen3VLVisionModel, Qwen3VLVisionModel, Qwen3VisionTower]


def make_towers(config: VisionTowerConfig, seed: int = 3) -> Towers:
    """transformers' tower in eager and in sdpa attention, and ours, all with the same random weights."""
    eager, ours = parity.build_towers(Qwen3VLVisionModel, hf_vision_config(config), config, Qwen3VisionTower, seed)
    sdpa = Qwen3VLVisionModel._from_config(hf_vision_config(config), attn_implementation="sdpa").eval()
    sdpa.load_state_dict(eager.state_dict())
    return eager, sdpa, ours


@pytest.fixture(scope="module")
def towers() -> Towers:
    return make_towers(TINY)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape
    return float((a - b).norm() / b.norm())


def split(rows: torch.Tensor, config: VisionTowerConfig) -> list[torch.Tensor]:
    """Our widened rows as [main, DeepStack 1, ...]."""
    return list(rows.split(config.out_hidden_size, dim=-1))


def parity_errors(towers: Towers, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> list[tuple[float, float]]:
    """Per output (main, then each DeepStack layer): (ours vs eager, sdpa vs eager) relative errors."""
    eager, sdpa, ours = towers
    with torch.inference_mode():
        expected, other, got = eager(pixel_values, grid_thw), sdpa(pixel_values, grid_thw), ours(pixel_values, grid_thw)
    wanted = [expected.pooler_output, *expected.deepstack_features]
    reference = [other.pooler_output, *other.deepstack_features]
    assert got.shape == (int(grid_thw.prod(-1).sum()) // ours.config.merge_unit, ours.config.output_width)
    assert all(w.abs().mean() > 0.1 for w in wanted)  # not a comparison of near-zero tensors
    return [(rel(g, w), rel(r, w)) for g, w, r in zip(split(got, ours.config), wanted, reference, strict=True)]


def assert_parity(errors: list[tuple[float, float]]) -> None:
    for index, (ours, reference) in enumerate(errors):
        assert ours <= FACTOR * max(reference, FLOOR), (index, ours, reference)


# The tiny tower's position table is 8 x 8: grids below, at and above it, square and not.
GRIDS = {
    "square 256x256 (16x16 patches)": [(1, 16, 16)],
    "landscape 192x352": [(1, 12, 22)],
    "tall-thin 640x32": [(1, 40, 2)],
    "one merged token": [(1, 2, 2)],
    "exactly the table 128x128": [(1, 8, 8)],
    "mixed batch with a video": [(1, 12, 22), (2, 8, 10), (1, 2, 2)],
}


@pytest.mark.parametrize("case", list(GRIDS))
def test_parity_with_transformers(towers: Towers, case: str) -> None:
    grids = GRIDS[case]
    assert_parity(parity_errors(towers, parity.patch_rows(grids, TINY.row_width), torch.tensor(grids)))


@pytest.mark.parametrize("num_frames", [2, 3])
def test_parity_on_a_video_through_our_processor(towers: Towers, num_frames: int) -> None:
    frames = np.random.default_rng(num_frames).integers(0, 256, (num_frames, 96, 160, 3), dtype=np.uint8)
    processed = process_video(frames, QWEN3_VL)
    assert processed.grid_thw.tolist() == [[2 if num_frames == 3 else 1, 6, 10]]
    assert_parity(parity_errors(towers, processed.pixel_values, processed.grid_thw))


def test_position_taps_are_transformers(towers: Towers) -> None:
    grids = [(1, 16, 16), (2, 6, 10), (1, 40, 2), (1, 2, 2)]
    ours = position_taps(grids, 2, 8)
    theirs = get_vision_interpolation_indices_and_weights(
        torch.tensor(grids), num_grid_per_side=8, mode="bilinear", align_corners=True, spatial_merge_size=2
    )
    assert torch.equal(ours[0], theirs[0])
    assert torch.equal(ours[1], theirs[1])


def test_batched_items_equal_items_encoded_alone(towers: Towers) -> None:
    _, _, ours = towers
    grids = [(1, 16, 16), (1, 12, 22), (2, 8, 10), (1, 16, 16)]
    assert parity.assert_batch_equals_items_alone(ours, grids) == [64, 66, 40, 64]


def test_config_checks() -> None:
    assert TINY.output_width == 3 * 128
    with pytest.raises(ValueError, match="positive square"):
        VisionTowerConfig(**{**_fields(TINY), "num_position_embeddings": 60})
    with pytest.raises(ValueError, match="increasing order"):
        VisionTowerConfig(**{**_fields(TINY), "deepstack_visual_indexes": (2, 1)})
    with pytest.raises(ValueError, match="increasing order"):
        VisionTowerConfig(**{**_fields(TINY), "deepstack_visual_indexes": (1, 4)})
    with pytest.raises(ValueError, match="no learned positions or DeepStack"):
        VisionTowerConfig(**{**_fields(get_preset("tiny")), "deepstack_visual_indexes": (1,)})


def _fields(config: VisionTowerConfig) -> dict[str, Any]:
    return {name: getattr(config, name) for name in config.__slots__}  # type: ignore[attr-defined]


# The `vision_config` of each published checkpoint's config.json (Qwen/Qwen3-VL-{2B,4B,8B}-Instruct).
_SMALL = {
    "deepstack_visual_indexes": [5, 11, 17],
    "depth": 24,
    "hidden_act": "gelu_pytorch_tanh",
    "hidden_size": 1024,
    "in_channels": 3,
    "initializer_range": 0.02,
    "intermediate_size": 4096,
    "model_type": "qwen3_vl",
    "num_heads": 16,
    "num_position_embeddings": 2304,
    "patch_size": 16,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
}
PUBLISHED = {
    "qwen3-vl-2b": _SMALL | {"out_hidden_size": 2048},
    "qwen3-vl-4b": _SMALL | {"out_hidden_size": 2560},
    "qwen3-vl-8b": _SMALL
    | {"deepstack_visual_indexes": [8, 16, 24], "depth": 27, "hidden_size": 1152, "intermediate_size": 4304}
    | {"out_hidden_size": 4096},
}


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_presets_are_the_published_towers(name: str) -> None:
    vision = PUBLISHED[name]
    preset = PRESETS[name]
    assert vision_config_from_hf({"model_type": "qwen3_vl", "vision_config": vision}, name=name) == preset
    with torch.device("meta"):
        reference = Qwen3VLVisionModel._from_config(Qwen3VLVisionConfig(**vision))
        ours = Qwen3VisionTower(preset)
    theirs = {k: tuple(v.shape) for k, v in reference.state_dict().items()}
    mine = {k: tuple(v.shape) for k, v in ours.state_dict().items()}
    width = vision["hidden_size"]
    assert theirs.pop("patch_embed.proj.weight") == (width, 3, 2, 16, 16)
    assert mine.pop("patch_embed.proj.weight") == (width, 3 * 2 * 16 * 16)
    assert mine == theirs
    assert preset.output_width == vision["out_hidden_size"] * 4


def test_transformers_defaults_fill_missing_keys() -> None:
    config = vision_config_from_hf({"model_type": "qwen3_vl", "vision_config": {"out_hidden_size": 4096}})
    assert config == PRESETS["qwen3-vl-8b"].__class__(**{**_fields(PRESETS["qwen3-vl-8b"]), "name": "checkpoint"})
    with pytest.raises(ValueError, match="hidden_act 'silu'"):
        vision_config_from_hf({"model_type": "qwen3_vl", "vision_config": {"hidden_act": "silu"}})


# Real weights: a tiny whole model written by transformers.

CHECKPOINT_VISION = {
    "depth": 3,
    "hidden_size": 96,
    "intermediate_size": 112,
    "num_heads": 6,
    "out_hidden_size": 64,
    "num_position_embeddings": 36,
    "deepstack_visual_indexes": [0, 2],
}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    directory = tmp_path_factory.mktemp("qwen3_vl")
    text = {
        "hidden_size": 64,
        "intermediate_size": 64,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 32,
        "vocab_size": 64,
        "max_position_embeddings": 256,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [8, 4, 4]},
    }
    config = Qwen3VLConfig(text_config=text, vision_config=CHECKPOINT_VISION)
    torch.manual_seed(5)
    model = Qwen3VLForConditionalGeneration._from_config(config, attn_implementation="eager").eval()
    parity.randomize(model.model.visual, 5)
    model.save_pretrained(directory)
    return directory, model.model.visual


def test_a_checkpoint_written_by_transformers_loads_and_embeds_as_transformers(checkpoint: tuple[Path, Any]) -> None:
    directory, reference = checkpoint
    settings = EngineSettings(model={"device": "cpu", "dtype": "float32", "checkpoint": str(directory)}).model
    encoder = VisionEncoder(settings)
    try:
        config = encoder.config
        assert (config.arch, config.depth, config.hidden_size, config.deepstack_visual_indexes) == (
            "qwen3_vl", 3, 96, (0, 2),
        )  # fmt: skip
        assert encoder.width == 64 * 3
        assert encoder.geometry.name == "qwen3_vl"
        assert encoder.from_checkpoint
        assert "key prefix 'model.visual.'" in encoder.weights
        image = Image.fromarray(np.random.default_rng(7).integers(0, 256, (300, 420, 3), dtype=np.uint8))
        processed = process_image(resize_for_model(image, encoder.geometry), encoder.geometry)
        got = encoder.forward(processed.pixel_values, processed.grid_thw)
        with torch.inference_mode():
            expected = reference(processed.pixel_values, processed.grid_thw)
        wanted = [expected.pooler_output, *expected.deepstack_features]
        for ours, theirs in zip(split(got, config), wanted, strict=True):
            assert theirs.abs().mean() > 0.1
            assert parity.max_diff(ours, theirs) <= 1e-4
    finally:
        encoder.close()


# The processor: patch 16, mean/std 0.5, rows in transformers' order.


def test_video_rows_are_transformers_patch_order() -> None:
    frames = np.random.default_rng(1).integers(0, 256, (3, 64, 96, 3), dtype=np.uint8)
    normalized = normalize_frames(torch.from_numpy(frames), QWEN3_VL)
    padded = torch.cat([normalized, normalized[-1:]])  # transformers pads with the last frame as we do
    theirs, grid_t, grid_h, grid_w = Qwen3VLVideoProcessor().patchify(padded[None], 16, 2, 2)
    assert (grid_t, grid_h, grid_w) == (2, 4, 6)
    assert torch.equal(process_video(frames, QWEN3_VL).pixel_values, theirs[0])
    assert torch.equal(patchify(normalized, QWEN3_VL)[0], theirs[0])


# The engine: widened rows in the buffer, the budget and the hand-off.

ENGINE_MODEL = {"preset": "tiny-3", "min_pixels": 32 * 32}


def expected_rows(image: np.ndarray) -> torch.Tensor:
    tower = build_vision_tower("tiny-3", seed=0).model
    processed = process_image(image, QWEN3_VL)
    with torch.inference_mode():
        return tower(processed.pixel_values, processed.grid_thw)


def test_vllm_handoff_rows_split_as_vllm_qwen3_vl_splits_them(
    make_engine: EngineFactory, stub_llm: tuple[StubLLM, str]
) -> None:
    stub, stub_url = stub_llm
    stub.state.server = "vllm"
    stub.state.deepstack_layers = 2
    images = [pixels(64, 96), pixels(96, 64, seed=1)]
    handoff = {"backend": "openai", "url": stub_url, "format": "vllm", "expected_hidden_size": 384}
    with make_engine(model=ENGINE_MODEL, handoff=handoff) as (_, url):
        assert status(url)["model"]["embedding_width"] == 384
        assert status(url)["model"]["deepstack_visual_indexes"] == [1, 2]
        job_id = admitted(url, submit_body("ds", images))
        assert httpx.get(f"{url}{REQUESTS}/{job_id}/response", timeout=30).status_code == 200
        wait_idle(url)
    seen = stub.state.by_request_id("ds")
    assert [grid.tolist() for grid in seen.grids if grid is not None] == [[1, 4, 6], [1, 6, 4]]
    assert stub.state.refused == []
    for index, image in enumerate(images):
        main, first, second = split(expected_rows(image), TINY)
        assert torch.allclose(seen.embeds[index], main, atol=1e-5)
        assert seen.deepstack[index].shape == (2, 6, 128)
        assert torch.allclose(seen.deepstack[index][0], first, atol=1e-5)
        assert torch.allclose(seen.deepstack[index][1], second, atol=1e-5)


def test_the_stub_refuses_rows_that_do_not_split() -> None:
    rows = [torch.zeros(6, 128)]
    with pytest.raises(Refusal, match="split_with_sizes") as refused:
        split_deepstack(rows, 128, 2)
    assert refused.value.status == 500
    main, stacks = split_deepstack([torch.arange(12.0).view(2, 6)], 2, 2)
    assert main[0].tolist() == [[0, 1], [6, 7]]
    assert stacks[0].tolist() == [[[2, 3], [8, 9]], [[4, 5], [10, 11]]]


def test_expected_hidden_size_is_the_widened_width() -> None:
    settings = EngineSettings(handoff={"backend": "openai", "url": "http://127.0.0.1:9", "expected_hidden_size": 128})
    with pytest.raises(ConfigError, match="produces rows of 384"):
        check_handoff(settings.handoff, TINY.output_width, torch.float32, "qwen3_vl", "tiny-3")


def test_reference_reports_the_deepstack_layers_and_the_budget_counts_widened_rows(make_engine: EngineFactory) -> None:
    # One 64x96 image: 6 rows x 384 x float32 = 9,216 bytes; a budget of 9,215 never fits it.
    with make_engine(model=ENGINE_MODEL, encoder={"max_resident_bytes": 9215}) as (_, url):
        refused = submit(url, submit_body("big", [pixels(64, 96)]))
        assert refused.status_code == 413
    with make_engine(model=ENGINE_MODEL, encoder={"max_resident_bytes": 9216}) as (_, url):
        job_id = admitted(url, submit_body("fits", [pixels(64, 96)]))
        response = httpx.get(f"{url}{REQUESTS}/{job_id}/response", timeout=30)
        wait_idle(url)
    content = response.json()["choices"][0]["message"]["content"]
    assert content.startswith("image 0: 6 rows x 384 (128 + 2 DeepStack layers x 128), sha256 ")
