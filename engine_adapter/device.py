"""The engine's device code in one place: which device and dtype to run on, moving, syncing, peak memory.

Every `torch.cuda` call of the engine goes through here. `auto` picks the current CUDA device with bfloat16
(float16 on GPUs without bf16 support) when one is present, and the CPU with float32 otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeVar

import torch
from torch import nn

__all__ = [
    "DTYPES",
    "DeviceChoice",
    "cuda_available",
    "describe",
    "move_module",
    "peak_memory_bytes",
    "reset_peak_memory",
    "resolve_device",
    "resolve_dtype",
    "select_device",
    "synchronize",
]

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}

ModuleT = TypeVar("ModuleT", bound=nn.Module)


@dataclass(frozen=True, slots=True)
class DeviceChoice:
    device: torch.device
    dtype: torch.dtype

    def __str__(self) -> str:
        return describe(self)


def cuda_available() -> bool:
    return torch.cuda.is_available()


def resolve_device(spec: str = "auto") -> torch.device:
    """`auto`, `cpu`, `cuda` or `cuda:N` -> a device that exists here (ValueError saying why if not)."""
    spec = spec.strip().lower()
    if spec == "auto":
        return torch.device("cuda", torch.cuda.current_device()) if cuda_available() else torch.device("cpu")
    try:
        device = torch.device(spec)
    except RuntimeError:
        raise ValueError(f"device {spec!r} is not one of auto, cpu, cuda, cuda:N") from None
    if device.type == "cpu":
        return torch.device("cpu")
    if device.type != "cuda":
        raise ValueError(f"device {spec!r} is not one of auto, cpu, cuda, cuda:N")
    if not cuda_available():
        raise ValueError(f"device {spec!r} was requested but CUDA is not available on this machine")
    count = torch.cuda.device_count()
    index = torch.cuda.current_device() if device.index is None else device.index
    if index >= count:
        raise ValueError(f"device {spec!r} was requested but this machine has {count} CUDA device(s)")
    return torch.device("cuda", index)


def resolve_dtype(spec: str, device: torch.device) -> torch.dtype:
    """`auto`, `float32`, `bfloat16` or `float16`.

    `auto` is bfloat16 on CUDA (float16 on GPUs without bf16) and float32 on the CPU.
    """
    spec = spec.strip().lower()
    if spec == "auto":
        if device.type != "cuda":
            return torch.float32
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    try:
        return DTYPES[spec]
    except KeyError:
        raise ValueError(f"dtype {spec!r} is not one of auto, {', '.join(DTYPES)}") from None


def select_device(device: str = "auto", dtype: str = "auto") -> DeviceChoice:
    resolved = resolve_device(device)
    return DeviceChoice(device=resolved, dtype=resolve_dtype(dtype, resolved))


def describe(choice: DeviceChoice) -> str:
    """E.g. `cuda:0 (NVIDIA H100 80GB HBM3), bfloat16` or `cpu, float32` for the start-up log."""
    dtype = str(choice.dtype).removeprefix("torch.")
    if choice.device.type == "cuda":
        return f"{choice.device} ({torch.cuda.get_device_name(choice.device)}), {dtype}"
    return f"{choice.device}, {dtype}"


def move_module(module: ModuleT, choice: DeviceChoice) -> ModuleT:
    """Move a module's parameters and buffers to the chosen device and (floating point) dtype."""
    return module.to(device=choice.device, dtype=choice.dtype)


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (a no-op on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def peak_memory_bytes(device: torch.device) -> int | None:
    """Peak bytes allocated by torch on a CUDA device since the last reset; None on the CPU."""
    if device.type != "cuda":
        return None
    return int(torch.cuda.max_memory_allocated(device))


def reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
