"""One client cannot freeze the others, and a web page cannot drive the server: JSON bodies only, the
`Host` check, read timeouts on headers and bodies, prompts refused by size before tokenizing, and tokenizing that
does not hold up the event loop, other requests or a running stream."""

from __future__ import annotations

import logging
import socket
import threading
import time

import httpx
import pytest

from ds4_mlx.commands.serve import warn_if_exposed
from ds4_mlx.engine import GenerationRequest
from ds4_mlx.serve.app import ServerOptions
from ds4_mlx.serve.guard import host_allowed
from serve_support import ScriptedEngine, live_server

CHAT = {"model": "deepseek-chat", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 20}
MESSAGES = {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]}


@pytest.fixture(scope="module")
def live():
    with live_server(ScriptedEngine(), ServerOptions(read_timeout_seconds=1.0)) as live:
        yield live


# -- browser reach -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data",
                                          None, "application/jsonp"])
@pytest.mark.parametrize("path, shape", [("/v1/chat/completions", "openai"), ("/v1/completions", "openai"),
                                         ("/v1/responses", "openai"), ("/v1/messages", "anthropic"),
                                         ("/v1/messages/count_tokens", "anthropic")])
def test_post_bodies_must_be_json(live, content_type, path, shape):
    """A web page can send these content types (or none) cross-origin without a CORS preflight."""
    headers = {} if content_type is None else {"content-type": content_type}
    body = MESSAGES if shape == "anthropic" else CHAT
    r = httpx.post(live.url + path, content=httpx.Request("POST", "/", json=body).content, headers=headers,
                   timeout=10)
    assert r.status_code == 415
    error = r.json()["error"]
    assert "application/json" in error["message"]
    if shape == "anthropic":
        assert r.json()["type"] == "error" and error["type"] == "invalid_request_error"
    else:
        assert error["type"] == "invalid_request_error"


def test_json_with_a_charset_is_served(live):
    r = httpx.post(live.url + "/v1/chat/completions", content=httpx.Request("POST", "/", json=CHAT).content,
                   headers={"content-type": "Application/JSON; charset=utf-8"}, timeout=30)
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "Hello there."


@pytest.mark.parametrize("host", ["evil.example", "evil.example:8000", "127.0.0.1.evil.example", "localhost.evil"])
@pytest.mark.parametrize("method, path, shape", [("POST", "/v1/chat/completions", "openai"), ("GET", "/health", None),
                                                 ("POST", "/v1/messages", "anthropic"), ("GET", "/v1/models", None)])
def test_a_foreign_host_is_refused(live, host, method, path, shape):
    """DNS rebinding: a page's own name pointed at 127.0.0.1 reaches the server with that name as `Host`."""
    body = MESSAGES if shape == "anthropic" else CHAT
    r = httpx.request(method, live.url + path, json=body if method == "POST" else None, headers={"host": host},
                      timeout=10)
    assert r.status_code == 403 and "--allow-host" in r.text
    assert ("type" in r.json()) == (shape == "anthropic")


@pytest.mark.parametrize("host", ["localhost", "localhost:8000", "127.0.0.1", "127.0.0.1:1", "[::1]:8000",
                                  "LOCALHOST.", "127.1.2.3"])
def test_loopback_hosts_are_served(live, host):
    r = httpx.get(live.url + "/health", headers={"host": host}, timeout=10)
    assert r.status_code == 200 and r.json()["status"] == "ok"


def test_allow_host_names_more_hosts():
    assert not host_allowed("box.lan:8000", "127.0.0.1", ())
    assert host_allowed("box.lan:8000", "127.0.0.1", ("box.lan",))
    assert host_allowed("Box.Lan", "127.0.0.1", ("box.lan",))
    assert host_allowed("anything", "127.0.0.1", ("*",))
    assert host_allowed("box.lan", "box.lan", ())  # the bound name itself
    assert host_allowed("192.168.1.5:8000", "0.0.0.0", ()) and host_allowed("[fe80::1]:8000", "::", ())
    assert not host_allowed("192.168.1.5", "127.0.0.1", ())  # not a bound address
    assert host_allowed("192.168.1.5", "192.168.1.5", ())
    assert not host_allowed("evil.example", "0.0.0.0", ())  # names still need --allow-host
    assert host_allowed(None, "127.0.0.1", ())  # HTTP/1.0 without Host: not a browser


def test_allowed_hosts_reach_the_server():
    with live_server(ScriptedEngine(), ServerOptions(allowed_hosts=("box.lan",))) as live:
        assert httpx.get(live.url + "/health", headers={"host": "box.lan:8000"}, timeout=10).status_code == 200
        assert httpx.get(live.url + "/health", headers={"host": "other.lan"}, timeout=10).status_code == 403


def test_a_non_loopback_host_without_a_key_warns(caplog):
    with caplog.at_level(logging.WARNING, "ds4_mlx.serve"):
        for host, key in (("127.0.0.1", None), ("localhost", None), ("::1", None), ("0.0.0.0", "secret")):
            warn_if_exposed(host, key)
        assert caplog.text == ""
        warn_if_exposed("0.0.0.0", None)
        warn_if_exposed("192.168.1.5", "")
    assert caplog.text.count("without an API key") == 2


# -- read timeouts -----------------------------------------------------------------------------------------------


def raw_connection(live) -> socket.socket:
    host, port = live.url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=10)
    return sock


def read_all(sock: socket.socket) -> bytes:
    out = b""
    while chunk := sock.recv(65536):
        out += chunk
    return out


def test_headers_that_never_finish_are_timed_out(live):
    sock = raw_connection(live)
    t0 = time.monotonic()
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Ty")
    assert read_all(sock) == b""  # closed by the server
    assert 0.9 <= time.monotonic() - t0 < 8
    sock.close()


def test_a_stalled_body_gets_408(live):
    sock = raw_connection(live)
    t0 = time.monotonic()
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 b"Content-Length: 1000\r\n\r\n{\"messages\": [")
    reply = read_all(sock)
    assert reply.startswith(b"HTTP/1.1 408") and b"did not arrive in time" in reply
    assert 0.9 <= time.monotonic() - t0 < 8
    sock.close()
    assert httpx.get(live.url + "/health", timeout=10).status_code == 200


def test_a_slow_but_steady_upload_is_served(live):
    """The timeout is between parts of the body, not for the whole of a body that keeps coming."""
    body = httpx.Request("POST", "/", json=CHAT).content
    sock = raw_connection(live)
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 b"Connection: close\r\nContent-Length: %d\r\n\r\n" % len(body))
    for i in range(0, len(body), len(body) // 4 + 1):
        time.sleep(0.5)
        sock.sendall(body[i : i + len(body) // 4 + 1])
    assert read_all(sock).startswith(b"HTTP/1.1 200")
    sock.close()


def test_the_header_timeout_never_cuts_a_long_answer_on_a_kept_alive_connection():
    """The header timer runs only while a connection waits for its next request's headers."""
    engine = ScriptedEngine(reply=long_reply)
    engine.model.delay = 0.01
    with live_server(engine, ServerOptions(read_timeout_seconds=0.5)) as live, httpx.Client(timeout=60) as client:
        assert client.post(live.url + "/v1/chat/completions", json=CHAT).status_code == 200
        time.sleep(0.2)
        with client.stream("POST", live.url + "/v1/chat/completions",
                           json={**CHAT, "max_tokens": 200, "stream": True}) as r:
            t0 = time.monotonic()
            lines = [line for line in r.iter_lines() if line]
        assert time.monotonic() - t0 > 1.0 and lines[-1] == "data: [DONE]"
        assert client.get(live.url + "/health").status_code == 200  # the same connection, still open


# -- bounded prompts ---------------------------------------------------------------------------------------------


def test_a_prompt_too_big_for_the_context_is_refused_before_tokenizing():
    engine = ScriptedEngine(ctx=4096)
    counted: list[int] = []
    real = engine.count_tokens
    engine.count_tokens = lambda prompt: counted.append(len(prompt)) or real(prompt)
    bound = 4096 * engine.tokenizer.max_token_bytes
    big = {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "x" * bound}]}
    with live_server(engine) as live:
        for path in ("/v1/messages", "/v1/messages/count_tokens"):
            r = httpx.post(live.url + path, json=big, timeout=60)
            assert r.status_code == 400, path
            error = r.json()["error"]
            assert "at least" in error["message"] and error["n_ctx"] == 4096 and error["n_prompt_tokens"] >= 4096
        assert counted == []  # never tokenized
        r = httpx.post(live.url + "/v1/chat/completions", json={**CHAT, "messages": big["messages"]}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
        # a prompt just under the bound is counted as usual (and may be reported over the context: count_tokens)
        small = {**big, "messages": [{"role": "user", "content": "x" * (bound // 2)}]}
        r = httpx.post(live.url + "/v1/messages/count_tokens", json=small, timeout=60)
        assert r.status_code == 200 and r.json()["input_tokens"] > 0 and counted


def long_reply(req: GenerationRequest) -> str:
    return "word " * 3000


@pytest.mark.parametrize("body_mb, tokenized", [(20, False), (1, True)])
def test_a_big_body_does_not_stall_a_stream_or_health(body_mb, tokenized):
    """While a big body is read, parsed, rendered and (if it can fit) tokenized for count_tokens, which skips the
    queue, another client's stream keeps flowing and /health answers within 1 s. A 20 MB prompt cannot fit a
    65536-token context and is refused by its size; 1 MB is tokenized (about 2 s here), off the event loop and
    without holding the GIL."""
    engine = ScriptedEngine(ctx=65536, reply=long_reply)
    engine.model.delay = 0.01
    stream_times: list[float] = []
    health_times: list[float] = []
    big_done = threading.Event()
    result: dict = {}

    with live_server(engine) as live:
        def stream() -> None:
            with httpx.stream("POST", live.url + "/v1/chat/completions", timeout=60,
                              json={**CHAT, "max_tokens": 3000, "stream": True}) as r:
                for _ in r.iter_lines():
                    stream_times.append(time.monotonic())
                    if big_done.is_set():
                        break  # measured enough: hang up, which cancels the rest

        def big() -> None:
            content = ("alpha beta gamma delta " * (body_mb * 2**20 // 23 + 1))[: body_mb * 2**20]
            r = httpx.post(live.url + "/v1/messages/count_tokens", timeout=120,
                           json={"model": "m", "messages": [{"role": "user", "content": content}]})
            result["status"], result["body"] = r.status_code, r.json()
            big_done.set()

        streamer = threading.Thread(target=stream)
        streamer.start()
        while len(stream_times) < 5:
            time.sleep(0.01)
        start = time.monotonic()
        sender = threading.Thread(target=big)
        sender.start()
        while not big_done.is_set():
            t0 = time.monotonic()
            assert httpx.get(live.url + "/health", timeout=10).status_code == 200
            health_times.append(time.monotonic() - t0)
            time.sleep(0.1)
        end = time.monotonic()
        sender.join()
        streamer.join()

    assert result["status"] == (200 if tokenized else 400), result
    if tokenized:
        assert result["body"]["input_tokens"] > 100_000
    assert max(health_times) < 1.0, health_times
    during = [t for t in stream_times if start <= t <= end]
    gaps = [b - a for a, b in zip([start] + during, during + [end])]
    assert during and max(gaps) < 1.0, (end - start, max(gaps))


def test_the_trace_file_is_private(tmp_path):
    """It holds every prompt: 0600 when created, and made so when it exists."""
    fresh, existing = tmp_path / "fresh.trace", tmp_path / "existing.trace"
    existing.write_text("earlier\n")
    existing.chmod(0o644)
    for path in (fresh, existing):
        with live_server(ScriptedEngine(), ServerOptions(trace=str(path))) as live:
            assert httpx.post(live.url + "/v1/chat/completions", json=CHAT, timeout=30).status_code == 200
        assert path.stat().st_mode & 0o777 == 0o600 and "rendered prompt" in path.read_text()
    assert existing.read_text().startswith("earlier\n")
