"""`ds4-mlx tokens`: tokenize a prompt with the model's vocabulary and print the ids, like `ds4 --dump-tokens`.

Only the GGUF metadata is read (no weights, no chat template): the text is tokenized exactly as written, with the
seven chat specials recognized unless --no-specials is given.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..errors import RequestError
from ..model.gguf import GGUFFile
from ..tokenizer import Tokenizer
from .options import DEFAULT_MODEL, model_file, unused_model_note

STDIN = Path("-")
"""`-p -` and `--prompt-file -`: the prompt comes from standard input."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("-m", "--model", type=Path, help=f"GGUF file (default ./{DEFAULT_MODEL})")
    p.add_argument("--demo", action="store_true", help="use the built-in tiny demo model's vocabulary (the real one)")
    text = p.add_mutually_exclusive_group(required=True)
    text.add_argument("-p", "--prompt", help="text to tokenize; - reads it from standard input")
    text.add_argument("--prompt-file", type=Path, help="file whose UTF-8 text is tokenized (- for standard input)")
    p.add_argument("--no-specials", action="store_true", help="treat the chat special strings as plain text")


def read_prompt_file(path: Path) -> str:
    """The UTF-8 text of a prompt file (standard input for `-`), or a RequestError that names the file and the
    problem."""
    name = "standard input" if path == STDIN else f"prompt file {path}"
    try:
        data = sys.stdin.buffer.read() if path == STDIN else path.read_bytes()
        return data.decode("utf-8")
    except OSError as e:
        raise RequestError(f"cannot read {name}: {e.strerror}") from None
    except UnicodeDecodeError as e:
        raise RequestError(f"{name} is not UTF-8 text (byte {e.start}: {e.reason})") from None


def prompt_from_args(args: argparse.Namespace) -> str | None:
    """The text of -p TEXT or --prompt-file FILE (`-` for either reads standard input); None when neither is given."""
    if args.prompt is not None:
        return read_prompt_file(STDIN) if args.prompt == "-" else args.prompt
    if args.prompt_file is not None:
        return read_prompt_file(args.prompt_file)
    return None


def prompt_source(args: argparse.Namespace) -> str:
    """Where `prompt_from_args` read the prompt, in the words of the flags: -p, standard input, or the file."""
    if args.prompt is not None:
        return "standard input" if args.prompt == "-" else "-p"
    return "standard input" if args.prompt_file == STDIN else f"--prompt-file {args.prompt_file}"


def format_tokens(tokenizer: Tokenizer, ids: list[int]) -> str:
    """The id list on one line, then one line per token: the id right-aligned in 6 columns, two spaces, the raw
    vocab string."""
    lines = ["[" + ", ".join(map(str, ids)) + "]"]
    lines += [f"{i:6d}  {tokenizer.token_text(i)}" for i in ids]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    text = prompt_from_args(args)
    if (note := unused_model_note(args)) is not None:
        print(f"ds4-mlx: warning: {note}", file=sys.stderr)
    path = model_file(args)
    if args.demo:
        from ..engine import ensure_demo_model  # built on first use: only --demo pays for importing MLX

        path = ensure_demo_model()
    with GGUFFile.open(path) as f:
        tokenizer = Tokenizer.from_gguf(f.metadata)
    print(format_tokens(tokenizer, tokenizer.encode(text, specials=not args.no_specials)))
    return 0
