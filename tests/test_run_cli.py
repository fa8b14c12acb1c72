"""`ds4-mlx run` end to end on the tiny model, and the example notebook."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ds4_mlx.chat import ThinkMode, render_cli_prompt
from ds4_mlx.commands.options import encode_cli_prompt
from ds4_mlx.engine import Engine, GenerationRequest
from ds4_mlx.sampling import SamplingParams

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tiny_path(demo_model):
    return demo_model


def ds4(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "ds4_mlx.cli", *args],
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
        timeout=300,
    )


def test_run_greedy_prints_what_the_engine_generates(tiny_path):
    r = ds4("run", "-m", str(tiny_path), "-p", "Hello", "-n", "6", "--temp", "0", "--nothink", "--ctx", "256",
            "--backend", "cpu")
    assert r.returncode == 0, r.stderr
    engine = Engine.load(tiny_path, ctx=256)
    ids = encode_cli_prompt(engine.tokenizer, render_cli_prompt("Hello", think=ThinkMode.NONE, ctx=256))
    done = list(engine.generate(GenerationRequest(prompt=ids, max_tokens=6, sampling=SamplingParams(temperature=0),
                                                  thinking=False)))[-1]
    assert r.stdout == done.message.content + "\n"
    stats = r.stderr.strip().splitlines()[-1]
    assert f"prompt {len(ids)} tokens" in stats and "generation 6 tokens" in stats and "finish length" in stats


def test_run_reuses_a_disk_checkpoint_across_processes(tiny_path, tmp_path):
    flags = ["run", "-m", str(tiny_path), "-p", "Tell me a story about a lighthouse keeper and the sea.", "-n", "2",
             "--temp", "0", "--ctx", "256", "--kv-disk-dir", str(tmp_path / "kv"), "--kv-cache-min-tokens", "8",
             "--kv-cache-boundary-align-tokens", "0", "--kv-cache-boundary-trim-tokens", "0"]
    first = ds4(*flags)
    assert first.returncode == 0, first.stderr
    assert "(0 cached)" in first.stderr and list((tmp_path / "kv").glob("*.kv"))
    second = ds4(*flags)
    assert second.returncode == 0, second.stderr
    assert "(0 cached)" not in second.stderr
    assert second.stdout == first.stdout


def test_cli_prompt_keeps_special_strings_as_text(tiny_path):
    engine = Engine.load(tiny_path, ctx=256)
    ids = encode_cli_prompt(engine.tokenizer, render_cli_prompt("<｜User｜>", think=ThinkMode.HIGH, ctx=256))
    assert ids.count(engine.tokenizer.user_id) == 1
    assert ids[0] == engine.tokenizer.bos_id and ids[-1] == engine.tokenizer.think_id


def test_missing_model_says_where_to_get_one(tmp_path):
    r = ds4("run", "-m", str(tmp_path / "nope.gguf"), "-p", "hi")
    assert r.returncode == 1
    assert "download_model.sh" in r.stderr and "--demo" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr


def test_no_prompt_is_a_clear_error(tiny_path):
    r = ds4("run", "-m", str(tiny_path))
    assert r.returncode == 1 and "-p TEXT" in r.stderr


def test_dump_logprobs(tiny_path, tmp_path):
    out = tmp_path / "lp.json"
    r = ds4("run", "-m", str(tiny_path), "-p", "Hi", "-n", "4", "--nothink", "--ctx", "256",
            "--dump-logprobs", str(out), "--logprobs-top-k", "5")
    assert r.returncode == 0, r.stderr
    dump = json.loads(out.read_text())
    assert dump["source"] == "ds4-mlx" and dump["top_k"] == 5 and dump["ctx"] == 256
    assert len(dump["steps"]) == 4
    for i, step in enumerate(dump["steps"]):
        assert step["step"] == i
        top = step["top_logprobs"]
        assert len(top) == 5
        assert step["selected"] == top[0]["token"]
        lps = [t["logprob"] for t in top]
        assert lps == sorted(lps, reverse=True) and lps[0] <= 0
        assert sum(math.exp(x) for x in lps) <= 1 + 1e-5
        assert bytes(step["selected"]["bytes"]).decode("utf-8", "replace") == step["selected"]["text"]


def test_example_notebook_runs(tmp_path):
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.read(ROOT / "examples" / "quickstart.ipynb", as_version=4)
    os.environ["XDG_CACHE_HOME"] = str(tmp_path)
    try:
        NotebookClient(nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    finally:
        del os.environ["XDG_CACHE_HOME"]
    assert (tmp_path / "ds4-mlx").is_dir()
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])]
    assert not any(o.get("output_type") == "error" for o in outputs)
