"""The official `openai` and `anthropic` SDKs against a live server with the engine over a scripted model.

The scripted model makes tool calls and reasoning happen on demand (the tiny random model never writes a
tool call); test_serve_live.py runs the same SDKs against the tiny model.
"""

from __future__ import annotations

import anthropic
import openai
import pytest

from ds4_mlx.chat import EOS
from serve_support import MODEL, ScriptedEngine, live_server

TOOL_TEXT = ('\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="list_files">\n<｜DSML｜parameter name="path" '
             'string="true">/tmp & "x"</｜DSML｜parameter>\n<｜DSML｜parameter name="depth" string="false">2'
             "</｜DSML｜parameter>\n</｜DSML｜invoke>\n<｜DSML｜invoke name=\"read\">\n<｜DSML｜parameter "
             'name="name" string="true">a.c</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>')
OPENAI_TOOLS = [
    {"type": "function", "function": {"name": "list_files", "description": "List files",
                                      "parameters": {"type": "object", "properties": {"path": {"type": "string"}}}}},
    {"type": "function", "function": {"name": "read", "parameters": {"type": "object"}}},
]
ANTHROPIC_TOOLS = [
    {"name": "list_files", "description": "List files", "input_schema": {"type": "object"}},
    {"name": "read", "input_schema": {"type": "object"}},
]


def reply(req) -> str:
    reasoning = "Thinking hard.</think>" if req.thinking else ""
    if req.tools_active:
        return reasoning + "Let me look." + TOOL_TEXT
    return reasoning + "Plain answer."


@pytest.fixture(scope="module")
def live():
    engine = ScriptedEngine(reply=reply)
    with live_server(engine, max_queue=0) as live:
        yield live


@pytest.fixture(scope="module")
def oai(live):
    return openai.OpenAI(base_url=live.url + "/v1", api_key="dsv4-local", max_retries=0)


@pytest.fixture(scope="module")
def claude(live):
    return anthropic.Anthropic(base_url=live.url, api_key="dsv4-local", max_retries=0)


USER = [{"role": "user", "content": "hi"}]

# ---------------------------------------------------------------------------------------------------------
# openai


def test_openai_plain_and_thinking(oai):
    r = oai.chat.completions.create(model=MODEL, messages=USER)
    assert r.choices[0].message.content == "Plain answer."
    assert r.choices[0].message.reasoning_content == "Thinking hard."
    assert r.choices[0].finish_reason == "stop" and r.model == MODEL and r.id.startswith("chatcmpl-")
    r = oai.chat.completions.create(model="deepseek-chat", messages=USER)
    assert r.choices[0].message.content == "Plain answer."
    assert getattr(r.choices[0].message, "reasoning_content", None) is None
    r = oai.chat.completions.create(model="deepseek-chat", messages=USER, extra_body={"thinking": {"type": "enabled"}})
    assert r.choices[0].message.reasoning_content == "Thinking hard."
    r = oai.chat.completions.create(model=MODEL, messages=USER, reasoning_effort="none")
    assert r.model_extra == {} and r.choices[0].message.content == "Plain answer."


def test_openai_usage(oai, live):
    messages = [{"role": "user", "content": "count me"}]
    r = oai.chat.completions.create(model="deepseek-chat", messages=messages)
    tokenizer = live.worker.engine.tokenizer
    assert r.usage.prompt_tokens > 0 and r.usage.completion_tokens == len(tokenizer.encode("Plain answer."))
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert r.usage.prompt_tokens_details.cached_tokens < r.usage.prompt_tokens
    # the next turn extends the live session, which holds the prompt and the answer
    messages += [{"role": "assistant", "content": "Plain answer."}, {"role": "user", "content": "again"}]
    again = oai.chat.completions.create(model="deepseek-chat", messages=messages)
    assert again.usage.prompt_tokens_details.cached_tokens == r.usage.total_tokens


def test_openai_streaming(oai):
    chunks = list(oai.chat.completions.create(model=MODEL, messages=USER, stream=True,
                                              stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    reasoning = "".join(getattr(c.choices[0].delta, "reasoning_content", None) or "" for c in chunks if c.choices)
    assert (reasoning, content) == ("Thinking hard.", "Plain answer.")
    assert chunks[-2].choices[0].finish_reason == "stop"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens > 0
    no_usage = list(oai.chat.completions.create(model=MODEL, messages=USER, stream=True))
    assert all(c.usage is None for c in no_usage)


def test_openai_tool_calls(oai):
    r = oai.chat.completions.create(model=MODEL, messages=USER, tools=OPENAI_TOOLS)
    message = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls" and message.content == "Let me look."
    assert [(c.function.name, c.function.arguments) for c in message.tool_calls] == [
        ("list_files", '{"path":"/tmp & \\"x\\"","depth":2}'), ("read", '{"name":"a.c"}')]
    assert len({c.id for c in message.tool_calls}) == 2 and all(c.id.startswith("call_") for c in message.tool_calls)


def test_openai_streamed_tool_calls_accumulate(oai):
    with oai.chat.completions.stream(model=MODEL, messages=USER, tools=OPENAI_TOOLS) as stream:
        events = list(stream)
        final = stream.get_final_completion()
    message = final.choices[0].message
    assert message.content == "Let me look."
    assert [(c.function.name, c.function.arguments) for c in message.tool_calls] == [
        ("list_files", '{"path":"/tmp & \\"x\\"","depth":2}'), ("read", '{"name":"a.c"}')]
    assert final.choices[0].finish_reason == "tool_calls"
    assert any(e.type == "tool_calls.function.arguments.delta" for e in events)


def test_openai_completions_and_models(oai):
    r = oai.completions.create(model=MODEL, prompt="say hi")
    assert r.choices[0].text == "Plain answer." and r.object == "text_completion"
    assert "".join(c.choices[0].text for c in oai.completions.create(model=MODEL, prompt="x", stream=True)
                   if c.choices) == "Plain answer."
    assert [m.id for m in oai.models.list()] == [MODEL, "deepseek-chat", "deepseek-reasoner"]
    assert oai.models.retrieve("deepseek-reasoner").id == "deepseek-reasoner"


def test_openai_errors(oai):
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model=MODEL, messages=[])
    assert e.value.status_code == 400 and "at least one message" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x" * 5000}])
    assert e.value.body["code"] == "context_length_exceeded"
    with pytest.raises(openai.NotFoundError):
        oai.models.retrieve("gpt-4o")


# ---------------------------------------------------------------------------------------------------------
# anthropic


THINK = {"type": "enabled", "budget_tokens": 1024}
"""Anthropic's switch for thinking; without it a Messages request does not think (docs/server.md)."""


def test_anthropic_plain_and_thinking(claude, live):
    m = claude.messages.create(model=MODEL, max_tokens=1000, messages=USER, thinking=THINK)
    assert [b.type for b in m.content] == ["thinking", "text"]
    assert m.content[0].thinking == "Thinking hard." and m.content[0].signature == m.id
    assert m.content[1].text == "Plain answer." and m.stop_reason == "end_turn" and m.id.startswith("msg_")
    m = claude.messages.create(model=MODEL, max_tokens=1000, messages=USER, thinking={"type": "disabled"})
    assert [b.type for b in m.content] == ["text"]
    m = claude.messages.create(model=MODEL, max_tokens=1000, messages=USER)  # as Claude Code's switch sends it
    assert [b.type for b in m.content] == ["text"] and m.content[0].text == "Plain answer."
    output_tokens = len(live.worker.engine.tokenizer.encode("Plain answer."))
    assert m.usage.output_tokens == output_tokens and m.usage.input_tokens == 0
    assert m.usage.cache_read_input_tokens + m.usage.cache_creation_input_tokens > 0


def test_anthropic_streaming(claude):
    with claude.messages.stream(model=MODEL, max_tokens=1000, messages=USER, system="Be brief.",
                                thinking=THINK) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == "Plain answer."
    assert [b.type for b in final.content] == ["thinking", "text"]
    assert final.content[0].thinking == "Thinking hard."
    assert final.usage.cache_creation_input_tokens > 0 and final.usage.output_tokens > 0


def test_anthropic_tool_use(claude):
    m = claude.messages.create(model=MODEL, max_tokens=1000, messages=USER, tools=ANTHROPIC_TOOLS, thinking=THINK)
    assert m.stop_reason == "tool_use"
    assert [b.type for b in m.content] == ["thinking", "text", "tool_use", "tool_use"]
    calls = m.content[2:]
    assert [(c.name, c.input) for c in calls] == [("list_files", {"path": '/tmp & "x"', "depth": 2}),
                                                  ("read", {"name": "a.c"})]
    assert all(c.id.startswith("toolu_") for c in calls)
    with claude.messages.stream(model=MODEL, max_tokens=1000, messages=USER, tools=ANTHROPIC_TOOLS,
                                thinking=THINK) as stream:
        final = stream.get_final_message()
    assert [(b.name, b.input) for b in final.content if b.type == "tool_use"] == [
        ("list_files", {"path": '/tmp & "x"', "depth": 2}), ("read", {"name": "a.c"})]
    assert final.stop_reason == "tool_use"


def test_anthropic_count_tokens_and_errors(claude):
    assert claude.messages.count_tokens(model=MODEL, messages=USER).input_tokens > 0
    with pytest.raises(anthropic.BadRequestError) as e:
        claude.messages.create(model=MODEL, max_tokens=10, messages=[{"role": "user", "content": "x" * 5000}])
    assert e.value.body["error"]["n_ctx"] == 4096
    with pytest.raises(anthropic.BadRequestError) as e:
        claude.messages.create(model=MODEL, max_tokens=10, messages=[])
    assert e.value.body["type"] == "error"


# ---------------------------------------------------------------------------------------------------------
# openai Responses (Codex)

RESPONSES_TOOLS = [
    {"type": "function", "name": "list_files", "description": "List files", "strict": False,
     "parameters": {"type": "object", "properties": {"path": {"type": "string"}}}},
    {"type": "function", "name": "read", "parameters": {"type": "object"}},
]


def test_responses_plain_and_reasoning_summary(oai):
    r = oai.responses.create(model=MODEL, input="hi")
    assert r.output_text == "Plain answer." and [item.type for item in r.output] == ["message"]
    assert r.status == "completed" and r.id.startswith("resp_") and r.usage.output_tokens > 0
    r = oai.responses.create(model=MODEL, input="hi", reasoning={"effort": "high", "summary": "auto"})
    assert [item.type for item in r.output] == ["reasoning", "message"]
    assert r.output[0].summary[0].text == "Thinking hard."


def test_responses_tool_calls_stream_and_replay(oai, live):
    with oai.responses.stream(model=MODEL, input="list", tools=RESPONSES_TOOLS,
                              reasoning={"summary": "detailed"}) as stream:
        text = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
        final = stream.get_final_response()
    assert text == "Let me look." == final.output_text
    calls = [item for item in final.output if item.type == "function_call"]
    assert [(c.name, c.arguments) for c in calls] == [
        ("list_files", '{"path":"/tmp & \\"x\\"","depth":2}'), ("read", '{"name":"a.c"}')]
    assert all(c.call_id.startswith("call_") and c.id.startswith("fc_") for c in calls)

    # Codex replays the whole history; the calls' ids bring back the exact DSML that was sampled
    history = [{"role": "user", "content": "list"},
               {"type": "reasoning", "summary": [{"type": "summary_text", "text": "Thinking hard."}]},
               {"role": "assistant", "content": [{"type": "output_text", "text": "Let me look."}]},
               *({"type": "function_call", "call_id": c.call_id, "name": c.name, "arguments": "{}"} for c in calls),
               *({"type": "function_call_output", "call_id": c.call_id, "output": "ok"} for c in calls)]
    engine = live.worker.engine
    oai.responses.create(model=MODEL, input=history, tools=RESPONSES_TOOLS)
    replayed = "<think>Thinking hard.</think>Let me look." + TOOL_TEXT + EOS + "<｜User｜><tool_result>ok"
    assert replayed in engine.requests[-1].prompt
