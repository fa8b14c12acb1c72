"""Helpers for the server tests: the real Engine over a scripted model, and a live server on a real socket."""

from __future__ import annotations

import contextlib
import functools
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from ds4_mlx.engine import Engine, GenerationRequest
from ds4_mlx.events import Done, Event, PromptAccepted
from ds4_mlx.model.factory import build_vocab
from ds4_mlx.serve.app import HttpServer, ServerOptions, create_app
from ds4_mlx.serve.worker import Worker
from ds4_mlx.tokenizer import Tokenizer
from scripted import ScriptedModel

MODEL = "deepseek-v4-flash"


@functools.cache
def small_tokenizer() -> Tokenizer:
    """The factory's small byte-level vocabulary (512 ids, every special token): quick to build, spells any text."""
    vocab = build_vocab("small")
    return Tokenizer(list(vocab.tokens), list(vocab.merges))


def default_reply(req: GenerationRequest) -> str:
    return ("Let me think.</think>" if req.thinking else "") + "Hello there."


class ScriptedEngine(Engine):
    """The real Engine over a `ScriptedModel` that writes `reply(request)` and then EOS, for every request.

    Only what the model samples is scripted: reuse, stop rules, tool-block stops, finish reasons, usage and
    cancellation are the engine's own. Test hooks: `requests` (every GenerationRequest received), `started` (set
    when a generation begins), `gate` (when set, a generation waits for it first, holding the worker busy),
    `refusal` (raised before any event, as the engine refuses a prompt), `cancelled` (generations that ended
    cancelled) and `shut_down`; `model.delay` and `model.fail_at` slow the model down or make it fail.
    """

    def __init__(self, ctx: int = 4096, reply: Callable[[GenerationRequest], str] = default_reply) -> None:
        tokenizer = small_tokenizer()
        super().__init__(ScriptedModel(tokenizer.vocab_size, [tokenizer.eos_id]), tokenizer, ctx, model_name=MODEL)
        self.reply = reply
        self.requests: list[GenerationRequest] = []
        self.started = threading.Event()
        self.gate: threading.Event | None = None
        self.refusal: Exception | None = None
        self.cancelled = 0
        self.shut_down = False

    def answer(self, lane, req: GenerationRequest, cancel: Callable[[], bool] | None = None,
               shared: Callable[[], bool] | None = None) -> Iterator[Event]:
        self.requests.append(req)
        self.started.set()
        if self.gate is not None:
            self.gate.wait(10)
        if self.refusal is not None:
            raise self.refusal
        self.model.play(self.tokenizer.encode(self.reply(req)) + [self.tokenizer.eos_id])
        answer = super().answer(lane, req, cancel, shared)
        value = None
        while True:
            try:
                event = answer.send(value)
            except StopIteration:
                return
            if isinstance(event, PromptAccepted) and event.cached_tokens == event.prompt_tokens:
                lane.session.logits = self.model.logits()  # restored whole: the first choice is this reply's too
            elif isinstance(event, Done) and event.error == "cancelled":
                self.cancelled += 1
            value = yield event

    def shutdown(self) -> None:
        self.shut_down = True
        super().shutdown()


@dataclass
class Live:
    url: str
    worker: Worker
    server: HttpServer


@contextlib.contextmanager
def live_server(engine, options: ServerOptions = ServerOptions(), max_queue: int = 64,
                send_buffer: int | None = None) -> Iterator[Live]:
    """Serve `engine` (or the engine a zero-argument loader returns, loaded on the worker thread) on
    127.0.0.1 at a free port, from a background thread. `send_buffer`: SO_SNDBUF of the accepted connections
    (they inherit the listening socket's), so that a client that stops reading fills it soon."""
    worker = Worker(engine if callable(engine) else lambda: engine, max_queue)
    worker.start()
    app = create_app(worker, options)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if send_buffer is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, send_buffer)
    sock.bind(("127.0.0.1", 0))
    server = HttpServer(app, worker, read_timeout=options.read_timeout_seconds,
                        write_timeout=options.write_timeout_seconds, log_level="warning",
                        timeout_graceful_shutdown=5)
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


def sse_frames(text: str) -> list[tuple[str | None, str]]:
    """(event name or None, data) of every SSE frame."""
    frames = []
    for frame in text.split("\n\n"):
        lines = frame.split("\n")
        data = [line[6:] for line in lines if line.startswith("data: ")]
        if data:
            event = [line[7:] for line in lines if line.startswith("event: ")]
            frames.append((event[0] if event else None, data[0]))
    return frames
