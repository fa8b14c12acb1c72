"""Requests in the exact shapes coding agents send, replayed against the real server over the tiny model (real
tokenizer): Claude Code 2.1 (/v1/messages?beta=true with system turns inside `messages`, adaptive thinking,
`context_management`, `output_config`, beta headers), opencode (chat completions with its tools and two system
messages) and Codex (Responses with developer and reasoning items). Each answer is checked for what the client
parses, and the reuse targets (an identical resend, a retry whose last message was edited) for their cached
tokens.
"""

from __future__ import annotations

import copy
import json

import httpx
import pytest

from ds4_mlx.chat import ThinkMode, render_chat
from ds4_mlx.engine import Engine
from ds4_mlx.model.factory import write_model
from ds4_mlx.model.weights import open_weights
from ds4_mlx.serve import anthropic
from ds4_mlx.serve.rawjson import parse_body
from ds4_mlx.tokenizer import Tokenizer
from serve_support import live_server, sse_frames

CTX = 8192
CLAUDE_HEADERS = {
    "anthropic-version": "2023-06-01",
    "anthropic-beta": "claude-code-20250219,interleaved-thinking-2025-05-14,context-management-2025-06-27,"
                      "fine-grained-tool-streaming-2025-05-14",
    "x-api-key": "sk-local",
    "user-agent": "claude-cli/2.1.3 (external, cli)",
    "x-app": "cli",
}
GUIDE = ("You are an interactive CLI tool that helps users with software engineering tasks. Use the instructions "
         "below and the tools available to you to assist the user.\n\n# Tone and style\nBe concise. ") * 12


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return write_model(tmp_path_factory.mktemp("clients") / "tiny.gguf", preset="tiny", vocab="real")


@pytest.fixture(scope="module")
def tokenizer(model_path) -> Tokenizer:
    return Tokenizer.from_gguf(open_weights(model_path).file.metadata)


@pytest.fixture(scope="module")
def http(model_path):
    with live_server(lambda: Engine.load(model_path, ctx=CTX)) as live, \
            httpx.Client(base_url=live.url, timeout=300) as client:
        yield client


def encode(body: dict) -> bytes:
    """The body's bytes as clients send them (compact JSON); the server shows tool schemas byte for byte."""
    return json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode()


def post(http: httpx.Client, url: str, body: dict, headers: dict | None = None) -> httpx.Response:
    return http.post(url, content=encode(body), headers={"content-type": "application/json", **(headers or {})})


def events(text: str) -> list[tuple[str | None, dict | str]]:
    """(event name, decoded data) of every SSE frame."""
    return [(name, data if data == "[DONE]" else json.loads(data)) for name, data in sse_frames(text)]


def claude_code_body(prompt: str) -> dict:
    """Claude Code 2.1's first request of a session: its billing header and prompt as system blocks, the user's
    message with a reminder, then system turns (environment, deferred tools, agents and skills) inside `messages`."""
    return {
        "model": "claude-sonnet-4-5-20250929",
        "max_tokens": 12,
        "stream": True,
        "system": [
            {"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.3; cc_entrypoint=cli"},
            {"type": "text", "text": "You are Claude Code, Anthropic's official CLI for Claude.",
             "cache_control": {"type": "ephemeral"}},
            {"type": "text", "text": GUIDE, "cache_control": {"type": "ephemeral"}},
        ],
        "messages": [
            {"role": "user", "content": [
                {"type": "text", "text": "<system-reminder>\nAs you answer the user's questions, you can use the "
                                         "following context: CLAUDE.md says run pytest.\n</system-reminder>"},
                {"type": "text", "text": prompt, "cache_control": {"type": "ephemeral"}},
            ]},
            {"role": "system", "content": "<env>\nWorking directory: /src/app\nIs directory a git repo: Yes\n"
                                          "Platform: darwin\nToday's date: 2026-12-01\n</env>"},
            {"role": "system", "content": [
                {"type": "text", "text": "Deferred tools available through ToolSearch: WebFetch, NotebookEdit."},
                {"type": "text", "text": "Available agents: general-purpose, Explore. Skills: none."},
            ]},
        ],
        "tools": [
            {"name": "Bash", "description": "Executes a bash command in a persistent shell session.",
             "input_schema": {"$schema": "http://json-schema.org/draft-07/schema#", "type": "object",
                              "properties": {"command": {"type": "string", "description": "The command"},
                                             "timeout": {"type": "number"}},
                              "required": ["command"], "additionalProperties": False}},
            {"name": "Read", "description": "Reads a file from the local filesystem.",
             "input_schema": {"type": "object", "properties": {"file_path": {"type": "string"}},
                              "required": ["file_path"]}},
        ],
        "tool_choice": {"type": "auto"},
        "metadata": {"user_id": "user_0f3a_account__session_9b1c"},
        "thinking": {"type": "adaptive"},
        "output_config": {"effort": "medium"},
        "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
    }


def last_message_start(tokenizer: Tokenizer, body: dict) -> int:
    """Where the rendered prompt's last user turn begins, in tokens."""
    request = anthropic.parse_messages(parse_body(encode(body)), ctx=CTX, default_model="x")
    ids = tokenizer.encode(render_chat(request.messages, tools=request.tools, think=request.options.think, ctx=CTX))
    return max(i for i, t in enumerate(ids) if t == tokenizer.user_id)


def check_claude_stream(text: str) -> dict:
    """The event sequence Claude Code parses: message_start, balanced content blocks, message_delta with usage,
    message_stop; every frame's event line names its type. Returns the final usage."""
    frames = events(text)
    assert all(name == data["type"] for name, data in frames)
    kinds = [data["type"] for _, data in frames]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    open_block = None
    for _, data in frames[1:-2]:
        if data["type"] == "content_block_start":
            assert open_block is None
            open_block = data["index"]
        elif data["type"] == "content_block_delta":
            assert data["index"] == open_block
        else:
            assert data["type"] == "content_block_stop" and data["index"] == open_block
            open_block = None
    assert open_block is None
    assert frames[-2][1]["delta"]["stop_reason"] in ("end_turn", "max_tokens", "tool_use")
    return frames[-2][1]["usage"]


def test_claude_code_session(http, tokenizer):
    body = claude_code_body("The test in tests/test_utils.py fails. Fix it.")
    url = "/v1/messages?beta=true"
    assert http.get("/v1/models", headers=CLAUDE_HEADERS).json()["data"][0]["type"] == "model"
    counted = post(http, "/v1/messages/count_tokens?beta=true", {k: body[k] for k in ("model", "system", "messages",
                                                                                     "tools")}, CLAUDE_HEADERS)
    assert counted.status_code == 200
    first = post(http, url, body, CLAUDE_HEADERS)
    assert first.status_code == 200 and first.headers["content-type"].startswith("text/event-stream")
    usage = check_claude_stream(first.text)
    prompt_tokens = usage["cache_read_input_tokens"] + usage["cache_creation_input_tokens"]
    assert prompt_tokens == counted.json()["input_tokens"] and usage["cache_read_input_tokens"] == 0

    # an identical resend (a retry after a timeout) reuses its whole prompt
    again = check_claude_stream(post(http, url, body, CLAUDE_HEADERS).text)
    assert again["cache_read_input_tokens"] >= 0.95 * prompt_tokens

    # Claude Code's retry appends a reminder to the last user message: everything before that message is reused
    edited = copy.deepcopy(body)
    edited["messages"][0]["content"].append({"type": "text", "text": "<system-reminder>The user opened "
                                             "tests/test_utils.py.</system-reminder>"})
    retry = check_claude_stream(post(http, url, edited, CLAUDE_HEADERS).text)
    assert retry["cache_read_input_tokens"] == last_message_start(tokenizer, edited)
    assert retry["cache_read_input_tokens"] == last_message_start(tokenizer, body) > 0.8 * prompt_tokens

    # the next turn: the model's tool call and its result, then a system turn appended after them
    turn = copy.deepcopy(body)
    turn["messages"] += [
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "Run the tests first.", "signature": "sig"},
            {"type": "tool_use", "id": "toolu_01", "name": "Bash", "input": {"command": "pytest -q"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_01",
                                      "content": "1 failed, 4 passed"}]},
        {"role": "system", "content": "<system-reminder>Todo list is empty.</system-reminder>"},
    ]
    answer = post(http, url, {**turn, "stream": False}, CLAUDE_HEADERS)
    assert answer.status_code == 200
    message = answer.json()
    assert message["type"] == "message" and message["role"] == "assistant" and message["content"]
    assert message["stop_reason"] in ("end_turn", "max_tokens")
    assert message["usage"]["cache_read_input_tokens"] > 0


def test_claude_code_compacts_on_the_overflow_it_recognises(http):
    body = claude_code_body("Summarise: " + "the build log line. " * 4000)
    r = post(http, "/v1/messages?beta=true", body, CLAUDE_HEADERS)
    assert r.status_code == 400
    error = r.json()
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    n, m = error["error"]["n_prompt_tokens"], CTX - 1
    assert error["error"]["message"] == f"prompt is too long: {n} tokens > {m} maximum" and n > m


def test_claude_code_unknown_role_is_refused_in_anthropics_words(http):
    body = claude_code_body("hi")
    body["messages"].insert(1, {"role": "tool", "content": "x"})
    r = post(http, "/v1/messages?beta=true", body, CLAUDE_HEADERS)
    assert r.status_code == 400
    assert r.json()["error"]["message"] == "messages.1.role: Input should be 'user', 'assistant' or 'system'"


OPENCODE_TOOLS = [
    {"type": "function", "function": {
        "name": "bash", "description": "Executes a given bash command in a persistent shell session.",
        "parameters": {"type": "object", "properties": {"command": {"type": "string"},
                                                        "timeout": {"type": "number"},
                                                        "description": {"type": "string"}},
                       "required": ["command", "description"], "additionalProperties": False,
                       "$schema": "http://json-schema.org/draft-07/schema#"}}},
    {"type": "function", "function": {
        "name": "read", "description": "Reads a file from the local filesystem.",
        "parameters": {"type": "object", "properties": {"filePath": {"type": "string"}, "offset": {"type": "number"},
                                                        "limit": {"type": "number"}},
                       "required": ["filePath"], "additionalProperties": False}}},
]


def test_opencode_chat_completions_with_tools(http):
    body = {
        "model": "deepseek-v4-flash",
        "max_tokens": 10,
        "temperature": None,
        "top_p": None,
        "messages": [
            {"role": "system", "content": "You are opencode, an interactive CLI agent."},
            {"role": "system", "content": "Here is some useful information about the environment you are running "
                                          "in:\n<env>\n  Working directory: /src/app\n</env>"},
            {"role": "user", "content": [{"type": "text", "text": "add a --verbose flag"}]},
            {"role": "assistant", "content": "", "tool_calls": [
                {"id": "call_1", "type": "function",
                 "function": {"name": "read", "arguments": "{\"filePath\":\"/src/app/cli.py\"}"}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "import argparse\n"},
        ],
        "tools": OPENCODE_TOOLS,
        "tool_choice": "auto",
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    r = post(http, "/v1/chat/completions", body)
    assert r.status_code == 200
    frames = [data for _, data in events(r.text)]
    assert frames[-1] == "[DONE]"
    chunks = frames[:-1]
    assert all(c["object"] == "chat.completion.chunk" and c["id"] == chunks[0]["id"] for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant"}
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    usage = chunks[-1]["usage"]
    assert chunks[-1]["choices"] == [] and usage["completion_tokens"] == 10
    # thinking is on for this model name: the answer so far is all reasoning
    assert usage["completion_tokens_details"]["reasoning_tokens"] == 10

    # the same request again: everything is reused
    again = [data for _, data in events(post(http, "/v1/chat/completions", body).text)][-2]["usage"]
    assert again["prompt_tokens_details"]["cached_tokens"] == again["prompt_tokens"] == usage["prompt_tokens"]
    refused = post(http, "/v1/chat/completions", {**body, "n": 2})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "n"


def test_codex_responses_with_reasoning_items(http):
    body = {
        "model": "gpt-5-codex",
        "instructions": "You are Codex, based on GPT-5. You are running as a coding agent in the Codex CLI.",
        "input": [
            {"type": "message", "role": "developer", "content": [
                {"type": "input_text", "text": "<permissions instructions>Sandbox: workspace-write.</permissions "
                                               "instructions>"}]},
            {"type": "message", "role": "user", "content": [
                {"type": "input_text", "text": "<environment_context>\n  <cwd>/src/app</cwd>\n"
                                               "</environment_context>"}]},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "run the tests"}]},
            {"type": "reasoning", "id": "rs_0", "summary": [{"type": "summary_text", "text": "**Running tests**"}],
             "content": None, "encrypted_content": None},
            {"type": "function_call", "id": "fc_0", "name": "shell", "call_id": "call_0",
             "arguments": "{\"command\":[\"pytest\",\"-q\"],\"workdir\":\"/src/app\"}"},
            {"type": "function_call_output", "call_id": "call_0", "output": "{\"output\":\"4 passed\","
                                                                             "\"metadata\":{\"exit_code\":0}}"},
        ],
        "tools": [{"type": "function", "name": "shell", "description": "Runs a shell command.", "strict": False,
                   "parameters": {"type": "object", "properties": {"command": {"type": "array",
                                                                               "items": {"type": "string"}},
                                                                   "workdir": {"type": "string"}},
                                  "required": ["command"], "additionalProperties": False}}],
        "tool_choice": "auto",
        "parallel_tool_calls": False,
        "reasoning": {"effort": "medium", "summary": "auto"},
        "store": False,
        "stream": True,
        "include": ["reasoning.encrypted_content"],
        "prompt_cache_key": "0199a0b4-5c1e-7d52-a4e4-3a9c1f0e6b21",
        "max_output_tokens": 10,
    }
    r = post(http, "/v1/responses", body)
    assert r.status_code == 200
    frames = events(r.text)
    assert all(name == data["type"] for name, data in frames)  # Codex dispatches on the event line
    assert [data["sequence_number"] for _, data in frames] == list(range(len(frames)))
    created = frames[0][1]["response"]
    assert frames[0][0] == "response.created" and created["status"] == "in_progress"
    assert created["tools"] == body["tools"] and created["reasoning"] == {"effort": "medium", "summary": "auto"}
    assert created["instructions"] == body["instructions"] and created["usage"] is None
    final = frames[-1][1]["response"]
    assert frames[-1][0] == "response.incomplete" and final["incomplete_details"] == {"reason": "max_output_tokens"}
    assert set(created) == set(final)
    usage = final["usage"]
    assert usage["output_tokens"] == 10 and usage["output_tokens_details"]["reasoning_tokens"] == 10
    assert usage["input_tokens_details"]["cached_tokens"] == 0

    resent = post(http, "/v1/responses", {**body, "stream": False}).json()
    assert resent["status"] == "incomplete"
    assert resent["usage"]["input_tokens_details"]["cached_tokens"] == resent["usage"]["input_tokens"]


def test_claude_codes_own_switch_turns_thinking_off():
    """Claude Code sends `thinking: {"type": "adaptive"}` while its thinking is on; CLAUDE_CODE_DISABLE_THINKING=1
    leaves the field out (its effort stays). docs/server.md's rule for /v1/messages makes each do what it says."""
    body = claude_code_body("The test in tests/test_utils.py fails. Fix it.")
    on = anthropic.parse_messages(parse_body(encode(body)), ctx=CTX, default_model="x")
    assert on.options.think.thinking  # at the tier its effort asks for
    switched_off = {k: v for k, v in body.items() if k != "thinking"}
    off = anthropic.parse_messages(parse_body(encode(switched_off)), ctx=CTX, default_model="x")
    assert off.options.think is ThinkMode.NONE
    disabled = {**body, "thinking": {"type": "disabled"}}  # MAX_THINKING_TOKENS=0
    assert anthropic.parse_messages(parse_body(encode(disabled)), ctx=CTX, default_model="x").options.think \
        is ThinkMode.NONE
