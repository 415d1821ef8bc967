"""Lets PyPI's torchvision import beside the CPU build of torch, in .venv-vllm (the Makefile installs this module
with a .pth file that imports it at every interpreter start).

PyPI's torchvision wheels are CUDA builds: their C++ ops library (`torchvision/_C.so`) needs libtorch_cuda.so, so
beside a CPU torch it does not load, and torchvision runs without its C++ ops, as it is written to. Only one step of
its import does not allow for that: `torchvision/_meta_registrations.py` registers fake kernels for
`torchvision::nms` and `torchvision::qnms` without checking that the ops library defined them, and torch refuses
that for an undefined operator ("operator torchvision::nms does not exist"). This module declares the two schemas
(as the ops library would) before torchvision is first imported, so the import completes; calling either op still
fails, as every torchvision C++ op does without the library. transformers imports torchvision for Qwen2-VL's
image processor, and vLLM imports that processor's module.

It imports nothing at start-up: torch is imported when torchvision is first looked for.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from importlib.abc import MetaPathFinder
from importlib.machinery import ModuleSpec
from types import ModuleType

_SCHEMA = "(Tensor dets, Tensor scores, float iou_threshold) -> Tensor"


class _DeclareTorchvisionOps(MetaPathFinder):
    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> ModuleSpec | None:
        if fullname == "torchvision":
            sys.meta_path.remove(self)
            _declare()
        return None  # the module itself is found by the usual finders


def _declare() -> None:
    import torch

    if torch.version.cuda is not None:
        return  # with a CUDA torch, torchvision's ops library loads and defines them itself
    for name in ("nms", "qnms"):
        torch.library.define(f"torchvision::{name}", _SCHEMA)


sys.meta_path.insert(0, _DeclareTorchvisionOps())
