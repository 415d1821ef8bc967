from __future__ import annotations

from pathlib import Path

from tests.config_reference import ROOT, render, yaml_comments


def test_committed_reference_is_current() -> None:
    committed = (ROOT / "docs" / "configuration.md").read_text(encoding="utf-8")
    assert committed == render(), "docs/configuration.md is out of date: run `make config-reference`"


def test_every_key_is_described() -> None:
    described = [line for line in render().splitlines() if line.startswith("| `")]
    assert len(described) > 60
    assert [line for line in described if line.endswith("|  |")] == []


def test_comments_follow_their_key_across_continuation_lines(tmp_path: Path) -> None:
    path = tmp_path / "x.yaml"
    path.write_text("# header\na:\n  b: 1   # first\n        # second\n  c: 2\nd: 3 # top\n")
    assert yaml_comments(path) == {"a": "", "a.b": "first second", "a.c": "", "d": "top"}
