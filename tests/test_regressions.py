"""Regression tests from an independent review against ds4's behaviour: each test pins a bug that was found and
fixed (its docstring says which rule). The fuzz tests at the end guard the robustness rules: a client mistake
never gets a 500, every error body has its endpoint's shape, and every malformed file is a GGUFError/LayoutError.
"""

from __future__ import annotations

import asyncio
import json
import logging
import struct
from pathlib import Path

import httpx
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import gguf_build
from ds4_mlx.engine import Engine, GenerationRequest
from ds4_mlx.errors import GGUFError, LayoutError
from ds4_mlx.model.factory import build_vocab
from ds4_mlx.model.gguf import GGUFFile, ValueType
from ds4_mlx.model.weights import open_weights
from ds4_mlx.serve.app import ServerOptions, create_app
from ds4_mlx.serve.worker import Worker
from ds4_mlx.tokenizer import Tokenizer
from scripted import scripted_engine
from serve_support import ScriptedEngine, live_server, small_tokenizer, sse_frames

USER = [{"role": "user", "content": "hi"}]
PROMPT = "<｜begin▁of▁sentence｜><｜User｜>hi<｜Assistant｜><think>"
CALL = (
    '\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="bash">\n'
    '<｜DSML｜parameter name="command" string="true">ls</｜DSML｜parameter>\n'
    "</｜DSML｜invoke>\n</｜DSML｜tool_calls>"
)


# ---------------------------------------------------------------------------------------------------------
# helpers: a live server over the scripted engine, and an Engine over a scripted model


@pytest.fixture
def engine():
    return ScriptedEngine()


@pytest.fixture
def client(engine):
    with live_server(engine) as live, httpx.Client(base_url=live.url, timeout=20) as c:
        yield c


def post_raw(client: httpx.Client, path: str, body: bytes) -> httpx.Response:
    return client.post(path, content=body, headers={"content-type": "application/json"})


def assert_error_shape(r: httpx.Response, path: str) -> None:
    """A 4xx whose JSON body has the endpoint's error shape (docs/server.md "Errors")."""
    assert 400 <= r.status_code < 500, (r.status_code, r.text[:300])
    body = r.json()
    error = body["error"]
    if path.startswith("/v1/messages"):
        assert body["type"] == "error" and isinstance(error["type"], str)
    else:
        assert isinstance(error["type"], str)
    assert isinstance(error["message"], str) and error["message"]


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return small_tokenizer()


# ---------------------------------------------------------------------------------------------------------
# engine


def test_malformed_tool_block_finishes_with_stop(tokenizer):
    """As in ds4 (ds4_server.c), a malformed block when tools are active is not an error: the whole raw text is
    returned as assistant content, no tool calls, finish `stop`. Today the parser's recovery closes the block,
    the engine records "tool_calls", and Anthropic clients get stop_reason tool_use without a tool_use block."""
    malformed = CALL.replace('invoke name="bash"', 'invoke nam="bash"')
    engine, _ = scripted_engine(tokenizer, "Checking." + malformed)
    done = list(engine.generate(GenerationRequest(prompt=PROMPT, thinking=False, tools_active=True)))[-1]
    assert done.message.tool_calls == ()
    assert done.finish_reason == "stop"


def test_stop_strings_do_not_delay_the_tool_block_stop(tokenizer):
    """As in ds4 (ds4_server.c), with tools active generation stops immediately after the closing
    </｜DSML｜tool_calls>, and the live KV never holds anything after a closing tool tag. The engine feeds the
    parser (and the greedy-structure tracker) the text *after* stop-string hold-back, so any stop string
    of n characters delays both by up to n-1 characters."""
    engine, model = scripted_engine(tokenizer, "</think>Checking." + CALL + " and more text never meant to be sampled")
    request = GenerationRequest(prompt=PROMPT, tools_active=True, stop=("A-LONG-STOP-STRING-THAT-NEVER-MATCHES",))
    done = list(engine.generate(request))[-1]
    assert done.finish_reason == "tool_calls" and len(done.message.tool_calls) == 1
    assert tokenizer.decode(list(done.token_ids)).endswith("</｜DSML｜tool_calls>")
    assert "never" not in tokenizer.decode(model.fed)


def test_exact_token_prompt_is_never_retokenized(tokenizer):
    """engine.py `_reuse`: "exact: the caller gave token ids ... (the text of ids is not re-tokenized)". The CLI
    tokenizes itself so that special strings typed by a user stay plain text (GenerationRequest docstring), but
    the live-session text path re-encodes the remainder with specials: plain `<think>` bytes become the special
    `<think>` token and the caller's ids are replaced."""
    engine, model = scripted_engine(tokenizer, "")
    first = tokenizer.encode("<｜User｜>hi there")
    list(engine.generate(GenerationRequest(prompt=first)))
    second = [tokenizer.user_id] + [t for ch in "hi there" for t in tokenizer.encode(ch, specials=False)]
    second += tokenizer.encode("<think>", specials=False)  # typed by the user: plain text, not the special token
    model.fed.clear()
    done = list(engine.generate(GenerationRequest(prompt=second)))[-1]
    assert tokenizer.think_id not in model.fed
    assert done.usage.prompt_tokens == len(second)


# ---------------------------------------------------------------------------------------------------------
# server: responses to valid and invalid requests


def test_responses_tool_search_call_is_a_tool_search_call_item(client, engine):
    """ds4 (ds4_server.c) reports hosted tool_search calls as {"id":"fc_…","type":"tool_search_call","status":…,
    "call_id":…,"execution":"client","arguments":{…object…}}. The server advertises the hosted tool_search to
    the model (a synthesized schema line) but reports its calls as ordinary function calls."""
    block = CALL.replace('name="bash"', 'name="tool_search"').replace('name="command"', 'name="query"')
    engine.reply = lambda req: "r</think>" + block
    r = client.post("/v1/responses", json={"input": "find the file tools", "tools": [{"type": "tool_search"}]})
    assert r.status_code == 200
    call = r.json()["output"][-1]
    assert call["type"] == "tool_search_call" and call["execution"] == "client"
    assert call["arguments"] == {"query": "ls"}


def test_responses_accepts_tool_search_items(client, engine):
    """ds4_server.c: input items include `tool_search_call` (→ tool `tool_search`) and its `*_output`
    (`tool_search_output.tools` loads more tool schemas); only other item types are a 400."""
    body = {
        "input": [
            {"type": "message", "role": "user", "content": "list files"},
            {"type": "tool_search_call", "call_id": "call_1", "execution": "client", "status": "completed",
             "arguments": {"query": "files"}},
            {"type": "tool_search_output", "call_id": "call_1", "execution": "client", "status": "completed",
             "tools": [{"type": "function", "name": "list_files", "parameters": {"type": "object"}}]},
        ],
        "tools": [{"type": "tool_search"}],
    }
    r = client.post("/v1/responses", json=body)
    assert r.status_code == 200, r.text
    assert "list_files" in engine.requests[-1].prompt


@pytest.mark.parametrize(
    "path, body",
    [
        ("/v1/chat/completions", b'{"model":"\\ud800","messages":[{"role":"user","content":"hi"}]}'),
        ("/v1/chat/completions", b'{"model":"\\ud800","messages":[{"role":"user","content":"hi"}],"stream":true}'),
        ("/v1/messages", b'{"model":"\\udfff","messages":[{"role":"user","content":"hi"}]}'),
        ("/v1/responses", b'{"model":"\\ud83d","input":"hi","stream":true}'),
    ],
)
def test_lone_surrogate_in_model_is_not_a_server_error(client, path, body):
    """Robustness standard (review brief): "Bad input gets a clear error ... The server never answers 500 to a
    client mistake." `"\\ud800"` is valid JSON syntax; the echoed model name has no UTF-8 form, so encoding the
    answer raises. Either refuse it with a 400 or answer with U+FFFD in its place."""
    r = post_raw(client, path, body)
    if r.status_code != 200:
        assert_error_shape(r, path)
    elif b'"stream":true' in body:
        last = sse_frames(r.text)[-1]
        assert last[1] == "[DONE]" or json.loads(last[1])["type"] in ("message_stop", "response.completed")
    else:
        r.json()


def test_trace_survives_lone_surrogates(tmp_path):
    """The trace file is opened with encoding utf-8 and strict errors: writing a rendered prompt that holds a
    lone surrogate (valid JSON "\\udc00") raises inside the request. The tokenizer already maps lone surrogates
    to U+FFFD (tokenizer.py `encode`); the trace must not be the one place that fails."""
    with live_server(ScriptedEngine(), ServerOptions(trace=str(tmp_path / "trace.log"))) as live:
        with httpx.Client(base_url=live.url, timeout=20) as c:
            r = post_raw(c, "/v1/chat/completions", b'{"messages":[{"role":"user","content":"a\\udc00b"}]}')
    assert r.status_code == 200, r.text


def test_responses_tool_choice_with_lone_surrogate_gets_a_json_400(client):
    """ds4_server.c: tool_choice other than auto/none → 400 `tool_choice=… not supported`. The value is
    interpolated raw; with a lone surrogate the error body cannot be encoded, the handler raises, and
    Starlette answers a bare text/plain 500."""
    r = post_raw(client, "/v1/responses", b'{"input":"hi","tool_choice":"\\ud800"}')
    assert_error_shape(r, "/v1/responses")


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages"])
def test_huge_integer_sampling_knob_is_a_400(client, path):
    """Robustness standard: no 500 for a client mistake. `float(10**400)` raises OverflowError in
    common.sampling_params (non-thinking requests); a JSON `1e400` is already refused cleanly."""
    huge = "1" + "0" * 400
    body = {"/v1/chat/completions": '{"model":"deepseek-chat","messages":[{"role":"user","content":"x"}],',
            "/v1/completions": '{"prompt":"x","think":false,',
            "/v1/responses": '{"input":"x","reasoning":{"effort":"none"},',
            "/v1/messages": '{"messages":[{"role":"user","content":"x"}],"thinking":{"type":"disabled"},'}[path]
    r = post_raw(client, path, (body + f'"temperature":{huge}}}').encode())
    assert_error_shape(r, path)


def test_decode_failure_ends_the_stream_with_finish_error(client, engine):
    """As in ds4 (ds4_server.c), a generation failure during decode produces no error event: it ends the normal
    stream with finish `error` (Responses: `response.failed`)."""
    engine.model.fail_at = 2
    r = client.post("/v1/chat/completions", json={"messages": USER, "stream": True})
    frames = sse_frames(r.text)
    assert all(event != "error" for event, _ in frames)
    assert frames[-1][1] == "[DONE]"
    assert json.loads(frames[-2][1])["choices"][0]["finish_reason"] == "error"


def test_negative_max_tokens_is_clamped_to_zero(client):
    """As in ds4 (ds4_server.c), a negative `max_tokens` is 0 (then `finish_reason:"length"` with empty output)."""
    r = client.post("/v1/chat/completions", json={"messages": USER, "max_tokens": -1})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize("knob", [{"temperature": -1}, {"top_p": 0}])
def test_sampling_knobs_in_ds4_range_are_accepted(client, knob):
    """In ds4 (ds4_server.c) a temperature <= 0 means argmax; ds4 accepts any number for these knobs, and
    OpenAI's own API takes top_p in [0, 1]. SamplingParams refuses temperature < 0 and top_p = 0, so the same
    request that works in thinking mode (knobs ignored) fails once thinking is off."""
    r = client.post("/v1/chat/completions", json={"model": "deepseek-chat", "messages": USER, **knob})
    assert r.status_code == 200, r.text


def test_anthropic_stream_ending_inside_thinking_has_no_text_block(client, engine):
    """As in ds4 (ds4_server.c, Anthropic): if the stream ends inside thinking, the thinking block is closed (with
    signature) and nothing else is sent before message_delta."""
    engine.reply = lambda req: "still thinking about it"
    r = client.post("/v1/messages", json={"messages": USER, "max_tokens": 6, "stream": True,
                                          "thinking": {"type": "adaptive"}})
    events = [(e, json.loads(d)) for e, d in sse_frames(r.text)]
    starts = [d["content_block"]["type"] for e, d in events if e == "content_block_start"]
    assert starts == ["thinking"]
    assert [e for e, _ in events][-2:] == ["message_delta", "message_stop"]


@pytest.mark.parametrize("path", ["/v1/models", "/v1/models/deepseek-v4-flash", "/health"])
def test_head_is_an_unknown_endpoint(client, path):
    """ds4 (ds4_server.c) answers anything else, HEAD included, 404 `unknown endpoint`; docs/server.md: "Anything
    else, including a trailing slash or the wrong method, is 404"."""
    assert client.head(path).status_code == 404


def test_disconnect_while_reading_the_body_is_not_an_internal_error(caplog):
    """Robustness standard: client disconnects lose nothing and are never a 500. Starlette raises ClientDisconnect
    from `request.stream()`; the endpoint wrapper treats it as an internal fault (ERROR log with traceback,
    500 response, a 500 line in the trace)."""
    worker = Worker(ScriptedEngine)
    worker.start()
    app = create_app(worker)
    sent: list[dict] = []
    incoming = [{"type": "http.request", "body": b'{"messages":', "more_body": True}]

    async def receive() -> dict:
        return incoming.pop(0) if incoming else {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)

    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
        "path": "/v1/chat/completions", "raw_path": b"/v1/chat/completions", "query_string": b"",
        "root_path": "", "headers": [(b"content-type", b"application/json"), (b"content-length", b"1000")],
        "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 8000),
    }
    try:
        with caplog.at_level(logging.ERROR, logger="ds4_mlx.serve"):
            asyncio.run(app(scope, receive, send))
    finally:
        worker.shutdown()
        worker.join(10)
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == []
    assert 500 not in [m["status"] for m in sent if m["type"] == "http.response.start"]


# ---------------------------------------------------------------------------------------------------------
# GGUF and model files


def test_deeply_nested_metadata_array_is_a_gguf_error(tmp_path):
    """Review brief / errors.py: a malformed file fails with GGUFError naming what is wrong, "never an
    IndexError/struct.error/numpy error". `_Cursor.array` recurses once per nesting level; 5000 levels of
    array-of-array (12 bytes each) exceed Python's recursion limit."""
    value = struct.pack("<IQ", ValueType.U32, 0)
    for _ in range(5000):
        value = struct.pack("<IQ", ValueType.ARRAY, 1) + value
    data = b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", 1) + b"k" + struct.pack("<I", 9) + value
    path = tmp_path / "nested.gguf"
    path.write_bytes(data)
    with pytest.raises(GGUFError):
        GGUFFile.open(path)


def tiny_spec_with_vocab(tokens: list[str]) -> gguf_build.Spec:
    """The tiny layout (vocab_size 512) with the factory's small byte-level vocabulary, truncated to `tokens`."""
    spec = gguf_build.model_spec()
    spec.metadata["tokenizer.ggml.tokens"] = ((ValueType.ARRAY, ValueType.STRING), tokens)
    spec.metadata["tokenizer.ggml.merges"] = ((ValueType.ARRAY, ValueType.STRING), list(build_vocab("small").merges))
    return spec


def test_out_of_range_hash_routing_id_is_a_layout_error(tmp_path):
    """The hash layers' `ffn_gate_tid2eid` row t holds the expert ids of token t. MLX gathers do
    not bounds-check: with an id of 100000 in the table, Engine.load succeeds and the first generate() kills the
    process with SIGSEGV (checked by hand; not run by the suite). A corrupted file must fail at load with a LayoutError
    naming the tensor (the table is n_used x n_vocab int32: 3 MB for Flash, cheap to check once)."""
    c = gguf_build.TINY
    table = np.tile(np.arange(c.n_expert_used, dtype="<i4"), (c.n_vocab, 1))
    table[7, 1] = 100_000
    spec = tiny_spec_with_vocab(list(build_vocab("small").tokens))
    path = gguf_build.write(spec, tmp_path / "bad-hash.gguf", {"blk.0.ffn_gate_tid2eid.weight": table.tobytes()})
    with pytest.raises(LayoutError, match="tid2eid"):
        Engine.load(path, ctx=64)


def test_vocabulary_shorter_than_vocab_size_is_a_layout_error(tmp_path):
    """`tokenizer.ggml.tokens` holds the vocabulary by id and the logits have
    `vocab_size` entries, so the two must agree. Nothing checks it: the model can sample an id the tokenizer
    does not have, and the request fails mid-generation ("token id 511 is outside the vocabulary")."""
    spec = tiny_spec_with_vocab(list(build_vocab("small").tokens[:-1]))
    path = gguf_build.write(spec, tmp_path / "short-vocab.gguf")
    with pytest.raises(LayoutError, match="vocab"):
        Engine.load(path, ctx=64)


def test_tiny_file_with_small_vocabulary_loads(tmp_path):
    """The control for findings 4 and 11: the same file with a full vocabulary and a valid table loads."""
    spec = tiny_spec_with_vocab(list(build_vocab("small").tokens))
    assert Engine.load(gguf_build.write(spec, tmp_path / "ok.gguf"), ctx=64).tokenizer.vocab_size == 512


# ---------------------------------------------------------------------------------------------------------
# guards that hold today: server fuzz


BASES = {
    "/v1/chat/completions": {
        "model": "deepseek-chat",
        "messages": [
            {"role": "system", "content": "s"},
            {"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "image_url", "image_url": {}}]},
            {"role": "assistant", "content": None, "reasoning_content": "r",
             "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{\"a\":1}"}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "out"},
        ],
        "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
        "tool_choice": "auto", "temperature": 0.5, "top_p": 0.9, "top_k": 5, "min_p": 0.1, "seed": 3,
        "max_tokens": 50, "stop": ["zz"], "stream": False, "stream_options": {"include_usage": True},
        "thinking": {"type": "enabled"}, "reasoning_effort": "high",
    },
    "/v1/completions": {"prompt": "hi", "model": "m", "max_tokens": 10, "temperature": 0, "stop": "x",
                        "think": False, "seed": 1, "stream": False},
    "/v1/messages": {
        "model": "deepseek-chat", "max_tokens": 50, "system": [{"type": "text", "text": "sys"}],
        "messages": [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": [{"type": "thinking", "thinking": "t", "signature": "s"},
                                              {"type": "text", "text": "a"},
                                              {"type": "tool_use", "id": "t1", "name": "f", "input": {"a": 1}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1",
                                          "content": [{"type": "text", "text": "r"}]}]},
        ],
        "tools": [{"name": "f", "input_schema": {"type": "object"}}], "tool_choice": {"type": "auto"},
        "temperature": 0.5, "top_k": 3, "stop_sequences": ["q"], "thinking": {"type": "disabled"},
        "output_config": {"effort": "high"}, "stream": False,
    },
    "/v1/responses": {
        "model": "m", "instructions": "be nice",
        "input": [
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]},
            {"type": "reasoning", "summary": [{"type": "summary_text", "text": "s"}]},
            {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c", "output": "o"},
        ],
        "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}},
                  {"type": "namespace", "name": "ns__", "tools": [{"name": "g", "parameters": {}}]}],
        "tool_choice": "auto", "reasoning": {"effort": "low", "summary": "auto"}, "max_output_tokens": 30,
        "stream": False,
    },
}

SCALARS = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=8), st.sampled_from([10**400, -(10**400)]),
    st.sampled_from(["", "none", "max", "auto", "enabled", "disabled", "user", "assistant", "tool", "message",
                     "function_call", "reasoning", "text", "</think>", "<｜DSML｜tool_calls>", "\x00", "\ufffe",
                     "\ud800", "a\udfffb"]),
)
VALUES = st.recursive(
    SCALARS,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(
        st.sampled_from(["type", "text", "name", "role", "content", "id", "arguments", "function", "input",
                         "call_id", "output", "summary", "effort", "tools", "parameters", "namespace", "status"]),
        inner, max_size=3),
    max_leaves=6,
)


def _paths(value, prefix=()):
    yield prefix
    children = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, child in children:
        yield from _paths(child, (*prefix, key))


@st.composite
def mutated_requests(draw):
    """A valid request of one endpoint with one to three members replaced by arbitrary JSON (or removed)."""
    path = draw(st.sampled_from(sorted(BASES)))
    body = json.loads(json.dumps(BASES[path]))
    for _ in range(draw(st.integers(1, 3))):
        paths = [p for p in _paths(body) if p]
        where = draw(st.sampled_from(paths))
        parent = body
        for key in where[:-1]:
            parent = parent[key]
        if draw(st.booleans()) and isinstance(parent, dict):
            del parent[where[-1]]
        else:
            parent[where[-1]] = draw(VALUES)
    if draw(st.booleans()):
        body["stream"] = True
    return path, body


def _check_answer(r: httpx.Response, path: str, body) -> None:
    assert r.status_code < 500, (path, body, r.text[:300])
    if r.status_code >= 400:
        assert_error_shape(r, path)
    elif isinstance(body, dict) and body.get("stream") is True:
        frames = sse_frames(r.text)
        assert all(event != "error" for event, _ in frames)
        last = frames[-1][1]
        # an answer cut inside a tool block ends with finish "error": response.failed (ds4_server.c)
        assert last == "[DONE]" or json.loads(last)["type"] in ("message_stop", "response.completed",
                                                               "response.incomplete", "response.failed")
    else:
        assert isinstance(r.json(), dict)


@pytest.fixture(scope="module")
def fuzz_client():
    engine = ScriptedEngine(ctx=100_000, reply=lambda req: ("r</think>" if req.thinking else "") + "ok" + CALL)
    with live_server(engine) as live, httpx.Client(base_url=live.url, timeout=20) as c:
        yield c


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(request=mutated_requests())
def test_fuzzed_requests_never_get_a_server_error(fuzz_client, request):
    """Any JSON in any field of any endpoint: a 4xx in the endpoint's shape or a complete answer, never a 5xx."""
    path, body = request
    # a lone surrogate goes out as its JSON escape: backslashreplace writes exactly `\udXXX` inside the string
    r = post_raw(fuzz_client, path, json.dumps(body, ensure_ascii=False).encode("utf-8", "backslashreplace"))
    _check_answer(r, path, body)


@settings(max_examples=60, deadline=None)
@given(path=st.sampled_from(sorted(BASES)), cut=st.integers(0, 400), junk=st.binary(max_size=8))
def test_truncated_or_corrupted_bodies_get_a_400(fuzz_client, path, cut, junk):
    """Malformed JSON (cut short, trailing bytes, invalid UTF-8) is a 400 in the endpoint's shape."""
    raw = json.dumps(BASES[path]).encode()
    body = raw[: cut % len(raw)] + junk
    r = post_raw(fuzz_client, path, body)
    if r.status_code != 200:
        assert_error_shape(r, path)


@pytest.mark.parametrize("path", sorted(BASES))
@pytest.mark.parametrize("depth", [255, 300, 5000])
def test_deep_nesting_is_refused_cleanly(fuzz_client, path, depth):
    """ds4_server.c: JSON nesting is limited to 256 levels; deeper is a 400, never a recursion error."""
    body = json.dumps(BASES[path])[:-1] + ',"extra":' + "[" * depth + "]" * depth + "}"
    r = post_raw(fuzz_client, path, body.encode())
    if depth + 1 > 256:
        assert_error_shape(r, path)
    else:
        _check_answer(r, path, BASES[path])


# ---------------------------------------------------------------------------------------------------------
# guards that hold today: GGUF fuzz


@pytest.fixture(scope="module")
def valid_gguf(tmp_path_factory) -> tuple[bytes, int]:
    spec = gguf_build.model_spec()
    path = gguf_build.write(spec, tmp_path_factory.mktemp("gguf") / "tiny.gguf")
    return path.read_bytes(), len(gguf_build.header_bytes(spec)[0])


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_corrupted_gguf_headers_fail_with_layout_errors(valid_gguf, tmp_path_factory, data):
    """Truncations anywhere in the header and random byte flips in it give a GGUFError or LayoutError (or a
    file that still validates), never IndexError, struct.error, a numpy error or MemoryError."""
    raw, head = valid_gguf
    blob = bytearray(raw[:head])
    for _ in range(data.draw(st.integers(0, 4))):
        blob[data.draw(st.integers(0, head - 1))] = data.draw(st.integers(0, 255))
    keep = data.draw(st.one_of(st.just(len(raw)), st.integers(0, head)))
    path = Path(tmp_path_factory.mktemp("fuzz")) / "f.gguf"
    path.write_bytes((bytes(blob) + raw[head:])[:keep])
    try:
        open_weights(path).close()
    except (GGUFError, LayoutError):
        pass
