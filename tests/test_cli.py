"""The `ds4-mlx` dispatcher, and how every command answers a mistake: one line, no traceback."""

from __future__ import annotations

import subprocess
import sys

import pytest

from ds4_mlx.cli import COMMANDS, main


def test_help_lists_every_command(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    for name in COMMANDS:
        assert name in out


def test_unknown_command_is_a_usage_error(capsys):
    assert main(["frobnicate"]) == 2
    assert "unknown command" in capsys.readouterr().err


def test_console_entry_point_runs():
    r = subprocess.run([sys.executable, "-m", "ds4_mlx.cli", "--version"], capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout.startswith("ds4-mlx ")


# -- every mistake is one line, exit status 2 for usage and 1 for run time ------------------------------------------

MISSING = "missing.gguf"  # commands stop before they would load it
CTX = "argument -c/--ctx: expected a number of tokens from 1 to 1048576, got '{}'"
USAGE = [
    *[([cmd, "--ctx", ctx], CTX.format(ctx)) for cmd in ("run", "chat", "serve", "bench", "inspect")
      for ctx in ("0", "-5", "1048577")],
    *[([cmd, "-n", n], f"argument -n/--tokens: expected an integer >= 1, got '{n}'")
      for cmd in ("run", "chat", "serve") for n in ("-3", "0")],
    *[(["run", "-p", "x", "--logprobs-top-k", k, "--dump-logprobs", "lp.json"],
       f"argument --logprobs-top-k: expected an integer from 1 to 128, got '{k}'") for k in ("0", "129")],
    (["run", "-p", "x", "--logprobs-top-k", "5"], "--logprobs-top-k applies to --dump-logprobs FILE only"),
    (["run", "-p", "x", "--temp", "-1"], "sampling flags: temperature must be a number >= 0"),
    (["run", "-p", "x", "--mtp-draft", "2"], "--mtp-draft 2 needs an MTP draft file: --mtp FILE"),
    (["run"], "give a prompt with -p TEXT or --prompt-file FILE"),
    *[(["serve", "--port", port], f"argument --port: expected a port number from 1 to 65535, got '{port}'")
      for port in ("99999", "0")],
    (["serve", "--max-queue", "-1"], "argument --max-queue: expected an integer >= 0, got '-1'"),
    *[([cmd, "--kv-disk-space-mb", "0"], "argument --kv-disk-space-mb: expected an integer >= 1, got '0'")
      for cmd in ("run", "chat", "serve")],
    *[([cmd, "--kv-cache-min-tokens", "-4"], "argument --kv-cache-min-tokens: expected an integer >= 1, got '-4'")
      for cmd in ("run", "chat", "serve")],
    (["run", "--kv-cache-boundary-trim-tokens", "-1"],
     "argument --kv-cache-boundary-trim-tokens: expected an integer >= 0, got '-1'"),
    (["run", "-p", "x", "--kv-disk-dir", "kv", "--kv-cache-min-tokens", "600", "--kv-cache-cold-max-tokens", "500"],
     "--kv-cache-cold-max-tokens must be 0 (no cold saves) or >= --kv-cache-min-tokens (600), got 500"),
    (["bench", "--ctx-max", "100"], "--ctx-max 100 is below --ctx-start 2048"),
    (["run", "-p", ""], "the prompt from -p is empty: there is nothing to answer"),
    (["run", "-p", " \n"], "the prompt from -p is empty"),
    (["run", "--prompt-file", "empty.txt"], "the prompt from --prompt-file empty.txt is empty"),
    (["inspect", "-m", "a.gguf"], "two files given, missing.gguf and -m a.gguf: give one"),
    (["tokens"], "one of the arguments -p/--prompt --prompt-file is required"),
    (["make-model", "x.gguf", "--preset", "huge"], "argument --preset: invalid choice: 'huge'"),
    (["make-model", "x.gguf", "--sparse", "--repeat"], "argument --repeat: not allowed with argument --sparse"),
]
RUNTIME = [
    *[([cmd, "--backend", "gpu"], "--backend gpu: this MLX build has no gpu backend (available: cpu)")
      for cmd in ("run", "chat", "serve", "bench")],
    *[([cmd, "--kv-disk-dir", "{tmp}/file/kv"], "--kv-disk-dir {tmp}/file/kv: cannot create the folder")
      for cmd in ("run", "chat", "serve")],
    (["run", "-p", "x", "--dump-logprobs", "{tmp}/nowhere/lp.json"], "--dump-logprobs: no folder {tmp}/nowhere"),
    (["run", "-p", "x", "--dump-logprobs", "{tmp}"], "--dump-logprobs {tmp} is a folder"),
    (["run", "-p", "x"], f"no model file at {MISSING}: download one with ./download_model.sh"),
    *[([cmd, "--mtp", "/nonexistent.gguf"], "no MTP file at /nonexistent.gguf: download one with ./download_model.sh "
                                            "ds4f-dspark") for cmd in ("run", "chat", "serve")],
    (["tokens", "-p", "x"], f"no model file at {MISSING}: download one with ./download_model.sh"),
    (["inspect", MISSING], f"no model file at {MISSING}: download one with ./download_model.sh"),
]


def _cli(capsys, argv: list[str]) -> tuple[int, str]:
    """Runs the command in this process (an exception other than SystemExit would fail the test)."""
    try:
        code = main(argv)
    except SystemExit as e:
        code = e.code
    return code, capsys.readouterr().err


def _one_error_line(err: str, command: str) -> str:
    """The error line, after checking it is the last line and nothing but ds4-mlx notices comes before it."""
    lines = err.splitlines()
    assert lines and lines[-1].startswith(f"ds4-mlx {command}: error: "), err
    assert all(line.startswith("ds4-mlx: ") for line in lines[:-1]), err
    return lines[-1]


@pytest.fixture
def no_gpu_backend(monkeypatch):
    """MLX as it is on a machine without a GPU backend, whatever this machine has."""
    import mlx.core as mx

    monkeypatch.setattr(mx, "is_available", lambda device: device == mx.cpu)


@pytest.mark.parametrize(("argv", "message"), USAGE, ids=[" ".join(a) for a, _ in USAGE])
def test_usage_mistakes_are_one_line_and_exit_2(argv, message, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "empty.txt").write_text("")
    extra = {"inspect": [MISSING], "make-model": []}.get(argv[0], ["-m", MISSING])
    code, err = _cli(capsys, [*argv, *extra])
    assert code == 2
    assert message in _one_error_line(err, argv[0])


@pytest.mark.parametrize(("argv", "message"), RUNTIME, ids=[" ".join(a) for a, _ in RUNTIME])
def test_run_time_mistakes_are_one_line_and_exit_1(argv, message, capsys, tmp_path, monkeypatch, no_gpu_backend):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "file").write_text("not a folder")
    argv = [a.format(tmp=tmp_path) for a in argv]
    if argv[0] == "serve":
        argv += ["--port", str(_free_port())]
    if argv[0] == "run" and "-p" not in argv:
        argv += ["-p", "x"]
    extra = ["-m", MISSING] if argv[0] not in ("inspect",) else []
    code, err = _cli(capsys, [*argv, *extra])
    assert code == 1
    assert message.format(tmp=tmp_path) in _one_error_line(err, argv[0])


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_serve_stops_before_loading_when_the_port_is_taken(capsys):
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        code, err = _cli(capsys, ["serve", "-m", MISSING, "--port", str(port)])
    assert code == 1
    assert _one_error_line(err, "serve") == f"ds4-mlx serve: error: cannot listen on 127.0.0.1:{port}: " \
                                          "Address already in use"


@pytest.mark.parametrize(("flags", "warning"), [
    (["--think-max"], "--think-max needs --ctx >= 393216; ctx=32768 uses normal thinking instead"),
    (["--mtp", "draft.gguf", "--mtp-draft", "2"], "--mtp speculates only in greedy decoding (--temp 0, no "
                                                  "penalties): it is unused here"),
    (["--mtp", "draft.gguf", "--temp", "0"], "--mtp without --mtp-draft N (N >= 2) does not speculate"),
    (["--raw", "--nothink"], "--raw sends the prompt as written: --system and the thinking flags are unused"),
])
def test_ignored_options_are_named(flags, warning, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "draft.gguf").write_bytes(b"")  # there: what is said is that it goes unused
    code, err = _cli(capsys, ["run", "-m", MISSING, "-p", "x", *flags])
    assert code == 1 and f"ds4-mlx: warning: {warning}" in err.splitlines()[0]
    _one_error_line(err, "run")


def test_options_that_apply_are_not_warned_about(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "draft.gguf").write_bytes(b"")
    code, err = _cli(capsys, ["run", "-m", MISSING, "-p", "x", "--think-max", "--ctx", "393216", "--mtp",
                              "draft.gguf", "--mtp-draft", "2", "--temp", "0"])
    assert code == 1 and "warning" not in err


def test_a_bad_flag_from_the_console_has_no_traceback():
    r = subprocess.run([sys.executable, "-m", "ds4_mlx.cli", "run", "--ctx", "0", "-p", "x"], capture_output=True,
                       text=True)
    assert r.returncode == 2 and r.stdout == "" and "Traceback" not in r.stderr
    assert r.stderr == ("ds4-mlx run: error: argument -c/--ctx: expected a number of tokens from 1 to 1048576, "
                        "got '0' (`ds4-mlx run --help` lists the options)\n")


def test_a_missing_mtp_file_is_said_before_any_warning(capsys, tmp_path, monkeypatch):
    """`--mtp /nonexistent` without --mtp-draft would be unused, but the file's absence is the one thing said."""
    monkeypatch.chdir(tmp_path)
    code, err = _cli(capsys, ["run", "-m", MISSING, "-p", "x", "--mtp", "/nonexistent.gguf"])
    assert code == 1 and "warning" not in err
    assert _one_error_line(err, "run").endswith("no MTP file at /nonexistent.gguf: download one with "
                                                "./download_model.sh ds4f-dspark (0731's DSpark drafter) or mtp "
                                                "(the preview's)")


@pytest.mark.parametrize("command", ["run", "tokens"])
def test_demo_names_an_unused_model_file(command, capsys, tmp_path, monkeypatch, demo_model):
    """--demo loads its own model: a -m beside it is said to be unused (and not opened)."""
    import ds4_mlx.engine as engine_module

    monkeypatch.chdir(tmp_path)
    loaded = []

    def refuse(path, *args, **kwargs):
        loaded.append(path)
        raise engine_module.ResourceError("stop here")

    monkeypatch.setattr(engine_module.Engine, "load", refuse)
    code, err = _cli(capsys, [command, "--demo", "-m", "tiny.gguf", "-p", "x"])
    assert "ds4-mlx: warning: --demo loads the built-in demo model: -m tiny.gguf is unused" in err.splitlines()
    assert code == (1 if command == "run" else 0)
    assert loaded == ([demo_model] if command == "run" else [])
    code, err = _cli(capsys, [command, "--demo", "-p", "x"])
    assert "warning" not in err


@pytest.mark.parametrize("host", ["256.1.1.1", "no-such-host.invalid"])
def test_serve_says_when_the_host_cannot_be_resolved(host, capsys):
    code, err = _cli(capsys, ["serve", "-m", MISSING, "--host", host, "--port", str(_free_port())])
    assert code == 1
    line = _one_error_line(err, "serve")
    assert f"cannot listen on {host}:" in line and f"the host '{host}' cannot be resolved to an address" in line
    assert "Unknown error" not in line


@pytest.mark.parametrize("argv", [["tokens", "--demo", "-p", "word " * 20000], ["inspect", "{model}"]])
def test_a_closed_pipe_ends_quietly(argv, demo_model):
    """`ds4-mlx tokens ... | head -1`: the reader is gone before the output is written; no traceback, and the exit
    status a shell gives a process ended by SIGPIPE."""
    command = [sys.executable, "-m", "ds4_mlx.cli", *[a.format(model=demo_model) for a in argv]]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=300) == 141 and err == ""
