"""Loading a settings model from YAML, environment and CLI flags, shared by the gateway and the engine.

Precedence: CLI flag > environment (`MMGATE_` prefix, `__` nesting) > YAML file > model default.
Any invalid value stops start-up with a `ConfigError` naming the key and the value, and so does an environment
variable with the process's prefix that names no key of its settings (`ProcessEnvSource`).
"""

from __future__ import annotations

import contextvars
import difflib
import os
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ValidationError
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings, EnvSettingsSource, PydanticBaseSettingsSource

_yaml_data: contextvars.ContextVar[dict[str, Any]] = contextvars.ContextVar("mmgate_yaml_data")

SettingsT = TypeVar("SettingsT", bound=BaseSettings)

# The environment prefixes of every mmgate process. One shell may configure several of them, and the engine's
# prefix extends the gateway's, so a variable belongs to the process with the longest prefix that it starts with
# and that a key follows: `MMGATE_ENGINE_MODEL__PRESET` is the engine's, `MMGATE_ENGINE__URL` the gateway's
# (its `engine` section).
PROCESS_ENV_PREFIXES = ("MMGATE_", "MMGATE_ENGINE_")


class ConfigError(Exception):
    """A configuration file or value that cannot be used; the message names the key and the value."""


class LayeredSettings(BaseSettings):
    """Base of both processes' settings: sources in the precedence order above (CLI arguments arrive as init
    arguments), and no .env or secrets files."""

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        return (init_settings, ProcessEnvSource(settings_cls), YamlDataSource(settings_cls))


class ProcessEnvSource(EnvSettingsSource):
    """pydantic-settings' environment source, which reads only the variables that name a field and so would drop
    a misspelt section (`MMGATE_LIMIT__MAX_REQUEST_BODY_BYTES`) without a word: here a variable of this process
    (see `PROCESS_ENV_PREFIXES`) whose first segment is not a top-level key stops start-up with a `ConfigError`
    naming the variable and the closest key. Nested keys are checked by the sections themselves (extra keys are
    forbidden)."""

    def __call__(self) -> dict[str, Any]:
        unknown = unknown_env_variables(self.settings_cls, os.environ)
        if unknown:
            raise ConfigError("invalid configuration:\n" + "\n".join(f"  {line}" for line in unknown))
        return super().__call__()


def env_owner(name: str, prefixes: Iterable[str]) -> str | None:
    """The prefix, of `prefixes`, of the process that environment variable `name` configures: the longest one that
    `name` starts with (ignoring case) and that is followed by a key (not by nothing, nor by an underscore)."""
    upper = name.upper()
    owners = [
        prefix
        for prefix in prefixes
        if upper.startswith(prefix.upper()) and upper[len(prefix) : len(prefix) + 1] not in ("", "_")
    ]
    return max(owners, key=len, default=None)


def unknown_env_variables(settings_cls: type[BaseSettings], environ: Mapping[str, str]) -> list[str]:
    """One line for each variable of `environ` that belongs to `settings_cls`'s process and whose first segment is
    no top-level key of it, naming the variable and the closest key. The value is not shown: a misspelt variable
    may hold a credential (a Redis URL with its password)."""
    prefix = str(settings_cls.model_config.get("env_prefix") or "")
    delimiter = settings_cls.model_config.get("env_nested_delimiter") or None
    prefixes = {*PROCESS_ENV_PREFIXES, prefix}
    known = list(settings_cls.model_fields)
    lines = []
    for name in sorted(environ):
        if not prefix or env_owner(name, prefixes) != prefix:
            continue
        rest = name[len(prefix) :]
        first, nested = rest.split(delimiter, 1) if delimiter and delimiter in rest else (rest, None)
        if first.lower() in known:
            continue
        hint = _suggest_env(prefix, delimiter, first, nested, known)
        lines.append(f"environment variable {name}: unknown key {first.lower()}; {hint}")
    return lines


def _suggest_env(prefix: str, delimiter: str | None, first: str, nested: str | None, known: list[str]) -> str:
    joiner = delimiter or ""
    # A single underscore where the delimiter belongs: `MMGATE_LIMITS_MAX_REQUEST_BODY_BYTES`.
    for key in known:
        if delimiter and nested is None and first.lower().startswith(key + "_"):
            return f"did you mean {prefix}{key.upper()}{joiner}{first[len(key) + 1 :].upper()}?"
    close = _closest(first.lower(), known)
    if close is not None:
        tail = f"{joiner}{nested.upper()}" if nested is not None else ""
        return f"did you mean {prefix}{close.upper()}{tail}?"
    return f"its top-level keys are {', '.join(known)} ({prefix}<KEY>{joiner}<NESTED KEY>)"


class YamlDataSource(PydanticBaseSettingsSource):
    """The lowest-precedence source: the YAML file given to `load_settings`."""

    def get_field_value(self, field: FieldInfo, field_name: str) -> tuple[Any, str, bool]:
        return _yaml_data.get({}).get(field_name), field_name, False

    def __call__(self) -> dict[str, Any]:
        return dict(_yaml_data.get({}))


def read_yaml(path: str | Path) -> dict[str, Any]:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror or exc}") from exc
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {path} is not valid YAML: {exc}") from exc
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping, not {type(data).__name__}")
    return data


def load_settings(
    settings_cls: type[SettingsT],
    config_file: str | Path | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> SettingsT:
    """Build `settings_cls` from the YAML file, the environment and nested CLI `overrides`."""
    token = _yaml_data.set(read_yaml(config_file) if config_file is not None else {})
    try:
        return settings_cls(**dict(overrides or {}))
    except ValidationError as exc:
        raise ConfigError(describe_validation_error(exc, settings_cls)) from None
    finally:
        _yaml_data.reset(token)


def value_sources(
    settings_cls: type[BaseSettings], config_file: str | Path | None = None, overrides: Mapping[str, Any] | None = None
) -> Iterator[tuple[str, Any, str]]:
    """Each leaf key of the settings `load_settings` builds from the same arguments, as `(dotted key, value,
    source)`; the source is the highest layer that sets the key: `cli`, `env`, `yaml` or `default`."""
    settings = load_settings(settings_cls, config_file, overrides)
    layers = (
        ("cli", dict(overrides or {})),
        ("env", EnvSettingsSource(settings_cls)()),
        ("yaml", read_yaml(config_file) if config_file is not None else {}),
    )
    for path, value in _leaves(settings, ()):
        source = next((name for name, data in layers if _sets(data, path)), "default")
        yield ".".join(path), value, source


def _leaves(model: BaseModel, prefix: tuple[str, ...]) -> Iterator[tuple[tuple[str, ...], Any]]:
    for name in type(model).model_fields:
        value = getattr(model, name)
        if isinstance(value, BaseModel):
            yield from _leaves(value, (*prefix, name))
        else:
            yield (*prefix, name), value


def _sets(data: Any, path: tuple[str, ...]) -> bool:
    for part in path:
        if not isinstance(data, Mapping) or part not in data:
            return False
        data = data[part]
    return True


def describe_validation_error(exc: ValidationError, settings_cls: type[BaseModel] | None = None) -> str:
    lines = []
    for error in exc.errors(include_url=False):
        parts = [str(part) for part in error["loc"] if not _is_union_branch(part)]
        key = ".".join(parts)
        value = error.get("input")
        shown = "" if isinstance(value, dict) else f" = {value!r}"
        message = error["msg"]
        if error["type"] == "extra_forbidden" and settings_cls is not None:
            message = _unknown_key(settings_cls, parts)
        lines.append(f"  {key or '<root>'}{shown}: {message}")
    return "invalid configuration:\n" + "\n".join(lines)


def _unknown_key(settings_cls: type[BaseModel], parts: list[str]) -> str:
    """The message for a key the model does not have: the closest key of its section, when one is close."""
    model: Any = settings_cls
    for part in parts[:-1]:
        field = model.model_fields.get(part) if isinstance(model, type) and issubclass(model, BaseModel) else None
        model = field.annotation if field is not None else None
    if not (isinstance(model, type) and issubclass(model, BaseModel)):
        return "unknown key"
    known = list(model.model_fields)
    close = _closest(parts[-1], known)
    if close is not None:
        return f"unknown key; did you mean {'.'.join([*parts[:-1], close])}?"
    section = ".".join(parts[:-1]) or "the top level"
    return f"unknown key; the keys of {section} are {', '.join(known)}"


def _closest(name: str, known: list[str]) -> str | None:
    close = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
    return close[0] if close else None


_UNION_BRANCH_NAMES = frozenset({"int", "str", "float", "none", "constrained-int"})


def _is_union_branch(part: object) -> bool:
    # pydantic names the branch of a union it tried (e.g. "function-after[...]", "int"); not part of the key.
    return isinstance(part, str) and ("[" in part or part in _UNION_BRANCH_NAMES)
