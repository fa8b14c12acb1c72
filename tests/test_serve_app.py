"""The HTTP server over real sockets, with the real engine over a scripted model: routing, errors, CORS, auth, SSE,
queueing, cancellation, shutdown, tool memory and the trace. The official SDKs run against it in test_serve_sdk.py."""

from __future__ import annotations

import json
import logging
import re
import socket
import threading
import time

import httpx
import pytest

from ds4_mlx.chat import EOS, ThinkMode
from ds4_mlx.errors import ContextOverflow
from ds4_mlx.sampling import SamplingParams
from ds4_mlx.serve import anthropic, openai
from ds4_mlx.serve import app as app_module
from ds4_mlx.serve.app import ServerOptions
from ds4_mlx.serve.common import CallIds, ChatRequest, Options
from serve_support import MODEL, ScriptedEngine, live_server, sse_frames

USER = [{"role": "user", "content": "hi"}]
CORS = {
    "access-control-allow-origin": "*",
    "access-control-allow-methods": "GET, POST, OPTIONS",
    "access-control-allow-headers": "*",
}


@pytest.fixture
def engine():
    return ScriptedEngine()


@pytest.fixture
def live(engine):
    with live_server(engine) as live:
        yield live


@pytest.fixture
def client(live):
    with httpx.Client(base_url=live.url, timeout=20) as c:
        yield c


def sse_data(text: str) -> list[dict | str]:
    out = []
    for frame in text.split("\n\n"):
        for line in frame.split("\n"):
            if line.startswith("data: "):
                payload = line[6:]
                out.append(payload if payload == "[DONE]" else json.loads(payload))
    return out


def wait_until(predicate, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        time.sleep(0.01)


# ---------------------------------------------------------------------------------------------------------
# routing


def test_models_and_health(client):
    models = client.get("/v1/models").json()
    assert [m["id"] for m in models["data"]] == [MODEL, "deepseek-chat", "deepseek-reasoner"]
    model = client.get(f"/v1/models/{MODEL}")
    assert model.status_code == 200 and model.text.endswith("}\n")
    assert list(model.json())[:8] == ["id", "object", "created", "owned_by", "name", "context_length",
                                      "top_provider", "supported_parameters"]  # ds4's keys first, in its order
    assert model.json()["top_provider"] == {"context_length": 4096, "max_completion_tokens": 4096,
                                            "is_moderated": False}
    missing = client.get("/v1/models/gpt-4")
    assert missing.status_code == 404 and "gpt-4" in missing.json()["error"]["message"]
    assert client.get("/health").json() == {"status": "ok", "model": MODEL, "ctx": 4096, "parallel": 1,
                                                "running": 0, "busy": False, "queued": 0}


def test_models_answer_anthropic_clients_in_anthropics_shape(client):
    """Claude Code and the anthropic SDK send `anthropic-version`; they read Anthropic's model list."""
    headers = {"anthropic-version": "2023-06-01"}
    models = client.get("/v1/models", headers=headers).json()
    entries = [{k: e[k] for k in ("type", "id", "display_name", "created_at")} for e in models["data"]]
    assert entries == [{"type": "model", "id": m, "display_name": "DeepSeek V4 Flash",
                        "created_at": "2026-01-01T00:00:00Z"} for m in (MODEL, "deepseek-chat", "deepseek-reasoner")]
    assert {k: models[k] for k in ("has_more", "first_id", "last_id")} == {"has_more": False, "first_id": MODEL,
                                                                           "last_id": "deepseek-reasoner"}
    assert client.get(f"/v1/models/{MODEL}", headers=headers).json() == models["data"][0]
    missing = client.get("/v1/models/claude-x", headers=headers)
    assert missing.status_code == 404 and missing.json()["type"] == "error"
    assert missing.json()["error"]["type"] == "not_found_error"


@pytest.mark.parametrize(
    "method, path, shape",
    [
        ("GET", "/v1/nothing", "openai"),
        ("GET", "/v1/chat/completions", "openai"),
        ("POST", "/v1/models", "openai"),
        ("GET", "/v1/models/", "openai"),
        ("POST", "/v1/chat/completions/", "openai"),
        ("GET", "/v1/messages", "anthropic"),
        ("POST", "/v1/messages/batches", "anthropic"),
    ],
)
def test_unknown_endpoints_are_404_in_the_path_shape(client, method, path, shape):
    r = client.request(method, path)
    assert r.status_code == 404 and r.headers["content-type"] == "application/json"
    expected = {"error": {"message": "unknown endpoint", "type": "invalid_request_error"}}
    if shape == "anthropic":
        expected = {"type": "error", "error": {"type": "not_found_error", "message": "unknown endpoint"}}
    assert r.json() == expected


def test_options_is_204_without_cors_headers_by_default(client):
    r = client.options("/v1/chat/completions")
    assert r.status_code == 204 and r.headers["content-length"] == "0" and r.content == b""
    assert "content-type" not in r.headers and "access-control-allow-origin" not in r.headers
    assert "access-control-allow-origin" not in client.get("/v1/models").headers


def test_cors_headers_on_every_response():
    with live_server(ScriptedEngine(), ServerOptions(cors=True)) as live, httpx.Client(base_url=live.url) as c:
        preflight = c.options("/anything")
        assert preflight.status_code == 204 and "content-type" not in preflight.headers
        responses = [
            preflight,
            c.get("/v1/models"),
            c.post("/v1/chat/completions", json={"messages": USER}),
            c.post("/v1/chat/completions", json={"messages": USER, "stream": True}),
            c.post("/v1/messages", content=b"{"),
            c.get("/nowhere"),
        ]
        for r in responses:
            assert {k: r.headers.get(k) for k in CORS} == CORS, r.request.url


def test_http_keep_alive_serves_several_requests_on_one_connection(live):
    host, port = live.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        for _ in range(3):
            sock.sendall(f"GET /health HTTP/1.1\r\nHost: {host}\r\n\r\n".encode())
            head = b""
            while b"\r\n\r\n" not in head:
                head += sock.recv(4096)
            header, body = head.split(b"\r\n\r\n", 1)
            length = int(next(line.split(b":")[1] for line in header.split(b"\r\n")
                              if line.lower().startswith(b"content-length")))
            while len(body) < length:
                body += sock.recv(4096)
            assert header.startswith(b"HTTP/1.1 200") and b"connection: close" not in header.lower()


# ---------------------------------------------------------------------------------------------------------
# authentication


def test_api_key():
    with live_server(ScriptedEngine(), ServerOptions(api_key="sekret")) as live, httpx.Client(base_url=live.url) as c:
        denied = c.post("/v1/chat/completions", json={"messages": USER})
        assert denied.status_code == 401 and denied.json()["error"]["type"] == "authentication_error"
        denied = c.post("/v1/messages", json={"messages": USER}, headers={"x-api-key": "wrong"})
        assert denied.status_code == 401 and denied.json()["error"]["type"] == "authentication_error"
        assert c.get("/v1/models").status_code == 401
        ok = c.post("/v1/chat/completions", json={"messages": USER}, headers={"Authorization": "Bearer sekret"})
        assert ok.status_code == 200
        assert c.post("/v1/messages", json={"messages": USER}, headers={"x-api-key": "sekret"}).status_code == 200
        assert c.get("/health").status_code == 200
        assert c.options("/v1/messages").status_code == 204


@pytest.mark.parametrize("header", ["authorization", "x-api-key"])
def test_a_non_ascii_api_key_matches_its_utf8_bytes(header):
    """--api-key clé matches the key's UTF-8 bytes (a latin-1 comparison accepted only é, which no UTF-8
    client sends)."""
    def offer(key: bytes) -> dict[str, bytes]:
        return {header: b"Bearer " + key if header == "authorization" else key}

    with live_server(ScriptedEngine(), ServerOptions(api_key="clé")) as live, httpx.Client(base_url=live.url) as c:
        assert c.get("/v1/models", headers=offer("clé".encode("utf-8"))).status_code == 200
        assert c.get("/v1/models", headers=offer("clé".encode("latin-1"))).status_code == 401
        assert c.get("/v1/models", headers=offer(b"cle")).status_code == 401
        assert c.post("/v1/messages", json={"messages": USER}, headers=offer("clé".encode())).status_code == 200


# ---------------------------------------------------------------------------------------------------------
# errors


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/messages", "/v1/completions"])
@pytest.mark.parametrize(
    "body, status, message",
    [
        (b"{not json", 400, "invalid JSON request"),
        (b"", 400, "the body is empty"),
        (b"[]", 400, "must be a JSON object"),
        (b'{"messages":[{"role":"user","content":"x"}],"prompt":"x","temperature":"hot"}', 400,
         "temperature must be a number"),
        (b'{"messages":[{"role":"user","content":"x"}],"prompt":"x","stream":1}', 400, "stream must be a boolean"),
        (b'{"model":"m"}', 400, "missing "),
    ],
)
def test_bad_requests_get_a_4xx_in_the_endpoint_shape(client, path, body, status, message):
    r = client.post(path, content=body, headers={"content-type": "application/json"})
    assert r.status_code == status and r.text.endswith("\n")
    error = r.json()
    if path == "/v1/messages":
        assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
        assert message in error["error"]["message"]
    else:
        assert error["error"]["type"] == "invalid_request_error" and message in error["error"]["message"]
    assert r.headers["x-request-id"]
    assert client.post(path, json={"messages": USER, "prompt": "p"}).status_code == 200  # still serving


@pytest.mark.parametrize(
    "path, body",
    [
        ("/v1/chat/completions", {"messages": []}),
        ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}),
        ("/v1/messages", {"messages": [{"role": "developer", "content": "x"}]}),
        ("/v1/messages", {"messages": [{"role": "assistant", "content": [{"type": "tool_use", "input": "x"}]}]}),
        ("/v1/chat/completions", {"messages": USER, "reasoning_effort": "banana"}),
    ],
)
def test_bad_roles_and_empty_messages(client, path, body):
    r = client.post(path, json=body)
    assert r.status_code == 400
    assert (r.json()["error"]["type"]) == "invalid_request_error"


def test_prompt_longer_than_the_context(client):
    long = "x" * 5000
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": long}]})
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["param"] == "messages" and error["code"] == "context_length_exceeded"
    assert error["n_ctx"] == 4096 and error["n_prompt_tokens"] > 4096
    assert error["message"] == (
        f"Prompt has {error['n_prompt_tokens']} tokens, but the configured context size is 4096 tokens")
    r = client.post("/v1/completions", json={"prompt": long})
    assert r.json()["error"]["param"] == "prompt"
    r = client.post("/v1/messages", json={"messages": [{"role": "user", "content": long}], "stream": True})
    assert r.status_code == 400 and set(r.json()["error"]) == {"type", "message", "n_prompt_tokens", "n_ctx"}
    error = r.json()["error"]  # Anthropic's wording, which Claude Code matches to compact its history
    assert error["type"] == "invalid_request_error"
    assert error["message"] == f"prompt is too long: {error['n_prompt_tokens']} tokens > 4095 maximum"


def test_engine_errors_before_generation_get_a_status_code(client, engine):
    """A refused prompt or a failed prefill, before any output: an error body, also for streams."""
    engine.refusal = ContextOverflow(4100, 4096)
    r = client.post("/v1/chat/completions", json={"messages": USER, "stream": True})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    engine.refusal = None
    engine.model.fail_at, engine.model.failure = 0, RuntimeError("kernel exploded")
    r = client.post("/v1/messages", json={"messages": USER})
    assert r.status_code == 500
    assert r.json()["error"] == {"type": "api_error",
                                 "message": f"internal server error (request id {r.headers['x-request-id']})"}
    r = client.post("/v1/chat/completions", json={"messages": USER, "stream": True})
    assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"
    assert "kernel exploded" not in r.text
    engine.model.fail_at = None
    assert client.post("/v1/chat/completions", json={"messages": USER}).status_code == 200


def test_no_device_memory_for_the_prefill_is_a_503_that_loses_nothing(client, engine):
    """A prefill chunk the device memory budget has no room for (memory.py) is refused before anything is
    allocated: 503 with what was needed, and the next request, with room again, is answered."""
    from ds4_mlx import memory

    with memory.limited(0):  # nothing free (a limit at the live arrays races the collector)
        r = client.post("/v1/chat/completions", json={"messages": USER})
    assert r.status_code == 503 and "no room to prefill" in r.json()["error"]["message"]
    assert client.post("/v1/chat/completions", json={"messages": USER}).status_code == 200


def test_prefill_failure_after_the_stream_began_is_an_sse_error_event(client, engine):
    """As in ds4: a prefill that fails after keepalives started (the headers are out) ends with an `event: error`."""
    engine.session.chunk_size = 2
    engine.model.fail_at = 1  # the second chunk
    r = client.post("/v1/chat/completions", json={"messages": USER, "stream": True})
    assert r.status_code == 200
    assert r.text.endswith('event: error\ndata: {"error":{"message":"internal server error (request id '
                           + r.headers["x-request-id"] + ')","type":"server_error"}}\n\n')
    engine.session.reset()
    r = client.post("/v1/messages", json={"messages": USER, "stream": True})
    last = r.text.strip().split("\n\n")[-1]
    assert last.startswith("event: error\ndata: ")
    assert json.loads(last.split("data: ")[1])["error"]["type"] == "api_error"


def test_body_size_limit(client, monkeypatch):
    monkeypatch.setattr(app_module, "MAX_BODY_BYTES", 100)
    r = client.post("/v1/messages", json={"messages": [{"role": "user", "content": "x" * 200}]})
    assert r.status_code == 413 and r.json()["error"]["type"] == "request_too_large"


# ---------------------------------------------------------------------------------------------------------
# responses and streams


def test_sse_bytes_on_the_wire_are_the_translator_frames(client, engine):
    """What the server sends is exactly the translator's frames for the engine's events, nothing more."""
    text = ("Plan.</think>Checking.\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"ls\">\n<｜DSML｜parameter "
            'name="path" string="true">/tmp</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>')
    engine.reply = lambda req: text
    tools = [{"type": "function", "function": {"name": "ls"}}]
    r = client.post("/v1/chat/completions", json={"messages": USER, "tools": tools, "stream": True,
                                                  "stream_options": {"include_usage": True}})
    first = json.loads(r.text.split("\n\n")[0][6:])
    call_id = re.search(r'"id":"(call_[0-9a-f]{32})"', r.text).group(1)
    call_ids = CallIds("call_")
    call_ids.ids = [call_id]
    stream = openai.ChatStream(first["id"], first["created"], served(include_usage=True), call_ids)
    events = replay(engine)
    expected = stream.start(events[0]) + [f for e in events[1:-1] for f in stream.event(e)] + stream.done(events[-1])
    assert r.text == "".join(expected)

    engine.reset()
    r = client.post("/v1/messages", json={"messages": USER, "tools": [{"name": "ls"}], "stream": True})
    message_id = json.loads(r.text.split("data: ", 1)[1].split("\n", 1)[0])["message"]["id"]
    call_ids = CallIds("toolu_")
    call_ids.ids = [re.search(r'"id":"(toolu_[0-9a-f]{32})"', r.text).group(1)]
    stream = anthropic.MessageStream(message_id, 0, served(), call_ids)
    events = replay(engine)
    assert events[0].cached_tokens == 0 and r.text.count("cache_creation_input_tokens") == 2
    expected = stream.start(events[0]) + [f for e in events[1:-1] for f in stream.event(e)] + stream.done(events[-1])
    assert r.text == "".join(expected)


def served(include_usage: bool = False) -> ChatRequest:
    """What the translators read of a request: the model name they echo, and include_usage."""
    return ChatRequest(Options(MODEL, ThinkMode.HIGH, SamplingParams(), include_usage=include_usage), ())


def replay(engine: ScriptedEngine) -> list:
    """The events the engine produces for its last request, starting from nothing computed, as the server's did."""
    engine.reset()
    return list(engine.generate(engine.requests[-1]))


def test_anthropic_message_start_reports_the_cache_split(client, engine):
    """message_start goes out after the engine accepted the prompt, so it carries the reused prefix."""

    def usages(messages: list) -> tuple[dict, dict]:
        r = client.post("/v1/messages", json={"model": "deepseek-chat", "messages": messages, "stream": True})
        data = [json.loads(d) for _, d in sse_frames(r.text)]
        return data[0]["message"]["usage"], data[-2]["usage"]

    start, final = usages(USER)
    assert start["cache_read_input_tokens"] == 0 and start["cache_creation_input_tokens"] > 0
    prompt = start["cache_creation_input_tokens"]
    start, final = usages(USER + [{"role": "assistant", "content": "Hello there."}, {"role": "user", "content": "?"}])
    assert start["cache_read_input_tokens"] == prompt + len(engine.tokenizer.encode("Hello there."))
    assert final["cache_read_input_tokens"] == start["cache_read_input_tokens"]
    assert final["cache_creation_input_tokens"] == start["cache_creation_input_tokens"] > 0


def test_a_decode_failure_ends_every_stream_normally(client, engine):
    """As in ds4, a generation failure during decode produces no error event: it ends the normal stream with
    finish `error` (Responses: `response.failed`)."""
    engine.model.fail_at = 3  # the prefill and two decoded tokens, then the device fails

    def frames(path: str, body: dict) -> list:
        r = client.post(path, json={**body, "stream": True})
        out = sse_frames(r.text)
        assert r.status_code == 200 and all(event != "error" for event, _ in out)
        return [d if d == "[DONE]" else json.loads(d) for _, d in out]

    chat = frames("/v1/chat/completions", {"messages": USER})
    assert chat[-1] == "[DONE]" and chat[-2]["choices"][0]["finish_reason"] == "error"
    completion = frames("/v1/completions", {"prompt": "p"})
    assert completion[-1] == "[DONE]" and completion[-2]["choices"][0]["finish_reason"] == "error"
    message = frames("/v1/messages", {"messages": USER})
    assert message[-1]["type"] == "message_stop" and message[-2]["delta"]["stop_reason"] == "end_turn"
    response = frames("/v1/responses", {"input": "p"})
    assert response[-1]["type"] == "response.failed" and response[-1]["response"]["error"]["code"] == "server_error"


def test_sse_headers_and_keepalive_comments_during_prefill(engine):
    engine.session.chunk_size = 2
    with live_server(engine, ServerOptions(keepalive_seconds=0)) as live, httpx.Client(base_url=live.url) as c:
        r = c.post("/v1/chat/completions", json={"messages": USER, "stream": True})
    assert r.headers["content-type"] == "text/event-stream" and r.headers["cache-control"] == "no-cache"
    frames = r.text.split("\n\n")
    ids = engine.tokenizer.encode(engine.requests[-1].prompt)
    user = ids.index(engine.tokenizer.user_id)  # the prefill also stops where the last user turn starts
    chunks = -(-user // 2) + -(-(len(ids) - user) // 2)
    assert chunks >= 3
    assert json.loads(frames[0][6:])["choices"][0]["delta"] == {"role": "assistant"}
    assert frames[1 : 1 + chunks] == [": prefill"] * chunks and frames[1 + chunks].startswith("data: ")
    assert "".join(json.loads(f[6:])["choices"][0]["delta"].get("content", "") for f in frames[1 + chunks : -2]) == (
        "Hello there.")
    assert frames[-2:] == ["data: [DONE]", ""]


def test_no_keepalive_when_the_stream_is_fresh(client, engine):
    engine.session.chunk_size = 2  # several prefill chunks, but the keepalive interval (5 s) never passes
    assert ": prefill" not in client.post("/v1/messages", json={"messages": USER, "stream": True}).text


def test_generation_request_carries_the_normalized_request(client, engine):
    client.post("/v1/chat/completions", json={
        "messages": USER, "think": False, "temperature": 0, "seed": 7, "stop": ["END"], "max_tokens": 9,
        "tools": [{"type": "function", "function": {"name": "ls"}}]})
    req = engine.requests[-1]
    assert req.prompt.endswith("<｜User｜>hi<｜Assistant｜></think>") and '{"name":"ls"}' in req.prompt
    assert (req.thinking, req.tools_active, req.max_tokens, req.stop) == (False, True, 9, ("END",))
    assert (req.sampling.temperature, req.sampling.seed) == (0.0, 7)
    client.post("/v1/completions", json={"prompt": "p"})
    assert engine.requests[-1].thinking is False  # raw text: no reasoning split for legacy completions
    assert engine.requests[-1].prompt.endswith("<｜User｜>p<｜Assistant｜><think>")


@pytest.mark.parametrize("temperature", [1e-46, 1e-300])
def test_a_tiny_temperature_is_greedy_on_every_endpoint(client, engine, temperature):
    """A temperature that is 0 in float32 once divided by zero in the draw, and every endpoint answered
    token 0 (`<｜begin▁of▁sentence｜>`) over and over instead of the model's most likely text."""
    knobs = {"temperature": temperature, "max_tokens": 9}
    cases = [
        ("/v1/chat/completions", {"messages": USER, "think": False, **knobs},
         lambda b: b["choices"][0]["message"]["content"]),
        ("/v1/completions", {"prompt": "p", "model": "deepseek-chat", **knobs}, lambda b: b["choices"][0]["text"]),
        ("/v1/responses", {"input": "hi", "reasoning": {"effort": "none"}, "temperature": temperature,
                           "max_output_tokens": 9}, lambda b: b["output"][-1]["content"][0]["text"]),
        ("/v1/messages", {"messages": USER, "thinking": {"type": "disabled"}, **knobs},
         lambda b: b["content"][0]["text"]),
    ]
    for path, body, text in cases:
        r = client.post(path, json=body)
        assert r.status_code == 200, (path, r.text)
        assert engine.requests[-1].sampling.temperature == temperature, path  # the knob reached the sampler
        assert text(r.json()) == "Hello there.", path


def test_completion_returns_the_raw_text(client, engine):
    engine.reply = lambda req: "hmm</think>answer"
    body = client.post("/v1/completions", json={"prompt": "p"}).json()
    assert body["choices"][0]["text"] == "hmm</think>answer" and body["object"] == "text_completion"
    streamed = sse_data(client.post("/v1/completions", json={"prompt": "p", "stream": True}).text)
    assert "".join(d["choices"][0]["text"] for d in streamed[:-1]) == "hmm</think>answer"


def test_tool_call_ids_replay_the_sampled_dsml(client, engine):
    """ds4_server.c: the next request's history re-renders the exact sampled block, not canonical DSML."""
    block = ('\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="bash">\n<｜DSML｜parameter name="timeout" '
             'string="false">  10 </｜DSML｜parameter>\n<｜DSML｜parameter name="command" string="true">ls'
             "</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>")
    engine.reply = lambda req: "plan</think>Checking." + block
    tools = [{"type": "function", "function": {"name": "bash", "parameters": {"type": "object"}}}]
    first = client.post("/v1/chat/completions", json={"messages": USER, "tools": tools}).json()
    message = first["choices"][0]["message"]
    assert first["choices"][0]["finish_reason"] == "tool_calls"
    (call,) = message["tool_calls"]
    assert call["id"].startswith("call_") and len(call["id"]) == 37
    assert json.loads(call["function"]["arguments"]) == {"timeout": 10, "command": "ls"}
    engine.reply = lambda req: "done</think>There are files."
    history = USER + [
        {"role": "assistant", "content": message["content"], "reasoning_content": message["reasoning_content"],
         "tool_calls": [{**call, "function": {"name": "bash", "arguments": '{"command": "ls", "timeout": 10}'}}]},
        {"role": "tool", "tool_call_id": call["id"], "content": "a b"},
    ]
    client.post("/v1/chat/completions", json={"messages": history, "tools": tools})
    prompt = engine.requests[-1].prompt
    assert "<think>plan</think>Checking." + block + EOS + "<｜User｜><tool_result>a b</tool_result>" in prompt
    # the new prompt extends the first prompt plus the exact sampled text, so the live session can be reused
    assert prompt.startswith(engine.requests[0].prompt + "plan</think>Checking." + block)

    # Anthropic ids work the same way
    engine.reply = lambda req: "plan</think>Checking." + block
    first = client.post("/v1/messages", json={"messages": USER, "tools": [{"name": "bash", "input_schema": {}}],
                                              "stream": True})
    starts = [d for d in sse_data(first.text) if d["type"] == "content_block_start"]
    tool_id = starts[-1]["content_block"]["id"]
    assert tool_id.startswith("toolu_") and engine.tool_memory.lookup([tool_id]) is not None


def test_trace_file(tmp_path, engine):
    path = tmp_path / "trace.txt"
    engine.reply = lambda req: ('r</think>x\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="ls">\n'
                                "</｜DSML｜invoke>\n</｜DSML｜tool_calls>")
    with live_server(engine, ServerOptions(trace=str(path))) as live, httpx.Client(base_url=live.url) as c:
        c.post("/v1/chat/completions", json={"messages": USER, "tools": [{"type": "function",
                                                                          "function": {"name": "ls"}}]})
        c.post("/v1/chat/completions", json={"messages": USER, "temperature": "x"})
    text = path.read_text()
    for needle in ["request /v1/chat/completions", "--- rendered prompt", "<｜User｜>hi<｜Assistant｜><think>",
                   "tool call 0 started: ls", "tool call 0 ended", "done finish=tool_calls",
                   "cache: cache miss, prefilled all", "--- sampled DSML", "error 400", "temperature must be"]:
        assert needle in text, needle
    refused = text[text.index("error 400") :]  # the refused request's body is recorded, so it can be replayed
    assert 'request: {"messages":[{"role":"user","content":"hi"}],"temperature":"x"}' in refused
    stamps = re.findall(r"^=== (\S+) ", text, re.M)  # ISO 8601 with the year
    assert stamps and all(re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d[+-]\d{4}", s) for s in stamps)


def test_every_request_ends_with_one_summary_line(client, engine, caplog):
    """Finished or refused, streamed or not: one line each, with the prompt, the cache split, the rates and
    the finish reason."""
    caplog.set_level(logging.INFO, logger="ds4_mlx.serve")
    client.post("/v1/chat/completions", json={"messages": USER})
    client.post("/v1/messages", json={"messages": USER, "stream": True})
    client.post("/v1/chat/completions", json={"messages": USER, "n": 2})
    lines = [r.getMessage() for r in caplog.records if r.name == "ds4_mlx.serve"]
    assert len(lines) == 3
    assert re.fullmatch(r"chatcmpl-\w+ chat prompt=\d+ cached=0 completion=\d+ reasoning=\d+ finish=stop "
                        r"prefill \d+ tok [\d.]+s \(([\d.]+ t/s|-)\) decode \d+ tok [\d.]+s \(([\d.]+ t/s|-)\) "
                        r"reuse=none 0",
                        lines[0]), lines[0]
    assert lines[1].startswith("msg_") and " messages prompt=" in lines[1] and "finish=stop" in lines[1]
    assert re.search(r" cached=[1-9]", lines[1])  # the resend reused the first request's prompt
    assert lines[2].endswith("chat refused: 400 invalid request: n must be 1: this server generates one choice "
                             "per request")


def test_count_tokens(client, engine):
    r = client.post("/v1/messages/count_tokens", json={"messages": USER})
    assert r.json() == {"input_tokens": engine.count_tokens("<｜begin▁of▁sentence｜><｜User｜>hi<｜Assistant｜><think>")}
    # a conversation too long for the context is counted too: clients ask exactly to decide when to compact
    r = client.post("/v1/messages/count_tokens", json={"messages": [{"role": "user", "content": "x" * 5000}]})
    assert r.status_code == 200 and r.json()["input_tokens"] > engine.ctx
    assert engine.requests == []


# ---------------------------------------------------------------------------------------------------------
# the worker: queue, concurrency, cancellation, shutdown


def test_queue_limit_answers_429():
    engine = ScriptedEngine()
    engine.gate = threading.Event()
    with live_server(engine, max_queue=1) as live, httpx.Client(base_url=live.url, timeout=20) as c:
        results = {}

        def post(name):
            results[name] = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": name}]})

        running = threading.Thread(target=post, args=("a",))
        running.start()
        wait_until(engine.started.is_set)
        queued = threading.Thread(target=post, args=("b",))
        queued.start()
        wait_until(lambda: live.worker.queued == 1)
        refused = c.post("/v1/messages", json={"messages": USER})
        assert refused.status_code == 429 and refused.headers["retry-after"] == "1"
        assert refused.json()["error"]["type"] == "rate_limit_error"
        assert "at most 1" in refused.json()["error"]["message"]
        engine.gate.set()
        running.join(10)
        queued.join(10)
        assert results["a"].status_code == results["b"].status_code == 200


def test_concurrent_clients_match_their_sequential_answers(engine):
    engine.reply = lambda req: "thought</think>" + req.prompt[-60:-30]
    engine.model.delay = 0.001
    bodies = [{"messages": [{"role": "user", "content": f"question number {i} " * 3}], "seed": i}
              for i in range(16)]
    with live_server(engine) as live, httpx.Client(base_url=live.url, timeout=60) as c:
        sequential = [c.post("/v1/chat/completions", json=b).json()["choices"][0]["message"] for b in bodies]
        results: list = [None] * 16

        def run(i):
            with httpx.Client(base_url=live.url, timeout=60) as own:
                stream = i % 2 == 1
                r = own.post("/v1/chat/completions", json={**bodies[i], "stream": stream})
                if stream:
                    deltas = [d["choices"][0]["delta"] for d in sse_data(r.text)[:-1] if d["choices"]]
                    results[i] = {"role": "assistant",
                                  "content": "".join(d.get("content", "") for d in deltas),
                                  "reasoning_content": "".join(d.get("reasoning_content", "") for d in deltas)}
                else:
                    results[i] = r.json()["choices"][0]["message"]

        threads = [threading.Thread(target=run, args=(i,)) for i in range(16)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    assert results == sequential
    assert len({m["content"] for m in results}) == 16


def test_streaming_client_disconnect_cancels_generation(engine, caplog):
    caplog.set_level(logging.INFO, logger="ds4_mlx.serve")
    engine.reply = lambda req: "x" * 3000
    engine.model.delay = 0.01
    with live_server(engine) as live:
        with httpx.Client(base_url=live.url, timeout=20) as c:
            with c.stream("POST", "/v1/chat/completions", json={"messages": USER, "stream": True}) as r:
                next(r.iter_bytes())
        wait_until(lambda: engine.cancelled == 1, timeout=5)
        summary = [r.getMessage() for r in caplog.records if "finish=" in r.getMessage()]
        assert len(summary) == 1 and re.search(r" chat prompt=[1-9]\d* cached=0 finish=cancelled", summary[0])
        with httpx.Client(base_url=live.url, timeout=20) as c:
            engine.reply = lambda req: "ok</think>fine"
            assert c.post("/v1/chat/completions", json={"messages": USER}).json()["choices"][0]["message"][
                "content"] == "fine"


def test_non_streaming_client_disconnect_cancels_generation(engine):
    engine.reply = lambda req: "x" * 3000
    engine.model.delay = 0.01
    with live_server(engine) as live:
        with httpx.Client(base_url=live.url, timeout=0.5) as c, pytest.raises(httpx.ReadTimeout):
            c.post("/v1/messages", json={"messages": USER})
        wait_until(lambda: engine.cancelled == 1, timeout=5)
        assert not live.worker.busy or wait_until(lambda: not live.worker.busy) is None


def test_queued_client_that_leaves_is_skipped():
    engine = ScriptedEngine()
    engine.gate = threading.Event()
    with live_server(engine) as live:
        holder = threading.Thread(target=lambda: httpx.post(live.url + "/v1/chat/completions",
                                                            json={"messages": USER}, timeout=20))
        holder.start()
        wait_until(engine.started.is_set)
        with httpx.Client(base_url=live.url, timeout=0.5) as c, pytest.raises(httpx.ReadTimeout):
            c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "gone"}]})
        time.sleep(0.2)  # let the server notice the disconnect
        engine.gate.set()
        holder.join(10)
        wait_until(lambda: not live.worker.busy and live.worker.queued == 0)
        assert len(engine.requests) == 1


def test_shutdown_stops_generation_and_refuses_the_queue():
    engine = ScriptedEngine()
    engine.reply = lambda req: "x" * 3000
    engine.model.delay = 0.01
    with live_server(engine) as live:
        results = {}

        def post(name, path, body):
            results[name] = httpx.post(live.url + path, json=body, timeout=20)

        running = threading.Thread(target=post, args=("running", "/v1/chat/completions",
                                                      {"messages": USER, "stream": True}))
        running.start()
        wait_until(engine.started.is_set)
        queued = threading.Thread(target=post, args=("queued", "/v1/messages", {"messages": USER}))
        queued.start()
        wait_until(lambda: live.worker.queued == 1)
        live.server.handle_exit(15, None)  # what SIGTERM does
        running.join(10)
        queued.join(10)
    finish = [d for d in sse_data(results["running"].text) if isinstance(d, dict) and d["choices"]][-1]
    assert finish["choices"][0]["finish_reason"] == "error"
    assert results["queued"].status_code == 503
    assert results["queued"].json() == {"type": "error", "error": {"type": "api_error",
                                                                   "message": "server shutting down"}}
    assert engine.cancelled == 1
