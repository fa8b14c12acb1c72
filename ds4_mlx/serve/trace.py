"""`ds4-mlx serve --trace FILE`: a human-readable record of what the model saw and did, per request.

For debugging agent sessions: the raw request, the rendered prompt, the cache decision (how much of the prompt
the live session already held), the tool-parser events as they happened and the generated text and parse.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any

from ..events import Done, Event, ToolCallEnd, ToolCallStart


class Trace:
    """Appends records to one file; safe to call from any thread."""

    def __init__(self, path: str | Path) -> None:
        # kept open for the server's lifetime; text that has no UTF-8 form (lone surrogates) is escaped, not fatal.
        # 0600, also when it exists: it holds every prompt.
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o600)
        try:
            os.fchmod(fd, 0o600)
        except OSError:
            pass  # not ours to change (e.g. /dev/stderr): written as it is
        self._file = open(fd, "a", encoding="utf-8", errors="backslashreplace")  # noqa: SIM115
        self._lock = threading.Lock()

    def _write(self, request_id: str, title: str, *sections: tuple[str, Any]) -> None:
        stamp = time.strftime("%Y-%m-%dT%H:%M:%S%z")  # ISO 8601
        lines = [f"=== {stamp} {request_id} {title}"]
        for name, value in sections:
            text = str(value)
            if "\n" in text or len(text) > 80:
                lines += [f"--- {name} ({len(text)} chars)", text, f"--- end {name}"]
            else:
                lines.append(f"{name}: {text}")
        with self._lock:
            self._file.write("\n".join(lines) + "\n")
            self._file.flush()

    def request(self, request_id: str, endpoint: str, body: str, params: dict[str, Any], prompt: str,
                prompt_tokens: int) -> None:
        sections = [(k, v) for k, v in params.items()]
        sections += [("prompt tokens", prompt_tokens), ("request", body), ("rendered prompt", prompt)]
        self._write(request_id, f"request {endpoint}", *sections)

    def event(self, request_id: str, event: Event) -> None:
        if isinstance(event, ToolCallStart):
            self._write(request_id, f"tool call {event.index} started: {event.name}")
        elif isinstance(event, ToolCallEnd):
            self._write(request_id, f"tool call {event.index} ended")

    def done(self, request_id: str, done: Done, call_ids: list[str]) -> None:
        usage = done.usage
        reused = (
            f"reused {usage.cached_tokens} cached tokens, prefilled {usage.cache_write_tokens}"
            if usage.cached_tokens
            else f"cache miss, prefilled all {usage.prompt_tokens} tokens"
        )
        if done.reuse is not None:
            reused += f" (from: {done.reuse.describe()})"
        message = done.message
        calls = [f"{i} {c.name} {c.arguments}" for i, c in zip(call_ids, message.tool_calls)]
        self._write(
            request_id,
            f"done finish={done.finish_reason}",
            ("cache", reused),
            ("completion tokens", usage.completion_tokens),
            ("prefill seconds", f"{done.prefill_seconds:.3f}"),
            ("decode seconds", f"{done.decode_seconds:.3f}"),
            *([("error", done.error)] if done.error else []),
            ("reasoning", message.reasoning),
            ("content", message.content),
            *([("tool calls", "\n".join(calls)), ("sampled DSML", message.raw_dsml)] if calls else []),
        )

    def error(self, request_id: str, status: int, message: str, body: str | None = None) -> None:
        """A refused or failed request; `body` is the request as sent when it was not traced before."""
        self._write(request_id, f"error {status}", ("message", message), *([("request", body)] if body else []))

    def close(self) -> None:
        with self._lock:
            self._file.close()
