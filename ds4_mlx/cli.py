"""The `ds4-mlx` command: a thin dispatcher over one module per subcommand.

Each module in `ds4_mlx.commands` exposes `add_arguments(parser)` and `run(args) -> int`. Only the chosen
command's module is imported, so `ds4-mlx tokens` does not pay for loading MLX kernels or the server.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from .errors import Ds4Error, UsageError

COMMANDS: dict[str, tuple[str, str]] = {
    "run": ("run", "generate a completion for one prompt"),
    "chat": ("chat", "interactive terminal chat"),
    "serve": ("serve", "OpenAI- and Anthropic-compatible HTTP server"),
    "bench": ("bench", "measure load time, and prefill and decode speed at growing contexts"),
    "inspect": ("inspect", "describe a DeepSeek V4 Flash GGUF file"),
    "tokens": ("tokens", "tokenize text and print the ids"),
    "make-model": ("make_model", "write a DeepSeek V4 layout GGUF with random weights (for tests and demos)"),
}


def _usage() -> str:
    lines = ["usage: ds4-mlx COMMAND [options]", "", "commands:"]
    lines += [f"  {name:<12} {help_}" for name, (_, help_) in COMMANDS.items()]
    lines += ["", "`ds4-mlx COMMAND --help` describes a command's options."]
    return "\n".join(lines)


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage mistake is one line (the full usage of `run` is a screenful), then exit status 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (`{self.prog} --help` lists the options)\n")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0 if argv else 2
    if argv[0] in ("-V", "--version"):
        from . import __version__

        print(f"ds4-mlx {__version__}")
        return 0
    name = argv[0]
    if name not in COMMANDS:
        print(f"ds4-mlx: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(f".commands.{COMMANDS[name][0]}", __package__)
    parser = _Parser(prog=f"ds4-mlx {name}", description=COMMANDS[name][1])
    module.add_arguments(parser)
    args = parser.parse_args(argv[1:])
    try:
        return int(module.run(args) or 0)
    except Ds4Error as e:
        print(f"ds4-mlx {name}: error: {e}", file=sys.stderr)
        return 2 if isinstance(e, UsageError) else 1
    except KeyboardInterrupt:
        print("", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return _closed_pipe()


def _closed_pipe() -> int:
    """The reader of our output went away (`ds4-mlx run ... | head -c 20`): stop quietly, as `cat` does. The
    standard streams are pointed at /dev/null so that Python's flush at exit meets no closed pipe either; the
    exit status is a shell's for a process ended by SIGPIPE."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    for stream in (sys.stdout, sys.stderr):
        try:
            os.dup2(devnull, stream.fileno())
        except (OSError, ValueError):  # a stream without a file descriptor (replaced by a caller)
            pass
    os.close(devnull)
    return 128 + 13  # SIGPIPE


if __name__ == "__main__":
    sys.exit(main())
