"""`ds4-mlx tokens`: tokenize a prompt with the model's vocabulary and print the ids, like `ds4 --dump-tokens`.

Only the GGUF metadata is read (no weights, no chat template): the text is tokenized exactly as written, with the
seven chat specials recognized unless --no-specials is given.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from ..errors import RequestError
from ..model.gguf import GGUFFile
from ..tokenizer import Tokenizer
from .options import DEFAULT_MODEL


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("-m", "--model", type=Path, default=Path(DEFAULT_MODEL), help="GGUF file (default ./ds4flash.gguf)")
    text = p.add_mutually_exclusive_group(required=True)
    text.add_argument("-p", "--prompt", help="text to tokenize")
    text.add_argument("--prompt-file", type=Path, help="file whose UTF-8 text is tokenized")
    p.add_argument("--no-specials", action="store_true", help="treat the chat special strings as plain text")


def read_prompt_file(path: Path) -> str:
    """The UTF-8 text of a prompt file, or a RequestError that names the file and the problem."""
    try:
        return path.read_bytes().decode("utf-8")
    except OSError as e:
        raise RequestError(f"cannot read prompt file {path}: {e.strerror}") from None
    except UnicodeDecodeError as e:
        raise RequestError(f"prompt file {path} is not UTF-8 text (byte {e.start}: {e.reason})") from None


def format_tokens(tokenizer: Tokenizer, ids: list[int]) -> str:
    """The id list on one line, then one line per token: the id right-aligned in 6 columns, two spaces, the raw
    vocab string."""
    lines = ["[" + ", ".join(map(str, ids)) + "]"]
    lines += [f"{i:6d}  {tokenizer.token_text(i)}" for i in ids]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    text = args.prompt if args.prompt is not None else read_prompt_file(args.prompt_file)
    with GGUFFile.open(args.model) as f:
        tokenizer = Tokenizer.from_gguf(f.metadata)
    print(format_tokens(tokenizer, tokenizer.encode(text, specials=not args.no_specials)))
    return 0
