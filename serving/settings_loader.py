"""Loading a settings model from YAML, environment and CLI flags, shared by the gateway and the engine.

Precedence: CLI flag > environment (`MMGATE_` prefix, `__` nesting) > YAML file > model default.
Any invalid value stops start-up with a `ConfigError` naming the key (and the environment variable that set it, if
one did) and the value, unless the key is named as a credential (`serving.credentials`); so does an unknown key, or
an environment variable with the process's prefix that names no key of its settings (`ProcessEnvSource`), named
with the closest known key and never with its value. A list key takes from the environment a comma-separated list
(`/a,/b`), a JSON list (`["/a", "/b"]`) or an empty string (no items).
"""

from __future__ import annotations

import contextvars
import difflib
import json
import os
import types
import typing
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ValidationError
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings, EnvSettingsSource, PydanticBaseSettingsSource, SettingsError

from serving.credentials import hide_url_password, is_credential

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

    def _load_env_vars(self) -> Mapping[str, str | None]:
        """The variables, with the value of each one that sets a list key as the JSON list it says
        (`env_list_items`), which is what pydantic-settings reads a list from."""
        env_vars = dict(super()._load_env_vars())
        for path, name in env_keys(self.settings_cls, os.environ).items():
            field = field_at(self.settings_cls, path)
            lookup = name if self.case_sensitive else name.lower()
            value = env_vars.get(lookup)
            if field is None or value is None or not _is_list(field.annotation):
                continue
            env_vars[lookup] = json.dumps(env_list_items(name, ".".join(path), value))
        return env_vars

    def decode_complex_value(self, field_name: str, field: FieldInfo, value: Any) -> Any:
        try:
            return super().decode_complex_value(field_name, field, value)
        except ValueError as exc:
            if field is not self.settings_cls.model_fields.get(field_name):
                raise
            # A whole section in one variable (`MMGATE_LIMITS='{...}'`) that is not JSON.
            raise ConfigError(
                f"invalid configuration:\n  environment variable {self.env_prefix}{field_name.upper()}: section "
                f"{field_name} takes a JSON object, or set its keys one per variable "
                f"({self.env_prefix}{field_name.upper()}{self.env_nested_delimiter or '_'}<KEY>); not JSON: {exc}"
            ) from None


def env_list_items(variable: str, key: str, value: str) -> list[Any]:
    """The items that environment variable `variable` gives list key `key`: a JSON list when `value` starts with
    `[` (or `{` or `"`, which cannot start a comma-separated item), else the comma-separated items with the spaces
    around them removed; an empty value is no items. Anything else is a `ConfigError` naming both, not the value."""
    text = value.strip()
    if not text:
        return []
    if text[0] not in '[{"':
        return [item.strip() for item in text.split(",") if item.strip()]
    try:
        items = json.loads(text)
    except ValueError as exc:
        problem = f"not valid JSON ({exc})"
    else:
        if isinstance(items, list):
            return items
        problem = f"a JSON {type(items).__name__}, not a list"
    raise ConfigError(
        f"invalid configuration:\n  environment variable {variable}: {key} takes a list, comma-separated (a,b) or "
        f'JSON (["a", "b"]); this is {problem}'
    )


def env_keys(settings_cls: type[BaseSettings], environ: Mapping[str, str]) -> dict[tuple[str, ...], str]:
    """The key (as its path of names) that each variable of `environ` belonging to `settings_cls`'s process sets
    → the variable's name. A variable naming no key is listed too (`field_at` finds no field for it)."""
    prefix = str(settings_cls.model_config.get("env_prefix") or "")
    delimiter = settings_cls.model_config.get("env_nested_delimiter") or None
    prefixes = {*PROCESS_ENV_PREFIXES, prefix}
    keys: dict[tuple[str, ...], str] = {}
    for name in sorted(environ):
        if not prefix or env_owner(name, prefixes) != prefix:
            continue
        rest = name[len(prefix) :].lower()
        keys[tuple(rest.split(delimiter) if delimiter else [rest])] = name
    return keys


def env_variable(settings_cls: type[BaseSettings], path: Iterable[str]) -> str:
    """The environment variable that sets the key at `path`."""
    prefix = str(settings_cls.model_config.get("env_prefix") or "")
    delimiter = settings_cls.model_config.get("env_nested_delimiter") or "_"
    return prefix + delimiter.join(path).upper()


def field_at(model: type[BaseModel], path: tuple[str, ...]) -> FieldInfo | None:
    """The field of `model` at `path` (`("upstream", "blocked_paths")`), or None when there is none."""
    field: FieldInfo | None = None
    current: type[BaseModel] | None = model
    for part in path:
        if current is None:
            return None
        field = current.model_fields.get(part)
        if field is None:
            return None
        current = _section_type(field.annotation)
    return field


def _section_type(annotation: Any) -> type[BaseModel] | None:
    options = typing.get_args(annotation) if typing.get_origin(annotation) in (typing.Union, types.UnionType) else ()
    for option in options or (annotation,):
        if isinstance(option, type) and issubclass(option, BaseModel):
            return option
    return None


def _is_list(annotation: Any) -> bool:
    return typing.get_origin(annotation) in (tuple, list, set, frozenset)


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
        raise ConfigError(f"config file {path} is not valid YAML: {_yaml_problem(exc)}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping, not {type(data).__name__}")
    return data


def _yaml_problem(exc: yaml.YAMLError) -> str:
    """What is wrong and where, without the file's text around it (that line may hold a credential)."""
    if not isinstance(exc, yaml.MarkedYAMLError):
        return type(exc).__name__
    mark = exc.problem_mark or exc.context_mark
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    return ", ".join(part for part in (exc.context, exc.problem) if part) + where


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
        environ = env_keys(settings_cls, os.environ)
        from_env = {path: name for path, name in environ.items() if not _sets(overrides, path)}
        raise ConfigError(describe_validation_error(exc, settings_cls, from_env)) from None
    except SettingsError as exc:
        raise ConfigError(f"invalid configuration:\n  {exc}: {exc.__cause__}") from None
    finally:
        _yaml_data.reset(token)


def raw_value(
    settings_cls: type[BaseSettings],
    config_file: str | Path | None,
    overrides: Mapping[str, Any] | None,
    path: tuple[str, ...],
) -> Any:
    """The value the highest layer that sets the key at `path` gives it, unvalidated (None when none does): what the
    configuration asks for where it cannot be loaded as a whole."""
    environ = env_keys(settings_cls, os.environ)
    if _sets(overrides or {}, path):
        return _get(overrides or {}, path)
    if path in environ:
        return os.environ[environ[path]]
    try:
        data = read_yaml(config_file) if config_file is not None else {}
    except ConfigError:
        return None
    return _get(data, path) if _sets(data, path) else None


def value_sources(
    settings_cls: type[BaseSettings], config_file: str | Path | None = None, overrides: Mapping[str, Any] | None = None
) -> Iterator[tuple[str, Any, str]]:
    """Each leaf key of the settings `load_settings` builds from the same arguments, as `(dotted key, value,
    source)`; the source is the highest layer that sets the key: `cli`, `env`, `yaml` or `default`."""
    settings = load_settings(settings_cls, config_file, overrides)
    layers = (
        ("cli", dict(overrides or {})),
        ("env", ProcessEnvSource(settings_cls)()),
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


def _get(data: Any, path: tuple[str, ...]) -> Any:
    for part in path:
        data = data[part]
    return data


def describe_validation_error(
    exc: ValidationError,
    settings_cls: type[BaseSettings] | None = None,
    from_env: Mapping[tuple[str, ...], str] | None = None,
) -> str:
    """One line for each error: the key, its value, and what is wrong with it; first the environment variable that
    set the key, where `from_env` (key path → variable) names one. No value is shown for an unknown key, a key
    named as a credential or a section, and no URL's password."""
    lines = []
    for error in exc.errors(include_url=False):
        parts = [str(part) for part in error["loc"] if not _is_union_branch(part)]
        key = ".".join(parts)
        variable = _setting_variable(from_env or {}, parts)
        origin = f"environment variable {variable}: " if variable is not None else ""
        value = error.get("input")
        unknown = error["type"] == "extra_forbidden"
        hidden = unknown or isinstance(value, dict) or any(is_credential(part) for part in parts)
        shown = "" if hidden else f" = {hide_url_password(repr(value))}"
        message = error["msg"]
        if unknown and settings_cls is not None:
            message = _unknown_key(settings_cls, parts, named_in_env=variable is not None)
        lines.append(f"  {origin}{key or '<root>'}{shown}: {message}")
    return "invalid configuration:\n" + "\n".join(lines)


def _setting_variable(from_env: Mapping[tuple[str, ...], str], parts: list[str]) -> str | None:
    """The variable that set the key at `parts` or the list or section holding it."""
    for length in range(len(parts), 0, -1):
        variable = from_env.get(tuple(parts[:length]))
        if variable is not None:
            return variable
    return None


def _unknown_key(settings_cls: type[BaseSettings], parts: list[str], *, named_in_env: bool = False) -> str:
    """The message for a key the model does not have: the closest key of its section, when one is close (and its
    environment variable, when the unknown key came from one)."""
    model: Any = settings_cls
    for part in parts[:-1]:
        field = model.model_fields.get(part) if isinstance(model, type) and issubclass(model, BaseModel) else None
        model = field.annotation if field is not None else None
    if not (isinstance(model, type) and issubclass(model, BaseModel)):
        return "unknown key"
    known = list(model.model_fields)
    close = _closest(parts[-1], known)
    if close is not None:
        path = [*parts[:-1], close]
        variable = f" ({env_variable(settings_cls, path)})" if named_in_env else ""
        return f"unknown key; did you mean {'.'.join(path)}{variable}?"
    section = ".".join(parts[:-1]) or "the top level"
    return f"unknown key; the keys of {section} are {', '.join(known)}"


def _closest(name: str, known: list[str]) -> str | None:
    close = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
    return close[0] if close else None


_UNION_BRANCH_NAMES = frozenset({"int", "str", "float", "none", "constrained-int"})


def _is_union_branch(part: object) -> bool:
    # pydantic names the branch of a union it tried (e.g. "function-after[...]", "int"); not part of the key.
    return isinstance(part, str) and ("[" in part or part in _UNION_BRANCH_NAMES)
