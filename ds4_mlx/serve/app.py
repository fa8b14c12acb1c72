"""The HTTP application: routes, auth, CORS, request ids, error bodies, SSE streaming and the trace.

A generation request is read, normalized, rendered and measured on a thread-pool thread (tokenizing a long
prompt takes a while), refused before queueing when it cannot fit the context, then handed to the worker. Its
events come back on the event loop, where a wire translator (`openai`, `anthropic`, `responses`) turns them
into a JSON body or SSE frames. A client that goes away cancels its job: at the next token when running,
before it starts when still queued.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ..chat import render_chat, render_completion_prompt
from ..engine import GenerationRequest
from ..errors import ContextOverflow, RequestError
from ..memory import MemoryShortage
from ..events import Done, Event, PrefillProgress, PromptAccepted, TextDelta
from ..reuse import Reuse
from . import anthropic, openai, responses
from .common import (
    KEEPALIVE,
    ApiError,
    CallIds,
    ChatRequest,
    CompletionRequest,
    context_overflow,
    dumps,
    new_id,
)
from .guard import (
    PREPARE_SLOTS,
    READ_TIMEOUT_SECONDS,
    WRITE_TIMEOUT_SECONDS,
    PrepareGate,
    RequestGuard,
    check_prompt_size,
    header_timeout_protocol,
    read_body,
)
from .metrics import CONTENT_TYPE as METRICS_TYPE
from .metrics import Metrics
from .modelcard import model_card
from .rawjson import parse_body
from .trace import Trace
from .worker import Job, Worker

log = logging.getLogger("ds4_mlx.serve")

MAX_BODY_BYTES = 64 * 1024 * 1024
"""Largest request body accepted (as in ds4)."""

MODEL_ALIASES = ("deepseek-chat", "deepseek-reasoner")
SSE_HEADERS = {"content-type": "text/event-stream", "cache-control": "no-cache"}
CORS_HEADERS = [
    (b"access-control-allow-origin", b"*"),
    (b"access-control-allow-methods", b"GET, POST, OPTIONS"),
    (b"access-control-allow-headers", b"*"),
]


@dataclass(frozen=True)
class ServerOptions:
    """The server's behaviour flags (`ds4-mlx serve --help` documents them)."""

    cors: bool = False
    api_key: str | None = None
    trace: str | None = None
    keepalive_seconds: float = 5.0
    bind_host: str = "127.0.0.1"
    """The address the server listens on: a `Host` header naming it is served (besides loopback names)."""
    allowed_hosts: tuple[str, ...] = ()
    """`--allow-host`: other names a `Host` header may carry ("*": any)."""
    read_timeout_seconds: float = READ_TIMEOUT_SECONDS
    write_timeout_seconds: float = WRITE_TIMEOUT_SECONDS
    """`--write-timeout`: a client that takes no byte of its answer for this long is treated as disconnected."""


@dataclass(frozen=True)
class Api:
    """One wire format: how its requests are read and how its answers and errors are written.

    Every translator module has the same two signatures: `response(id, created, request, done, call_ids, text)`
    builds the non-streaming body (`text` is every TextDelta joined); `stream(id, created, request, call_ids)`
    returns an object with `start(prompt_accepted)`, `event(event)` and `done(done)`, each giving SSE frames.
    """

    name: str
    id_prefix: str
    call_prefix: str
    param: str
    parse: Callable[..., ChatRequest | CompletionRequest]
    response: Callable[[str, int, Any, Done, CallIds, str], dict[str, Any]]
    stream: Callable[[str, int, Any, CallIds], Any]
    error_json: Callable[[ApiError], dict[str, Any]] = openai.error_json
    stream_error: Callable[[str], str] = openai.stream_error
    overflow: Callable[[int, int, str], ApiError] = context_overflow
    """The error for a prompt that does not fit, in the words the API's clients act on."""
    split_reasoning: bool = True
    """False for legacy completions, which return the raw text with reasoning and `</think>` in it."""


CHAT = Api("chat", "chatcmpl-", "call_", "messages", openai.parse_chat, openai.chat_completion, openai.ChatStream)
COMPLETIONS = Api("completions", "cmpl-", "call_", "prompt", openai.parse_completion, openai.completion,
                  openai.CompletionStream, split_reasoning=False)
MESSAGES = Api("messages", "msg_", "toolu_", "messages", anthropic.parse_messages, anthropic.message,
               anthropic.MessageStream, anthropic.error_json, anthropic.stream_error,
               overflow=anthropic.context_overflow)
RESPONSES = Api("responses", "resp_", "call_", "input", responses.parse_responses, responses.response,
                responses.ResponseStream)


def json_response(value: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    """A JSON body as ds4 writes it: compact, raw UTF-8, ending in a newline."""
    return Response((dumps(value) + "\n").encode("utf-8"), status, headers, media_type="application/json")


async def _chained(first: Iterable[Event], rest: AsyncIterator[Event]) -> AsyncIterator[Event]:
    for event in first:
        yield event
    async for event in rest:
        yield event


class HttpLayer:
    """Answers every OPTIONS request with 204 (CORS preflight) and adds the CORS headers when enabled."""

    def __init__(self, app: ASGIApp, cors: bool) -> None:
        self.app = app
        self.cors = cors

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        extra = CORS_HEADERS if self.cors else []
        if scope["method"] == "OPTIONS":
            await send({"type": "http.response.start", "status": 204,
                        "headers": [(b"content-length", b"0"), *extra]})
            await send({"type": "http.response.body", "body": b""})
            return

        async def send_with_cors(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), *extra]}
            await send(message)

        await self.app(scope, receive, send_with_cors if extra else send)


class Server:
    """The endpoints over one worker (and so one engine)."""

    def __init__(self, worker: Worker, options: ServerOptions) -> None:
        assert worker.engine is not None, "start the worker (load the engine) before building the app"
        self.worker = worker
        self.engine = worker.engine
        self.options = options
        self.trace = Trace(options.trace) if options.trace else None
        self.gate = PrepareGate(worker.max_queue + PREPARE_SLOTS)
        self.metrics = Metrics(worker)

    # -- plumbing -------------------------------------------------------------------------------------------

    def _authorized(self, request: Request) -> bool:
        """Whether the request carries the API key, compared as bytes: the header's bytes as sent (Starlette
        decodes headers as latin-1, which gives them back exactly) against the key's UTF-8 bytes (the bytes of the
        command line as given, `surrogateescape`), so a non-ASCII key matches what UTF-8 clients send."""
        key = self.options.api_key
        if not key:
            return True
        bearer = request.headers.get("authorization", "")
        offered = bearer[7:] if bearer[:7].lower() == "bearer " else request.headers.get("x-api-key", "")
        return secrets.compare_digest(offered.encode("latin-1"), key.encode("utf-8", "surrogateescape"))

    def _failed(self, exc: Exception, api: Api, rid: str, body: bytes | None = None) -> ApiError:
        """The error a failed request reports: the client's mistake as it is (one log line), anything else as a
        500 that names the request id (logged with its traceback). Traced either way, with the request `body`
        when it was read and not traced yet, so that a refused request can be replayed."""
        if isinstance(exc, ContextOverflow):
            error = api.overflow(exc.n_prompt_tokens, exc.n_ctx, api.param)
        elif isinstance(exc, MemoryShortage):  # no room on the device now: the request itself is fine
            error = ApiError(str(exc), 503)
        elif isinstance(exc, RequestError):
            error = exc if isinstance(exc, ApiError) else ApiError(str(exc))
        else:
            log.error("%s %s failed", rid, api.name, exc_info=exc)
            error = ApiError(f"internal server error (request id {rid})", 500)
        if error.status < 500:
            log.info("%s %s refused: %d %s", rid, api.name, error.status, error.message)
        if self.trace:
            text = None if body is None else body.decode("utf-8", "replace")
            self.trace.error(rid, error.status, error.message, text)
        return error

    def endpoint(self, api: Api, handler: Callable[[Request, str], Awaitable[Response]], shared: bool = False,
                 label: str | None = None):
        """Wraps a handler with the request id, the API-key check, the mapping of errors to bodies and the request
        count of /metrics (by `label`, else the API's name). A `shared` endpoint (the model list, which both APIs
        have) answers Anthropic's clients in Anthropic's error shape."""

        async def run(request: Request) -> Response:
            rid = new_id(api.id_prefix, 12)
            errors = MESSAGES if shared and _anthropic_client(request) else api
            try:
                if not self._authorized(request):
                    raise ApiError("invalid API key: send it as 'Authorization: Bearer KEY' or 'x-api-key: KEY'", 401)
                response = await handler(request, rid)
            except Exception as exc:
                error = self._failed(exc, api, rid, getattr(request.state, "body", None))
                headers = {"retry-after": "1"} if error.status == 429 else None
                response = json_response(errors.error_json(error), error.status, headers)
            response.headers["x-request-id"] = rid
            self.metrics.answered(label or api.name, response.status_code)
            return response

        return run

    async def _read(self, request: Request) -> bytes:
        request.state.body = await read_body(request, MAX_BODY_BYTES, self.options.read_timeout_seconds)
        return request.state.body  # kept for the trace, should the request be refused

    def _render(self, request: ChatRequest | CompletionRequest) -> str:
        think = request.options.think
        if isinstance(request, CompletionRequest):
            return render_completion_prompt(request.prompt, think, self.engine.ctx, self.engine.checkpoint)
        return render_chat(request.messages, tools=request.tools, think=think, ctx=self.engine.ctx,
                           tool_memory=self.engine.tool_memory, checkpoint=self.engine.checkpoint)

    def _recall_tool_ids(self, request: ChatRequest | CompletionRequest) -> dict[str, str]:
        """With the disk KV cache on, tool-call ids this process does not know (e.g. from before a restart) are
        looked up in the checkpoint files' tool maps, so that their sampled DSML is replayed (ds4_server.c)."""
        store = self.engine.kv_store
        if store is None or isinstance(request, CompletionRequest):
            return {}
        memory = self.engine.tool_memory
        ids = {call.id for message in request.messages for call in message.tool_calls}
        return store.tool_map({i for i in ids if i and i not in memory})

    def _prepare(self, data: bytes, api: Api) -> tuple[ChatRequest | CompletionRequest, str, int]:
        """Parse, normalize, render and count, on a pool thread."""
        request = api.parse(parse_body(data), ctx=self.engine.ctx, default_model=self.engine.model_name)
        recalled = self._recall_tool_ids(request)
        with self.engine.tool_memory_lock:  # rendering reads the tool memory and refreshes its LRU order
            for call_id, block in recalled.items():
                self.engine.tool_memory.remember([call_id], block)
            prompt = self._render(request)
        check_prompt_size(prompt, self.engine.ctx, self.engine.tokenizer.max_token_bytes, api.param)
        return request, prompt, self.engine.count_tokens(prompt)

    def _remember(self, ids: CallIds, done: Done) -> list[str]:
        """Map the wire ids of the calls just generated to the exact DSML sampled (ds4_server.c)."""
        calls = ids.first(len(done.message.tool_calls))
        if calls and done.message.raw_dsml:
            with self.engine.tool_memory_lock:
                self.engine.tool_memory.remember(calls, done.message.raw_dsml)
        return calls

    @contextlib.asynccontextmanager
    async def _cancel_on_disconnect(self, request: Request, job: Job) -> AsyncIterator[None]:
        async def watch() -> None:
            while (await request.receive())["type"] != "http.disconnect":
                pass
            job.cancel()

        watcher = asyncio.create_task(watch())
        try:
            yield
        finally:
            watcher.cancel()

    def _finished(self, rid: str, api: Api, done: Done, calls: list[str]) -> None:
        """The request's summary line, and its trace record."""
        usage = done.usage
        log.info(
            "%s %s prompt=%d cached=%d completion=%d reasoning=%d finish=%s%s prefill %d tok %.2fs (%s) "
            "decode %d tok %.2fs (%s) reuse=%s",
            rid, api.name, usage.prompt_tokens, usage.cached_tokens, usage.completion_tokens, usage.reasoning_tokens,
            done.finish_reason, f" ({done.error})" if done.error else "", usage.cache_write_tokens,
            done.prefill_seconds, _rate(usage.cache_write_tokens, done.prefill_seconds), usage.completion_tokens,
            done.decode_seconds, _rate(usage.completion_tokens, done.decode_seconds),
            done.reuse.describe() if done.reuse is not None else "-",
        )
        if self.trace:
            self.trace.done(rid, done, calls)

    # -- generation -----------------------------------------------------------------------------------------

    def generation(self, api: Api) -> Callable[[Request], Awaitable[Response]]:
        async def handle(request: Request, rid: str) -> Response:
            request.state.arrived = time.monotonic()  # the start of its time to first token
            with self.worker.reserve() as submit:  # counts against --max-queue from before its body is read
                data, (norm, prompt, n_prompt) = await self._read_and_prepare(request, api)
                if n_prompt >= self.engine.ctx:  # one free slot is needed after the prompt
                    raise api.overflow(n_prompt, self.engine.ctx, api.param)
                job = self._job(request, rid, api, data, norm, prompt, n_prompt)
                submit(job)
            ids = CallIds(api.call_prefix)
            created = int(time.time())
            options = norm.options
            if options.stream:
                stream = api.stream(rid, created, norm, ids)
                return await self._stream(request, job, api, rid, stream, ids)
            done, text = None, []
            async with self._cancel_on_disconnect(request, job):
                async for event in self.metrics.watch(api.name, request.state.arrived, job.events()):
                    if self.trace:
                        self.trace.event(rid, event)
                    if isinstance(event, TextDelta):
                        text.append(event.text)
                    elif isinstance(event, Done):
                        done = event
            if done is None:
                raise ApiError("the request was cancelled before it ran", 499)
            self._finished(rid, api, done, self._remember(ids, done))
            return json_response(api.response(rid, created, norm, done, ids, "".join(text)),
                                 headers=self._reuse_header(done.reuse))

        return self.endpoint(api, handle)

    async def _read_and_prepare(self, request: Request, api: Api) -> tuple[bytes, tuple[Any, str, int]]:
        """The body, read and prepared within the gate's bounds (guard.py)."""
        async with self.gate.enter():
            data = await self._read(request)
            async with self.gate.slot():
                return data, await run_in_threadpool(self._prepare, data, api)

    def _job(self, request: Request, rid: str, api: Api, data: bytes, norm: ChatRequest | CompletionRequest,
             prompt: str, n_prompt: int) -> Job:
        """The worker's job for a prepared request (traced when the trace is on)."""
        options = norm.options
        tools = norm.tools if isinstance(norm, ChatRequest) else ()
        job = Job(
            GenerationRequest(prompt=prompt, max_tokens=options.max_tokens, sampling=options.sampling,
                              stop=options.stop, thinking=api.split_reasoning and options.think.thinking,
                              tools_active=bool(tools), output=options.output),
            rid,
        )
        if self.trace:
            params = {"model": options.model, "think": options.think.value, "tools": len(tools),
                      "stream": options.stream, "max_tokens": options.max_tokens,
                      "sampling": options.sampling, "stop": list(options.stop)}
            self.trace.request(rid, request.url.path, data.decode("utf-8"), params, prompt, n_prompt)
            request.state.body = None  # traced: an error record need not repeat it
        return job

    async def _stream(self, request: Request, job: Job, api: Api, rid: str, stream: Any, ids: CallIds) -> Response:
        """SSE. The headers go out with the first event after the engine accepted the prompt (the first prefill
        chunk's progress, or the first output), so that a prompt refused or failing in a single-chunk prefill
        still gets a proper status code, as in ds4. A failure after that is an SSE error frame; decode
        failures are not failures here: the engine ends them with finish reason "error"."""
        events = self.metrics.watch(api.name, request.state.arrived, job.events())
        async with self._cancel_on_disconnect(request, job):
            head = [await anext(events, None)]
            if isinstance(head[0], PromptAccepted):
                head.append(await anext(events, None))
        if head[-1] is None:
            raise ApiError("the request was cancelled before it ran", 499)
        accepted = head[0] if isinstance(head[0], PromptAccepted) else None

        async def frames() -> AsyncIterator[str]:
            last_write = time.monotonic()
            ended = False  # a summary line (or an error line) was logged
            try:
                yield "".join(stream.start(accepted))
                async for event in _chained(head, events):
                    if self.trace:
                        self.trace.event(rid, event)
                    if isinstance(event, PrefillProgress):
                        out = [KEEPALIVE] if time.monotonic() - last_write >= self.options.keepalive_seconds else []
                    elif isinstance(event, Done):
                        calls = self._remember(ids, event)
                        self._finished(rid, api, event, calls)
                        ended = True
                        out = stream.done(event)
                    else:
                        out = stream.event(event)
                    if out:
                        yield "".join(out)
                        last_write = time.monotonic()
            except Exception as exc:
                ended = True
                yield api.stream_error(self._failed(exc, api, rid).message)
            finally:
                job.cancel()
                if not ended:  # the client went away before the answer ended
                    log.info("%s %s prompt=%d cached=%d finish=cancelled (the client disconnected)", rid, api.name,
                             accepted.prompt_tokens if accepted else 0, accepted.cached_tokens if accepted else 0)

        return StreamingResponse(frames(), headers={**SSE_HEADERS,
                                                    **self._reuse_header(accepted.reuse if accepted else None)})

    def _reuse_header(self, reuse: Reuse | None) -> dict[str, str]:
        """With --trace, `x-ds4-reuse` tells the client how much of its prompt was reused, from where, and where it
        first differs from the live session (prompt text: only where the operator asked for traces)."""
        return {"x-ds4-reuse": reuse.describe()} if self.trace and reuse is not None else {}

    # -- other endpoints ------------------------------------------------------------------------------------

    async def count_tokens(self, request: Request, rid: str) -> Response:
        """Anthropic's `/v1/messages/count_tokens`: the rendered prompt's length, without generating, also when it
        does not fit the context (clients ask exactly to find out whether to compact)."""
        _, (_, _, n_prompt) = await self._read_and_prepare(request, MESSAGES)
        return json_response({"input_tokens": n_prompt})

    def _model_ids(self) -> tuple[str, ...]:
        return (self.engine.model_name, *MODEL_ALIASES)

    def _model(self, model_id: str) -> dict[str, Any]:
        return openai.model_json(model_id, model_card(self.engine))

    async def models(self, request: Request, rid: str) -> Response:
        if _anthropic_client(request):
            return json_response(anthropic.models_json(self._model_ids(), model_card(self.engine)))
        return json_response({"object": "list", "data": [self._model(m) for m in self._model_ids()]})

    async def model(self, request: Request, rid: str) -> Response:
        model_id = request.path_params["model_id"]
        if not model_id:  # `/v1/models/`: a trailing slash is an unknown endpoint, as everywhere else
            return await self.not_found(request, HTTPException(404))
        if model_id not in self._model_ids():
            raise ApiError(f"model {model_id!r} not found; this server serves {', '.join(self._model_ids())}", 404)
        if _anthropic_client(request):
            return json_response(anthropic.model_json(model_id, model_card(self.engine)))
        return json_response(self._model(model_id))

    async def metrics_text(self, request: Request, rid: str) -> Response:
        """Prometheus' text format (metrics.py)."""
        return Response(self.metrics.render(), media_type=METRICS_TYPE)

    async def health(self, request: Request) -> Response:
        return json_response({"status": "ok", "model": self.engine.model_name, "ctx": self.engine.ctx,
                              "parallel": self.worker.parallel, "running": self.worker.running,
                              "busy": self.worker.busy, "queued": self.worker.queued})

    async def not_found(self, request: Request, exc: HTTPException) -> Response:
        """Unknown paths, and known paths with the wrong method, as in ds4: 404 in the path's error shape."""
        api = MESSAGES if request.url.path.startswith("/v1/messages") else CHAT
        return json_response(api.error_json(ApiError("unknown endpoint", 404)), 404)

    def close(self) -> None:
        if self.trace:
            self.trace.close()


def _rate(tokens: int, seconds: float) -> str:
    return f"{tokens / seconds:.1f} t/s" if tokens and seconds > 0 else "-"


def _anthropic_client(request: Request) -> bool:
    """Anthropic's SDKs and Claude Code send `anthropic-version` with every request."""
    return "anthropic-version" in request.headers


def _get(path: str, endpoint: Callable[[Request], Awaitable[Response]]) -> Route:
    """A GET route. Starlette adds HEAD to every GET route; ds4 answers HEAD 404 like any unknown endpoint."""
    route = Route(path, endpoint, methods=["GET"])
    route.methods.discard("HEAD")
    return route


def create_app(worker: Worker, options: ServerOptions = ServerOptions()) -> Starlette:
    """The ASGI app over a started worker; stopping the app (uvicorn's shutdown) stops the worker."""
    server = Server(worker, options)
    routes = [
        _get("/health", server.health),
        _get("/metrics", server.endpoint(CHAT, server.metrics_text, label="metrics")),
        _get("/v1/models", server.endpoint(CHAT, server.models, shared=True, label="models")),
        _get("/v1/models/{model_id:path}", server.endpoint(CHAT, server.model, shared=True, label="models")),
        Route("/v1/chat/completions", server.generation(CHAT), methods=["POST"]),
        Route("/v1/completions", server.generation(COMPLETIONS), methods=["POST"]),
        Route("/v1/messages", server.generation(MESSAGES), methods=["POST"]),
        Route("/v1/messages/count_tokens", server.endpoint(MESSAGES, server.count_tokens, label="count_tokens"),
              methods=["POST"]),
        Route("/v1/responses", server.generation(RESPONSES), methods=["POST"]),
    ]

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        try:
            yield
        finally:
            worker.shutdown()
            await run_in_threadpool(worker.join)
            server.close()

    app = Starlette(routes=routes, exception_handlers={HTTPException: server.not_found}, lifespan=lifespan)
    app.router.redirect_slashes = False  # ds4 answers 404 for a trailing slash; a redirect would hide the typo
    app.state.server = server
    posts = [route.path for route in routes if "POST" in route.methods]
    return HttpLayer(RequestGuard(app, options.bind_host, options.allowed_hosts, posts), options.cors)


class HttpServer(uvicorn.Server):
    """uvicorn's server over the app, plus: the first SIGINT/SIGTERM also stops generation, so that open
    responses end at once (finish reason "error"), queued requests get 503, and shutdown does not wait for
    a long answer. A second signal exits immediately (uvicorn's force exit)."""

    def __init__(self, app: ASGIApp, worker: Worker, read_timeout: float = READ_TIMEOUT_SECONDS,
                 write_timeout: float = WRITE_TIMEOUT_SECONDS, **config: Any) -> None:
        """`read_timeout`: how long a request's headers may take; `write_timeout`: how long an answer may wait for
        a client that reads nothing (guard.py)."""
        config.setdefault("http", header_timeout_protocol(read_timeout, write_timeout))
        super().__init__(uvicorn.Config(app, lifespan="on", **config))
        self.worker = worker
        self.loop: asyncio.AbstractEventLoop | None = None

    async def serve(self, sockets: list[Any] | None = None) -> None:
        self.loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: Any) -> None:
        if self.loop is not None:
            # A signal handler must not take locks that the interrupted code may hold: defer to the loop.
            self.loop.call_soon_threadsafe(self.worker.shutdown)
        super().handle_exit(sig, frame)
