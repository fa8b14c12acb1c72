"""`ds4-mlx chat`: the token transcript, prefix reuse between turns, the REPL commands and Ctrl+C (ds4_cli.c).

The model is the tiny preset with the real V4 vocabulary: its text is meaningless, but its tokens, the transcript
and the engine's reuse of the live session are exactly what the real model gets. Answers are capped at a few
tokens and sampled greedily so the tests stay fast and deterministic.
"""

from __future__ import annotations

import io
import json
import signal
import subprocess
import sys
from types import SimpleNamespace

import mlx.core as mx
import pytest
from rich.console import Console

from ds4_mlx.chat import ABSOLUTE_MAXIMUM_PREFIX, ASSISTANT, EOS, ThinkMode
from ds4_mlx.model.checkpoint import Checkpoint
from ds4_mlx.commands.chat import Chat, Transcript, interrupts_for_the_main_thread, piped_lines
from ds4_mlx.commands.terminal import AnswerPrinter
from ds4_mlx.engine import Engine
from ds4_mlx.events import ReasoningDelta, TextDelta
from ds4_mlx.sampling import SamplingParams

SYSTEM = "You are a helpful assistant"
PROMPT_BYTES = b"ds4-mlx> "
CTX = 1024
MAX_TOKENS = 3


@pytest.fixture(scope="module")
def model_path(demo_model):
    return demo_model


@pytest.fixture(scope="module")
def engine(model_path):
    return Engine.load(model_path, CTX)


@pytest.fixture
def chat(engine):
    """A fresh REPL over the shared engine, its output captured; the engine's session starts empty."""
    engine.set_context(CTX)
    return Chat(
        engine,
        system=SYSTEM,
        think=ThinkMode.HIGH,
        max_tokens=MAX_TOKENS,
        sampling=SamplingParams(temperature=0),
        out=Console(file=io.StringIO(), force_terminal=False, soft_wrap=True),
        err=Console(file=io.StringIO(), force_terminal=False, soft_wrap=True),
    )


def out(chat: Chat) -> str:
    return chat.out.file.getvalue()


def err(chat: Chat) -> str:
    return chat.err.file.getvalue()


def plain(tok, text: str) -> list[int]:
    return tok.encode(text, specials=False)


def turn_tokens(tok, text: str, opener: int) -> list[int]:
    return [tok.user_id, *plain(tok, text), tok.assistant_id, opener]


def test_first_turn_transcript_is_ds4s_token_layout(chat):
    tok = chat.engine.tokenizer
    done = chat.send("Hello <｜User｜> there")  # a special typed by the user stays plain text
    assert done is not None and done.usage.cached_tokens == 0
    assert 1 <= len(done.token_ids) <= MAX_TOKENS
    preamble = [tok.bos_id, *plain(tok, SYSTEM)]
    expected = preamble + turn_tokens(tok, "Hello <｜User｜> there", tok.think_id) + [*done.token_ids, tok.eos_id]
    assert chat.transcript.tokens(tok, chat.think, chat.engine.ctx, chat.engine.checkpoint) == expected
    assert done.usage.prompt_tokens == len(expected) - len(done.token_ids) - 1


def test_second_turn_reuses_the_live_session(chat):
    tok = chat.engine.tokenizer
    first = chat.send("hello")
    live = list(chat.engine.session.tokens)
    transcript = chat.transcript.tokens(tok, chat.think, chat.engine.ctx, chat.engine.checkpoint)
    assert live == transcript[: len(live)] and len(live) >= first.usage.prompt_tokens
    second = chat.send("and again")
    # Only the new turn (and the transcript's tail the session had not fed yet) is prefilled.
    assert second.usage.cached_tokens == len(live)
    assert second.usage.prompt_tokens == len(transcript) + len(turn_tokens(tok, "and again", tok.think_id))
    stats = [line for line in err(chat).splitlines() if line.startswith("ds4-mlx: prompt")]
    assert len(stats) == 2
    assert f"prompt {second.usage.prompt_tokens} tokens ({len(live)} reused)" in stats[1]
    assert stats[1].endswith(f"generation {second.usage.completion_tokens} tokens at "
                             f"{second.usage.completion_tokens / second.decode_seconds:.1f} t/s, "
                             f"finish {second.finish_reason}")


def test_think_commands_switch_the_opener(chat):
    tok = chat.engine.tokenizer

    def new_turn(text: str) -> tuple[list[int], list[int]]:
        before = len(chat.transcript.turns)
        done = chat.send(text)
        return chat.transcript.turns[before:], [*done.token_ids, tok.eos_id]

    assert chat.handle("/nothink") and out(chat) == "Thinking mode: none.\n"
    turn, answer = new_turn("no thinking")
    assert turn == turn_tokens(tok, "no thinking", tok.think_end_id) + answer
    assert chat.handle("  /think ") and out(chat).endswith("Thinking mode: low (the default tier).\n")
    assert chat.think is ThinkMode.LOW
    turn, answer = new_turn("think now")
    assert turn == turn_tokens(tok, "think now", tok.think_id) + answer
    assert chat.handle("/think-high") and out(chat).endswith("Thinking mode: high.\n")
    assert chat.think is ThinkMode.HIGH


def test_think_max_below_its_context_runs_as_high(chat):
    tok = chat.engine.tokenizer
    before = chat.transcript.tokens(tok, ThinkMode.HIGH, chat.engine.ctx, Checkpoint.PREVIEW)
    assert chat.handle("/think-max")
    assert out(chat) == "Thinking mode: high (ctx below 393216).\n"
    assert err(chat) == (
        f"ds4-mlx: warning: /think-max needs --ctx >= 393216; ctx={CTX} uses normal thinking instead\n"
    )
    assert chat.think is ThinkMode.MAX
    # no Think-Max prefix
    assert chat.transcript.tokens(tok, chat.think, chat.engine.ctx, chat.engine.checkpoint) == before


def test_think_max_reply_with_a_large_context():
    chat = Chat(
        SimpleNamespace(ctx=393216),
        system=SYSTEM, think=ThinkMode.HIGH, max_tokens=1, sampling=SamplingParams(),
        out=Console(file=io.StringIO()), err=Console(file=io.StringIO()),
    )
    assert chat.handle("/think-max")
    assert out(chat) == "Thinking mode: max.\n" and err(chat) == ""


def test_think_max_prefix_follows_bos_and_goes_away_again(engine):
    tok = engine.tokenizer
    transcript = Transcript(SYSTEM, turns=[tok.user_id, 7, tok.assistant_id, tok.think_id, 9, tok.eos_id])
    high = transcript.tokens(tok, ThinkMode.HIGH, 393216, Checkpoint.PREVIEW)
    maxed = transcript.tokens(tok, ThinkMode.MAX, 393216, Checkpoint.PREVIEW)
    assert maxed == [tok.bos_id, *plain(tok, ABSOLUTE_MAXIMUM_PREFIX), *high[1:]]
    assert transcript.tokens(tok, ThinkMode.MAX, 393215, Checkpoint.PREVIEW) == high


def test_unknown_command_prints_ds4s_two_lines(chat):
    assert chat.handle("/bogus arg")
    assert err(chat) == "ds4-mlx: unknown command: /bogus arg\nds4-mlx: type /help for commands\n"
    assert chat.handle("/think extra")  # commands match exactly after trimming
    assert err(chat).endswith("ds4-mlx: unknown command: /think extra\nds4-mlx: type /help for commands\n")
    assert chat.think is ThinkMode.HIGH and chat.transcript.turns == []


def test_help_lists_every_command(chat):
    chat.handle("/help")
    for command in ("/help", "/think", "/nothink", "/think-max", "/ctx N", "/read FILE", "/system TEXT", "/clear",
                    "/save FILE", "/load FILE", '""" ... """', "/quit, /exit"):
        assert f"  {command} " in out(chat)


def test_ctx_recreates_the_session_and_keeps_the_transcript(chat):
    tok = chat.engine.tokenizer
    chat.send("remember me")
    kept = list(chat.transcript.turns)
    assert chat.handle("/ctx 512")
    assert chat.engine.ctx == 512 and chat.engine.session.ctx == 512 and chat.engine.session.tokens == []
    assert "ds4-mlx: context buffers " in err(chat) and "(ctx=512, backend=cpu, prefill_chunk=512," in err(chat)
    assert chat.transcript.turns == kept
    done = chat.send("after resize")
    assert done.usage.cached_tokens == 0  # the whole transcript is prefilled again
    assert done.usage.prompt_tokens == 1 + len(plain(tok, SYSTEM)) + len(kept) + len(
        turn_tokens(tok, "after resize", tok.think_id)
    )


@pytest.mark.parametrize("arg", ["", "abc", "0", "-5"])
def test_ctx_rejects_a_bad_size(chat, arg):
    assert chat.handle(f"/ctx {arg}")
    assert err(chat) == f"ds4-mlx: error: /ctx expects a positive number of tokens, got {arg!r}\n"
    assert chat.engine.ctx == CTX


def test_ctx_too_large_for_the_device_is_refused(chat):
    from ds4_mlx import memory

    with memory.limited(mx.get_active_memory() + 2**28):  # 256 MiB free
        chat.handle("/ctx 1048576")
    assert err(chat).startswith("ds4-mlx: error: ctx 1048576 needs ")
    assert f"the context stays at {CTX}" in err(chat)
    assert chat.engine.ctx == CTX


def test_ctx_beyond_the_trained_context_is_refused(chat):
    chat.handle("/ctx 1048577")
    assert err(chat) == ("ds4-mlx: error: context size must be from 1 to 1048576 tokens (the model's trained "
                         "context), got 1048577\n")
    assert chat.engine.ctx == CTX


def test_read_sends_the_file_as_the_next_message(chat, tmp_path):
    tok = chat.engine.tokenizer
    path = tmp_path / "question.txt"
    path.write_text("What is in\nthis file?\n", encoding="utf-8")
    assert chat.handle(f"/read {path}")
    turn = turn_tokens(tok, "What is in\nthis file?\n", tok.think_id)
    assert chat.transcript.turns[: len(turn)] == turn
    assert err(chat).count("ds4-mlx: prompt ") == 1


def test_read_of_a_missing_file_is_one_error_line(chat, tmp_path):
    assert chat.handle(f"/read {tmp_path / 'nope.txt'}")
    assert err(chat) == f"ds4-mlx: error: cannot read prompt file {tmp_path / 'nope.txt'}: No such file or directory\n"
    assert chat.handle("/read")
    assert err(chat).endswith("ds4-mlx: error: /read expects a file name\n")
    assert chat.transcript.turns == []


def user_texts(chat: Chat) -> list[str]:
    """The user messages of the transcript, decoded."""
    tok = chat.engine.tokenizer
    turns, texts = chat.transcript.turns, []
    for i, t in enumerate(turns):
        if t == tok.user_id:
            end = turns.index(tok.assistant_id, i)
            texts.append(tok.decode(turns[i + 1 : end]))
    return texts


def test_triple_quotes_make_one_message_of_several_lines(chat):
    lines = ['"""', "line one", "", "  line three  ", '"""', '""" inline start', 'ends here"""', '"""single"""']
    chat.loop(piped_lines(io.StringIO("\n".join(lines) + "\n")))
    assert user_texts(chat) == ["line one\n\n  line three  ", "inline start\nends here", "single"]
    assert err(chat).count("ds4-mlx: prompt ") == 3


def test_an_unfinished_block_is_not_sent(chat):
    chat.loop(['"""', "typed", None, "/nothink"])  # None: Ctrl+C at the prompt
    assert err(chat) == 'ds4-mlx: Ctrl+C: the unfinished """ message was not sent\n' and chat.block is None
    assert chat.think is ThinkMode.NONE  # the line after Ctrl+C is a command again
    chat.loop(['"""', "never closed"])
    assert err(chat).endswith('ds4-mlx: the input ended: the unfinished """ message was not sent\n')
    assert chat.transcript.turns == []


def test_clear_starts_over(chat):
    tok = chat.engine.tokenizer
    chat.send("first")
    assert chat.handle("/clear") and out(chat).endswith("Conversation cleared.\n")
    assert chat.transcript.turns == []
    done = chat.send("again")
    assert done.usage.prompt_tokens == 1 + len(plain(tok, SYSTEM)) + len(turn_tokens(tok, "again", tok.think_id))


def test_system_replaces_the_system_text(chat):
    tok = chat.engine.tokenizer
    chat.send("before")
    kept = list(chat.transcript.turns)
    assert chat.handle("/system  You answer in French. ")
    assert out(chat).endswith("\nSystem text set.\n") and chat.transcript.system == "You answer in French."
    assert chat.transcript.turns == kept
    assert chat.transcript.tokens(tok, chat.think, CTX, chat.engine.checkpoint)[: 1 + len(plain(tok, "You answer in French."))] == [
        tok.bos_id, *plain(tok, "You answer in French.")]
    done = chat.send("after")
    assert done.usage.cached_tokens == 0  # the preamble changed: everything is prefilled again
    chat.handle("/system")
    assert out(chat).endswith("System text: 'You answer in French.'\n")


def test_save_and_load_restore_the_conversation(chat, tmp_path):
    chat.handle("/nothink")
    chat.send("remember this")
    chat.handle("/system Be brief.")
    kept = list(chat.transcript.turns)
    path = tmp_path / "talk.json"
    assert chat.handle(f"/save {path}") and out(chat).endswith(f"Saved 1 turn to {path}.\n")
    saved = json.loads(path.read_text(encoding="utf-8"))
    assert saved["system"] == "Be brief." and saved["think"] == "none" and saved["turns"] == kept
    assert "remember this" in saved["text"]
    chat.handle("/clear")
    chat.handle("/think")
    chat.handle("/system Other.")
    assert chat.handle(f"/load {path}")
    assert out(chat).endswith(f"Loaded 1 turn from {path} (thinking mode: none).\n")
    assert chat.transcript.turns == kept and chat.transcript.system == "Be brief." and chat.think is ThinkMode.NONE
    done = chat.send("and now")
    assert user_texts(chat) == ["remember this", "and now"] and done.usage.prompt_tokens > len(kept)
    assert chat.handle(f"/save {path}") and out(chat).endswith(f"Saved 2 turns to {path}.\n")


@pytest.mark.parametrize(("content", "message"), [
    (None, "cannot read {path}: No such file or directory"),
    ("{not json", "cannot load {path}: Expecting property name"),
    (b"\x89PNG\r\n\x1a\n\x00", "cannot load {path}: not a conversation saved by /save (not UTF-8 text: byte 0 is "
                                "0x89)"),
    ('{"format": "other"}', "cannot load {path}: not a conversation saved by /save"),
    ('{"format": "ds4-mlx chat", "version": 1, "system": "", "think": "high", "turns": [1, -2]}',
     "cannot load {path}: 'turns' must be a list of token ids from 0 to"),
    ('{"format": "ds4-mlx chat", "version": 1, "system": "", "think": "hard", "turns": []}',
     "cannot load {path}: 'think' must be one of none, low, high, max, got 'hard'"),
])
def test_load_refuses_what_save_did_not_write(chat, tmp_path, content, message):
    chat.send("kept")
    kept = list(chat.transcript.turns)
    path = tmp_path / "bad.json"
    if isinstance(content, bytes):
        path.write_bytes(content)
    elif content is not None:
        path.write_text(content, encoding="utf-8")
    assert chat.handle(f"/load {path}")
    assert err(chat).count("\n") == 2 and f"ds4-mlx: error: {message.format(path=path)}" in err(chat)
    assert chat.transcript.turns == kept and chat.transcript.system == SYSTEM


def test_save_and_load_need_a_file_name(chat, tmp_path):
    chat.handle("/save")
    chat.handle("/load")
    chat.handle(f"/save {tmp_path / 'missing' / 'x.json'}")
    assert err(chat).splitlines() == [
        "ds4-mlx: error: /save expects a file name", "ds4-mlx: error: /load expects a file name",
        f"ds4-mlx: error: cannot write {tmp_path / 'missing' / 'x.json'}: No such file or directory"]


def test_quit_and_exit_stop_the_loop(chat):
    chat.loop(piped_lines(io.StringIO("/nothink\n\n   \n/exit\n/think\n")))
    assert out(chat) == "Thinking mode: none.\n" and chat.think is ThinkMode.NONE
    assert chat.handle("/quit") is False


def test_context_overflow_is_an_error_line_and_the_turn_is_dropped(chat):
    chat.engine.set_context(24)
    assert chat.send("this message is long enough to leave no room at all in a context of only twenty-four "
                     "tokens, since the system text and the markers take some of them too") is None
    assert err(chat).startswith("ds4-mlx: error: Prompt has ")
    assert chat.transcript.turns == []


def _interrupting(generate, times: int, after_first_delta: bool):
    """engine.generate that presses Ctrl+C `times` times, at the start or after the first streamed text."""

    def press() -> None:
        for _ in range(times):
            signal.raise_signal(signal.SIGINT)

    def wrapped(request, cancel=None):
        pending = after_first_delta
        if not pending:
            press()
        for event in generate(request, cancel):
            yield event
            if pending and isinstance(event, (ReasoningDelta, TextDelta)):
                pending = False
                press()

    return wrapped


def test_ctrl_c_keeps_the_partial_answer_and_appends_eos(chat, monkeypatch):
    tok = chat.engine.tokenizer
    chat.max_tokens = 50
    handler = signal.getsignal(signal.SIGINT)
    monkeypatch.setattr(chat.engine, "generate", _interrupting(chat.engine.generate, 1, after_first_delta=True))
    done = chat.send("stop me")
    assert done.error == "cancelled" and 1 <= len(done.token_ids) < 50
    assert chat.transcript.turns == turn_tokens(tok, "stop me", tok.think_id) + [*done.token_ids, tok.eos_id]
    assert err(chat).rstrip().endswith("finish cancelled")
    assert signal.getsignal(signal.SIGINT) is handler


def test_ctrl_c_before_the_first_token_rolls_the_turn_back(chat, monkeypatch):
    chat.send("kept")
    kept = list(chat.transcript.turns)
    monkeypatch.setattr(chat.engine, "generate", _interrupting(chat.engine.generate, 1, after_first_delta=False))
    done = chat.send("dropped")
    assert done.token_ids == () and done.error == "cancelled"
    assert chat.transcript.turns == kept and chat.engine.session.tokens == []


def test_second_ctrl_c_interrupts_at_once_and_drops_the_turn(chat, monkeypatch):
    monkeypatch.setattr(chat.engine, "generate", _interrupting(chat.engine.generate, 2, after_first_delta=True))
    assert chat.send("interrupt twice") is None
    assert "ds4-mlx: interrupted; this turn is dropped" in err(chat)
    assert chat.transcript.turns == [] and chat.engine.session.tokens == []


def test_threads_started_while_loading_leave_ctrl_c_to_the_main_thread():
    import threading

    masks = []
    with interrupts_for_the_main_thread():
        worker = threading.Thread(target=lambda: masks.append(signal.pthread_sigmask(signal.SIG_BLOCK, [])))
        worker.start()
        worker.join()
    assert signal.SIGINT in masks[0]
    assert signal.SIGINT not in signal.pthread_sigmask(signal.SIG_BLOCK, [])


def test_answer_printer_greys_reasoning_and_breaks_the_line_before_the_answer():
    buf = io.StringIO()
    printer = AnswerPrinter(buf, grey=True)
    printer.reasoning("let me think")
    printer.reasoning("\tmore")
    printer.text("The answer\tis 4")
    printer.end()
    assert buf.getvalue() == "\x1b[90mlet me think\tmore\x1b[0m\nThe answer\tis 4\n"
    buf = io.StringIO()
    printer = AnswerPrinter(buf, grey=False)
    printer.reasoning("done.\n")
    printer.end()
    assert buf.getvalue() == "done.\n"


def test_chat_through_a_pipe(model_path):
    """The command end to end: two turns (the second reusing the first), commands, /quit ending the input."""
    lines = "hello\n/nothink\nsecond turn\n/bogus\n/quit\nnever sent\n"
    r = subprocess.run(
        [sys.executable, "-m", "ds4_mlx.cli", "chat", "-m", str(model_path), "-c", str(CTX), "-n", "3", "--temp", "0"],
        input=lines, capture_output=True, text=True, timeout=120,
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("Type a message, or one of these commands")
    assert "Thinking mode: none." in r.stdout and "\x1b[" not in r.stdout
    assert r.stderr.startswith("ds4-mlx: context buffers ")
    assert f"(ctx={CTX}, backend=" in r.stderr
    stats = [line for line in r.stderr.splitlines() if line.startswith("ds4-mlx: prompt ")]
    assert len(stats) == 2
    assert "(0 reused)" in stats[0] and "(0 reused)" not in stats[1]
    assert "ds4-mlx: unknown command: /bogus\nds4-mlx: type /help for commands\n" in r.stderr
    assert ASSISTANT not in r.stdout and EOS not in r.stdout


class Terminal:
    """`ds4-mlx chat` on a pseudo-terminal, as a person at a keyboard drives it."""

    def __init__(self, model_path, home, max_tokens: int) -> None:
        import os
        import pty

        self.pid, self.fd = pty.fork()
        if self.pid == 0:  # the child: the chat command on the terminal's slave side
            os.environ["HOME"] = str(home)
            # started as a non-interactive shell starts a background job: with SIGINT ignored, a disposition that
            # exec keeps and Python then leaves alone; the chat must take Ctrl+C back (as .ci/run & once showed)
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            os.execv(sys.executable, [sys.executable, "-m", "ds4_mlx.cli", "chat", "-m", str(model_path), "-c",
                                      str(CTX), "-n", str(max_tokens), "--temp", "0"])
        self.seen = b""
        self.start = 0

    def write(self, data: bytes) -> None:
        import os

        os.write(self.fd, data)

    def expect(self, marker: bytes, timeout: float = 60.0) -> None:
        """Waits for `marker` in the output that came after the previous marker."""
        import os
        import select
        import time

        deadline = time.monotonic() + timeout
        while marker not in self.seen[self.start:]:
            assert time.monotonic() < deadline, f"no {marker!r} in {self.seen[self.start:]!r}"
            if select.select([self.fd], [], [], 0.1)[0]:
                try:
                    self.seen += os.read(self.fd, 65536)
                except OSError:  # the child closed the terminal
                    raise AssertionError(f"the chat ended before {marker!r}: {self.seen!r}") from None
        self.start = self.seen.index(marker, self.start) + len(marker)

    def close(self) -> int:
        """Ctrl+D, then the exit code."""
        import os

        try:
            self.write(b"\x04")
            _, status = os.waitpid(self.pid, 0)
        finally:
            os.close(self.fd)
        return os.waitstatus_to_exitcode(status)


def test_chat_in_a_terminal(model_path, tmp_path):
    """On a pseudo-terminal: the prompt, grey reasoning, Ctrl+C stopping an answer and clearing a typed line (the
    chat started with SIGINT ignored, as a background job is: it takes Ctrl+C back), Ctrl+D leaving, and the line
    history saved in the home directory."""
    import time

    term = Terminal(model_path, tmp_path, max_tokens=500)
    term.expect(PROMPT_BYTES)
    term.write(b"hello\r")
    term.expect(b"\x1b[90m")  # reasoning started, in grey
    term.write(b"\x03")
    term.expect(b"finish cancelled")
    term.expect(PROMPT_BYTES)
    term.write(b"typed then dropped")
    term.expect(b"typed then dropped")
    # CPython's readline only looks at signals when its wait is interrupted; a Ctrl+C that lands while it is
    # still handling the last keystroke waits for the next key. People do not type that fast.
    time.sleep(0.3)
    term.write(b"\x03")
    term.expect(PROMPT_BYTES)
    term.write(b"/nothink\r")
    term.expect(b"Thinking mode: none.")
    term.expect(PROMPT_BYTES)
    assert term.close() == 0
    assert b"\x1b[0m" in term.seen.split(b"\x1b[90m", 1)[1]  # the grey ends before the stats line
    assert (tmp_path / ".ds4_mlx_history").read_text().splitlines() == ["hello", "/nothink"]


def test_a_paste_in_the_terminal_is_one_message(model_path, engine, tmp_path):
    """The chat turns on the terminal's bracketed paste mode, so a paste arrives between markers, its line breaks
    as CR: the chat takes it as one message of two lines, sent by the Enter that follows, not as two messages."""
    tok = engine.tokenizer
    term = Terminal(model_path, tmp_path, max_tokens=2)
    term.expect(b"\x1b[?2004h")  # a terminal brackets pastes only after the program asks for it
    term.expect(PROMPT_BYTES)
    term.write(b"\x1b[200~first line\rsecond line\x1b[201~")
    term.expect(b"second line")
    term.write(b"\r")
    term.expect(b"ds4-mlx: prompt ")
    term.expect(PROMPT_BYTES)
    assert term.close() == 0
    expected = 1 + len(plain(tok, SYSTEM)) + len(turn_tokens(tok, "first line\nsecond line", tok.think_id))
    stats = [line for line in term.seen.decode(errors="replace").splitlines() if "ds4-mlx: prompt " in line]
    assert len(stats) == 1 and f"ds4-mlx: prompt {expected} tokens (0 reused)" in stats[0]
