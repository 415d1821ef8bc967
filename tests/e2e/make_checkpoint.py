"""Write a tiny random-weight Qwen2-VL or Qwen3-VL checkpoint that vLLM serves on a CPU in a fraction of a second
per request.

Run with the vLLM venv's python (it has torch, transformers and tokenizers):
`python tests/e2e/make_checkpoint.py DIR [--family qwen2_vl|qwen3_vl]` (default qwen2_vl).
Seeded, so the same versions write the same weights; DIR is left alone when it already holds a complete checkpoint
of that family (`.complete`, naming it, is written last). No download: the tokenizer is a byte-level BPE trained here
on a fixed text.

The geometry is the real model's where the processor and the gateway's `media.processor` meet, so the tensors vLLM
materializes per image and video are those of the real model; only the towers are tiny:

- Qwen2-VL: patch 14, merge 2, temporal patch 2, the min/max pixels of Qwen2-VL's preprocessor_config.json (its
  video processor takes the same, per frame). Text: 2 layers x 128; vision: 2 layers x 64, merger to 128.
- Qwen3-VL: patch 16, merge 2, temporal patch 2, Qwen3-VL's preprocessor_config.json and
  video_preprocessor_config.json (the video bounds are of the whole clip). Text: 2 layers x 128; vision: 3 blocks x
  64 with learned positions (16 x 16), the main merger to 128 and DeepStack mergers after blocks 1 and 2, whose
  features vLLM adds to the text model's first two layers: an image's embedding rows are 3 x 128 wide.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

# Qwen2-VL's own chat template (tokenizer_config.json / chat_template.json of Qwen/Qwen2-VL-*-Instruct).
CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}{% if add_vision_id %}Picture {{ image_count.value }}: "
    "{% endif %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}{% set video_count.value = video_count.value + 1 %}"
    "{% if add_vision_id %}Video {{ video_count.value }}: {% endif %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# Qwen2-VL's special tokens, in Qwen's order (their ids there are 151643...151656; here they follow the BPE vocab).
SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
]

# Qwen3-VL's chat template for user, system and assistant turns (Qwen/Qwen3-VL-*-Instruct's chat_template.json
# without its tool-calling branches): no default system prompt, media as Qwen2-VL's.
QWEN3_CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}{% if add_vision_id %}Picture {{ image_count.value }}: "
    "{% endif %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}{% set video_count.value = video_count.value + 1 %}"
    "{% if add_vision_id %}Video {{ video_count.value }}: {% endif %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# Qwen/Qwen2-VL-*-Instruct's preprocessor_config.json.
PREPROCESSOR = {
    "min_pixels": 3136,
    "max_pixels": 12845056,
    "patch_size": 14,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_std": [0.26862954, 0.26130258, 0.27577711],
    "image_processor_type": "Qwen2VLImageProcessor",
    "processor_class": "Qwen2VLProcessor",
}

# Qwen/Qwen3-VL-*-Instruct's preprocessor_config.json and video_preprocessor_config.json.
QWEN3_PREPROCESSOR = {
    "size": {"longest_edge": 16777216, "shortest_edge": 65536},
    "patch_size": 16,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
    "processor_class": "Qwen3VLProcessor",
    "image_processor_type": "Qwen2VLImageProcessorFast",
}
QWEN3_VIDEO_PREPROCESSOR = {
    **{key: value for key, value in QWEN3_PREPROCESSOR.items() if key != "image_processor_type"},
    "size": {"longest_edge": 25165824, "shortest_edge": 4096},
    "video_processor_type": "Qwen3VLVideoProcessor",
}

FAMILIES = ("qwen2_vl", "qwen3_vl")
BPE_VOCAB = 512
MAX_POSITIONS = 131072
SEED = 0

CORPUS = [
    "You are a helpful assistant. Describe this image in one sentence.",
    "The quick brown fox jumps over the lazy dog. A picture of a cat sitting on a red mat.",
    "What is shown in this image? There is a dog and a ball on the grass near the trees.",
    "Count the objects, read the text, name the colours: red, green, blue, yellow, black, white.",
    "The model answers questions about pictures, charts, documents and videos in many languages.",
]


def write_tokenizer(out: Path, template: str) -> dict[str, int]:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=BPE_VOCAB, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tokenizer.train_from_iterator(CORPUS * 4, trainer=trainer)
    tokenizer.add_special_tokens(SPECIAL_TOKENS)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=SPECIAL_TOKENS,
        model_max_length=MAX_POSITIONS,
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = template
    fast.save_pretrained(out)
    (out / "chat_template.json").write_text(json.dumps({"chat_template": template}, indent=2) + "\n")
    ids: dict[str, int] = {}
    for token in SPECIAL_TOKENS:
        found = fast.convert_tokens_to_ids(token)
        assert isinstance(found, int), (token, found)
        ids[token] = found
    assert len(set(ids.values())) == len(SPECIAL_TOKENS), ids
    return ids


def text_config(ids: dict[str, int], vocab_size: int, **extra: object) -> dict[str, object]:
    """The text model both families share (2 layers x 128, 2 heads of 64), and `extra`."""
    return {
        "vocab_size": vocab_size,
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "max_position_embeddings": MAX_POSITIONS,
        "rms_norm_eps": 1e-6,
        "bos_token_id": ids["<|endoftext|>"],
        "eos_token_id": ids["<|im_end|>"],
        "pad_token_id": ids["<|endoftext|>"],
        **extra,
    }


def media_token_ids(ids: dict[str, int]) -> dict[str, int]:
    return {
        "image_token_id": ids["<|image_pad|>"],
        "video_token_id": ids["<|video_pad|>"],
        "vision_start_token_id": ids["<|vision_start|>"],
        "vision_end_token_id": ids["<|vision_end|>"],
    }


def save_model(out: Path, ids: dict[str, int], model_class: type, config: object) -> None:
    """`model_class(config)` with seeded float32 random weights, saved to `out` with its generation config."""
    import torch

    torch.manual_seed(SEED)
    torch.set_default_dtype(torch.float32)
    model = model_class(config).eval()
    model.save_pretrained(out, safe_serialization=True)
    write_generation_config(out, ids)


def write_model(out: Path, ids: dict[str, int], vocab_size: int) -> None:
    """The Qwen2-VL model."""
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    config = Qwen2VLConfig(
        # head_dim 64: M-RoPE's temporal/height/width sections add up to head_dim / 2.
        text_config=text_config(
            ids,
            vocab_size,
            max_window_layers=2,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [8, 12, 12]},
        ),
        vision_config={
            "depth": 2,
            "embed_dim": 64,
            "hidden_size": 128,
            "num_heads": 2,
            "mlp_ratio": 4,
            "patch_size": 14,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
        },
        tie_word_embeddings=False,
        **media_token_ids(ids),
    )
    save_model(out, ids, Qwen2VLForConditionalGeneration, config)


def write_qwen3_model(out: Path, ids: dict[str, int], vocab_size: int) -> None:
    """The Qwen3-VL model, DeepStack mergers included."""
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    config = Qwen3VLConfig(
        # Interleaved M-RoPE: the temporal/height/width sections add up to head_dim / 2.
        text_config=text_config(
            ids,
            vocab_size,
            head_dim=64,
            rope_parameters={
                "rope_type": "default",
                "rope_theta": 5000000.0,
                "mrope_section": [12, 10, 10],
                "mrope_interleaved": True,
            },
        ),
        vision_config={
            "depth": 3,
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_heads": 2,
            "out_hidden_size": 128,
            "patch_size": 16,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "num_position_embeddings": 256,
            "deepstack_visual_indexes": [1, 2],
        },
        tie_word_embeddings=False,
        **media_token_ids(ids),
    )
    save_model(out, ids, Qwen3VLForConditionalGeneration, config)


def write_generation_config(out: Path, ids: dict[str, int]) -> None:
    generation = {
        "bos_token_id": ids["<|endoftext|>"],
        "eos_token_id": [ids["<|im_end|>"], ids["<|endoftext|>"]],
        "pad_token_id": ids["<|endoftext|>"],
        "do_sample": False,
    }
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")


def write_json(path: Path, value: object) -> None:
    path.write_text(json.dumps(value, indent=2) + "\n")


def main(target: str, family: str) -> None:
    out = Path(target)
    # A checkpoint written before the family was recorded has an empty `.complete`: Qwen2-VL.
    if (out / ".complete").exists() and ((out / ".complete").read_text().strip() or "qwen2_vl") == family:
        print(f"checkpoint present: {out}")
        return
    partial = out.with_name(out.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    ids = write_tokenizer(partial, CHAT_TEMPLATE if family == "qwen2_vl" else QWEN3_CHAT_TEMPLATE)
    vocab_size = -(-(max(ids.values()) + 1) // 64) * 64  # the embedding rows, padded like Qwen's
    if family == "qwen2_vl":
        write_model(partial, ids, vocab_size)
        write_json(partial / "preprocessor_config.json", PREPROCESSOR)
    else:
        write_qwen3_model(partial, ids, vocab_size)
        write_json(partial / "preprocessor_config.json", QWEN3_PREPROCESSOR)
        write_json(partial / "video_preprocessor_config.json", QWEN3_VIDEO_PREPROCESSOR)
    (partial / ".complete").write_text(family + "\n")
    shutil.rmtree(out, ignore_errors=True)
    partial.rename(out)
    print(f"{family} checkpoint written: {out} (vocab {vocab_size}, special tokens {ids})")


if __name__ == "__main__":
    args = sys.argv[1:]
    chosen = "qwen2_vl"
    if len(args) == 3 and args[1] == "--family" and args[2] in FAMILIES:
        chosen = args[2]
    elif len(args) != 1:
        sys.exit(f"usage: make_checkpoint.py DIR [--family {'|'.join(FAMILIES)}]")
    main(args[0], chosen)
