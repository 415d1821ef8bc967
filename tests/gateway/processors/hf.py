"""transformers' own processors of each family, built from the configs the gateway charges by (its package data,
gateway/processors/configs/), and what each says about an item's tokens. Runs in the measuring process
(measure.py), which has torchvision: the processors are the torchvision ("fast") ones vLLM runs.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

CONFIGS = Path(__file__).resolve().parents[3] / "gateway" / "processors" / "configs"


def _config(family: str, name: str) -> dict[str, Any] | None:
    path = CONFIGS / family / name
    return json.loads(path.read_text()) if path.exists() else None


@dataclass
class Built:
    image: Any
    video: Any | None
    image_tokens: Callable[[Any], list[int]]
    """Each image's LLM tokens (or patches) from the image processor's output."""
    video_tokens: Callable[[Any], list[int]] | None = None
    video_kwargs: dict[str, Any] | None = None


def _grid_tokens(key: str, merge: int) -> Callable[[Any], list[int]]:
    return lambda out: [int(t * h * w) // (merge * merge) for t, h, w in out[key].tolist()]


def build(family: str) -> Built:
    pre = _config(family, "preprocessor_config.json") or {}
    video = _config(family, "video_preprocessor_config.json")
    proc = _config(family, "processor_config.json") or {}
    if family in ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "glm4v"):
        if family == "glm4v":
            from transformers.models.glm4v.image_processing_glm4v import Glm4vImageProcessor as Image
            from transformers.models.glm4v.video_processing_glm4v import Glm4vVideoProcessor as Video
        else:
            from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor as Image

            if family == "qwen3_vl":
                from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor as Video
            else:
                from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor as Video
        image = Image.from_dict(pre)
        merge = int(pre["merge_size"])
        return Built(
            image,
            Video.from_dict(video or pre),
            _grid_tokens("image_grid_thw", merge),
            _grid_tokens("video_grid_thw", merge),
            {"do_sample_frames": False},
        )
    if family == "gemma3":
        from transformers.models.gemma3.image_processing_gemma3 import Gemma3ImageProcessor

        seq = int(proc["image_seq_length"])
        return Built(
            Gemma3ImageProcessor.from_dict(pre), None, lambda out: [int(seq * (n + 1)) for n in out["num_crops"]]
        )
    if family == "llama4":
        from transformers.models.llama4.image_processing_llama4 import Llama4ImageProcessor

        vision = (_config(family, "config.json") or {})["vision_config"]
        per_tile = (vision["image_size"] // vision["patch_size"]) ** 2 * vision["pixel_shuffle_ratio"] ** 2

        def llama4_tokens(out: Any) -> list[int]:
            # One image: its tiles (and the global thumbnail) are pixel_values' rows.
            return [int(out["pixel_values"].shape[0] * per_tile)]

        return Built(Llama4ImageProcessor.from_dict(pre), None, llama4_tokens)
    if family == "internvl3":
        from transformers.models.got_ocr2.image_processing_got_ocr2 import GotOcr2ImageProcessor
        from transformers.models.internvl.video_processing_internvl import InternVLVideoProcessor

        seq = int(proc["image_seq_length"])
        return Built(
            GotOcr2ImageProcessor.from_dict(pre),
            InternVLVideoProcessor.from_dict(video),
            lambda out: [int(n) * seq for n in out["num_patches"]],
            lambda out: [int(out["pixel_values_videos"].shape[1]) * seq],
        )
    if family in ("pixtral", "mistral3"):
        from transformers.models.pixtral.image_processing_pixtral import PixtralImageProcessor

        patch = int(proc["patch_size"]) * int(proc["spatial_merge_size"])

        def pixtral_tokens(out: Any) -> list[int]:
            # A row of patches and an [IMG_BREAK] (the last row's is [IMG_END]).
            return [(h // patch) * (w // patch + 1) for h, w in out["image_sizes"].tolist()]

        return Built(PixtralImageProcessor.from_dict(pre), None, pixtral_tokens)
    if family == "phi4_multimodal":
        from transformers.models.phi4_multimodal.image_processing_phi4_multimodal import (
            Phi4MultimodalImageProcessor,
        )

        return Built(Phi4MultimodalImageProcessor.from_dict(pre), None, lambda out: out["num_img_tokens"].tolist())
    if family == "llava_onevision":
        from transformers.models.llava_onevision.image_processing_llava_onevision import (
            LlavaOnevisionImageProcessor,
        )
        from transformers.models.llava_onevision.processing_llava_onevision import LlavaOnevisionProcessor
        from transformers.models.llava_onevision.video_processing_llava_onevision import (
            LlavaOnevisionVideoProcessor,
        )

        image = LlavaOnevisionImageProcessor.from_dict(pre)
        # The processor's own token count, without the tokenizer it would load.
        counter = LlavaOnevisionProcessor.__new__(LlavaOnevisionProcessor)
        counter.image_processor = image
        counter.patch_size = int(proc["patch_size"])
        counter.num_image_tokens = int(proc["num_image_tokens"])
        counter.vision_feature_select_strategy = proc["vision_feature_select_strategy"]
        counter.vision_aspect_ratio = proc["vision_aspect_ratio"]
        side = int(pre["size"]["height"])

        def llava_tokens(out: Any) -> list[int]:
            return [int(counter._get_number_of_features(h, w, side, side)) for h, w in out["image_sizes"].tolist()]

        def llava_video_tokens(out: Any) -> list[int]:
            # The processor's `replace_video_token` (its video placeholder count).
            text = counter.replace_video_token(out, 0)
            return [len(text) // len(counter.video_token)]

        counter.video_token = "<video>"
        return Built(image, LlavaOnevisionVideoProcessor.from_dict(video), llava_tokens, llava_video_tokens)
    raise ValueError(f"no transformers processor for {family!r}")
