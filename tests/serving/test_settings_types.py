"""Byte sizes: exactly an integer (plain, `_`- or thousands-grouped) or a number with a known unit; nothing parses
partially, and every form the processes print reads back as the same value."""

from __future__ import annotations

import pytest
from hypothesis import example, given
from hypothesis import strategies as st
from pydantic import TypeAdapter, ValidationError

from serving.settings_types import UNITS, Bytes, OptionalBytes, PositiveBytes, format_bytes, parse_byte_size

SIZES = st.integers(min_value=0, max_value=1 << 52)
BYTES = TypeAdapter(Bytes)
OPTIONAL = TypeAdapter(OptionalBytes)


def refused(value: object) -> bool:
    try:
        BYTES.validate_python(value)
    except ValidationError:
        return True
    return False


@given(SIZES)
@example(67_108_864)
@example(0)
@example(1000)
def test_every_printed_form_reads_back(value: int) -> None:
    for text in (format_bytes(value), f"{value:,}", f"{value:_}", str(value), f" {value:,} "):
        assert BYTES.validate_python(text) == value, text


@given(st.integers(min_value=0, max_value=1 << 20), st.sampled_from(sorted(UNITS)), st.sampled_from(["", " "]))
def test_integer_with_a_unit(number: int, unit: str, space: str) -> None:
    assert BYTES.validate_python(f"{number}{space}{unit}") == number * UNITS[unit]


@given(st.integers(min_value=0, max_value=1 << 20), st.integers(min_value=1, max_value=3))
def test_decimal_with_a_unit_must_be_whole_bytes(tenths: int, places: int) -> None:
    text = f"{tenths / 10**places:.{places}f}"
    exact = tenths * (1 << 30)
    if exact % 10**places == 0:
        assert BYTES.validate_python(text + "GiB") == exact // 10**places
    else:
        assert refused(text + "GiB")


def plain_integer_value(text: str) -> int | None:
    """An independent reading of the integer forms: digits with single `_` between them, or 1-3 digits then
    groups of `,` and three digits."""
    text = text.strip()
    if not text:
        return None
    if "," in text:
        head, *groups = text.split(",")
        if not (1 <= len(head) <= 3 and head.isdigit() and all(len(g) == 3 and g.isdigit() for g in groups)):
            return None
        return int(head + "".join(groups))
    parts = text.split("_")
    if all(part.isdigit() and part.isascii() for part in parts):
        return int("".join(parts))
    return None


@given(st.text(alphabet="0123456789,_. ", max_size=14))
@example("67,108,864")
@example("1,000")
@example("1,0000")
@example("1,00")
@example("1_000")
@example("1__000")
@example("1.5")
@example("1.5.3")
def test_digit_text_is_an_integer_form_or_refused(text: str) -> None:
    expected = plain_integer_value(text)
    if expected is None:
        assert refused(text), text
    else:
        assert BYTES.validate_python(text) == expected


@given(
    st.sampled_from(["1", "1.5", "64", "1_024"]),
    st.sampled_from(sorted(UNITS)),
    st.text(alphabet="0123456789,._ xKMGiB", min_size=1, max_size=4).filter(lambda junk: junk.strip() != ""),
)
@example("1.5", "GiB", ".3")
@example("64", "MiB", ",")
def test_nothing_after_a_size_is_ignored(number: str, unit: str, junk: str) -> None:
    assert refused(f"{number}{unit}{junk}")


@pytest.mark.parametrize(
    "text",
    [
        "1.5.3GiB",
        "1,000.5",
        "1,000MiB",
        "67,108,864 bytes",
        "64M",
        "64K",
        "1G",
        "64mib",
        "64 MiB B",
        "64  MiB",
        "-1",
        "+1",
        "1e6",
        "0x10",
        "64MiB,",
        ",64",
        "1._5KiB",
        "1.KiB",
        ".5KiB",
        "0.1KiB",
        "",
        "lots",
    ],
)
def test_refused(text: str) -> None:
    assert refused(text)


@pytest.mark.parametrize("value", [True, 1.5, 1024.0, -1])
def test_refused_non_text(value: object) -> None:
    assert refused(value)


def test_the_ambiguous_letters_name_both_meanings() -> None:
    with pytest.raises(ValueError, match=r"'M' is ambiguous: write MiB for powers of 1024 or MB for powers of 1000"):
        parse_byte_size("64M")
    with pytest.raises(ValueError, match=r"KiB for powers of 1024 or kB"):
        parse_byte_size("64k")


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("67,108,864", 67_108_864),
        ("64MiB", 64 << 20),
        ("64 MiB", 64 << 20),
        ("1.5GiB", 3 << 29),
        ("500kB", 500_000),
        ("500KB", 500_000),
        ("2TB", 2 * 10**12),
        ("1TiB", 1 << 40),
        ("7B", 7),
        ("1_000_000", 1_000_000),
    ],
)
def test_accepted(text: str, expected: int) -> None:
    assert BYTES.validate_python(text) == expected


def test_null_words_and_positive() -> None:
    assert OPTIONAL.validate_python("null") is None
    assert OPTIONAL.validate_python("67,108,864") == 67_108_864
    with pytest.raises(ValidationError):
        OPTIONAL.validate_python("1,0000")
    with pytest.raises(ValidationError):
        TypeAdapter(PositiveBytes).validate_python("0B")


def test_format_bytes() -> None:
    assert [format_bytes(v) for v in (0, 1, 1000, 1024, 64 << 20, 3 << 29, 1 << 40)] == [
        "0",
        "1",
        "1,000",
        "1KiB",
        "64MiB",
        "1536MiB",
        "1TiB",
    ]
