"""Every key of a settings model and of a YAML mapping, dotted, sections included: a shipped config file must
document exactly the model's keys."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel


def model_keys(model: type[BaseModel], prefix: str = "") -> set[str]:
    keys = set()
    for name, field in model.model_fields.items():
        keys.add(prefix + name)
        annotation = field.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            keys |= model_keys(annotation, prefix + name + ".")
    return keys


def yaml_keys(data: dict[str, Any], prefix: str = "") -> set[str]:
    keys = set()
    for name, value in data.items():
        keys.add(prefix + name)
        if isinstance(value, dict):
            keys |= yaml_keys(value, prefix + name + ".")
    return keys
