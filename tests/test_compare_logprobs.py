"""bench/compare_logprobs.py: two greedy logprob dumps compared step by step (the cross-engine check's tool)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from ds4_mlx.cli import main


def _tool():
    spec = importlib.util.spec_from_file_location("compare_logprobs",
                                                  Path(__file__).parents[1] / "bench" / "compare_logprobs.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks its module up there
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def dump(tmp_path_factory, demo_model) -> Path:
    path = tmp_path_factory.mktemp("dumps") / "ours.json"
    assert main(["run", "--demo", "--nothink", "--temp", "0", "-p", "Explain Redis streams.", "-n", "4",
                 "--dump-logprobs", str(path), "--logprobs-top-k", "20"]) == 0
    return path


def test_a_dump_equals_itself(dump, capsys):
    assert _tool().main([str(dump), str(dump)]) == 0
    out = capsys.readouterr().out
    assert "4 steps compared; largest logprob difference 0.0000: PASS" in out


def test_a_moved_logprob_and_a_different_choice_are_found(dump, tmp_path, capsys):
    data = json.loads(dump.read_text(encoding="utf-8"))
    data["steps"][0]["top_logprobs"][3]["logprob"] += 0.1
    moved = tmp_path / "moved.json"
    moved.write_text(json.dumps(data), encoding="utf-8")
    tool = _tool()
    assert tool.main([str(dump), str(moved)]) == 1
    assert "largest logprob difference 0.1000  <-" in capsys.readouterr().out
    data["steps"][0]["top_logprobs"][3]["logprob"] -= 0.1
    data["steps"][1]["selected"]["id"] += 1
    moved.write_text(json.dumps(data), encoding="utf-8")
    assert tool.main([str(dump), str(moved)]) == 1
    out = capsys.readouterr().out
    assert "step   1: DIFFERENT choice" in out and "2 steps compared" in out  # nothing after the split is compared
    assert tool.main([str(dump), str(tmp_path / "missing.json")]) == 2
