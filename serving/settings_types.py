"""Field types both processes' settings use: byte sizes, durations, limits that `null` turns off."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, ByteSize, ConfigDict, Field


def _null_words_to_none(value: Any) -> Any:
    # Environment variables are strings: let MMGATE_LIMITS__X=null turn a limit off like YAML's null does.
    if isinstance(value, str) and value.strip().lower() in {"null", "none", "off", ""}:
        return None
    return value


Nullable = BeforeValidator(_null_words_to_none)
Bytes = Annotated[ByteSize, Field(ge=0)]
PositiveBytes = Annotated[ByteSize, Field(ge=1)]
Seconds = Annotated[float, Field(gt=0)]
OptionalBytes = Annotated[Bytes | None, Nullable]
OptionalPositiveBytes = Annotated[PositiveBytes | None, Nullable]
OptionalSeconds = Annotated[Seconds | None, Nullable]
OptionalCount = Annotated[Annotated[int, Field(ge=1)] | None, Nullable]
OptionalText = Annotated[str | None, Nullable]


class Section(BaseModel):
    """A settings section: unknown keys are errors (a typo never silently keeps a default)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
