"""`ds4-mlx chat`: ds4's interactive REPL (ds4_cli.c) over one Engine, in the terminal with rich.

A message may span lines: a paste arrives whole in the terminal (bracketed paste), and the lines between two lines
of three double quotes (BLOCK) are one message, in a terminal or a pipe. /clear, /system, /save and /load manage the
conversation.

The conversation is kept as ds4 keeps it, as a token transcript: BOS + [Think-Max prefix] + system text, then per
turn `<｜User｜>` text `<｜Assistant｜>` + think opener + every generated token (reasoning included) + EOS. Each turn
sends the whole transcript as token ids; because it extends what the engine's live session holds, the engine reuses
that session and prefills only the new turn. The preamble is rebuilt from the current think mode, so switching Think
Max on or off changes the tokens right after BOS and the next turn prefills everything again, as in ds4.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

from rich.console import Console

from ..chat import (
    DEFAULT_SYSTEM,
    THINK_MAX_MIN_CONTEXT,
    ThinkMode,
    effective_think_mode,
    render_cli_preamble,
    render_cli_turn,
)
from ..errors import Ds4Error, RequestError
from ..model import watchdog
from ..model.checkpoint import Checkpoint
from ..events import Done, PrefillProgress, ReasoningDelta, TextDelta
from ..progress import Progress
from .options import (
    add_kv_cache_arguments,
    add_model_options,
    add_mtp_options,
    add_sampling_options,
    add_token_limit,
    encode_cli_prompt,
    open_engine,
    sampling_from_args,
    think_mode_from_args,
    token_limit,
)
from .terminal import AnswerPrinter, stop_on_interrupt

if TYPE_CHECKING:
    from ..engine import Engine
    from ..sampling import SamplingParams
    from ..tokenizer import Tokenizer

PROMPT = "ds4-mlx> "
BLOCK_PROMPT = "... "
BLOCK = '"""'
"""A line that starts with it opens a multi-line message; the next line that ends with it closes the message."""
DEFAULT_MAX_TOKENS = 50000
SAVE_FORMAT = "ds4-mlx chat"
SAVE_VERSION = 1
HISTORY_FILE = Path("~/.ds4_mlx_history")
HISTORY_LENGTH = 512

COMMANDS = (
    ("/help", "this list"),
    ("/think", "think before answering, at the default effort tier (low)"),
    ("/nothink", "answer without thinking"),
    ("/think-high", "the high tier (0731: the \"Absolute maximum\" prefix; the preview: as /think)"),
    ("/think-max", f"Think Max (needs --ctx >= {THINK_MAX_MIN_CONTEXT}, else normal thinking)"),
    ("/ctx N", "new context of N tokens; the conversation is kept and prefilled again"),
    ("/read FILE", "send the file's contents as your next message"),
    ("/system TEXT", "new system text for the conversation (/system alone shows it)"),
    ("/clear", "start the conversation over (system text and settings stay)"),
    ("/save FILE", "keep the conversation in a JSON file"),
    ("/load FILE", "continue a conversation kept with /save"),
    (f"{BLOCK} ... {BLOCK}", "a message of several lines: open and close it with a line of " + BLOCK),
    ("/quit, /exit", "leave (Ctrl+D too)"),
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_options(p)
    add_token_limit(p, DEFAULT_MAX_TOKENS, "most tokens per answer")
    p.add_argument(
        "-sys", "--system", default=DEFAULT_SYSTEM, help=f"system text (default {DEFAULT_SYSTEM!r}; '' for none)"
    )
    add_sampling_options(p)
    add_kv_cache_arguments(p)
    add_mtp_options(p)


@dataclass
class Transcript:
    """Everything the model has been told, as tokens: a preamble that follows the think mode, then the turns."""

    system: str
    turns: list[int] = field(default_factory=list)

    def tokens(self, tokenizer: Tokenizer, think: ThinkMode, ctx: int, checkpoint: Checkpoint) -> list[int]:
        preamble = render_cli_preamble(self.system, think=think, ctx=ctx, checkpoint=checkpoint)
        return encode_cli_prompt(tokenizer, preamble) + self.turns

    def to_json(self, tokenizer: Tokenizer, think: ThinkMode) -> dict:
        """What /save writes: the turns as the exact token ids (reasoning included), and their text for reading."""
        return {"format": SAVE_FORMAT, "version": SAVE_VERSION, "system": self.system, "think": think.value,
                "turns": self.turns, "text": tokenizer.decode(self.turns)}

    @classmethod
    def from_json(cls, data: object, vocab_size: int) -> tuple[Transcript, ThinkMode]:
        """The transcript and think mode of a /save file; ValueError says what does not match the format."""
        if not isinstance(data, dict) or data.get("format") != SAVE_FORMAT or data.get("version") != SAVE_VERSION:
            raise ValueError(f"not a conversation saved by /save (expected format {SAVE_FORMAT!r} version "
                             f"{SAVE_VERSION})")
        system, think, turns = data.get("system"), data.get("think"), data.get("turns")
        if not isinstance(system, str):
            raise ValueError("'system' must be a string")
        if think not in {mode.value for mode in ThinkMode}:
            raise ValueError(f"'think' must be one of {', '.join(mode.value for mode in ThinkMode)}, got {think!r}")
        if not isinstance(turns, list) or not all(type(t) is int and 0 <= t < vocab_size for t in turns):
            raise ValueError(f"'turns' must be a list of token ids from 0 to {vocab_size - 1}")
        return cls(system, turns), ThinkMode(think)


class Chat:
    """The REPL's state and commands: one engine, one transcript, the think mode and the sampling settings.

    `out` receives the answers (streamed as generated: no wrapping, no tab expansion; reasoning in grey when it is
    a colour terminal) and the command replies; `err` the startup, warning, error and stats lines.
    """

    def __init__(
        self,
        engine: Engine,
        *,
        system: str,
        think: ThinkMode,
        max_tokens: int,
        sampling: SamplingParams,
        out: Console,
        err: Console,
        quiet: bool = False,
    ) -> None:
        self.engine = engine
        self.transcript = Transcript(system)
        self.think = think
        self.max_tokens = max_tokens
        self.sampling = sampling
        self.out = out
        self.err = err
        self.progress = Progress(quiet=quiet)
        self._grey = out.is_terminal and not out.no_color
        self.block: list[str] | None = None
        """The lines of a multi-line message being typed (after a line that opens a BLOCK), else None."""

    # -- the loop ------------------------------------------------------------------------------------------------

    def loop(self, lines: Iterable[str | None]) -> None:
        """Handles lines until /quit, /exit or the end of the input. A Ctrl+C outside generation (a turn's own
        Ctrl+C is handled by `send`) abandons what the line was doing; it never leaves the chat. None stands for
        a Ctrl+C at the prompt: it drops a multi-line message being typed."""
        for line in lines:
            try:
                if line is None:
                    self._drop_block("Ctrl+C")
                elif not self.take(line):
                    return
            except KeyboardInterrupt:
                self.out.file.write("\n")
        self._drop_block("the input ended")

    def take(self, line: str) -> bool:
        """One line as typed: part of a BLOCK message, or a whole message or command. False when the user leaves."""
        if self.block is None and not line.lstrip().startswith(BLOCK):
            return self.handle(line)
        opening = self.block is None
        if opening:
            line = line.lstrip()[len(BLOCK):].lstrip()
            self.block = []
        closing = line.rstrip().endswith(BLOCK)
        if closing:
            line = line.rstrip()[: -len(BLOCK)]
        if line or not (opening or closing):
            self.block.append(line)
        if closing:
            text, self.block = "\n".join(self.block), None
            if text.strip():
                self.send(text)
        return True

    def _drop_block(self, why: str) -> None:
        if self.block is not None:
            self.block = None
            self.err.print(f"ds4-mlx: {why}: the unfinished {BLOCK} message was not sent")

    def handle(self, line: str) -> bool:
        """One input line: a command, or a user message. Returns False when the user asks to leave."""
        text = line.strip()
        if not text:
            return True
        if not text.startswith("/"):
            self.send(line)
            return True
        name, _, arg = text.partition(" ")
        arg = arg.strip()
        if text in ("/quit", "/exit"):
            return False
        if text == "/help":
            self.print_help()
        elif text == "/think":
            self.think = ThinkMode.LOW
            self.out.print("Thinking mode: low (the default tier).")
        elif text == "/think-high":
            self.think = ThinkMode.HIGH
            self.out.print("Thinking mode: high.")
        elif text == "/nothink":
            self.think = ThinkMode.NONE
            self.out.print("Thinking mode: none.")
        elif text == "/think-max":
            self.think = ThinkMode.MAX
            self._think_max_reply()
        elif name == "/ctx":
            self._set_context(arg)
        elif name == "/read":
            self._read(arg)
        elif name == "/system":
            self._system(arg)
        elif text == "/clear":
            self.transcript.turns = []
            self.out.print("Conversation cleared.")
        elif name == "/save":
            self._save(arg)
        elif name == "/load":
            self._load(arg)
        else:
            self.err.print(f"ds4-mlx: unknown command: {text}")
            self.err.print("ds4-mlx: type /help for commands")
        return True

    def print_help(self) -> None:
        width = max(len(command) for command, _ in COMMANDS)
        lines = ["Type a message, or one of these commands (Ctrl+C stops an answer):"]
        lines += [f"  {command:<{width}}  {what}" for command, what in COMMANDS]
        self.out.print("\n".join(lines))

    def error(self, message: str) -> None:
        self.err.print(f"ds4-mlx: error: {message}")

    def context_line(self) -> str:
        """ds4's startup line: what the session state of this context costs, and how it is laid out."""
        import mlx.core as mx

        engine = self.engine
        config = engine.model.config
        return (
            f"ds4-mlx: context buffers {engine.session.cache.nbytes / 2**20:.1f} MiB (ctx={engine.ctx}, "
            f"backend={mx.default_device().type.name}, prefill_chunk={engine.session.chunk_size}, "
            f"raw_kv_rows={config.sliding_window}, compressed_kv_rows={engine.ctx // 4 + 2})"
        )

    def warn_think_max(self) -> None:
        """Says so when Think Max was asked for but the context is too small for it (ds4's warning)."""
        if self.think is ThinkMode.MAX and effective_think_mode(self.think, self.engine.ctx) is not ThinkMode.MAX:
            self.err.print(
                f"ds4-mlx: warning: /think-max needs --ctx >= {THINK_MAX_MIN_CONTEXT}; "
                f"ctx={self.engine.ctx} uses normal thinking instead"
            )

    def _think_max_reply(self) -> None:
        if effective_think_mode(ThinkMode.MAX, self.engine.ctx) is ThinkMode.MAX:
            self.out.print("Thinking mode: max.")
        else:
            self.out.print(f"Thinking mode: high (ctx below {THINK_MAX_MIN_CONTEXT}).")
            self.warn_think_max()

    def _read(self, arg: str) -> None:
        """/read FILE: the file's text becomes the next user message."""
        from .tokens import read_prompt_file

        if not arg:
            self.error("/read expects a file name")
            return
        try:
            text = read_prompt_file(Path(arg).expanduser())
        except RequestError as e:
            self.error(str(e))
            return
        self.send(text)

    def _system(self, arg: str) -> None:
        """/system TEXT: the conversation goes on under a new system text (the next turn prefills it all again)."""
        if not arg:
            self.out.print(f"System text: {self.transcript.system!r}")
            return
        self.transcript.system = arg
        self.out.print("System text set.")

    def _save(self, arg: str) -> None:
        """/save FILE: the conversation as JSON (see Transcript.to_json)."""
        if not arg:
            self.error("/save expects a file name")
            return
        path = Path(arg).expanduser()
        data = self.transcript.to_json(self.engine.tokenizer, self.think)
        try:
            path.write_text(json.dumps(data, ensure_ascii=False, indent=1) + "\n", encoding="utf-8")
        except OSError as e:
            self.error(f"cannot write {path}: {e.strerror or e}")
            return
        self.out.print(f"Saved {self._turns()} to {path}.")

    def _load(self, arg: str) -> None:
        """/load FILE: a conversation kept with /save replaces the current one, with its system text and think
        mode; the next turn prefills it."""
        if not arg:
            self.error("/load expects a file name")
            return
        path = Path(arg).expanduser()
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
            self.transcript, self.think = Transcript.from_json(data, self.engine.tokenizer.vocab_size)
        except OSError as e:
            self.error(f"cannot read {path}: {e.strerror or e}")
            return
        except UnicodeDecodeError as e:  # a binary file: the codec's own message names no file and no remedy
            self.error(f"cannot load {path}: not a conversation saved by /save (not UTF-8 text: byte {e.start} is "
                       f"{e.object[e.start]:#04x})")
            return
        except ValueError as e:  # bad JSON (json.JSONDecodeError), or not /save's format
            self.error(f"cannot load {path}: {e}")
            return
        self.out.print(f"Loaded {self._turns()} from {path} (thinking mode: {self.think.value}).")

    def _turns(self) -> str:
        """How many user turns the conversation holds, in words: "1 turn", "3 turns"."""
        n = self.transcript.turns.count(self.engine.tokenizer.user_id)
        return f"{n} turn" if n == 1 else f"{n} turns"

    def _set_context(self, arg: str) -> None:
        """/ctx N: a new empty session of N tokens; the transcript stays, so the next turn prefills all of it."""
        try:
            ctx = int(arg)
        except ValueError:
            ctx = 0
        if ctx <= 0:
            self.error(f"/ctx expects a positive number of tokens, got {arg!r}")
            return
        try:
            self.engine.set_context(ctx)
        except Ds4Error as e:
            self.error(str(e))
            return
        self.err.print(self.context_line())

    # -- one turn ------------------------------------------------------------------------------------------------

    def send(self, text: str) -> Done | None:
        """Runs one user turn and streams the answer. Returns the engine's Done, or None if the turn failed.

        The transcript gains the turn and every generated token + EOS. Ctrl+C stops decoding and keeps what was
        generated; stopped before the first token, the turn is dropped and the session emptied.
        """
        from ..engine import GenerationRequest

        engine = self.engine
        tokenizer = engine.tokenizer
        turn = encode_cli_prompt(tokenizer, render_cli_turn(text, think=self.think))
        request = GenerationRequest(
            prompt=self.transcript.tokens(tokenizer, self.think, engine.ctx, engine.checkpoint) + turn,
            max_tokens=self.max_tokens,
            sampling=self.sampling,
            thinking=self.think.thinking,
        )
        printer = AnswerPrinter(self.out.file, grey=self._grey)
        try:
            with stop_on_interrupt() as stopped, self.progress.bar("prefill") as bar:
                done = None
                for event in engine.generate(request, cancel=stopped):
                    if isinstance(event, PrefillProgress):
                        bar.update(event.done, event.total)
                    elif isinstance(event, ReasoningDelta):
                        bar.close()
                        printer.reasoning(event.text)
                    elif isinstance(event, TextDelta):
                        bar.close()
                        printer.text(event.text)
                    elif isinstance(event, Done):
                        done = event
        except KeyboardInterrupt:  # a second Ctrl+C: stopped mid-step, so the session state is unknown
            printer.end()
            engine.session.reset()
            self.err.print("ds4-mlx: interrupted; this turn is dropped")
            return None
        except Ds4Error as e:
            printer.end()
            self.error(str(e))
            return None
        printer.end()
        assert done is not None
        if done.token_ids or not stopped():
            self.transcript.turns += turn + list(done.token_ids) + [tokenizer.eos_id]
        else:
            engine.session.reset()
        self.err.print(stats_line(done), style="dim")
        return done


def stats_line(done: Done) -> str:
    """After each answer: prompt size and how much of it the live session already held, then both speeds."""
    u = done.usage
    new = u.prompt_tokens - u.cached_tokens
    prefill = new / done.prefill_seconds if done.prefill_seconds > 0 else 0.0
    generation = u.completion_tokens / done.decode_seconds if done.decode_seconds > 0 else 0.0
    finish = "cancelled" if done.error == "cancelled" else done.finish_reason
    return (
        f"ds4-mlx: prompt {u.prompt_tokens} tokens ({u.cached_tokens} reused), prefill {prefill:.1f} t/s, "
        f"generation {u.completion_tokens} tokens at {generation:.1f} t/s, finish {finish}"
    )


@contextmanager
def interrupts_for_the_main_thread() -> Iterator[None]:
    """Keeps Ctrl+C for the main thread: run numpy's, MLX's and the tokenizer's first use inside this block.

    Threads inherit the signal mask of the thread that starts them, and those libraries start theirs when first
    imported or used (OpenBLAS at numpy's import, MLX at the first evaluation); with SIGINT blocked meanwhile, none
    of them will take it. A SIGINT taken by another thread sets Python's flag but does not interrupt the main
    thread's wait inside readline, so the prompt would ignore Ctrl+C until Enter. A Ctrl+C pressed meanwhile is
    delivered when the block ends.
    """
    if not hasattr(signal, "pthread_sigmask"):
        yield
        return
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        import mlx.core as mx

        yield
        mx.eval(mx.zeros(1) + 1)  # MLX starts a stream's thread at its first evaluation
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


def terminal_lines(prompt: Callable[[], str] = lambda: PROMPT) -> Iterator[str | None]:
    """Lines typed at the prompt (a paste arrives as one, newlines included). Ctrl+C clears the line rather than
    leaving, and yields None; Ctrl+D leaves."""
    while True:
        try:
            with watchdog.idle():  # under a split, waiting for a line is not waiting for the other ranks
                line = input(prompt())
            yield line
        except KeyboardInterrupt:
            print()
            yield None
        except EOFError:
            print()
            return


def piped_lines(stream: TextIO) -> Iterator[str]:
    """Lines from a pipe or a file, without their line ends."""
    while True:
        with watchdog.idle():
            line = stream.readline()
        if not line:
            return
        yield line.rstrip("\r\n")


@contextmanager
def readline_history(path: Path = HISTORY_FILE) -> Iterator[None]:
    """Line editing and a persistent history through `readline`, when this Python has it."""
    try:
        import readline
    except ImportError:
        yield
        return
    path = path.expanduser()
    try:
        readline.read_history_file(path)
    except OSError:
        pass
    readline.set_history_length(HISTORY_LENGTH)
    readline.parse_and_bind("set enable-bracketed-paste on")  # CPython turns it off; a paste is then one input
    try:
        yield
    finally:
        try:
            readline.write_history_file(path)
        except OSError:
            pass


def run(args: argparse.Namespace) -> int:
    if sys.stdin.isatty():
        # A chat at a terminal owns Ctrl+C. Started with SIGINT ignored (as a non-interactive shell starts a
        # background job; exec keeps the disposition and Python then leaves it), the prompt would ignore Ctrl+C
        # while an answer still stopped on it (the answer's own handler), so Python's is put back.
        signal.signal(signal.SIGINT, signal.default_int_handler)
    with interrupts_for_the_main_thread():
        sampling = sampling_from_args(args)
        engine = open_engine(args)
    chat = Chat(
        engine,
        system=args.system,
        think=think_mode_from_args(args),
        max_tokens=token_limit(args, DEFAULT_MAX_TOKENS, engine),
        sampling=sampling,
        out=Console(soft_wrap=True, markup=False, highlight=False, emoji=False),
        err=Console(stderr=True, soft_wrap=True, markup=False, highlight=False, emoji=False),
        quiet=args.quiet,
    )
    chat.err.print(chat.context_line())  # open_engine has warned if --think-max does not apply
    chat.print_help()
    try:
        if sys.stdin.isatty():
            with readline_history():
                chat.loop(terminal_lines(lambda: PROMPT if chat.block is None else BLOCK_PROMPT))
        else:
            chat.loop(piped_lines(sys.stdin))
    finally:
        engine.shutdown()  # with --kv-disk-dir, the conversation's state is saved for the next session
    return 0
