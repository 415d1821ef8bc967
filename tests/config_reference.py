"""Generates `configs/reference.md`, the configuration reference of the gateway and the engine.

    .venv/bin/python -m tests.config_reference > configs/reference.md     (or: make config-reference)

Keys, types, defaults and environment variables come from the settings models; each key's description is the
comment that documents it in `configs/gateway.yaml` / `configs/engine.yaml` (tests hold those files to every
key and every default), so the prose is written once. `tests/test_config_reference.py` fails when the
committed reference is out of date.
"""

from __future__ import annotations

import enum
import re
import types
import typing
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from annotated_types import Ge, Gt, Le
from pydantic import BaseModel, ByteSize
from pydantic.fields import FieldInfo

from engine_adapter.config import EngineSettings
from gateway.config import GatewaySettings

ROOT = Path(__file__).resolve().parents[1]

_KEY_LINE = re.compile(r"^(?P<indent> *)(?P<key>[A-Za-z_][A-Za-z0-9_]*):(?P<rest>.*)$")


def yaml_comments(path: Path) -> dict[str, str]:
    """`section.key` → the comment on its line and the comment-only lines under it, joined."""
    comments: dict[str, list[str]] = {}
    stack: list[tuple[int, str]] = []
    current: str | None = None
    for line in path.read_text(encoding="utf-8").splitlines():
        match = _KEY_LINE.match(line)
        if match:
            indent = len(match["indent"])
            while stack and stack[-1][0] >= indent:
                stack.pop()
            stack.append((indent, match["key"]))
            current = ".".join(key for _, key in stack)
            _, _, comment = match["rest"].partition("#")
            comments[current] = [comment.strip()] if comment.strip() else []
        elif line.strip().startswith("#") and current is not None and line.startswith(" "):
            comments[current].append(line.strip().lstrip("#").strip())
        elif not line.strip().startswith("#") and line.strip() and not line.strip().startswith("-"):
            current = None
    return {key: " ".join(parts) for key, parts in comments.items()}


def type_name(annotation: Any, metadata: list[Any]) -> str:
    origin = typing.get_origin(annotation)
    if origin is typing.Annotated:
        inner, *extra = typing.get_args(annotation)
        return type_name(inner, [*metadata, *extra])
    if origin in (typing.Union, types.UnionType):
        options = [arg for arg in typing.get_args(annotation) if arg is not type(None)]
        nullable = len(options) < len(typing.get_args(annotation))
        text = " or ".join(type_name(option, metadata) for option in options)
        return f"{text} or null" if nullable else text
    if origin is tuple:
        return f"list of {type_name(typing.get_args(annotation)[0], [])}"
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        return " \\| ".join(f"`{member.value}`" for member in annotation)
    names = {ByteSize: "bytes", bool: "boolean", int: "integer", float: "number", str: "string"}
    name = names.get(annotation, getattr(annotation, "__name__", str(annotation)))
    bounds = [f"≥ {m.ge}" for m in metadata if isinstance(m, Ge)] + [f"> {m.gt}" for m in metadata if isinstance(m, Gt)]
    bounds += [f"≤ {m.le}" for m in metadata if isinstance(m, Le)]
    return f"{name} ({', '.join(bounds)})" if bounds else name


def default_text(value: Any) -> str:
    if value is None:
        return "`null`"
    if isinstance(value, ByteSize):
        for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
            if value and value % (1 << shift) == 0:
                return f"`{value >> shift}{unit}` ({int(value):,})"
        return f"`{int(value)}`"
    if isinstance(value, enum.Enum):
        return f"`{value.value}`"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, tuple):
        return "`[" + ", ".join(str(item) for item in value) + "]`"
    return f"`{value}`"


def rows(model: type[BaseModel], prefix: str = "") -> Iterator[tuple[str, FieldInfo]]:
    for name, field in model.model_fields.items():
        annotation = field.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            yield from rows(annotation, f"{prefix}{name}.")
        else:
            yield f"{prefix}{name}", field


def section(title: str, model: type[BaseModel], env_prefix: str, config: Path) -> list[str]:
    comments = yaml_comments(config)
    lines = [
        f"## {title}",
        "",
        f"Annotated example with every default: `{config.relative_to(ROOT)}`. Environment: `{env_prefix}` + the key "
        "in capitals with `__` between levels.",
        "",
        "| key | type | default | environment | description |",
        "| --- | --- | --- | --- | --- |",
    ]
    for key, field in rows(model):
        env = env_prefix + key.upper().replace(".", "__")
        description = comments.get(key, "").replace("|", "\\|")
        annotation = field.annotation
        kind = type_name(annotation, list(field.metadata))
        lines.append(f"| `{key}` | {kind} | {default_text(field.default)} | `{env}` | {description} |")
    return [*lines, ""]


def render() -> str:
    lines = [
        "# Configuration reference",
        "",
        "Generated by `make config-reference` from the settings models (`gateway/config.py`,",
        "`engine_adapter/config.py`) and the comments of the annotated config files; do not edit by hand.",
        "Precedence: CLI flag > environment > YAML file > default. Byte sizes take integers or strings such as",
        "`256MiB`, `1.5GiB`, `64MB`; `null` turns a limit off. An invalid value stops start-up with a message naming",
        "the key and the value.",
        "",
        *section("Gateway (`python -m gateway`)", GatewaySettings, "MMGATE_", ROOT / "configs" / "gateway.yaml"),
        *section(
            "Engine (`python -m engine_adapter`)", EngineSettings, "MMGATE_ENGINE_", ROOT / "configs" / "engine.yaml"
        ),
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    print(render(), end="")
