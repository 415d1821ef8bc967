"""Building towers and filling their weights: safetensors checkpoints in both key layouts, shards, errors,
seeded random weights, dtypes."""

from __future__ import annotations

import json
import logging
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from transformers import Qwen2_5_VLConfig, Qwen2VLConfig

from engine_adapter.models import (
    CheckpointError,
    VisionTower,
    build_vision_tower,
    config_from_checkpoint,
    get_preset,
)


def hf_layout_state_dict(model: VisionTower) -> dict[str, torch.Tensor]:
    """The tower's tensors as a Hugging Face checkpoint stores them (Conv3d patch embedding)."""
    config = model.config
    state = {k: v.clone().contiguous() for k, v in model.state_dict().items()}
    state["patch_embed.proj.weight"] = state["patch_embed.proj.weight"].reshape(
        config.hidden_size,
        config.in_channels,
        config.temporal_patch_size,
        config.patch_size,
        config.patch_size,
    )
    return state


LLM_TENSORS = {"embed_tokens.weight": torch.ones(10, 4), "layers.0.mlp.up_proj.weight": torch.ones(4, 4)}


def write_checkpoint(directory: Path, model: VisionTower, layout: str) -> None:
    """One model.safetensors holding the tower under `layout` plus some language-model tensors."""
    directory.mkdir(parents=True, exist_ok=True)
    visual_prefix, llm_prefix = {
        "visual": ("visual.", "model."),
        "model.visual": ("model.visual.", "model."),
    }[layout]
    tensors = {visual_prefix + k: v for k, v in hf_layout_state_dict(model).items()}
    tensors |= {llm_prefix + k: v for k, v in LLM_TENSORS.items()}
    tensors["lm_head.weight"] = torch.ones(10, 4)
    save_file(tensors, str(directory / "model.safetensors"))


def sample_inputs() -> tuple[torch.Tensor, torch.Tensor]:
    grid = torch.tensor([[1, 16, 16], [1, 10, 12]])
    return torch.randn(256 + 120, 1176, generator=torch.Generator().manual_seed(0)), grid


def assert_same_weights(a: VisionTower, b: VisionTower) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for key in sa:
        assert torch.equal(sa[key], sb[key]), key


@pytest.mark.parametrize("preset", ["tiny", "tiny-2.5"])
@pytest.mark.parametrize("layout", ["visual", "model.visual"])
def test_loads_both_key_layouts(tmp_path: Path, preset: str, layout: str, caplog: pytest.LogCaptureFixture) -> None:
    source = build_vision_tower(preset, seed=11).model
    write_checkpoint(tmp_path, source, layout)
    with caplog.at_level(logging.INFO, logger="engine_adapter.models.loading"):
        loaded = build_vision_tower(preset, checkpoint=tmp_path)
    assert loaded.from_checkpoint
    assert loaded.weights.startswith(f"checkpoint {tmp_path}")
    assert f"key prefix '{layout}.'" in loaded.weights
    assert loaded.weights in caplog.text
    assert_same_weights(loaded.model, source)
    x, grid = sample_inputs()
    with torch.inference_mode():
        assert torch.equal(loaded.model(x, grid), source(x, grid))


def test_loads_a_single_file_path(tmp_path: Path) -> None:
    source = build_vision_tower("tiny", seed=4).model
    write_checkpoint(tmp_path, source, "visual")
    loaded = build_vision_tower("tiny", checkpoint=tmp_path / "model.safetensors")
    assert_same_weights(loaded.model, source)


def test_loads_sharded_checkpoint_reading_only_the_shards_with_visual_tensors(tmp_path: Path) -> None:
    source = build_vision_tower("tiny-2.5", seed=5).model
    tensors = {"model.visual." + k: v for k, v in hf_layout_state_dict(source).items()}
    keys = sorted(tensors)
    shards = {
        "model-00001-of-00003.safetensors": {k: tensors[k] for k in keys[: len(keys) // 2]},
        "model-00002-of-00003.safetensors": {k: tensors[k] for k in keys[len(keys) // 2 :]},
    }
    weight_map = {k: name for name, shard in shards.items() for k in shard}
    for name, shard in shards.items():
        save_file(shard, str(tmp_path / name))
    # The language-model shard is not a valid safetensors file: loading must never open it.
    (tmp_path / "model-00003-of-00003.safetensors").write_bytes(b"not safetensors")
    weight_map |= {"model.language_model." + k: "model-00003-of-00003.safetensors" for k in LLM_TENSORS}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    loaded = build_vision_tower("tiny-2.5", checkpoint=tmp_path)
    assert_same_weights(loaded.model, source)


def test_loads_several_unindexed_files(tmp_path: Path) -> None:
    source = build_vision_tower("tiny", seed=6).model
    tensors = {"visual." + k: v for k, v in hf_layout_state_dict(source).items()}
    keys = sorted(tensors)
    save_file({k: tensors[k] for k in keys[:5]}, str(tmp_path / "a.safetensors"))
    save_file({k: tensors[k] for k in keys[5:]}, str(tmp_path / "b.safetensors"))
    assert_same_weights(build_vision_tower("tiny", checkpoint=tmp_path).model, source)


def test_missing_unexpected_and_misshapen_keys_are_named(tmp_path: Path) -> None:
    state = hf_layout_state_dict(build_vision_tower("tiny").model)
    del state["blocks.1.attn.qkv.bias"]
    state["blocks.2.norm1.weight"] = torch.ones(64)
    save_file({"visual." + k: v for k, v in state.items()}, str(tmp_path / "model.safetensors"))
    message = r"missing 1 key\(s\): visual\.blocks\.1\.attn\.qkv\.bias; unexpected 1 key\(s\): visual\.blocks\.2"
    with pytest.raises(CheckpointError, match=message):
        build_vision_tower("tiny", checkpoint=tmp_path)

    state = hf_layout_state_dict(build_vision_tower("tiny").model)
    state["merger.mlp.2.weight"] = torch.zeros(64, 256)
    save_file({"visual." + k: v for k, v in state.items()}, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"visual\.merger\.mlp\.2\.weight has shape \(64, 256\).*\(128, 256\)"):
        build_vision_tower("tiny", checkpoint=tmp_path)


def test_checkpoint_of_the_other_architecture_is_refused(tmp_path: Path) -> None:
    write_checkpoint(tmp_path, build_vision_tower("tiny-2.5").model, "visual")
    with pytest.raises(CheckpointError, match=r"does not match vision tower 'tiny': missing .*blocks\.0\.mlp\.fc1"):
        build_vision_tower("tiny", checkpoint=tmp_path)


def test_config_json_that_disagrees_is_refused(tmp_path: Path) -> None:
    tiny = get_preset("tiny-2.5")
    write_checkpoint(tmp_path, build_vision_tower(tiny).model, "model.visual")
    vision = {
        "depth": tiny.depth,
        "hidden_size": tiny.hidden_size,
        "intermediate_size": tiny.intermediate_size,
        "num_heads": tiny.num_heads,
        "out_hidden_size": tiny.out_hidden_size,
        "window_size": tiny.window_size,
        "fullatt_block_indexes": list(tiny.fullatt_block_indexes),
    }
    config = Qwen2_5_VLConfig(vision_config=vision).to_dict()
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert build_vision_tower(tiny, checkpoint=tmp_path).from_checkpoint  # agrees: loads

    # Same tensor shapes, different window layout: only config.json can tell.
    config["vision_config"]["fullatt_block_indexes"] = [0]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"fullatt_block_indexes: checkpoint \(0,\), tower \(1,\)"):
        build_vision_tower(tiny, checkpoint=tmp_path)


def test_config_from_a_transformers_written_config_json(tmp_path: Path) -> None:
    tiny = get_preset("tiny")
    vision = {"depth": 2, "embed_dim": 64, "hidden_size": 128, "num_heads": 4, "mlp_ratio": 4}
    (tmp_path / "config.json").write_text(json.dumps(Qwen2VLConfig(vision_config=vision).to_dict()))
    parsed = config_from_checkpoint(tmp_path)
    assert parsed.name == str(tmp_path)
    assert replace(parsed, name="tiny") == tiny
    with pytest.raises(ValueError, match=r"has no config\.json"):
        config_from_checkpoint(tmp_path / "nowhere")


def test_unusable_checkpoints_fail_clearly(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="does not exist"):
        build_vision_tower("tiny", checkpoint=tmp_path / "missing")
    with pytest.raises(CheckpointError, match=r"has no \*\.safetensors files"):
        build_vision_tower("tiny", checkpoint=tmp_path)

    save_file({"model.embed_tokens.weight": torch.ones(2, 2)}, str(tmp_path / "model.safetensors"))
    no_visual = r"holds no vision tower weights.*'model\.visual\.' or 'visual\.'"
    with pytest.raises(CheckpointError, match=no_visual):
        build_vision_tower("tiny", checkpoint=tmp_path)

    save_file(
        {
            "visual.patch_embed.proj.weight": torch.ones(2),
            "model.visual.patch_embed.proj.weight": torch.ones(2),
        },
        str(tmp_path / "model.safetensors"),
    )
    with pytest.raises(CheckpointError, match="mixes both key layouts"):
        build_vision_tower("tiny", checkpoint=tmp_path)

    (tmp_path / "model.safetensors.index.json").write_text("{")
    with pytest.raises(CheckpointError, match="not a safetensors index"):
        build_vision_tower("tiny", checkpoint=tmp_path)
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"visual.x": "gone.st"}}))
    with pytest.raises(CheckpointError, match="lists shards that are missing"):
        build_vision_tower("tiny", checkpoint=tmp_path)


def test_random_weights_are_seeded_and_logged(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="engine_adapter.models.loading"):
        first = build_vision_tower("tiny", seed=3)
    assert first.weights == "random (seed=3)"
    assert not first.from_checkpoint
    assert "vision tower tiny (qwen2_vl) on cpu/torch.float32: random (seed=3) weights" in caplog.text
    assert_same_weights(first.model, build_vision_tower("tiny", seed=3).model)
    other = build_vision_tower("tiny", seed=4).model
    params, other_params = dict(first.model.named_parameters()), dict(other.named_parameters())
    assert not torch.equal(params["blocks.0.attn.qkv.weight"], other_params["blocks.0.attn.qkv.weight"])
    # Norm scales start at one and biases at zero; linear weights are small but not zero.
    model = first.model
    assert torch.equal(params["blocks.0.norm1.weight"], torch.ones(64))
    assert torch.equal(params["blocks.0.attn.qkv.bias"], torch.zeros(192))
    assert 0.015 < params["merger.mlp.0.weight"].std().item() < 0.025
    assert all(p.device.type == "cpu" and not p.requires_grad for p in model.parameters())
    assert not model.training


@pytest.mark.parametrize("preset", ["tiny", "tiny-2.5"])
def test_bfloat16_tower_tracks_float32(tmp_path: Path, preset: str) -> None:
    reference = build_vision_tower(preset, seed=9).model
    write_checkpoint(tmp_path, reference, "visual")
    half = build_vision_tower(preset, checkpoint=tmp_path, dtype=torch.bfloat16).model
    assert half.dtype == torch.bfloat16
    x, grid = sample_inputs()
    with torch.inference_mode():
        expected, got = reference(x, grid), half(x, grid)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), expected, atol=0.05, rtol=0.05)


def test_unknown_preset_is_refused() -> None:
    with pytest.raises(ValueError, match=r"unknown vision tower preset 'qwen9'.*tiny"):
        build_vision_tower("qwen9")
