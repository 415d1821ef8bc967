"""Helpers of the parity tests against transformers: its Qwen2-VL image processors, its Qwen2-VL and Qwen3-VL
video processors, and its vision towers.

transformers' torchvision processors (its default image processor, and its only video processors) need torchvision
to resize and normalize. Where torchvision is not installed, the video processors run with its two functions they
call on frames already at their resized size spelled out: `resize` returns such frames unchanged, and `normalize`
is torchvision's `normalize_image` (float32 mean and std tensors, subtract, then divide). Everything else,
the fused rescale-and-normalize constants among it, is transformers' own.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterable
from typing import Any, TypeVar

import numpy as np
import numpy.typing as npt
import pytest
import torch
import torch.nn.functional as F
from transformers.image_processing_backends import TorchvisionBackend
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

from engine_adapter.models import VisionTower, VisionTowerConfig, build_vision_tower, load_state_dict
from engine_adapter.processor import process_video
from processor_geometry import ProcessorGeometry

TowerT = TypeVar("TowerT", bound=VisionTower)
Grids = list[tuple[int, int, int]]


def _processor_options(geometry: ProcessorGeometry) -> dict[str, Any]:
    """The options of transformers' Qwen2-VL image processors that `geometry` sets."""
    return {
        "patch_size": geometry.patch_size,
        "temporal_patch_size": geometry.temporal_patch_size,
        "merge_size": geometry.merge_size,
        "min_pixels": geometry.min_pixels,
        "max_pixels": geometry.max_pixels,
        "image_mean": list(geometry.image_mean),
        "image_std": list(geometry.image_std),
    }


def hf_processor(geometry: ProcessorGeometry) -> Qwen2VLImageProcessorPil:
    """transformers' PIL image processor configured as `geometry`."""
    return Qwen2VLImageProcessorPil(**_processor_options(geometry))


HAS_TORCHVISION = importlib.util.find_spec("torchvision") is not None


def hf_torchvision_image_processor(geometry: ProcessorGeometry) -> Any:
    """transformers' default (torchvision) Qwen2-VL image processor configured as `geometry`; needs torchvision."""
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor

    return Qwen2VLImageProcessor(**_processor_options(geometry))


class _ResizedFramesOnly(TorchvisionBackend):
    """torchvision's resize of frames already at the size asked (unchanged) and its `normalize_image`."""

    def resize(self, image: torch.Tensor, size: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        if tuple(image.shape[-2:]) != (size.height, size.width):
            raise AssertionError(f"frames of {tuple(image.shape[-2:])} would be resized to {size}: needs torchvision")
        return image

    def normalize(
        self, image: torch.Tensor, mean: Iterable[float], std: Iterable[float], inplace: bool = False, **kwargs: Any
    ) -> torch.Tensor:
        mean_t = torch.as_tensor(mean, dtype=image.dtype, device=image.device)
        std_t = torch.as_tensor(std, dtype=image.dtype, device=image.device)
        if mean_t.ndim == 1:
            mean_t = mean_t.view(-1, 1, 1)
        if std_t.ndim == 1:
            std_t = std_t.view(-1, 1, 1)
        image = image.sub_(mean_t) if inplace else image.sub(mean_t)
        return image.div_(std_t)


class _Qwen3VideoFrames(Qwen3VLVideoProcessor, _ResizedFramesOnly):  # type: ignore[misc]
    pass


def hf_process_video(
    geometry: ProcessorGeometry, frames: npt.NDArray[np.uint8], *, do_resize: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """(`pixel_values_videos`, `video_grid_thw`) of one clip of uint8 [t, h, w, 3] frames (sampled already) from
    transformers' video processor of `geometry` (Qwen3-VL's for `clip` bounds, else Qwen2-VL's) configured as
    `geometry`.

    Without torchvision: for frames at their resized size only (see the module docstring); Qwen2-VL's video
    processor module imports torchvision, so Qwen3-VL's stands in for it with the resize off (the two share their
    rescale-and-normalize and their patchify, and the image rule leaves a size within the bounds unchanged)."""
    low, high = geometry.video_pixels
    arguments: dict[str, Any] = {
        "size": {"shortest_edge": low, "longest_edge": high},
        "patch_size": geometry.patch_size,
        "temporal_patch_size": geometry.temporal_patch_size,
        "merge_size": geometry.merge_size,
        "image_mean": list(geometry.image_mean),
        "image_std": list(geometry.image_std),
    }
    processor: Any
    if HAS_TORCHVISION and geometry.video_bounds == "frame":
        from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor

        processor = Qwen2VLVideoProcessor(**arguments)
    elif HAS_TORCHVISION:
        processor = Qwen3VLVideoProcessor(**arguments)
    else:
        processor = _Qwen3VideoFrames(**arguments)
        do_resize = do_resize and geometry.video_bounds == "clip"
    out = processor(
        videos=[frames],
        return_tensors="pt",
        do_sample_frames=False,
        cap_pixels_per_frame=False,
        do_convert_rgb=False,
        do_resize=do_resize,
    )
    return out["pixel_values_videos"], out["video_grid_thw"]


def randomize(model: torch.nn.Module, seed: int) -> None:
    """Non-trivial values everywhere, norms and biases included, so every copied tensor matters."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            is_norm = "norm" in name or "ln_q" in name
            param.copy_((1.0 + 0.1 * noise) if is_norm and name.endswith("weight") else 0.05 * noise)


def patch_rows(grids: Grids, row_width: int, seed: int = 0) -> torch.Tensor:
    """Random `pixel_values` rows for items of these grids."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(sum(t * h * w for t, h, w in grids), row_width, generator=generator)


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape
    return (a - b).abs().max().item()


def build_towers(
    reference_class: Any, hf_config: Any, config: VisionTowerConfig, tower_class: type[TowerT], seed: int
) -> tuple[Any, TowerT]:
    """transformers' tower with random weights, and ours built from `config` holding the same weights.

    transformers' eager attention (matmul + softmax per segment) is an implementation independent of ours."""
    reference = reference_class._from_config(hf_config, attn_implementation="eager").eval()
    randomize(reference, seed)
    ours = build_vision_tower(config).model
    assert isinstance(ours, tower_class)
    load_state_dict(ours, reference.state_dict())
    return reference, ours


def outputs(
    reference: Any, ours: VisionTower, pixel_values: torch.Tensor, grid_thw: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(transformers' embeddings, ours) of the same inputs."""
    with torch.inference_mode():
        return reference(pixel_values, grid_thw).pooler_output, ours(pixel_values, grid_thw)


def assert_on_grids(reference: Any, ours: VisionTower, grids: Grids, tolerance: float) -> None:
    """Random rows of items of these grids, packed in one batch, embed as transformers embeds them."""
    config = ours.config
    expected, got = outputs(reference, ours, patch_rows(grids, config.row_width), torch.tensor(grids))
    assert got.shape == (sum(t * h * w for t, h, w in grids) // config.merge_unit, config.out_hidden_size)
    assert expected.abs().mean() > 0.1  # the comparison is not between near-zero tensors
    assert max_diff(got, expected) <= tolerance


def assert_on_a_video(
    reference: Any,
    ours: VisionTower,
    geometry: ProcessorGeometry,
    frames: tuple[int, int, int],
    grid: list[int],
    tolerance: float,
) -> None:
    """Random frames (count, height, width), processed by our processor into one item of `grid`, embed as
    transformers embeds that item."""
    count, height, width = frames
    pixels = np.random.default_rng(count).integers(0, 256, (count, height, width, 3), dtype=np.uint8)
    processed = process_video(pixels, geometry)
    assert processed.grid_thw.tolist() == [grid]
    expected, got = outputs(reference, ours, processed.pixel_values, processed.grid_thw)
    assert max_diff(got, expected) <= tolerance


def assert_batch_equals_items_alone(ours: VisionTower, grids: Grids) -> list[int]:
    """Items encoded in one batch equal the items encoded alone; the last item, the first one's pixels again,
    embeds as the first does. Returns each item's output rows."""
    assert grids[-1] == grids[0]
    items = [patch_rows([g], ours.config.row_width, seed=i) for i, g in enumerate(grids)]
    items[-1] = items[0]
    with torch.inference_mode():
        batched = ours(torch.cat(items), torch.tensor(grids))
        alone = [ours(x, torch.tensor([g])) for x, g in zip(items, grids, strict=True)]
    rows = [a.shape[0] for a in alone]
    assert ours.output_rows(torch.tensor(grids)) == rows
    assert max_diff(batched, torch.cat(alone)) <= 1e-5
    # Two items with identical pixels give identical embeddings wherever they sit in the batch.
    assert max_diff(batched[: rows[0]], batched[-rows[0] :]) <= 1e-5
    return rows


def record_attention(monkeypatch: pytest.MonkeyPatch) -> list[tuple[tuple[int, ...], bool]]:
    """From now on, per `scaled_dot_product_attention` call: the shape of q, and whether the call had no mask
    (no `attn_mask`, no argument past q, k, v)."""
    calls: list[tuple[tuple[int, ...], bool]] = []
    real_sdpa = F.scaled_dot_product_attention

    def recording_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        calls.append((tuple(q.shape), kwargs.get("attn_mask") is None and not args))
        return real_sdpa(q, k, v, *args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", recording_sdpa)
    return calls


def hf_config_arguments(vision_config: dict[str, Any]) -> dict[str, Any]:
    """A checkpoint's `vision_config` as arguments of transformers' vision config class: `in_chans` is
    `in_channels` there, and `spatial_patch_size` (the checkpoints repeat `patch_size` under it) is left out."""
    arguments = dict(vision_config)
    arguments["in_channels"] = arguments.pop("in_chans")
    arguments.pop("spatial_patch_size")
    return arguments


def assert_same_parameters_as_transformers(
    reference_class: Any, hf_config: Any, tower_class: type[TowerT], preset: VisionTowerConfig
) -> tuple[Any, TowerT]:
    """Both towers of a published checkpoint, built on the meta device, have the same parameter names and shapes
    but for the patch embedding: a Conv3d weight in transformers, the same weight flattened for a Linear in ours
    (the published towers: 1280 channels, patches of 3 channels x 2 frames x 14 x 14 pixels). Returns both."""
    with torch.device("meta"):
        reference = reference_class._from_config(hf_config)
        ours = tower_class(preset)
    theirs = {k: tuple(v.shape) for k, v in reference.state_dict().items()}
    mine = {k: tuple(v.shape) for k, v in ours.state_dict().items()}
    assert theirs.pop("patch_embed.proj.weight") == (1280, 3, 2, 14, 14)
    assert mine.pop("patch_embed.proj.weight") == (1280, 1176)
    assert mine == theirs
    return reference, ours
