"""Field types both processes' settings use: byte sizes, durations, limits that `null` turns off.

A byte size is exactly one of (surrounding spaces ignored):

- an integer: `67108864`, `67_108_864`, or grouped by thousands with commas, `67,108,864` (the form the
  processes' own messages print: every group after the first has three digits);
- a number and a unit, with at most one space between them: `64MiB`, `1.5 GiB`, `500kB`. Units: `B`; decimal
  `kB` (or `KB`), `MB`, `GB`, `TB` (powers of 1000); binary `KiB`, `MiB`, `GiB`, `TiB` (powers of 1024). The
  result must be a whole number of bytes (`1.5KiB` is 1536; `0.1KiB` is refused).

Nothing else is a byte size: `K`, `M`, `G` alone are refused (nginx reads them as binary, SI as decimal), and so
are lower-case units other than `kB`, signs, floats without a unit, and anything left over after the number
(`1.5.3GiB`, `"1,0000"`). A refused value stops start-up with a message naming the key and the value.
"""

from __future__ import annotations

import re
from fractions import Fraction
from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, ByteSize, ConfigDict, Field

UNITS: dict[str, int] = {
    "B": 1,
    "kB": 1000,
    "KB": 1000,
    "MB": 1000**2,
    "GB": 1000**3,
    "TB": 1000**4,
    "KiB": 1 << 10,
    "MiB": 1 << 20,
    "GiB": 1 << 30,
    "TiB": 1 << 40,
}
_BINARY_UNITS = (("TiB", 40), ("GiB", 30), ("MiB", 20), ("KiB", 10))

_DIGITS = r"[0-9]+(?:_[0-9]+)*"
_INTEGER = re.compile(_DIGITS)
_GROUPED = re.compile(r"[0-9]{1,3}(?:,[0-9]{3})+")
_WITH_UNIT = re.compile(rf"(?P<number>{_DIGITS}(?:\.{_DIGITS})?) ?(?P<unit>[A-Za-z]+)")

_EXPECTED = (
    "expected an integer (1048576, 1_048_576 or 1,048,576) or a number with a unit (B, kB, MB, GB, TB, KiB, MiB, "
    "GiB, TiB), e.g. 64MiB or 1.5GiB"
)


def parse_byte_size(value: Any) -> Any:
    """The number of bytes `value` says, or `value` unchanged when it is not a string or a number (the field's
    own validation refuses it). Raises `ValueError` for anything that is not exactly a byte size."""
    if isinstance(value, bool):
        raise ValueError(f"a byte size, not a boolean; {_EXPECTED}")
    if isinstance(value, int):
        if value < 0:
            raise ValueError("a byte size cannot be negative")
        return value
    if isinstance(value, float):
        raise ValueError(f"a byte size without a unit must be an integer; {_EXPECTED}")
    if not isinstance(value, str):
        return value
    text = value.strip()
    if _INTEGER.fullmatch(text):
        return int(text.replace("_", ""))
    if _GROUPED.fullmatch(text):
        return int(text.replace(",", ""))
    match = _WITH_UNIT.fullmatch(text)
    if match is None:
        raise ValueError(f"not a byte size; {_EXPECTED}")
    unit = match["unit"]
    if unit not in UNITS:
        if unit.upper() in {"K", "M", "G", "T"}:
            raise ValueError(
                f"unit {unit!r} is ambiguous: write {unit.upper()}iB for powers of 1024 or "
                f"{'k' if unit.upper() == 'K' else unit.upper()}B for powers of 1000"
            )
        raise ValueError(f"unknown unit {unit!r}; {_EXPECTED}")
    amount = Fraction(match["number"].replace("_", "")) * UNITS[unit]
    if amount.denominator != 1:
        raise ValueError(f"{text} is not a whole number of bytes ({float(amount):.1f})")
    return int(amount)


def format_bytes(value: int) -> str:
    """`value` as the processes print it: the largest binary unit that holds it exactly (`64MiB`), else the
    integer grouped by thousands (`1,500`). Either form reads back as `value` (`parse_byte_size`)."""
    for unit, shift in _BINARY_UNITS:
        if value and value % (1 << shift) == 0:
            return f"{value >> shift}{unit}"
    return f"{value:,}"


def _null_words_to_none(value: Any) -> Any:
    # Environment variables are strings: let MMGATE_LIMITS__X=null turn a limit off like YAML's null does.
    if isinstance(value, str) and value.strip().lower() in {"null", "none", "off", ""}:
        return None
    return value


Nullable = BeforeValidator(_null_words_to_none)
ByteSizeText = BeforeValidator(parse_byte_size)
Bytes = Annotated[ByteSize, ByteSizeText, Field(ge=0)]
PositiveBytes = Annotated[ByteSize, ByteSizeText, Field(ge=1)]
Seconds = Annotated[float, Field(gt=0)]
OptionalBytes = Annotated[Bytes | None, Nullable]
OptionalPositiveBytes = Annotated[PositiveBytes | None, Nullable]
OptionalSeconds = Annotated[Seconds | None, Nullable]
OptionalCount = Annotated[Annotated[int, Field(ge=1)] | None, Nullable]
OptionalText = Annotated[str | None, Nullable]


class Section(BaseModel):
    """A settings section: unknown keys are errors (a typo never silently keeps a default)."""

    model_config = ConfigDict(extra="forbid", frozen=True)


LOG_LEVELS = ("critical", "error", "warning", "info", "debug")


def _known_log_level(value: Any) -> Any:
    if isinstance(value, str) and value.lower() in LOG_LEVELS:
        return value.lower()
    raise ValueError(f"must be one of {', '.join(LOG_LEVELS)}")


LogLevel = Annotated[str, BeforeValidator(_known_log_level)]
