"""Which family a served model belongs to, by its name: vLLM's `GET /v1/models` gives each model's `id` (the served
name) and `root` (the checkpoint's id or path), trtllm-serve the model's name. Matched without regard to case,
separators or suffixes (`-Instruct`, `-hf`, `-FP8`, sizes, an organisation or a directory in front); the most
specific pattern first ("Qwen2.5-VL" is not Qwen2-VL)."""

from __future__ import annotations

import re
from collections.abc import Iterable

_SEP = r"[-_. ]?"
FAMILY_PATTERNS: tuple[tuple[str, str], ...] = (
    ("qwen3_vl", rf"qwen{_SEP}3{_SEP}vl"),
    ("qwen2_5_vl", rf"qwen{_SEP}2[._]5{_SEP}vl"),
    ("qwen2_vl", rf"qwen{_SEP}2{_SEP}vl"),
    ("glm4v", rf"glm{_SEP}4(?:[._][156])?{_SEP}v"),
    ("gemma3", rf"gemma{_SEP}3(?!{_SEP}n)"),
    ("llama4", rf"llama{_SEP}4"),
    ("internvl3", rf"internvl{_SEP}3"),
    ("mistral3", rf"mistral{_SEP}small{_SEP}3[._][12]|mistral3"),
    ("pixtral", r"pixtral"),
    ("phi4_multimodal", rf"phi{_SEP}4{_SEP}multimodal"),
    ("llava_onevision", rf"llava{_SEP}onevision"),
)
_COMPILED = tuple((family, re.compile(pattern, re.IGNORECASE)) for family, pattern in FAMILY_PATTERNS)


def family_of(names: Iterable[str]) -> str | None:
    """The family of the first name that matches one (a served model's id, its root...)."""
    for name in names:
        for family, pattern in _COMPILED:
            if pattern.search(name):
                return family
    return None
