"""Device and dtype selection, moving, syncing and peak memory."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from engine_adapter import device as dev
from engine_adapter.models import build_vision_tower

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture
def no_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


@pytest.fixture
def two_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    """Pretend to be a two-GPU machine so the selection logic can be checked anywhere."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)


@pytest.mark.usefixtures("no_cuda")
def test_auto_is_cpu_float32_without_cuda() -> None:
    choice = dev.select_device()
    assert choice == dev.DeviceChoice(torch.device("cpu"), torch.float32)
    assert str(choice) == "cpu, float32"


@pytest.mark.usefixtures("no_cuda")
def test_explicit_overrides_on_cpu() -> None:
    assert dev.select_device(" CPU ", "bfloat16") == dev.DeviceChoice(torch.device("cpu"), torch.bfloat16)
    assert dev.resolve_dtype("float16", torch.device("cpu")) == torch.float16
    assert dev.resolve_dtype("float32", torch.device("cpu")) == torch.float32


@pytest.mark.usefixtures("no_cuda")
@pytest.mark.parametrize("spec", ["cuda", "cuda:1"])
def test_cuda_requested_without_cuda_is_refused(spec: str) -> None:
    with pytest.raises(ValueError, match=f"device '{spec}' was requested but CUDA is not available"):
        dev.resolve_device(spec)


@pytest.mark.parametrize("spec", ["tpu", "mps", "cuda:x", "gpu0", ""])
def test_unknown_devices_are_refused(spec: str) -> None:
    with pytest.raises(ValueError, match="is not one of auto, cpu, cuda, cuda:N"):
        dev.resolve_device(spec)


def test_unknown_dtypes_are_refused() -> None:
    with pytest.raises(ValueError, match="dtype 'fp8' is not one of auto, float32, bfloat16, float16"):
        dev.resolve_dtype("fp8", torch.device("cpu"))


@pytest.mark.usefixtures("two_gpus")
def test_selection_on_a_cuda_machine() -> None:
    assert dev.resolve_device("auto") == torch.device("cuda", 0)
    assert dev.resolve_device("cuda") == torch.device("cuda", 0)
    assert dev.resolve_device("cuda:1") == torch.device("cuda", 1)
    assert dev.resolve_device("cpu") == torch.device("cpu")
    with pytest.raises(ValueError, match="has 2 CUDA device"):
        dev.resolve_device("cuda:2")
    assert dev.resolve_dtype("auto", torch.device("cuda", 1)) == torch.bfloat16
    assert dev.resolve_dtype("auto", torch.device("cpu")) == torch.float32


def test_auto_dtype_without_bf16_support_is_float16(two_gpus: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    assert dev.select_device().dtype == torch.float16


def test_cpu_helpers() -> None:
    cpu = torch.device("cpu")
    assert dev.peak_memory_bytes(cpu) is None
    dev.reset_peak_memory(cpu)
    dev.synchronize(cpu)
    module = dev.move_module(nn.Linear(4, 4), dev.DeviceChoice(cpu, torch.bfloat16))
    assert module.weight.dtype == torch.bfloat16


@requires_cuda
def test_tiny_tower_on_cuda_tracks_cpu_float32() -> None:
    choice = dev.select_device("cuda", "auto")
    assert choice.dtype in (torch.bfloat16, torch.float16)
    cpu = build_vision_tower("tiny-2.5", seed=1).model
    gpu = build_vision_tower("tiny-2.5", seed=1, device=choice.device, dtype=choice.dtype).model
    grid = torch.tensor([[1, 16, 16], [2, 10, 12]])
    x = torch.randn(256 + 240, 1176, generator=torch.Generator().manual_seed(0))
    dev.reset_peak_memory(choice.device)
    with torch.inference_mode():
        expected = cpu(x, grid)
        got = gpu(x.to(choice.device), grid)
    dev.synchronize(choice.device)
    peak = dev.peak_memory_bytes(choice.device)
    assert peak is not None
    assert peak > 0
    assert got.device.type == "cuda"
    torch.testing.assert_close(got.float().cpu(), expected, atol=0.05, rtol=0.05)
    assert "cuda" in dev.describe(choice)
