"""The README's "Try it" commands, run as written against the embedded stack (engine and gateway processes) with a
photo too big for one command-line argument, and its "A refused request" command, whose answer must be the one the
README shows."""

from __future__ import annotations

import io
import os
import random
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import orjson
import pytest
import yaml
from PIL import Image

from tests.servers import ROOT, served_process

# Every test here starts processes of its own.
pytestmark = pytest.mark.slow

README = ROOT / "README.md"


def section_blocks(heading: str, language: str) -> list[str]:
    """The ```language blocks of the README section `## heading`, up to the next `## ` heading."""
    text = README.read_text(encoding="utf-8")
    section = text[text.index(f"## {heading}\n") :]
    section = section[: section.index("\n## ", 1)]
    return re.findall(rf"```{language}\n(.*?)```", section, re.DOTALL)


PHOTO = "docs/photo.jpg"


def try_it_blocks() -> list[str]:
    """The shell blocks of the README's "Try it" section that send the repository's photo."""
    return [block for block in section_blocks("Try it", "sh") if PHOTO in block]


def missing_tools(block: str) -> list[str]:
    needed = ["curl", "jq"] if "jq " in block else ["curl"]
    return [tool for tool in needed if shutil.which(tool) is None]


def skip_or_fail(missing: list[str]) -> None:
    if not os.environ.get("CI"):
        pytest.skip(f"{', '.join(missing)} not installed")
    pytest.fail(f"{', '.join(missing)} not installed in CI (.ci/run installs them)")


def noisy_jpeg(width: int, height: int) -> bytes:
    rng = random.Random(14)
    image = Image.frombytes("RGB", (width, height), rng.randbytes(width * height * 3))
    out = io.BytesIO()
    image.save(out, "JPEG", quality=95)
    return out.getvalue()


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The embedded stack of `make run` on free ports: the engine from configs/engine.yaml, the gateway from
    configs/demo.yaml pointed at it."""
    tmp = tmp_path_factory.mktemp("stack")
    env = {name: value for name, value in os.environ.items() if not name.startswith("MMGATE_")}
    with served_process("engine_adapter", ROOT / "configs" / "engine.yaml", env=env, log=tmp / "engine.log") as engine:
        demo = yaml.safe_load((ROOT / "configs" / "demo.yaml").read_text(encoding="utf-8"))
        demo["upstream"]["url"] = engine.url
        demo["engine"]["url"] = engine.url
        config = tmp / "demo.yaml"
        config.write_text(yaml.safe_dump(demo), encoding="utf-8")
        with served_process("gateway", config, env=env, log=tmp / "gateway.log") as gateway:
            yield gateway.url


def test_the_readme_shows_both_ways() -> None:
    blocks = try_it_blocks()
    assert len(blocks) == 2
    assert all("--data-binary @-" in block for block in blocks)
    assert any("jq " in block for block in blocks)


@pytest.mark.parametrize("index", [0, 1], ids=["jq", "python"])
def test_the_readme_command_answers_for_a_big_photo(stack: str, tmp_path: Path, index: int) -> None:
    block = try_it_blocks()[index]
    missing = missing_tools(block)
    if missing:
        skip_or_fail(missing)
    photo = noisy_jpeg(640, 480)
    assert len(photo) > 200 << 10  # its base64 is past the 128 KiB a single argument may hold
    (tmp_path / "docs").mkdir()
    (tmp_path / PHOTO).write_bytes(photo)
    command = block.replace("localhost:8000", stack.removeprefix("http://"))
    env = {**os.environ, "PATH": f"{ROOT / '.venv' / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}"}
    result = subprocess.run(["sh", "-c", command], cwd=tmp_path, capture_output=True, timeout=120, env=env)
    assert result.returncode == 0, result.stderr.decode()
    answer = orjson.loads(result.stdout)
    content = answer["choices"][0]["message"]["content"]
    assert content.startswith("image 0: 391 rows x 128, sha256 "), content
    assert "reference reply: 1 item(s), 391 embedding row(s)" in content


@pytest.mark.parametrize("index", [0, 1], ids=["jq", "python"])
def test_the_readme_command_answers_as_shown_from_the_repository(stack: str, index: int) -> None:
    """The command as written, from the repository's root, with the photo the repository has: the answer the README
    shows (the embeddings' checksum aside, which follows the CPU's arithmetic)."""
    block = try_it_blocks()[index]
    missing = missing_tools(block)
    if missing:
        skip_or_fail(missing)
    with Image.open(ROOT / PHOTO) as photo:
        assert (photo.format, photo.size) == ("JPEG", (640, 480))
    command = block.replace("localhost:8000", stack.removeprefix("http://"))
    env = {**os.environ, "PATH": f"{ROOT / '.venv' / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}"}
    result = subprocess.run(["sh", "-c", command], cwd=ROOT, capture_output=True, timeout=120, env=env)
    assert result.returncode == 0, result.stderr.decode()
    [shown] = [block for block in section_blocks("Try it", "json")]
    answer, expected = orjson.loads(result.stdout), orjson.loads(shown)

    def comparable(body: dict[str, object]) -> dict[str, object]:
        text = re.sub(r"sha256 [0-9a-f]{64}", "sha256 X", str(body["choices"][0]["message"]["content"]))  # type: ignore[index]
        return {"content": text, "usage": body["usage"], "object": body["object"], "model": body["model"]}

    assert comparable(answer) == comparable(expected)


def test_the_readme_refusal_answers_as_shown(stack: str, tmp_path: Path) -> None:
    [block] = section_blocks("A refused request", "sh")
    [shown] = section_blocks("A refused request", "json")
    missing = missing_tools(block)
    if missing:
        skip_or_fail(missing)
    command = block.replace("localhost:8000", stack.removeprefix("http://")).replace(".venv/bin/python", sys.executable)
    result = subprocess.run(["sh", "-c", command], cwd=tmp_path, capture_output=True, timeout=120)
    assert result.returncode == 0, result.stderr.decode()
    answer, expected = orjson.loads(result.stdout), orjson.loads(shown)
    assert answer["message"].startswith("media predicted from the headers reach "), answer

    def count_blanked(body: dict[str, object]) -> dict[str, object]:
        # The count includes the raw body, whose size follows the PNG encoder's output.
        return {**body, "message": re.sub(r"reach [0-9,]+ bytes", "reach N bytes", str(body["message"]))}

    assert count_blanked(answer) == count_blanked(expected)
