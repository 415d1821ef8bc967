"""The tower a checkpoint's own config.json describes: any Qwen2-VL / Qwen2.5-VL shape, not only the presets.

The checkpoints are tiny whole models written by transformers (`save_pretrained`, seeded random weights); the
engine's encoder built from one with `model.preset` null must embed as transformers' own tower does. A preset
named together with a checkpoint must be the tower its config.json describes.
"""

from __future__ import annotations

import json
import logging
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import (
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
    Qwen2VLConfig,
    Qwen2VLForConditionalGeneration,
)

from engine_adapter.config import EngineSettings, ModelSettings
from engine_adapter.encoder import VisionEncoder
from engine_adapter.models import (
    PRESETS,
    CheckpointError,
    NoTowerConfigError,
    build_vision_tower,
    checkpoint_config,
    find_preset,
    tower_config,
)
from serving.settings_loader import ConfigError, load_settings
from tests.config_cli import write_config
from tests.conftest import EngineFactory
from tests.engine_adapter import transformers_parity as parity
from tests.engine_adapter.conftest import status

TOLERANCE = 1e-4


def text_config(hidden_size: int) -> dict[str, Any]:
    """A one-layer language model: the checkpoint is a whole model, but only its tower is read."""
    return {
        "hidden_size": hidden_size,
        "intermediate_size": 64,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "vocab_size": 64,
        "max_position_embeddings": 256,
        "bos_token_id": 0,
        "eos_token_id": 1,
    }


@dataclass(frozen=True)
class Spec:
    model_class: Any
    make_config: Callable[[], Any]
    tower: tuple[Any, ...]
    """(arch, depth, hidden_size, num_heads, intermediate_size, out_hidden_size, window_size, fullatt)"""
    geometry: str
    near_preset: str
    """The preset of the same architecture, which the checkpoint's tower is not."""
    differs: str
    """One of the differences the refusal of `near_preset` names."""


SPECS = {
    # Three blocks of 96 wide with 6 heads (head_dim 16), MLP ratio 2, 160 wide out: no preset's shape.
    "qwen2_vl": Spec(
        Qwen2VLForConditionalGeneration,
        lambda: Qwen2VLConfig(
            text_config=text_config(160),
            vision_config={"depth": 3, "embed_dim": 96, "num_heads": 6, "hidden_size": 160, "mlp_ratio": 2},
            bos_token_id=0,
            eos_token_id=1,
        ),
        ("qwen2_vl", 3, 96, 6, 192, 160, 0, ()),
        "qwen2_vl",
        "tiny",
        "depth: checkpoint 3, tower 2",
    ),
    # Its own window (56 px = 2 x 2 merged tokens) and full-attention layout (the middle block).
    "qwen2_5_vl": Spec(
        Qwen2_5_VLForConditionalGeneration,
        lambda: Qwen2_5_VLConfig(
            text_config=text_config(192),
            vision_config={
                "depth": 3,
                "hidden_size": 96,
                "intermediate_size": 112,
                "num_heads": 6,
                "out_hidden_size": 192,
                "window_size": 56,
                "fullatt_block_indexes": [1],
            },
            bos_token_id=0,
            eos_token_id=1,
        ),
        ("qwen2_5_vl", 3, 96, 6, 112, 192, 56, (1,)),
        "qwen2_5_vl",
        "tiny-2.5",
        "window_size: checkpoint 56, tower 112",
    ),
}


def save_checkpoint(directory: Path, model_class: Any, config: Any, seed: int) -> Any:
    """A whole transformers model with seeded random weights (norms and biases too) saved to `directory`;
    returns its vision tower, in eager attention: the reference."""
    torch.manual_seed(seed)
    model = model_class._from_config(config, attn_implementation="eager").eval()
    parity.randomize(model.model.visual, seed)
    model.save_pretrained(directory)
    return model.model.visual


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Any]]:
    """Per architecture: the checkpoint directory and transformers' tower it holds."""
    saved = {}
    for seed, (arch, spec) in enumerate(SPECS.items()):
        directory = tmp_path_factory.mktemp(arch)
        saved[arch] = (directory, save_checkpoint(directory, spec.model_class, spec.make_config(), seed))
    return saved


def model_settings(**model: Any) -> ModelSettings:
    return EngineSettings(model={"device": "cpu", "dtype": "float32", **model}).model


def tower_shape(encoder: VisionEncoder) -> tuple[Any, ...]:
    c = encoder.config
    return (
        c.arch,
        c.depth,
        c.hidden_size,
        c.num_heads,
        c.intermediate_size,
        c.out_hidden_size,
        c.window_size,
        c.fullatt_block_indexes,
    )


@pytest.mark.parametrize("arch", list(SPECS))
def test_a_checkpoint_of_no_preset_builds_its_own_tower_and_embeds_as_transformers(
    checkpoints: dict[str, tuple[Path, Any]], arch: str, caplog: pytest.LogCaptureFixture
) -> None:
    spec = SPECS[arch]
    directory, reference = checkpoints[arch]
    with caplog.at_level(logging.INFO, logger="engine_adapter.encoder"):
        encoder = VisionEncoder(model_settings(checkpoint=str(directory)))
    try:
        assert tower_shape(encoder) == spec.tower
        assert find_preset(encoder.config) is None
        assert encoder.config.name == str(directory)
        assert encoder.from_checkpoint
        assert encoder.width == spec.tower[5]
        assert encoder.geometry.name == spec.geometry  # model.processor null: the tower's own geometry
        assert f"from {directory / 'config.json'}" in caplog.text
        assert f"checkpoint {directory}" in caplog.text

        # 140 x 196 px: 10 x 14 patches, 5 x 7 merged tokens (partial 2 x 2 windows in the Qwen2.5-VL tower).
        image = Image.fromarray(np.random.default_rng(7).integers(0, 256, (140, 196, 3), dtype=np.uint8))
        inputs = parity.hf_processor(encoder.geometry)(images=image, return_tensors="pt")
        pixel_values, grid_thw = inputs["pixel_values"], inputs["image_grid_thw"]
        assert grid_thw.tolist() == [[1, 10, 14]]
        got = encoder.forward(pixel_values, grid_thw)
        with torch.inference_mode():
            expected = reference(pixel_values, grid_thw).pooler_output
        assert got.shape == (35, spec.tower[5])
        assert expected.abs().mean() > 0.1  # not a comparison of near-zero tensors
        assert parity.max_diff(got, expected) <= TOLERANCE
    finally:
        encoder.close()


@pytest.mark.parametrize("arch", list(SPECS))
def test_a_preset_named_with_a_checkpoint_it_does_not_describe_is_refused_naming_both(
    checkpoints: dict[str, tuple[Path, Any]], arch: str
) -> None:
    spec = SPECS[arch]
    directory, _ = checkpoints[arch]
    with pytest.raises(ConfigError) as refused:
        VisionEncoder(model_settings(preset=spec.near_preset, checkpoint=str(directory)))
    message = str(refused.value)
    assert message.startswith(f"model.preset = {spec.near_preset!r} does not match model.checkpoint = '{directory}'")
    assert spec.differs in message
    assert "set model.preset to null" in message
    assert "Traceback" not in message


def test_a_checkpoint_of_a_preset_tower_loads_named_or_not(tmp_path: Path) -> None:
    """The deployments name the preset of their checkpoint's tower: that still loads, and so does leaving it
    out (the tower is then named after the preset it equals)."""
    tiny = PRESETS["tiny"]
    vision = {"depth": tiny.depth, "embed_dim": tiny.hidden_size, "num_heads": tiny.num_heads, "mlp_ratio": 4}
    config = Qwen2VLConfig(
        text_config=text_config(tiny.out_hidden_size),
        vision_config=vision | {"hidden_size": tiny.out_hidden_size},
        bos_token_id=0,
        eos_token_id=1,
    )
    reference = save_checkpoint(tmp_path, Qwen2VLForConditionalGeneration, config, 5)
    grids = [(1, 8, 12)]
    rows, grid_thw = parity.patch_rows(grids, tiny.row_width), torch.tensor(grids)
    with torch.inference_mode():
        expected = reference(rows, grid_thw).pooler_output
    for preset in ("tiny", None):
        encoder = VisionEncoder(model_settings(preset=preset, checkpoint=str(tmp_path)))
        try:
            assert encoder.config == tiny
            assert encoder.tower_source == ("model.preset" if preset else str(tmp_path / "config.json"))
            assert parity.max_diff(encoder.forward(rows, grid_thw), expected) <= TOLERANCE
        finally:
            encoder.close()


LLAMA = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 1}


@pytest.mark.parametrize(
    ("config_json", "expected"),
    [
        (
            json.dumps(LLAMA),
            r"is not a Qwen2-VL, Qwen2\.5-VL or Qwen3-VL model "
            r"\(model_type='llama'; supported: qwen2_vl, qwen2_5_vl, qwen3_vl\)",
        ),
        (
            json.dumps({"model_type": "qwen2_vl"}),
            r"is not a Qwen2-VL, Qwen2\.5-VL or Qwen3-VL model \(model_type='qwen2_vl'",
        ),
        (json.dumps([1, 2]), r"is not a Qwen2-VL, Qwen2\.5-VL or Qwen3-VL model \(model_type=None"),
        ("{", r"config\.json: invalid JSON"),
        (
            json.dumps({"model_type": "qwen2_vl", "vision_config": {"depth": "three"}}),
            r"unusable vision_config \(invalid literal for int\(\)",
        ),
        (
            json.dumps({"model_type": "qwen2_vl", "vision_config": {"embed_dim": 96, "num_heads": 5}}),
            r"hidden_size must be divisible by num_heads",
        ),
        (
            json.dumps({"model_type": "qwen2_5_vl", "vision_config": {"depth": 2, "fullatt_block_indexes": [4]}}),
            r"fullatt_block_indexes \[4\] outside 0\.\.1",
        ),
    ],
    ids=["llama", "no-vision-config", "not-an-object", "invalid-json", "wrong-type", "bad-heads", "bad-fullatt"],
)
@pytest.mark.parametrize("preset", [None, "tiny"])
def test_a_config_json_that_describes_no_qwen2_vl_tower_is_refused_naming_the_key(
    checkpoints: dict[str, tuple[Path, Any]], tmp_path: Path, config_json: str, expected: str, preset: str | None
) -> None:
    directory, _ = checkpoints["qwen2_vl"]
    shutil.copy(directory / "model.safetensors", tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text(config_json)
    with pytest.raises(ConfigError, match=expected) as refused:
        VisionEncoder(model_settings(preset=preset, checkpoint=str(tmp_path)))
    assert str(refused.value).startswith(f"model.checkpoint = '{tmp_path}': ")


def test_without_a_config_json_the_tower_must_be_named(
    checkpoints: dict[str, tuple[Path, Any]], tmp_path: Path
) -> None:
    directory, _ = checkpoints["qwen2_vl"]
    weights = tmp_path / "model.safetensors"
    shutil.copy(directory / "model.safetensors", weights)
    for checkpoint, why in ((tmp_path, "has no config.json"), (weights, "is a file")):
        with pytest.raises(ConfigError) as refused:
            VisionEncoder(model_settings(checkpoint=str(checkpoint)))
        message = str(refused.value)
        assert message.startswith(f"model.checkpoint = '{checkpoint}': ")
        assert why in message
        assert "name its tower with model.preset (qwen2-vl-2b, " in message
        with pytest.raises(NoTowerConfigError, match=why):
            checkpoint_config(checkpoint)
    with pytest.raises(ConfigError, match=r"^model\.checkpoint = '/nonexistent/ckpt': checkpoint .* does not exist"):
        VisionEncoder(model_settings(checkpoint="/nonexistent/ckpt"))


def test_the_library_builds_the_checkpoints_tower_when_given_none(checkpoints: dict[str, tuple[Path, Any]]) -> None:
    directory, _ = checkpoints["qwen2_5_vl"]
    loaded = build_vision_tower(checkpoint=directory)
    assert loaded.from_checkpoint
    assert (loaded.model.config.window_size, loaded.model.config.fullatt_block_indexes) == (56, (1,))
    assert tower_config(None, directory) == loaded.model.config
    assert tower_config(None) == PRESETS["tiny"]
    assert tower_config("small", directory) == PRESETS["small"]  # a named preset wins (loading then checks it)
    with pytest.raises(CheckpointError, match="describes a different vision tower than 'small'"):
        build_vision_tower("small", checkpoint=directory)


def test_preset_is_optional_and_tiny_without_a_checkpoint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert ModelSettings().preset is None
    assert load_settings(EngineSettings, write_config(tmp_path, "model:\n  preset: null\n")).model.preset is None
    monkeypatch.setenv("MMGATE_ENGINE_MODEL__PRESET", "null")
    assert load_settings(EngineSettings).model.preset is None
    monkeypatch.setenv("MMGATE_ENGINE_MODEL__PRESET", "tiny-2.5")
    assert load_settings(EngineSettings).model.preset == "tiny-2.5"
    monkeypatch.delenv("MMGATE_ENGINE_MODEL__PRESET")
    encoder = VisionEncoder(model_settings())
    try:
        assert encoder.config == PRESETS["tiny"]
        assert encoder.tower_source == "the default preset"
        assert not encoder.from_checkpoint
    finally:
        encoder.close()


def test_the_engine_reports_and_checks_the_checkpoints_tower(
    checkpoints: dict[str, tuple[Path, Any]], make_engine: EngineFactory
) -> None:
    """Status, processor geometry and the hand-off's width check follow the checkpoint's config.json."""
    directory, _ = checkpoints["qwen2_5_vl"]
    model = {"preset": None, "checkpoint": str(directory)}
    with make_engine(model=model, handoff={"expected_hidden_size": 192}) as (_, url):
        data = status(url)
    assert data["model"]["preset"] == str(directory)
    assert data["model"]["arch"] == "qwen2_5_vl"
    assert data["model"]["embedding_width"] == 192
    assert data["model"]["from_checkpoint"] is True
    assert data["processor"]["geometry"] == "qwen2_5_vl"
    refused = pytest.raises(ConfigError, match=r"^handoff\.expected_hidden_size = 3584: .* rows of 192")
    with refused, make_engine(model=model, handoff={"expected_hidden_size": 3584}):
        pass
