"""What `run` and `chat` share in the terminal: printing a streamed answer, and Ctrl+C stopping it cleanly."""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TextIO

GREY, RESET = "\x1b[90m", "\x1b[0m"  # ds4 shows reasoning in ANSI 90 on a terminal


class AnswerPrinter:
    """Writes the streamed answer exactly as generated; reasoning grey on a terminal, then a line break before
    the answer proper when the reasoning did not end with one (ds4 hides the think tags)."""

    def __init__(self, file: TextIO, grey: bool) -> None:
        self.file = file
        self.grey = grey
        self.in_reasoning = False
        self.last = "\n"

    def reasoning(self, text: str) -> None:
        if self.grey and not self.in_reasoning:
            self.file.write(GREY)
        self.in_reasoning = True
        self._write(text)

    def text(self, text: str) -> None:
        self._close_reasoning()
        self._write(text)

    def end(self) -> None:
        """Closes the answer (the grey included) so the next output starts on a fresh line in the plain colour."""
        self._close_reasoning()
        if self.last != "\n":
            self._write("\n")

    def _close_reasoning(self) -> None:
        if not self.in_reasoning:
            return
        if self.grey:
            self.file.write(RESET)
            self.file.flush()
        self.in_reasoning = False
        if self.last != "\n":
            self._write("\n")

    def _write(self, text: str) -> None:
        if text:
            self.file.write(text)
            self.file.flush()
            self.last = text[-1]


@contextmanager
def stop_on_interrupt() -> Iterator[Callable[[], bool]]:
    """While generating: the first Ctrl+C asks the engine to stop after the current token (its `cancel` hook);
    a second one raises KeyboardInterrupt at once. Outside the main thread signals cannot be caught, and the
    hook never fires."""
    pressed = threading.Event()
    if threading.current_thread() is not threading.main_thread():
        yield pressed.is_set
        return

    def on_sigint(signum: int, frame: object) -> None:
        if pressed.is_set():
            raise KeyboardInterrupt
        pressed.set()

    previous = signal.signal(signal.SIGINT, on_sigint)
    try:
        yield pressed.is_set
    finally:
        signal.signal(signal.SIGINT, previous)
