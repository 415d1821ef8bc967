"""Build a vision tower and fill its weights: from a local Hugging Face checkpoint, or seeded random.

The tower is a named preset, or the one a checkpoint directory's config.json describes (`tower_config`); a
preset named together with a checkpoint must be the tower its config.json describes.

Checkpoints are safetensors files (one file, several, or shards listed in `model.safetensors.index.json`).
Only the vision tower's tensors are read, under either key layout: `visual.*` (the published Qwen
checkpoints) or `model.visual.*` (checkpoints saved by recent transformers). The tower is created on the meta
device and materialized directly on the target device and dtype, so no full float32 copy is made on the host.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, fields, replace
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from engine_adapter.models.config import VisionTowerConfig
from engine_adapter.models.presets import DEFAULT_PRESET, config_from_checkpoint, find_preset, get_preset
from engine_adapter.models.qwen2_5_vl import Qwen25VisionTower
from engine_adapter.models.qwen2_vl import Qwen2VisionTower
from engine_adapter.models.qwen3_vl import Qwen3VisionTower
from engine_adapter.models.tower import VisionTower

__all__ = [
    "KEY_PREFIXES",
    "CheckpointError",
    "ConfigMismatchError",
    "LoadedTower",
    "NoTowerConfigError",
    "build_vision_tower",
    "checkpoint_config",
    "create_tower",
    "init_random_weights",
    "load_checkpoint",
    "load_state_dict",
    "tower_config",
]

logger = logging.getLogger(__name__)

KEY_PREFIXES = ("model.visual.", "visual.")
INDEX_FILE = "model.safetensors.index.json"
_PATCH_EMBED_KEY = "patch_embed.proj.weight"
_ARCH_FIELDS = tuple(f.name for f in fields(VisionTowerConfig) if f.name != "name")


class CheckpointError(ValueError):
    """A checkpoint that cannot fill the tower (missing files, missing or unexpected keys, wrong shapes)."""


class ConfigMismatchError(CheckpointError):
    """A checkpoint whose config.json describes another tower than the one asked for."""


class NoTowerConfigError(CheckpointError):
    """A checkpoint with no config.json to describe its tower (a file, or a directory without one)."""


def checkpoint_config(checkpoint: str | Path) -> VisionTowerConfig:
    """The tower a checkpoint directory's config.json describes (any Qwen2-VL, Qwen2.5-VL or Qwen3-VL tower).

    Named after the preset it equals, if any (its depth, widths, heads, window layout, patch geometry), else
    after the directory. CheckpointError (NoTowerConfigError without a config.json) when there is none to build.
    """
    path = Path(checkpoint)
    if not path.exists():
        raise CheckpointError(f"checkpoint {str(path)!r} does not exist")
    if not path.is_dir():
        raise NoTowerConfigError(
            f"checkpoint {str(path)!r} is a file: only a checkpoint directory's config.json describes its tower"
        )
    if not (path / "config.json").is_file():
        raise NoTowerConfigError(f"checkpoint directory {str(path)!r} has no config.json to describe its tower")
    try:
        config = config_from_checkpoint(path)
    except ValueError as exc:
        raise CheckpointError(str(exc)) from None
    preset = find_preset(config)
    return config if preset is None else replace(config, name=preset.name)


def tower_config(preset: str | None, checkpoint: str | Path | None = None) -> VisionTowerConfig:
    """The tower to build: the named preset; without one, the checkpoint's (`checkpoint_config`); without a
    checkpoint either, the default preset (tiny)."""
    if preset is not None:
        return get_preset(preset)
    if checkpoint is not None:
        return checkpoint_config(checkpoint)
    return get_preset(DEFAULT_PRESET)


def create_tower(config: VisionTowerConfig) -> VisionTower:
    """An uninitialized tower of the config's architecture (under `torch.device("meta")`: no allocation)."""
    if config.arch == "qwen2_vl":
        return Qwen2VisionTower(config)
    if config.arch == "qwen3_vl":
        return Qwen3VisionTower(config)
    return Qwen25VisionTower(config)


@dataclass(frozen=True, slots=True)
class LoadedTower:
    model: VisionTower
    weights: str
    """What filled the weights, for the start-up log: `checkpoint <path> (...)` or `random (seed=N)`."""
    from_checkpoint: bool


def build_vision_tower(
    config: VisionTowerConfig | str | None = None,
    *,
    checkpoint: str | Path | None = None,
    seed: int = 0,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> LoadedTower:
    """A tower in eval mode on `device` / `dtype` with checkpoint weights, or random ones from `seed`.

    `config`: a tower, a preset's name, or None for `tower_config(None, checkpoint)`: the checkpoint's own.
    """
    if not isinstance(config, VisionTowerConfig):
        config = tower_config(config, checkpoint)
    with torch.device("meta"):
        model = create_tower(config)
    model = model.to(dtype=dtype).to_empty(device=device).eval()
    model.requires_grad_(False)
    if checkpoint is None:
        init_random_weights(model, seed)
        weights = f"random (seed={seed})"
    else:
        weights = load_checkpoint(model, checkpoint)
    logger.info("vision tower %s (%s) on %s/%s: %s weights", config.name, config.arch, device, dtype, weights)
    return LoadedTower(model=model, weights=weights, from_checkpoint=checkpoint is not None)


def init_random_weights(model: nn.Module, seed: int) -> None:
    """Deterministic weights from `seed`, the same on every device: drawn on the host in float32, then copied.

    Linear and embedding weights ~ N(0, 0.02), biases 0, norm scales 1 (the transformers initialisation).
    """
    generator = torch.Generator().manual_seed(seed)
    done: set[str] = set()
    for module_name, module in model.named_modules():
        for param_name, param in module.named_parameters(recurse=False):
            full = f"{module_name}.{param_name}" if module_name else param_name
            if isinstance(module, nn.Linear | nn.Embedding) and param_name == "weight":
                values = torch.empty(param.shape, dtype=torch.float32).normal_(0.0, 0.02, generator=generator)
            elif param_name == "bias":
                values = torch.zeros(param.shape)
            elif param_name == "weight":  # LayerNorm / RMSNorm scale
                values = torch.ones(param.shape)
            else:
                raise TypeError(f"no initialisation rule for parameter {full}")
            with torch.no_grad():
                param.copy_(values)
            done.add(full)
    missing = {name for name, _ in model.named_parameters()} - done
    if missing:
        raise TypeError(f"parameters left uninitialised: {sorted(missing)}")


def _safetensors_files(path: Path) -> tuple[list[Path], dict[str, Path] | None]:
    """The files to read, and the key -> file map when a shard index is present."""
    if path.is_file():
        return [path], None
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {str(path)!r} does not exist")
    index = path / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise CheckpointError(f"{index}: not a safetensors index ({exc!r})") from None
        key_files = {key: path / name for key, name in weight_map.items()}
        files = sorted(set(key_files.values()))
        absent = [str(f) for f in files if not f.is_file()]
        if absent:
            raise CheckpointError(f"{index} lists shards that are missing: {absent}")
        return files, key_files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"checkpoint directory {str(path)!r} has no *.safetensors files")
    return files, None


def _visual_keys(keys: list[str], where: str) -> tuple[str, list[str]]:
    present = [prefix for prefix in KEY_PREFIXES if any(k.startswith(prefix) for k in keys)]
    if not present:
        raise CheckpointError(
            f"{where} holds no vision tower weights: no key starts with {' or '.join(map(repr, KEY_PREFIXES))}"
        )
    if len(present) > 1:
        raise CheckpointError(f"{where} mixes both key layouts {present}; expected exactly one")
    prefix = present[0]
    return prefix, [k for k in keys if k.startswith(prefix)]


def _key_locations(files: list[Path], key_files: dict[str, Path] | None) -> dict[str, Path]:
    """Every tensor key in the checkpoint and the file that holds it."""
    if key_files is not None:
        return key_files
    locations: dict[str, Path] = {}
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as handle:
            locations.update(dict.fromkeys(handle.keys(), file))
    return locations


def _iter_tensors(locations: dict[str, Path], keys: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """Read `keys` one at a time, opening each shard once."""
    by_file: dict[Path, list[str]] = {}
    for key in keys:
        by_file.setdefault(locations[key], []).append(key)
    for file, file_keys in by_file.items():
        with safe_open(str(file), framework="pt", device="cpu") as handle:
            for key in file_keys:
                yield key, handle.get_tensor(key)


def _check_config(model: VisionTower, directory: Path) -> None:
    """Refuse a checkpoint whose config.json describes another tower (shapes alone miss window layouts)."""
    if not (directory / "config.json").is_file():
        return
    try:
        theirs = config_from_checkpoint(directory)
    except ValueError as exc:
        raise CheckpointError(str(exc)) from None
    ours = model.config
    diffs = [
        f"{name}: checkpoint {getattr(theirs, name)!r}, tower {getattr(ours, name)!r}"
        for name in _ARCH_FIELDS
        if name != "geometry_name" and getattr(theirs, name) != getattr(ours, name)
    ]
    if diffs:
        raise ConfigMismatchError(
            f"{directory}/config.json describes a different vision tower than {ours.name!r}: " + "; ".join(diffs)
        )


def _format_keys(keys: set[str]) -> str:
    shown = sorted(keys)[:8]
    more = f" and {len(keys) - len(shown)} more" if len(keys) > len(shown) else ""
    return ", ".join(shown) + more


def load_checkpoint(model: VisionTower, checkpoint: str | Path) -> str:
    """Fill `model` from the checkpoint's vision tower tensors; returns a description for the start-up log.

    Every tower parameter must be present with a matching shape and no other visual tensor may be, so a
    checkpoint of another size or architecture fails here with the keys named instead of loading garbage.
    """
    path = Path(checkpoint)
    files, key_files = _safetensors_files(path)
    if path.is_dir():
        _check_config(model, path)
    locations = _key_locations(files, key_files)
    prefix, keys = _visual_keys(list(locations), str(path))
    _assign(model, prefix, keys, _iter_tensors(locations, keys), f"checkpoint {str(path)!r}")
    return f"checkpoint {path} ({len(keys)} tensors, key prefix {prefix!r})"


def load_state_dict(model: VisionTower, state_dict: Mapping[str, torch.Tensor]) -> None:
    """Fill `model` from an in-memory state dict: a whole model's (`visual.*` / `model.visual.*` keys, other
    keys ignored) or a bare vision tower's, e.g. `transformers`' vision model `state_dict()`."""
    keys = list(state_dict)
    if any(k.startswith(KEY_PREFIXES) for k in keys):
        prefix, keys = _visual_keys(keys, "state dict")
    else:
        prefix = ""
    _assign(model, prefix, keys, ((k, state_dict[k]) for k in keys), "state dict")


def _assign(
    model: VisionTower,
    prefix: str,
    keys: list[str],
    tensors: Iterator[tuple[str, torch.Tensor]],
    source: str,
) -> None:
    params = dict(model.named_parameters())
    found = {k.removeprefix(prefix) for k in keys}
    missing = set(params) - found
    unexpected = found - set(params)
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"missing {len(missing)} key(s): {_format_keys({prefix + k for k in missing})}")
        if unexpected:
            parts.append(f"unexpected {len(unexpected)} key(s): {_format_keys({prefix + k for k in unexpected})}")
        raise CheckpointError(f"{source} does not match vision tower {model.config.name!r}: " + "; ".join(parts))
    for key, tensor in tensors:
        name = key.removeprefix(prefix)
        param = params[name]
        if name == _PATCH_EMBED_KEY and tensor.ndim == 5:
            # Conv3d [out, c, t, p, p] -> Linear [out, row_width]
            tensor = tensor.reshape(tensor.shape[0], -1)
        if tensor.shape != param.shape:
            raise CheckpointError(
                f"{source}: {key} has shape {tuple(tensor.shape)}, "
                f"tower {model.config.name!r} needs {tuple(param.shape)}"
            )
        with torch.no_grad():
            param.copy_(tensor)
