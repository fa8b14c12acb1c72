"""The pure wire translations: request bodies → normalized requests, events → JSON bodies and SSE frames.

Expected bytes are written out from ds4_server.c (ds4's captured shapes); where this server
deliberately differs (Anthropic error shape, usage in message_delta) the test says so.
"""

import json

import pytest

from ds4_mlx import dsml
from ds4_mlx.chat import (
    BOS,
    EOS,
    TOOLS_EPILOGUE,
    TOOLS_PREAMBLE,
    Message,
    ThinkMode,
    ToolCallSpec,
    render_chat,
)
from ds4_mlx.errors import RequestError
from ds4_mlx.events import (
    Done,
    ParsedMessage,
    PromptAccepted,
    ReasoningDelta,
    TextDelta,
    ToolCall,
    ToolCallArgsDelta,
    ToolCallEnd,
    ToolCallStart,
    Usage,
)
from ds4_mlx.sampling import SamplingParams
from ds4_mlx.serve import anthropic, openai
from ds4_mlx.serve.common import ApiError, CallIds, ChatRequest, CompletionRequest, Options, context_overflow
from ds4_mlx.serve.rawjson import parse_body

CTX = 32768
MODEL = "deepseek-v4-flash"


def chat(body: dict, ctx: int = CTX):
    return openai.parse_chat(parse_body(json.dumps(body).encode()), ctx=ctx, default_model=MODEL)


def messages(body: dict, ctx: int = CTX):
    return anthropic.parse_messages(parse_body(json.dumps(body).encode()), ctx=ctx, default_model=MODEL)


USER = [{"role": "user", "content": "hi"}]

# ---------------------------------------------------------------------------------------------------------
# OpenAI requests


def test_openai_fields_sent_as_null_are_not_set():
    """OpenAI's API takes null for an optional field; clients (and the SDKs' dict bodies) send them."""
    nulls = {k: None for k in ("model", "temperature", "top_p", "seed", "stream", "max_tokens",
                               "max_completion_tokens", "presence_penalty", "frequency_penalty", "stop",
                               "stream_options", "n", "tools", "tool_choice", "reasoning_effort", "think")}
    req = chat({"messages": USER, **nulls})
    assert req.options == chat({"messages": USER}).options
    assert req.options.model == MODEL and req.options.max_tokens is None and not req.options.stream
    assert chat({"messages": USER, "n": 1}).options == req.options


@pytest.mark.parametrize(
    "tool, path",
    [
        ({"type": "function", "function": {"description": "x"}}, "tools[0].function.name"),
        ({"type": "function", "name": "ls"}, "tools[0].function.name"),  # the Responses shape sent to chat
        ({"description": "x", "input_schema": {}}, "tools[0].name"),  # Anthropic's shape
    ],
)
def test_tool_errors_name_the_clients_field(tool, path):
    with pytest.raises(ApiError) as e:
        chat({"messages": USER, "tools": [tool]})
    assert e.value.param == path and f"{path} must be a non-empty string" in e.value.message
    with pytest.raises(ApiError) as e:
        chat({"messages": [{"role": "user", "content": 5}]})
    assert e.value.param == "messages[0].content"


def test_n_other_than_one_is_refused_naming_n():
    with pytest.raises(ApiError) as e:
        chat({"messages": USER, "n": 3})
    assert (e.value.status, e.value.param, e.value.code) == (400, "n", "invalid_value")


def test_chat_messages_are_normalized():
    req = chat({"messages": [
        {"role": "system", "content": "S"},
        {"role": "user", "content": ["a", {"type": "text", "text": "b"}, {"type": "image_url", "image_url": {}}]},
        {"role": "assistant", "content": None, "reasoning_content": [{"text": "r"}],
         "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "ls", "arguments": "{\"a\":1}"}},
                        {"id": "call_2", "function": {"name": "no_args"}},
                        {"id": "call_3", "function": {"arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "out", "name": "ignored"},
        {"content": "role defaults to user"},
    ]})
    assert req.messages == (
        Message("system", "S"),
        Message("user", "ab"),
        Message("assistant", "", "r", (ToolCallSpec("call_1", "ls", '{"a":1}'),)),
        Message("tool", "out", tool_call_id="call_1"),
        Message("user", "role defaults to user"),
    )
    assert req.options.model == MODEL and req.tools == ()


def test_chat_tool_arguments_may_be_an_object():
    req = chat({"messages": [{"role": "assistant", "tool_calls": [
        {"id": "c", "function": {"name": "f", "arguments": {"b": 1, "a": [2]}}}]}]})
    assert req.messages[0].tool_calls[0].arguments == {"b": 1, "a": [2]}


def test_chat_tools_keep_raw_bytes_and_tool_choice_none_drops_them():
    function = '{"name": "bash",\n "parameters": {"type": "object"}}'
    text = f'{{"messages":[{{"role":"user","content":"x"}}],"tools":[{{"type":"function","function":{function}}}]}}'
    body = parse_body(text.encode())
    assert openai.parse_chat(body, ctx=CTX, default_model=MODEL).tools == (function,)
    body.value["tool_choice"] = "none"
    assert openai.parse_chat(body, ctx=CTX, default_model=MODEL).tools == ()
    body.value["tool_choice"] = "required"  # treated as auto, as in ds4
    assert openai.parse_chat(body, ctx=CTX, default_model=MODEL).tools == (function,)


def test_worked_example_renders_byte_for_byte():
    """ds4_server.c: the request normalized by the server and rendered gives the documented prompt."""
    tool = ('{"name":"bash","description":"Run a shell command","parameters":{"type":"object","properties":'
            '{"command":{"type":"string"},"timeout":{"type":"number"}},"required":["command"]}}')
    body = (
        '{"messages":[\n {"role":"system","content":"You are a coding agent."},\n'
        ' {"role":"user","content":"How many files are in /tmp?"},\n'
        ' {"role":"assistant","content":"Let me check.","reasoning_content":"I should run ls.",\n'
        '  "tool_calls":[{"id":"call_abc","type":"function","function":{"name":"bash",\n'
        '   "arguments":"{\\"command\\":\\"ls /tmp | wc -l\\",\\"timeout\\": 10}"}}]},\n'
        ' {"role":"tool","tool_call_id":"call_abc","content":"42\\n"},\n'
        ' {"role":"assistant","content":"There are 42 entries.","reasoning_content":"Output says 42."},\n'
        ' {"role":"user","content":"Thanks. And in /var?"}],\n'
        f' "tools":[{{"type":"function","function":{tool}}}]}}'
    )
    req = openai.parse_chat(parse_body(body.encode()), ctx=CTX, default_model=MODEL)
    prompt = render_chat(req.messages, tools=req.tools, think=req.options.think, ctx=CTX)
    expected = (
        BOS + TOOLS_PREAMBLE + tool + TOOLS_EPILOGUE + "\n\nYou are a coding agent."
        "<｜User｜>How many files are in /tmp?<｜Assistant｜><think>I should run ls.</think>Let me check.\n\n"
        "<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"bash\">\n"
        "<｜DSML｜parameter name=\"command\" string=\"true\">ls /tmp | wc -l</｜DSML｜parameter>\n"
        "<｜DSML｜parameter name=\"timeout\" string=\"false\">10</｜DSML｜parameter>\n"
        "</｜DSML｜invoke>\n</｜DSML｜tool_calls>" + EOS + "<｜User｜><tool_result>42\n</tool_result>"
        "<｜Assistant｜><think>Output says 42.</think>There are 42 entries." + EOS +
        "<｜User｜>Thanks. And in /var?<｜Assistant｜><think>"
    )
    assert prompt == expected


@pytest.mark.parametrize(
    "fields, ctx, mode",
    [
        ({}, CTX, ThinkMode.LOW),
        ({"model": "deepseek-chat"}, CTX, ThinkMode.NONE),
        ({"model": "deepseek-reasoner"}, CTX, ThinkMode.LOW),
        ({"model": "deepseek-chat", "thinking": {"type": "enabled"}}, CTX, ThinkMode.LOW),
        ({"model": "deepseek-reasoner", "think": False}, CTX, ThinkMode.NONE),
        ({"think": False, "thinking": True}, CTX, ThinkMode.NONE),  # `think` is read first
        ({"thinking": True, "reasoning_effort": "none"}, CTX, ThinkMode.NONE),  # effort none always turns it off
        ({"thinking": {"type": "disabled", "budget_tokens": 1024}}, CTX, ThinkMode.NONE),
        ({"thinking": True}, CTX, ThinkMode.LOW),
        ({"thinking": {"type": "adaptive"}}, CTX, ThinkMode.LOW),
        ({"thinking": None, "reasoning_effort": None}, CTX, ThinkMode.LOW),
        ({"reasoning_effort": "none"}, CTX, ThinkMode.NONE),
        ({"reasoning_effort": "low"}, CTX, ThinkMode.LOW),
        ({"reasoning_effort": "xhigh"}, 393216, ThinkMode.HIGH),
        ({"reasoning_effort": "max"}, 393215, ThinkMode.HIGH),
        ({"reasoning_effort": "max"}, 393216, ThinkMode.MAX),
    ],
)
def test_chat_thinking_control(fields, ctx, mode):
    assert chat({"messages": USER, **fields}, ctx=ctx).options.think is mode


def test_sampling_knobs_apply_only_without_thinking():
    knobs = {"temperature": 0, "top_p": 0.5, "top_k": 7, "min_p": 0.1, "seed": 42,
             "presence_penalty": 0.5, "frequency_penalty": -0.5}
    off = chat({"messages": USER, "think": False, **knobs}).options.sampling
    assert off == SamplingParams(temperature=0.0, top_p=0.5, top_k=7, min_p=0.1, seed=42,
                                 presence_penalty=0.5, frequency_penalty=-0.5)
    on = chat({"messages": USER, **knobs}).options.sampling
    assert on == SamplingParams(seed=42)  # the seed still makes a thinking answer reproducible
    assert chat({"messages": USER, "seed": 0}).options.sampling.seed is None


@pytest.mark.parametrize(
    "knobs, sampling",
    [
        ({"temperature": -1}, SamplingParams(temperature=0)),
        ({"top_p": 0}, SamplingParams(top_k=1)),
        ({"top_p": -3, "top_k": 40}, SamplingParams(top_k=1)),
        ({"top_p": 7}, SamplingParams(top_p=1)),
        ({"min_p": -0.5}, SamplingParams(min_p=0)),
    ],
)
def test_sampling_knobs_outside_the_sampler_range_mean_what_they_mean_in_ds4(knobs, sampling):
    """ds4_server.c: ds4 takes any number; below 0 a temperature is greedy, a top_p of 0 or less keeps only
    the most likely token (its nucleus is complete at the first), above 1 keeps all; a negative min_p drops none."""
    assert chat({"messages": USER, "think": False, **knobs}).options.sampling == sampling


def test_negative_max_tokens_means_zero():
    """ds4_server.c: `max_tokens` negative → 0 (the answer is then empty, finish "length")."""
    assert chat({"messages": USER, "max_tokens": -5}).options.max_tokens == 0
    assert messages({"messages": USER, "max_tokens": -1}).options.max_tokens == 0


def test_chat_options():
    opts = chat({"messages": USER, "model": "anything", "stop": ["END", "", "STOP"], "max_tokens": 10,
                 "max_completion_tokens": 20, "stream": True, "stream_options": {"include_usage": True}}).options
    assert (opts.model, opts.stop, opts.max_tokens, opts.stream, opts.include_usage) == (
        "anything", ("END", "STOP"), 20, True, True)
    opts = chat({"messages": USER, "stop": "X", "max_tokens": 5.0, "stream_options": None}).options
    assert (opts.stop, opts.max_tokens, opts.stream, opts.include_usage) == (("X",), 5, False, False)


@pytest.mark.parametrize(
    "body, message",
    [
        ({}, "missing messages"),
        ({"messages": None}, "missing messages"),
        ({"messages": []}, "at least one message"),
        ({"messages": "hi"}, "messages must be an array, got a string"),
        ({"messages": ["hi"]}, "messages[0] must be an object"),
        ({"messages": [{"role": "robot", "content": "x"}]},
         "Invalid value: 'robot'. Supported values are: 'system', 'developer', 'user', 'assistant', 'tool', "
         "'function', and 'latest_reminder'."),
        ({"messages": [{"role": None, "content": "x"}]}, "messages[0].role must be a string, got null"),
        ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content must be a string"),
        ({"messages": [{"role": "user", "content": [5]}]}, "messages[0].content[0] must be a string or an object"),
        ({"messages": [{"role": "tool", "tool_call_id": None}]}, "messages[0].tool_call_id must be a string"),
        ({"messages": [{"role": "assistant", "tool_calls": {}}]}, "messages[0].tool_calls must be an array"),
        ({"messages": USER, "n": 2}, "n must be 1"),
        ({"messages": USER, "temperature": "1"}, "temperature must be a number or null, got a string"),
        ({"messages": USER, "top_k": 1.5}, "top_k must be an integer"),
        ({"messages": USER, "top_k": True}, "top_k must be an integer or null, got a boolean"),
        ({"messages": USER, "stream": "yes"}, "stream must be a boolean"),
        ({"messages": USER, "model": 5}, "model must be a string"),
        ({"messages": USER, "stop": [1]}, "stop must be a string or an array of strings"),
        ({"messages": USER, "stream_options": {"include_usage": 1}}, "stream_options.include_usage"),
        ({"messages": USER, "reasoning_effort": "banana"}, "unsupported reasoning effort 'banana'"),
        ({"messages": USER, "reasoning_effort": 3}, "reasoning effort must be a string"),
        ({"messages": USER, "think": "no"}, "think must be a boolean"),
        ({"messages": USER, "tools": [1]}, "tools[0] must be an object"),
        ({"messages": USER, "tools": [{"type": "function", "function": {"description": "x"}}]},
         "tools[0].function.name must be"),
        ({"messages": USER, "think": False, "min_p": 2}, "min_p must be a number in [0, 1]"),
    ],
)
def test_chat_request_errors_name_the_field(body, message):
    with pytest.raises(RequestError) as e:
        chat(body)
    assert message in str(e.value)


@pytest.mark.parametrize(
    "member, message",
    [
        ('"temperature":1e400', "temperature must be a finite number"),
        ('"top_p":1' + "0" * 400, "top_p must be a finite number"),
        ('"max_tokens":-1e400', "max_tokens must be an integer, got -inf"),
    ],
)
def test_numbers_beyond_the_float_range_are_refused(member, message):
    """JSON numbers have no range: 1e400 parses to inf and 10**400 to an int that no float can hold."""
    body = parse_body(b'{"messages":[{"role":"user","content":"x"}],"think":false,' + member.encode() + b"}")
    with pytest.raises(ApiError, match=message):
        openai.parse_chat(body, ctx=CTX, default_model=MODEL)


def test_completion_prompt():
    body = parse_body(b'{"prompt":["first","second"],"max_tokens":3}')
    req = openai.parse_completion(body, ctx=CTX, default_model=MODEL)
    assert req.prompt == "first" and req.options.max_tokens == 3 and req.options.think is ThinkMode.LOW
    for bad, message in [(b"{}", "missing prompt"), (b'{"prompt":5}', "prompt must be"),
                         (b'{"prompt":[1,2]}', "first element is a string")]:
        with pytest.raises(ApiError, match=message):
            openai.parse_completion(parse_body(bad), ctx=CTX, default_model=MODEL)


# ---------------------------------------------------------------------------------------------------------
# Anthropic requests


def test_anthropic_messages_are_normalized():
    req = messages({
        "system": [{"type": "text", "text": "x-anthropic-billing-header: cc"}, {"type": "text", "text": "A"},
                   "B"],
        "messages": [
            {"content": "hi", "role": "user"},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "hmm", "signature": "sig"},
                {"type": "text", "text": "Listing."},
                {"type": "tool_use", "id": "toolu_1", "name": "ls", "input": {"path": "/tmp", "all": True}},
                {"type": "tool_use", "id": "toolu_2", "name": "cat", "input": None}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": "a.c\nb.c"},
                {"type": "image", "source": {}},
                {"type": "text", "text": "thanks"},
                {"type": "tool_result", "tool_use_id": "toolu_2",
                 "content": [{"type": "text", "text": "x</tool_result>y"}, {"type": "image"}], "is_error": True}]},
        ],
    })
    assert req.messages == (
        Message("system", "A\nB"),
        Message("user", "hi"),
        Message("assistant", "Listing.", "hmm", (ToolCallSpec("toolu_1", "ls", {"path": "/tmp", "all": True}),
                                                 ToolCallSpec("toolu_2", "cat", {}))),
        Message("user", "<tool_result>a.c\nb.c</tool_result>thanks<tool_result>x&lt;/tool_result>y</tool_result>"),
    )
    prompt = render_chat(req.messages, think=req.options.think, ctx=CTX)
    assert "<｜User｜><tool_result>a.c\nb.c</tool_result>thanks<tool_result>" in prompt  # ds4_server.c


def test_anthropic_system_turns_inside_messages_render_in_place():
    """Claude Code 2.1 sends system turns inside `messages` (string or text blocks); the opening ones join the
    system region, later ones stay where they are, so the prompt of the turns before them does not change."""
    body = {"system": "Top.", "messages": [
        {"role": "system", "content": "Env block."},
        {"role": "user", "content": "hi"},
        {"role": "system", "content": [{"type": "text", "text": "Skills:"},
                                       {"type": "text", "text": "x-anthropic-hidden"},
                                       {"type": "text", "text": "none", "cache_control": {"type": "ephemeral"}}]},
    ]}
    req = messages(body)
    assert req.messages == (Message("system", "Top."), Message("system", "Env block."), Message("user", "hi"),
                            Message("system", "Skills:\nnone"))
    prompt = render_chat(req.messages, think=ThinkMode.NONE, ctx=CTX)
    assert prompt == BOS + "Top.\n\nEnv block.<｜User｜>hiSkills:\nnone<｜Assistant｜></think>"
    without = render_chat(messages({**body, "messages": body["messages"][:2]}).messages, think=ThinkMode.NONE,
                          ctx=CTX)
    assert prompt.startswith(without.removesuffix("<｜Assistant｜></think>"))


@pytest.mark.parametrize(
    "fields, mode",
    [
        ({}, ThinkMode.NONE),  # as in Anthropic's API: no `thinking`, no thinking
        ({"thinking": None}, ThinkMode.NONE),
        ({"thinking": {"type": "disabled"}}, ThinkMode.NONE),
        ({"thinking": {"type": "enabled", "budget_tokens": 2048}}, ThinkMode.LOW),
        ({"thinking": {"type": "adaptive"}}, ThinkMode.LOW),  # Claude Code, its thinking on
        ({"thinking": {"type": "adaptive"}, "output_config": {"effort": "max"}}, ThinkMode.HIGH),  # ctx < 393216
        ({"thinking": {"type": "adaptive"}, "output_config": {"effort": "none"}}, ThinkMode.NONE),
        ({"output_config": {"effort": "high"}}, ThinkMode.NONE),  # CLAUDE_CODE_DISABLE_THINKING=1: an effort alone
        ({"model": "deepseek-reasoner"}, ThinkMode.LOW),
        ({"model": "deepseek-chat", "thinking": {"type": "adaptive"}}, ThinkMode.LOW),
        ({"model": "deepseek-chat"}, ThinkMode.NONE),
        ({"reasoning_effort": "none", "output_config": {"effort": "high"}, "thinking": True}, ThinkMode.NONE),
    ],
)
def test_anthropic_thinking_control(fields, mode):
    """The rule of docs/server.md for /v1/messages: `thinking` (enabled and adaptive on, disabled off), else the
    model alias, else off; an effort sets the level only, and `none` turns thinking off."""
    assert messages({"messages": USER, **fields}).options.think is mode


def test_anthropic_options_and_tools():
    tool = '{"name":"ls","description":"List files","input_schema":{"type":"object","properties":{}}}'
    text = (f'{{"messages":[{{"role":"user","content":"x"}}],"tools":[{tool}],"max_tokens":64,'
            '"stop_sequences":["\\n\\nHuman:"],"temperature":0.2,"top_k":5,"min_p":0.9,"thinking":false}')
    req = anthropic.parse_messages(parse_body(text.encode()), ctx=CTX, default_model=MODEL)
    assert req.tools == (tool,)
    assert req.options.max_tokens == 64 and req.options.stop == ("\n\nHuman:",)
    assert req.options.sampling == SamplingParams(temperature=0.2, top_k=5)  # no min_p on this API
    body = parse_body(text.replace('"max_tokens":64', '"tool_choice":{"type":"none"}').encode())
    req = anthropic.parse_messages(body, ctx=CTX, default_model=MODEL)
    assert req.tools == () and req.options.max_tokens is None  # max_tokens is optional here


@pytest.mark.parametrize(
    "body, message",
    [
        ({}, "missing messages"),
        ({"messages": []}, "at least one message"),
        ({"messages": [{"role": "tool", "content": "x"}]},
         "messages.0.role: Input should be 'user', 'assistant' or 'system'"),
        ({"messages": [{"role": "system", "content": [{"type": "image"}]}]},
         'messages[0].content[0].type must be "text" in system content'),
        ({"messages": [{"role": "user", "content": [{"type": 1}]}]}, "messages[0].content[0].type"),
        ({"messages": [{"role": "assistant", "content": [{"type": "tool_use", "name": "f", "input": [1]}]}]},
         "messages[0].content[0].input must be an object"),
        ({"messages": USER, "system": 5}, "system must be"),
        ({"messages": USER, "stop_sequences": "x", "temperature": "hot"}, "temperature must be a number"),
        ({"messages": USER, "output_config": {"effort": "huge"}}, "unsupported reasoning effort"),
        ({"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_9"}]}]},
         "Anthropic continuation state is not available for tool_use_id toolu_9; retry by replaying the full "
         "messages history"),
    ],
)
def test_anthropic_request_errors(body, message):
    with pytest.raises(RequestError) as e:
        messages(body)
    assert message in str(e.value)


# ---------------------------------------------------------------------------------------------------------
# Error bodies


def test_error_shapes():
    plain = ApiError("invalid JSON request")
    assert openai.error_json(plain) == {"error": {"message": "invalid JSON request", "type": "invalid_request_error"}}
    assert anthropic.error_json(plain) == {"type": "error", "error": {"type": "invalid_request_error",
                                                                       "message": "invalid JSON request"}}
    overflow = context_overflow(40000, 32768, "messages")
    message = "Prompt has 40000 tokens, but the configured context size is 32768 tokens"
    assert openai.error_json(overflow) == {"error": {
        "message": message, "type": "invalid_request_error", "param": "messages", "code": "context_length_exceeded",
        "n_prompt_tokens": 40000, "n_ctx": 32768}}
    assert anthropic.error_json(overflow) == {"type": "error", "error": {
        "type": "invalid_request_error", "message": message, "n_prompt_tokens": 40000, "n_ctx": 32768}}
    assert openai.error_json(ApiError("x", 429))["error"]["type"] == "rate_limit_error"
    assert anthropic.error_json(ApiError("x", 429))["error"]["type"] == "rate_limit_error"
    assert anthropic.error_json(ApiError("x", 404))["error"]["type"] == "not_found_error"
    assert openai.error_json(ApiError("x", 500))["error"]["type"] == "server_error"
    assert anthropic.error_json(ApiError("x", 503))["error"]["type"] == "api_error"
    assert openai.stream_error("boom") == 'event: error\ndata: {"error":{"message":"boom","type":"server_error"}}\n\n'
    assert anthropic.stream_error("boom") == (
        'event: error\ndata: {"type":"error","error":{"type":"api_error","message":"boom"}}\n\n')


# ---------------------------------------------------------------------------------------------------------
# Responses: a captured example of ds4's server

ARGS = '{"command":"ls -la && echo \\"hi\\"","timeout":{"a":[1,2]}}'
DONE = Done(
    "tool_calls",
    ParsedMessage("The user wants files.", "Checking.", (ToolCall("bash", ARGS),),
                  raw_dsml="\n\n<｜DSML｜tool_calls>…"),
    Usage(prompt_tokens=120, cached_tokens=100, completion_tokens=60),
)
EVENTS = [
    ReasoningDelta("The user wants files."),
    TextDelta("Checking."),
    ToolCallStart(0, "bash"),
    *(ToolCallArgsDelta(0, t) for t in ["{", '"command":"', 'ls -la && echo \\"hi\\"', '"', ',"timeout":',
                                        '{ "a": [1, 2] }', "}"]),
    ToolCallEnd(0),
]


def request(include_usage: bool = False) -> ChatRequest:
    """What the translators read of a request: the model name they echo, and include_usage."""
    return ChatRequest(Options(MODEL, ThinkMode.HIGH, SamplingParams(), include_usage=include_usage), ())


def ids(prefix: str, *values: str) -> CallIds:
    call_ids = CallIds(prefix)
    call_ids.ids = list(values)
    return call_ids


def test_chat_completion_body_is_the_captured_one():
    body = openai.chat_completion("chatcmpl-7", 1795954088, request(), DONE,
                                  ids("call_", "call_9e32de3c21531eda6c5767a41ee09d5c"))
    assert json.dumps(body, ensure_ascii=False, separators=(",", ":")) == (
        '{"id":"chatcmpl-7","object":"chat.completion","created":1795954088,"model":"deepseek-v4-flash",'
        '"choices":[{"index":0,"message":{"role":"assistant","content":"Checking.","reasoning_content":'
        '"The user wants files.","tool_calls":[{"id":"call_9e32de3c21531eda6c5767a41ee09d5c","type":"function",'
        '"function":{"name":"bash","arguments":"{\\"command\\":\\"ls -la && echo \\\\\\"hi\\\\\\"\\",\\"timeout\\":'
        '{\\"a\\":[1,2]}}"}}]},"finish_reason":"tool_calls"}],"usage":{"prompt_tokens":120,"completion_tokens":60,'
        '"total_tokens":180,"prompt_tokens_details":{"cached_tokens":100,"cache_write_tokens":20},'
        '"completion_tokens_details":{"reasoning_tokens":0}}}'
    )


def test_chat_completion_without_reasoning_or_tools_omits_them():
    done = Done("stop", ParsedMessage("", ""), Usage(5, 0, 1))
    message = openai.chat_completion("c", 1, request(), done, CallIds("call_"))["choices"][0]["message"]
    assert message == {"role": "assistant", "content": ""}


def test_unclosed_reasoning_is_content_in_a_non_streaming_chat_answer():
    """ds4_server.c quirk: output cut inside <think> is reported as content (streaming keeps it reasoning)."""
    done = Done("length", ParsedMessage("still thinking", "", reasoning_closed=False), Usage(5, 0, 3))
    message = openai.chat_completion("c", 1, request(), done, CallIds("call_"))["choices"][0]["message"]
    assert message == {"role": "assistant", "content": "still thinking"}
    stream = openai.ChatStream("c", 1, request(), CallIds("call_"))
    assert json.loads(stream.event(ReasoningDelta("still"))[0][6:])["choices"][0]["delta"] == {
        "reasoning_content": "still"}


def test_chat_stream_frames_are_the_captured_sequence():
    stream = openai.ChatStream("chatcmpl-7", 1795954088, request(include_usage=True), ids("call_", "call_" + "a" * 32))
    frames = stream.start() + [f for e in EVENTS for f in stream.event(e)] + stream.done(DONE)
    head = '{"id":"chatcmpl-7","object":"chat.completion.chunk","created":1795954088,"model":"deepseek-v4-flash",'

    def chunk(delta: str, finish: str = "null") -> str:
        return f'data: {head}"choices":[{{"index":0,"delta":{delta},"finish_reason":{finish}}}]}}\n\n'

    def args(text: str) -> str:
        return chunk('{"tool_calls":[{"index":0,"function":{"arguments":' + json.dumps(text) + "}}]}")

    assert frames == [
        chunk('{"role":"assistant"}'),
        chunk('{"reasoning_content":"The user wants files."}'),
        chunk('{"content":"Checking."}'),
        chunk('{"tool_calls":[{"index":0,"id":"call_' + "a" * 32
              + '","type":"function","function":{"name":"bash","arguments":""}}]}'),
        args("{"), args('"command":"'), args('ls -la && echo \\"hi\\"'), args('"'), args(',"timeout":'),
        args('{ "a": [1, 2] }'), args("}"),
        chunk("{}", '"tool_calls"'),
        f'data: {head}"choices":[],"usage":{{"prompt_tokens":120,"completion_tokens":60,"total_tokens":180,'
        '"prompt_tokens_details":{"cached_tokens":100,"cache_write_tokens":20},'
        '"completion_tokens_details":{"reasoning_tokens":0}}}\n\n',
        "data: [DONE]\n\n",
    ]
    streamed = "".join(json.loads(f[6:])["choices"][0]["delta"]["tool_calls"][0]["function"]["arguments"]
                       for f in frames[4:11])
    assert json.loads(streamed) == json.loads(ARGS)


def test_chat_stream_sends_unstreamed_calls_in_one_chunk_and_no_usage_unless_asked():
    stream = openai.ChatStream("c", 1, request(), ids("call_", "call_x", "call_y"))
    done = Done("tool_calls", ParsedMessage("", "", (ToolCall("a", '{"x": 1}'), ToolCall("b", "{}"))), Usage(3, 0, 2))
    frames = stream.done(done)
    assert [json.loads(f[6:]) for f in frames[:-1]] == [
        {"id": "c", "object": "chat.completion.chunk", "created": 1, "model": MODEL, "choices": [{"index": 0, "delta": {
            "tool_calls": [
                {"index": 0, "id": "call_x", "type": "function", "function": {"name": "a", "arguments": '{"x":1}'}},
                {"index": 1, "id": "call_y", "type": "function", "function": {"name": "b", "arguments": "{}"}}]},
            "finish_reason": None}]},
        {"id": "c", "object": "chat.completion.chunk", "created": 1, "model": MODEL,
         "choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]},
    ]
    assert frames[-1] == "data: [DONE]\n\n"


def test_completion_stream_and_body():
    completion = CompletionRequest(request().options, "p")
    stream = openai.CompletionStream("cmpl-1", 2, completion, CallIds("call_"))
    done = Done("length", ParsedMessage("", "ab"), Usage(4, 1, 2))
    frames = stream.start() + stream.event(TextDelta("a</think>")) + stream.event(TextDelta("b")) + stream.done(done)
    head = '{"id":"cmpl-1","object":"text_completion","created":2,"model":"deepseek-v4-flash",'
    assert frames == [
        f'data: {head}"choices":[{{"text":"a</think>","index":0,"finish_reason":null}}]}}\n\n',
        f'data: {head}"choices":[{{"text":"b","index":0,"finish_reason":null}}]}}\n\n',
        f'data: {head}"choices":[{{"text":"","index":0,"finish_reason":"length"}}]}}\n\n',
        "data: [DONE]\n\n",
    ]
    assert openai.completion("cmpl-1", 2, completion, done, CallIds("call_"), "a</think>b")["choices"] == [
        {"text": "a</think>b", "index": 0, "finish_reason": "length"}]


def test_anthropic_message_body_is_the_captured_one():
    body = anthropic.message("chatcmpl-8", 0, request(), DONE, ids("toolu_", "toolu_42907c0712b542fbd42f945a4b1cf40c"))
    assert json.dumps(body, ensure_ascii=False, separators=(",", ":")) == (
        '{"id":"chatcmpl-8","type":"message","role":"assistant","model":"deepseek-v4-flash","content":[{"type":'
        '"thinking","thinking":"The user wants files.","signature":"chatcmpl-8"},{"type":"text","text":"Checking."},'
        '{"type":"tool_use","id":"toolu_42907c0712b542fbd42f945a4b1cf40c","name":"bash","input":{"command":'
        '"ls -la && echo \\"hi\\"","timeout":{"a":[1,2]}}}],"stop_reason":"tool_use","stop_sequence":null,'
        '"usage":{"input_tokens":0,"output_tokens":60,"cache_read_input_tokens":100,"cache_creation_input_tokens":20}}'
    )


@pytest.mark.parametrize(
    "finish, parsed, content, stop_reason",
    [
        ("stop", ParsedMessage("r", ""), [{"type": "thinking", "thinking": "r", "signature": "m"},
                                          {"type": "text", "text": ""}], "end_turn"),
        ("length", ParsedMessage("", ""), [{"type": "text", "text": ""}], "max_tokens"),
        ("error", ParsedMessage("", "x"), [{"type": "text", "text": "x"}], "end_turn"),
    ],
)
def test_anthropic_message_edge_shapes(finish, parsed, content, stop_reason):
    body = anthropic.message("m", 0, request(), Done(finish, parsed, Usage(1, 0, 1)), CallIds("toolu_"))
    assert body["content"] == content and body["stop_reason"] == stop_reason


def test_anthropic_stream_is_the_captured_sequence():
    stream = anthropic.MessageStream("chatcmpl-8", 0, request(), ids("toolu_", "toolu_" + "b" * 32))
    frames = stream.start(PromptAccepted(120, 100)) + [f for e in EVENTS for f in stream.event(e)] + stream.done(DONE)

    def event(name: str, data: str) -> str:
        return f"event: {name}\ndata: {data}\n\n"

    def delta(index: int, body: str) -> str:
        return event("content_block_delta", f'{{"type":"content_block_delta","index":{index},"delta":{body}}}')

    def args(text: str) -> str:
        return delta(2, '{"type":"input_json_delta","partial_json":' + json.dumps(text) + "}")

    assert frames == [
        event("message_start", '{"type":"message_start","message":{"id":"chatcmpl-8","type":"message","role":'
              '"assistant","model":"deepseek-v4-flash","content":[],"stop_reason":null,"stop_sequence":null,'
              '"usage":{"input_tokens":0,"output_tokens":0,"cache_read_input_tokens":100,'
              '"cache_creation_input_tokens":20}}}'),
        event("content_block_start", '{"type":"content_block_start","index":0,"content_block":{"type":"thinking",'
              '"thinking":"","signature":""}}'),
        delta(0, '{"type":"thinking_delta","thinking":"The user wants files."}'),
        delta(0, '{"type":"signature_delta","signature":"chatcmpl-8"}'),
        event("content_block_stop", '{"type":"content_block_stop","index":0}'),
        event("content_block_start", '{"type":"content_block_start","index":1,"content_block":{"type":"text",'
              '"text":""}}'),
        delta(1, '{"type":"text_delta","text":"Checking."}'),
        event("content_block_stop", '{"type":"content_block_stop","index":1}'),
        event("content_block_start", '{"type":"content_block_start","index":2,"content_block":{"type":"tool_use",'
              '"id":"toolu_' + "b" * 32 + '","name":"bash","input":{}}}'),
        args("{"), args('"command":"'), args('ls -la && echo \\"hi\\"'), args('"'), args(',"timeout":'),
        args('{ "a": [1, 2] }'), args("}"),
        event("content_block_stop", '{"type":"content_block_stop","index":2}'),
        # ds4 sends only output_tokens here; the full usage is what Anthropic's API sends today.
        event("message_delta", '{"type":"message_delta","delta":{"stop_reason":"tool_use","stop_sequence":null},'
              '"usage":{"input_tokens":0,"output_tokens":60,"cache_read_input_tokens":100,'
              '"cache_creation_input_tokens":20}}'),
        event("message_stop", '{"type":"message_stop"}'),
    ]


def test_anthropic_stream_endings():
    def run(events, done):
        stream = anthropic.MessageStream("m", 0, request(), ids("toolu_", "toolu_z"))
        frames = stream.start() + [f for e in events for f in stream.event(e)] + stream.done(done)
        return [json.loads(f.split("data: ", 1)[1]) for f in frames]

    # thinking only: the block closes with its signature, then an empty text block
    out = run([ReasoningDelta("r")], Done("length", ParsedMessage("r", ""), Usage(1, 0, 1)))
    assert [(d["type"], d.get("delta", d.get("content_block", {})).get("type")) for d in out] == [
        ("message_start", None), ("content_block_start", "thinking"), ("content_block_delta", "thinking_delta"),
        ("content_block_delta", "signature_delta"), ("content_block_stop", None),
        ("content_block_start", "text"), ("content_block_stop", None),
        ("message_delta", None), ("message_stop", None)]
    assert out[-2]["delta"]["stop_reason"] == "max_tokens"
    # a call parsed only at the end is sent whole
    out = run([TextDelta("t")], Done("tool_calls", ParsedMessage("", "t", (ToolCall("f", '{"a": 1}'),)),
                                     Usage(1, 0, 1)))
    assert out[4]["content_block"] == {"type": "tool_use", "id": "toolu_z", "name": "f", "input": {}}
    assert out[5]["delta"] == {"type": "input_json_delta", "partial_json": '{"a":1}'}
    assert out[6] == {"type": "content_block_stop", "index": 1}


def test_streams_from_the_real_parser_keep_the_documented_order():
    """Generated text → dsml.StreamParser events → frames: no DSML leaks and ds4's event orders hold."""
    text = ("The user wants files.</think>I will inspect the files.\n\n<｜DSML｜tool_calls>\n"
            '<｜DSML｜invoke name="bash">\n<｜DSML｜parameter name="command" string="true">echo partial done'
            "</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>")
    parser = dsml.StreamParser(thinking=True, tools_active=True)
    events = [e for i in range(0, len(text), 5) for e in parser.feed(text[i:i + 5])] + parser.finish()
    message = dsml.parse_message(text, thinking=True, tools_active=True)
    done = Done("tool_calls", message, Usage(10, 0, 20))

    chat_stream = openai.ChatStream("c", 1, request(), CallIds("call_"))
    chat_frames = chat_stream.start() + [f for e in events for f in chat_stream.event(e)] + chat_stream.done(done)
    deltas = [json.loads(f[6:])["choices"][0]["delta"] for f in chat_frames[:-1]]
    kinds = [next(iter(d), "finish") for d in deltas]
    assert kinds == sorted(kinds, key=["role", "reasoning_content", "content", "tool_calls", "finish"].index)
    assert "".join(d.get("content", "") for d in deltas) == "I will inspect the files."
    assert "DSML" not in "".join(chat_frames[:-2]).replace('"arguments"', "")
    call_ids = {c["id"] for d in deltas for c in d.get("tool_calls", []) if "id" in c}
    assert len(call_ids) == 1 and call_ids.pop().startswith("call_")
    arguments = "".join(c["function"]["arguments"] for d in deltas for c in d.get("tool_calls", []))
    assert json.loads(arguments) == {"command": "echo partial done"}

    stream = anthropic.MessageStream("m", 0, request(), CallIds("toolu_"))
    frames = stream.start() + [f for e in events for f in stream.event(e)] + stream.done(done)
    names = [f.split("\n", 1)[0][len("event: "):] for f in frames]
    data = [json.loads(f.split("data: ", 1)[1]) for f in frames]
    blocks = [d["content_block"]["type"] for d in data if d["type"] == "content_block_start"]
    assert blocks == ["thinking", "text", "tool_use"]
    assert names[0] == "message_start" and names[-1] == "message_stop" and "ping" not in names
    assert "DSML" not in "".join(frames)
    partial = "".join(d["delta"].get("partial_json", "") for d in data if d["type"] == "content_block_delta")
    assert json.loads(partial) == {"command": "echo partial done"}
