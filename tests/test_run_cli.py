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


@pytest.mark.parametrize("temp", ["0", pytest.param("1e-46", marks=pytest.mark.slow)])  # a temperature that is 0 in float32 is greedy too
def test_run_greedy_prints_what_the_engine_generates(tiny_path, temp):
    r = ds4("run", "-m", str(tiny_path), "-p", "Hello", "-n", "6", "--temp", temp, "--nothink", "--ctx", "256",
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
    assert r.returncode == 2 and "-p TEXT" in r.stderr


@pytest.mark.parametrize("flag", ["-p", pytest.param("--prompt-file", marks=pytest.mark.slow)])
def test_dash_reads_the_prompt_from_standard_input(tiny_path, flag):
    flags = ["run", "-m", str(tiny_path), "-n", "4", "--temp", "0", "--nothink", "--ctx", "256"]
    piped = subprocess.run([sys.executable, "-m", "ds4_mlx.cli", *flags, flag, "-"], input="Hello there",
                           capture_output=True, text=True, timeout=300)
    given = ds4(*flags, "-p", "Hello there")
    assert piped.returncode == 0 and given.returncode == 0, piped.stderr
    assert piped.stdout == given.stdout and piped.stdout.strip()
    assert piped.stderr.splitlines()[-1].split(",")[0] == given.stderr.splitlines()[-1].split(",")[0]  # same prompt


@pytest.fixture
def scripted_run(demo_model, monkeypatch, capsys):
    """`ds4-mlx run ARGS` in this process over an engine whose model writes the given text: returns the engine's
    model (what it was fed), the exit code, standard output and standard error (not a terminal). Everything but
    the loading runs as in the command."""
    from ds4_mlx.cli import main
    from ds4_mlx.model.gguf import GGUFFile
    from ds4_mlx.tokenizer import Tokenizer
    from scripted import scripted_engine

    with GGUFFile.open(demo_model) as f:
        tokenizer = Tokenizer.from_gguf(f)

    def go(text: str, *args: str, eos: bool = True, name: str | None = None):
        engine, model = scripted_engine(tokenizer, text, eos=eos, ctx=4096)
        if name is not None:
            engine.file_facts = {"general.name": name}  # what Engine.load keeps of the file's metadata
        monkeypatch.setattr(Engine, "load", lambda *args, **kwargs: engine)
        rc = main(["run", *args])
        out, err = capsys.readouterr()
        return model, rc, out, err

    go.tokenizer = tokenizer
    return go


def test_piped_output_is_the_answer_alone(scripted_run):
    _, rc, out, err = scripted_run("Let me think.</think>The answer.", "-p", "Q?")
    assert rc == 0 and out == "The answer.\n"
    assert err.startswith("Let me think.\n") and err.splitlines()[-1].endswith("finish stop")
    _, rc, out, err = scripted_run("Let me think.</think>The answer.", "-p", "Q?", "--hide-reasoning")
    assert rc == 0 and out == "The answer.\n" and "Let me think." not in err


def test_nothink_answers_without_reasoning(scripted_run):
    """--nothink is said once, in the rendering: the prompt ends with `</think>`, so the text is the answer."""
    model, rc, out, _ = scripted_run("No thinking here.", "-p", "Q?", "--nothink")
    tok = scripted_run.tokenizer
    prompt = encode_cli_prompt(tok, render_cli_prompt("Q?", think=ThinkMode.NONE, ctx=4096))
    assert rc == 0 and out == "No thinking here.\n"
    assert model.fed[: len(prompt)] == prompt and prompt[-1] == tok.think_end_id


def test_raw_sends_the_prompt_as_written(scripted_run):
    tok = scripted_run.tokenizer
    model, rc, out, err = scripted_run(" upon a time.", "--raw", "-p", "Once")
    ids = [tok.bos_id, *tok.encode("Once")]  # BOS, then the text: no template, no system text
    assert rc == 0 and out == " upon a time.\n" and err.startswith(f"ds4-mlx: prompt {len(ids)} tokens")
    assert model.fed[: len(ids)] == ids
    chat = "<｜begin▁of▁sentence｜><｜User｜>Hi<｜Assistant｜><think>"
    model, rc, out, err = scripted_run("Hmm.</think>Hello!", "--raw", "-p", chat, "--system", "ignored")
    assert rc == 0 and out == "Hello!\n" and err.startswith("ds4-mlx: warning: --raw sends the prompt as written")
    ids = tok.encode(chat)
    assert model.fed[: len(ids)] == ids and len(ids) == 5  # specials read as specials; its <think> opens reasoning


def test_demo_answers_stop_at_the_default_limit(scripted_run):
    from ds4_mlx.commands.options import DEMO_MAX_TOKENS

    _, rc, _, err = scripted_run("word " * 400, "--demo", "-p", "hi", "--nothink", eos=False)
    assert rc == 0 and f"generation {DEMO_MAX_TOKENS} tokens" in err.splitlines()[-1]
    _, rc, _, err = scripted_run("word " * 400, "--demo", "-p", "hi", "--nothink", "-n", "300", eos=False)
    assert rc == 0 and "generation 300 tokens" in err.splitlines()[-1]


RANDOM_NAME = "DeepSeek V4 Flash tiny (random weights, seed 0)"  # make-model's name for a random-weight file
CAP_NOTE = "ds4-mlx: the model has random weights and never stops by itself: answers end after 256 tokens"


def test_a_random_weight_file_stops_at_the_demo_limit_and_says_so(scripted_run):
    """A make-model file with `run` is capped as --demo is (its model never writes the end token), and says so."""
    from ds4_mlx.commands.options import DEMO_MAX_TOKENS

    _, rc, _, err = scripted_run("word " * 400, "-p", "hi", "--nothink", eos=False, name=RANDOM_NAME)
    assert rc == 0 and f"generation {DEMO_MAX_TOKENS} tokens" in err.splitlines()[-1]
    assert err.splitlines()[0].startswith(CAP_NOTE)
    _, rc, _, err = scripted_run("word " * 400, "-p", "hi", "--nothink", "-n", "300", eos=False, name=RANDOM_NAME)
    assert rc == 0 and "generation 300 tokens" in err.splitlines()[-1] and "random weights" not in err
    _, rc, _, err = scripted_run("word " * 400, "-p", "hi", "--nothink", name="DeepSeek V4 Flash")
    assert rc == 0 and "generation 401 tokens" in err.splitlines()[-1] and "random weights" not in err  # and EOS


def test_serve_caps_a_random_weight_model_and_says_so(demo_model, monkeypatch, capsys):
    """`serve --demo` (or a make-model file): a request without max_tokens gets DEMO_MAX_TOKENS, not 393,216."""
    import argparse

    from ds4_mlx.commands import serve
    from ds4_mlx.commands.options import DEMO_MAX_TOKENS
    from ds4_mlx.model.gguf import GGUFFile
    from ds4_mlx.tokenizer import Tokenizer
    from scripted import scripted_engine

    with GGUFFile.open(demo_model) as f:
        tokenizer = Tokenizer.from_gguf(f)
    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)

    def default_limit(name: str, *flags: str) -> int:
        engine, _ = scripted_engine(tokenizer, "x")
        engine.file_facts = {"general.name": name}
        monkeypatch.setattr(Engine, "load", lambda *args, **kwargs: engine)
        return serve.serving_engine(parser.parse_args(list(flags)), None).default_max_tokens

    assert default_limit(RANDOM_NAME, "--demo") == DEMO_MAX_TOKENS
    assert CAP_NOTE in capsys.readouterr().err
    assert default_limit(RANDOM_NAME) == DEMO_MAX_TOKENS
    assert CAP_NOTE in capsys.readouterr().err
    assert default_limit(RANDOM_NAME, "-n", "1000") == 1000
    assert default_limit("DeepSeek V4 Flash") == serve.DEFAULT_MAX_TOKENS == 393216
    assert "random weights" not in capsys.readouterr().err


@pytest.mark.parametrize("given", ["", "\n  \n"])
def test_an_empty_prompt_from_standard_input_is_refused(tiny_path, given):
    r = subprocess.run([sys.executable, "-m", "ds4_mlx.cli", "run", "-m", str(tiny_path), "-p", "-"], input=given,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr == "ds4-mlx run: error: the prompt from standard input is empty: there is nothing to answer\n"


def test_a_closed_pipe_ends_the_answer_quietly(tiny_path):
    """`ds4-mlx run ... | head -c 20`: once the reader is gone the answer stops, with no traceback, and the exit
    status a shell gives a process ended by SIGPIPE."""
    proc = subprocess.Popen([sys.executable, "-m", "ds4_mlx.cli", "run", "-m", str(tiny_path), "-p", "hi", "-n", "8",
                             "--nothink", "--temp", "0", "--ctx", "256", "-q"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()  # the reader is gone before the first token
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=300) == 141 and "Traceback" not in err and "Error" not in err


def test_ctrl_c_in_a_terminal_keeps_the_stats_line_and_resets_the_colour(tiny_path):
    """On a terminal the reasoning is grey; the first Ctrl+C stops the answer, the colour is reset, the stats line
    says so, and the exit status is 130."""
    import pty
    import select
    import time

    pid, fd = pty.fork()
    if pid == 0:
        os.execv(sys.executable, [sys.executable, "-m", "ds4_mlx.cli", "run", "-m", str(tiny_path), "-p", "Hi",
                                  "--ctx", "256", "-n", "200", "--temp", "0", "-q"])  # -q: no grey progress bar
    seen = b""
    deadline = time.monotonic() + 120
    interrupted = False
    try:
        while b"finish " not in seen:
            assert time.monotonic() < deadline, seen
            if select.select([fd], [], [], 0.1)[0]:
                try:
                    seen += os.read(fd, 65536)
                except OSError:
                    break
            if not interrupted and b"\x1b[90m" in seen and len(seen.split(b"\x1b[90m", 1)[1]) > 2:
                os.write(fd, b"\x03")
                interrupted = True
        _, status = os.waitpid(pid, 0)
    finally:
        os.close(fd)
    grey = seen.split(b"\x1b[90m", 1)[1]
    assert b"\x1b[0m" in grey and grey.index(b"\x1b[0m") < grey.index(b"ds4-mlx: prompt ")
    assert b"finish cancelled" in grey and os.waitstatus_to_exitcode(status) == 130


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


def test_example_notebook_runs(tmp_path, demo_model):
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.read(ROOT / "examples" / "quickstart.ipynb", as_version=4)
    before = demo_model.stat().st_mtime_ns
    NotebookClient(nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    assert demo_model.stat().st_mtime_ns == before  # the kernel used the session's demo model, not a new one
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])]
    assert not any(o.get("output_type") == "error" for o in outputs)


def test_the_notebook_doc_runs_it_with_what_the_extras_install():
    """docs/notebook.md's commands name a program the `test` extra installs beside this Python (nbclient's
    `jupyter execute`; nbconvert is not installed), with flags it takes, on the notebook that exists."""
    import re

    text = (ROOT / "docs" / "notebook.md").read_text(encoding="utf-8")
    commands = re.findall(r"^\.venv/bin/(jupyter execute[^#\n]*?)\s+#", text, re.M)
    assert len(commands) == 2
    jupyter = Path(sys.executable).parent / "jupyter"
    usage = subprocess.run([str(jupyter), "execute", "--help"], capture_output=True, text=True, timeout=120)
    assert usage.returncode == 0
    for command in commands:
        *flags, notebook = command.split()[2:]
        assert (ROOT / notebook).is_file() and notebook.endswith(".ipynb")
        assert all(f"\n{flag}\n" in usage.stdout for flag in flags)
