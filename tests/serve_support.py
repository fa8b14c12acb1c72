"""Helpers for the server tests: a scripted stand-in for the Engine and a live server on a real socket.

`ScriptedEngine` runs the real DSML stream parser and final parse over a scripted "generated" text, so the
events it yields are the ones the engine would yield for that text; only the model is missing.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from ds4_mlx import dsml
from ds4_mlx.chat import ToolMemory
from ds4_mlx.engine import GenerationRequest
from ds4_mlx.errors import ContextOverflow
from ds4_mlx.events import Done, Event, PrefillProgress, Usage
from ds4_mlx.serve.app import HttpServer, ServerOptions, create_app
from ds4_mlx.serve.worker import Worker

MODEL = "deepseek-v4-flash"


class ScriptedEngine:
    """Engine stand-in: one "token" per character of the prompt, and a scripted reply text.

    The "live session" is the last prompt plus its reply; the cached count is its common prefix with the next one.

    `reply(request) -> str` is the text the model "generates" (reasoning first when thinking); it is fed to
    the DSML stream parser `chunk` characters at a time, `delay` seconds apart, checking `cancel` between
    chunks like the engine does between tokens. `prefill_steps` PrefillProgress events come first. `gate`,
    when set, must be opened before generation starts (to hold a request "running"). `fail` is raised
    after `fail_after` chunks (0: before any event).
    """

    def __init__(self, ctx: int = 4096, reply: Callable[[GenerationRequest], str] | None = None) -> None:
        self.ctx = ctx
        self.model_name = MODEL
        self.default_max_tokens = 393216
        self.tool_memory = ToolMemory()
        self.tool_memory_lock = threading.Lock()
        self.kv_store = None
        self.reply = reply or (lambda req: ("Let me think.</think>" if req.thinking else "") + "Hello there.")
        self.chunk = 3
        self.delay = 0.0
        self.prefill_steps = 0
        self.gate: threading.Event | None = None
        self.fail: Exception | None = None
        self.fail_after = 0
        self.requests: list[GenerationRequest] = []
        self.cancelled = 0
        self.started = threading.Event()
        self.live = ""
        self.shut_down = False

    def count_tokens(self, prompt: str) -> int:
        return len(prompt)

    def shutdown(self) -> None:
        self.shut_down = True

    def generate(self, req: GenerationRequest, cancel: Callable[[], bool] | None = None) -> Iterator[Event]:
        self.requests.append(req)
        self.started.set()
        if len(req.prompt) >= self.ctx:
            raise ContextOverflow(len(req.prompt), self.ctx)
        if self.fail is not None and self.fail_after == 0:
            raise self.fail
        cached = len(os.path.commonprefix([self.live, req.prompt]))
        for i in range(self.prefill_steps):
            yield PrefillProgress(i + 1, self.prefill_steps)
        if self.gate is not None:
            self.gate.wait(10)
        text = self.reply(req)
        parser = dsml.StreamParser(thinking=req.thinking, tools_active=req.tools_active)
        finish, sent = "stop", ""
        for pos in range(0, len(text), self.chunk):
            if self.fail is not None and pos >= self.fail_after * self.chunk:
                raise self.fail
            if cancel is not None and cancel():
                self.cancelled += 1
                finish = "error"
                break
            time.sleep(self.delay)
            piece = text[pos : pos + self.chunk]
            sent += piece
            yield from parser.feed(piece)
            if req.tools_active and parser.tool_block_closed:
                finish = "tool_calls"
                break
            if req.max_tokens is not None and len(sent) >= req.max_tokens:
                finish = "length"
                break
        yield from parser.finish()
        message = dsml.parse_message(sent, thinking=req.thinking, tools_active=req.tools_active)
        if message.tool_calls and finish == "stop":
            finish = "tool_calls"
        self.live = req.prompt + sent
        yield Done(finish, message, Usage(len(req.prompt), cached, len(sent)))


@dataclass
class Live:
    url: str
    worker: Worker
    server: HttpServer


@contextlib.contextmanager
def live_server(engine, options: ServerOptions = ServerOptions(), max_queue: int = 64) -> Iterator[Live]:
    """Serve `engine` (or the engine a zero-argument loader returns, loaded on the worker thread) on
    127.0.0.1 at a free port, from a background thread."""
    worker = Worker(engine if callable(engine) else lambda: engine, max_queue)
    worker.start()
    app = create_app(worker, options)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    server = HttpServer(app, worker, log_level="warning", timeout_graceful_shutdown=5)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the test server did not start")
        time.sleep(0.01)
    try:
        yield Live(f"http://127.0.0.1:{sock.getsockname()[1]}", worker, server)
    finally:
        server.should_exit = True
        thread.join(15)
        sock.close()

