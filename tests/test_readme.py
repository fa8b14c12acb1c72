"""What README.md shows a newcomer works as shown: the Python example prints the answer, and the examples and the
test instructions say what the code does."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")


def fenced_blocks(language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```", README, flags=re.S | re.M)


def test_python_example_prints_the_answer(demo_model, tmp_path, monkeypatch, capsys):
    """The block after "### Python API", run as written where ./ds4flash.gguf is the demo model."""
    block = fenced_blocks("python")[0]
    assert 'ds4_mlx.load("ds4flash.gguf"' in block
    (tmp_path / "ds4flash.gguf").symlink_to(demo_model)
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    exec(compile(block, "README.md", "exec"), namespace)
    printed = capsys.readouterr().out
    assert namespace["answer"] and printed == namespace["answer"]  # no thinking asked, none arrived
    assert namespace["event"].message.reasoning == "" and 0 < namespace["event"].usage.completion_tokens <= 64


def test_curl_example_sets_an_answer_length():
    """The demo model never ends an answer: the copied curl command must stop by itself."""
    curl = next(b for b in fenced_blocks("sh") if b.startswith("curl "))
    body = json.loads(shlex.split(curl.replace("\\\n", " "))[-1])
    assert body["max_tokens"] > 0 and body["messages"][0]["role"] == "user"


@pytest.mark.parametrize("marker", ["slow", "gpu"])
def test_deselected_tests_are_explained(marker):
    """The default command skips the markers pyproject.toml's addopts leave out; the README says how to run them."""
    pyproject = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    assert f"not {marker}" in re.search(r'^addopts = "(.*)"$', pyproject, flags=re.M).group(1)
    assert f"-m {marker}" in README
