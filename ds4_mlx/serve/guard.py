"""What keeps one client from hurting the others, and web pages from driving the server.

* Browser reach. A page the user visits may POST to a local server: a "simple" cross-origin request (text/plain,
  form-encoded, or a typeless Blob) is sent without a CORS preflight. Requiring `Content-Type: application/json`
  forces a preflight, which this server only grants with `--cors`. DNS rebinding (a page's own host name re-pointed
  at 127.0.0.1) is stopped by the `Host` check: only loopback names and addresses, the bound address (any IP
  literal when bound to a wildcard address: a page cannot send one of those for its own origin) and the names
  given with `--allow-host` are served.
* Slow clients. uvicorn times out idle keep-alive connections but not a request whose headers or body never
  finish; `header_timeout_protocol` closes a connection whose request headers do not arrive in time, and
  `read_body` answers 408 when the body stalls. A client that stops reading an answer (its socket and the
  transport's buffer full) is a disconnect once `write_timeout` seconds pass without it taking a byte: the
  protocol aborts the connection, and the app cancels the generation as for any disconnect, freeing the worker.
* Big prompts. A prompt that cannot fit the context is refused before it is tokenized, from its size alone: no
  token spells more than `Tokenizer.max_token_bytes` bytes (128 in V4's vocabulary), so a prompt of B bytes has
  at least B / 128 tokens. Prompts that pass are tokenized on a pool thread, with the GIL released (tokenizer.py).
* Many bodies. Every request body, whatever its size, passes `PrepareGate`: at most `limit` requests between the
  start of their body and the end of its preparation (more get 429 before their body is read), and at most
  PREPARE_SLOTS of them parsed, rendered and tokenized at a time. Parsing and rendering hold the GIL: 48 bodies
  of 1 MB prepared at once on pool threads left the event loop a 49th of it, and `/health` waited 8-10 s.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import time
from collections.abc import AsyncIterator, Callable, Collection
from typing import Any

from starlette.requests import ClientDisconnect, Request
from uvicorn.protocols.http.h11_impl import H11Protocol

from . import anthropic, openai
from .common import ApiError, dumps

log = logging.getLogger("ds4_mlx.serve")

LOOPBACK_NAMES = ("localhost",)
WILDCARD_HOSTS = ("", "0.0.0.0", "::")
READ_TIMEOUT_SECONDS = 30.0
"""How long request headers, and each part of a body, may take to arrive."""
WRITE_TIMEOUT_SECONDS = 30.0
"""How long an answer may wait for a client that reads nothing once the buffers on the way are full."""
BODY_DEADLINE_SECONDS = 300.0
"""The longest a request body may take in all (64 MiB at 220 KiB/s)."""
PREPARE_SLOTS = 2
"""Request bodies parsed, rendered and tokenized at a time (the event loop keeps a third of the GIL at worst)."""


def host_allowed(host_header: str | None, bind_host: str, allowed: tuple[str, ...]) -> bool:
    """Whether a request's `Host` names this server (see the module docstring). A request without one (HTTP/1.0,
    never a browser) passes."""
    if host_header is None:
        return True
    name = _host_name(host_header)
    if name in LOOPBACK_NAMES or name == bind_host.lower().strip("[]") or "*" in allowed:
        return True
    if name in (a.lower() for a in allowed):
        return True
    try:
        address = ipaddress.ip_address(name)
    except ValueError:
        return False
    return address.is_loopback or bind_host in WILDCARD_HOSTS


def _host_name(header: str) -> str:
    """The host part of a Host header, lowercase, without port, brackets or a trailing dot."""
    header = header.strip().lower()
    if header.startswith("["):
        return header[1 : header.find("]")] if "]" in header else header[1:]
    if header.count(":") == 1:
        header = header.split(":", 1)[0]
    return header.rstrip(".")


def is_json(content_type: str | None) -> bool:
    return content_type is not None and content_type.split(";", 1)[0].strip().lower() == "application/json"


class RequestGuard:
    """ASGI middleware: refuses a foreign `Host` (403) and a POST to `json_paths` whose body is not
    `application/json` (415), in the error shape of the endpoint asked for, before any route runs."""

    def __init__(self, app: Callable[..., Any], bind_host: str, allowed_hosts: tuple[str, ...],
                 json_paths: Collection[str]) -> None:
        self.app = app
        self.bind_host = bind_host
        self.allowed_hosts = allowed_hosts
        self.json_paths = frozenset(json_paths)

    async def __call__(self, scope: dict[str, Any], receive: Callable[..., Any], send: Callable[..., Any]) -> None:
        if scope["type"] == "http":
            headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
            error = None
            if not host_allowed(headers.get("host"), self.bind_host, self.allowed_hosts):
                error = ApiError(f"Host {headers['host']!r} does not name this server; start it with --allow-host "
                                 f"NAME to serve requests addressed to NAME", 403)
            elif (scope["method"] == "POST" and scope["path"] in self.json_paths
                  and not is_json(headers.get("content-type"))):
                error = ApiError(f"request bodies must be JSON with 'Content-Type: application/json', got "
                                 f"{headers.get('content-type', 'no Content-Type')!r}", 415)
            if error is not None:
                await _send_error(send, scope["path"], error)
                return
        await self.app(scope, receive, send)


async def _send_error(send: Callable[..., Any], path: str, error: ApiError) -> None:
    shape = anthropic.error_json if path.startswith("/v1/messages") else openai.error_json
    body = (dumps(shape(error)) + "\n").encode("utf-8")
    await send({"type": "http.response.start", "status": error.status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


async def read_body(request: Request, limit: int, idle_timeout: float,
                    deadline: float = BODY_DEADLINE_SECONDS) -> bytes:
    """The request body, at most `limit` bytes (413), each part within `idle_timeout` seconds of the last and the
    whole within `deadline` (408), so a stalled upload does not hold its connection and memory forever."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise ApiError(f"request body too large: at most {limit} bytes", 413)
    chunks, size = [], 0
    end = time.monotonic() + deadline
    stream = request.stream()
    try:
        while True:
            wait = min(idle_timeout, end - time.monotonic())
            try:
                chunk = await asyncio.wait_for(anext(stream, None), max(wait, 0))
            except asyncio.TimeoutError:
                raise ApiError(f"the request body did not arrive in time (no data for {idle_timeout:g} s, or "
                               f"more than {deadline:g} s in all)", 408) from None
            if chunk is None:
                break
            size += len(chunk)
            if size > limit:
                raise ApiError(f"request body too large: at most {limit} bytes", 413)
            chunks.append(chunk)
    except ClientDisconnect:  # nobody is left to answer; not a fault of the server
        raise ApiError("the client disconnected while sending the request", 499) from None
    return b"".join(chunks)


def check_prompt_size(prompt: str, ctx: int, max_token_bytes: int, param: str) -> None:
    """Refuse, without tokenizing it, a prompt whose size alone shows that it has at least `ctx` tokens."""
    n_bytes = len(prompt.encode("utf-8", "surrogatepass"))
    at_least = -(-n_bytes // max_token_bytes)
    if at_least >= ctx:
        raise ApiError(f"Prompt has at least {at_least} tokens ({n_bytes} bytes, and no token spells more than "
                       f"{max_token_bytes}), but the configured context size is {ctx} tokens", param=param,
                       code="context_length_exceeded", extra={"n_prompt_tokens": at_least, "n_ctx": ctx})


class PrepareGate:
    """Bounds the request bodies in the server's hands (see the module docstring): `enter` before a body is read,
    429 when `limit` requests are already between reading and prepared; `slot` around the preparation itself."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._pending = 0
        self._slots: asyncio.Semaphore | None = None  # made on first use, inside the event loop

    @contextlib.asynccontextmanager
    async def enter(self) -> AsyncIterator[None]:
        if self._pending >= self.limit:
            raise ApiError(f"too many request bodies being read and prepared (at most {self.limit}); retry later",
                           429)
        self._pending += 1
        try:
            yield
        finally:
            self._pending -= 1

    @contextlib.asynccontextmanager
    async def slot(self) -> AsyncIterator[None]:
        if self._slots is None:
            self._slots = asyncio.Semaphore(PREPARE_SLOTS)
        async with self._slots:
            yield


def header_timeout_protocol(seconds: float, write_timeout: float = WRITE_TIMEOUT_SECONDS) -> type[H11Protocol]:
    """uvicorn's h11 protocol, closing a connection whose next request's headers are not complete `seconds` after
    it opened or after its last response (uvicorn itself only times out idle keep-alive connections), and aborting
    one whose client has taken no byte for `write_timeout` seconds while the transport's write buffer is full
    (asyncio's `pause_writing` without `resume_writing`): a disconnect, which cancels the request's generation."""

    class HeaderTimeoutH11(H11Protocol):
        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            self._header_timer: asyncio.TimerHandle | None = None
            self._write_timer: asyncio.TimerHandle | None = None
            self._arm()

        def pause_writing(self) -> None:
            super().pause_writing()
            if self._write_timer is None:
                self._write_timer = self.loop.call_later(write_timeout, self._stalled)

        def resume_writing(self) -> None:
            self._stop_write_timer()
            super().resume_writing()

        def _stop_write_timer(self) -> None:
            if self._write_timer is not None:
                self._write_timer.cancel()
                self._write_timer = None

        def _stalled(self) -> None:
            self._write_timer = None
            if not self.transport.is_closing():
                log.info("a client took no data for %g s: treated as disconnected", write_timeout)
            self.transport.abort()  # unsent data is dropped; connection_lost follows, as for a disconnect

        def on_response_complete(self) -> None:
            self._arm()  # before uvicorn starts on a pipelined request, which then is the newer cycle
            super().on_response_complete()

        def connection_lost(self, exc: Exception | None) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
            self._stop_write_timer()
            super().connection_lost(exc)

        def _arm(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
            self._header_timer = self.loop.call_later(seconds, self._expire, self.cycle)

        def _expire(self, cycle: Any) -> None:
            waiting = self.cycle is cycle and (cycle is None or cycle.response_complete)  # no newer request
            if waiting and not self.transport.is_closing():
                self.transport.close()

    return HeaderTimeoutH11
