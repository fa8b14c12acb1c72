"""Tools declared `strict`: their calls' arguments are held to their schemas by the token mask.

A scripted model writes tool calls whose arguments break the schema; the mask makes the engine write valid ones
instead, while the text before the block, the reasoning and the calls of tools that are not strict stay as written.
"""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest

from ds4_mlx.chat import Message, ThinkMode, render_chat
from ds4_mlx.constrain import Constraint, OutputFormat
from ds4_mlx.engine import GenerationRequest
from ds4_mlx.sampling import SamplingParams
from ds4_mlx.toolgrammar import ToolSpec
from scripted import scripted_engine
from serve_support import ScriptedEngine, live_server, small_tokenizer

D = "｜DSML｜"
WEATHER = {"type": "object", "properties": {
    "city": {"type": "string"},
    "days": {"type": "integer", "minimum": 1, "maximum": 7},
    "unit": {"enum": ["C", "F"]},
    "where": {"$ref": "#/$defs/point"}},
    "required": ["city", "days"], "additionalProperties": False,
    "$defs": {"point": {"type": "object", "properties": {"lat": {"type": "number"}}, "required": ["lat"],
                        "additionalProperties": False}}}


def call(name: str, *params: tuple[str, str, bool]) -> str:
    inner = "".join(f'<{D}parameter name="{k}" string="{"true" if s else "false"}">{v}</{D}parameter>\n'
                    for k, v, s in params)
    return f'<{D}invoke name="{name}">\n{inner}</{D}invoke>\n'


def block(*calls: str) -> str:
    return f"\n\n<{D}tool_calls>\n" + "".join(calls) + f"</{D}tool_calls>"


def generate(text: str, tools: list[ToolSpec], *, think: ThinkMode = ThinkMode.NONE, answer=None):
    engine, _ = scripted_engine(small_tokenizer(), text, ctx=2048)
    prompt = render_chat([Message("user", "q")], think=think, ctx=2048)
    req = GenerationRequest(prompt, max_tokens=1500, sampling=SamplingParams(temperature=0), tools_active=True,
                            output=Constraint.make(answer, tools))
    return [*engine.generate(req)][-1]


def test_a_strict_tools_arguments_are_held_to_its_schema():
    bad = call("get_weather", ("city", "Paris", True), ("days", '"many"', False))
    done = generate("Let me check." + block(bad), [ToolSpec("get_weather", WEATHER)])
    assert done.message.content == "Let me check."  # the text before the block is free
    assert done.finish_reason == "tool_calls" and len(done.message.tool_calls) >= 1
    for tool_call in done.message.tool_calls:
        assert tool_call.name == "get_weather"
        jsonschema.validate(json.loads(tool_call.arguments), WEATHER)
    assert json.loads(done.message.tool_calls[0].arguments)["city"] == "Paris"


def test_valid_calls_pass_unchanged_and_free_tools_stay_free():
    good = call("get_weather", ("city", "Oslo & Bergen", True), ("days", "3", False), ("unit", "C", True),
                ("where", '{"lat": 59.9}', False))
    free = call("search", ("query", "anything", True), ("n", "[1, 2]", False))
    text = "Two calls." + block(good, free)
    done = generate(text, [ToolSpec("get_weather", WEATHER), ToolSpec("search")])
    assert [(c.name, json.loads(c.arguments)) for c in done.message.tool_calls] == [
        ("get_weather", {"city": "Oslo & Bergen", "days": 3, "unit": "C", "where": {"lat": 59.9}}),
        ("search", {"query": "anything", "n": [1, 2]})]


def test_an_unknown_tool_name_is_refused_when_a_tool_is_strict():
    done = generate("Hm." + block(call("rm_rf", ("path", "/", True))), [ToolSpec("get_weather", WEATHER)])
    assert all(c.name == "get_weather" for c in done.message.tool_calls)


def test_reasoning_stays_free_with_strict_tools():
    text = "I will <｜DSML｜invoke> whatever</think>Ok." + block(call("get_weather", ("city", "Rome", True),
                                                                      ("days", "9", False)))
    done = generate(text, [ToolSpec("get_weather", WEATHER)], think=ThinkMode.HIGH)
    assert done.message.reasoning == "I will <｜DSML｜invoke> whatever" and done.message.content == "Ok."
    for tool_call in done.message.tool_calls:
        jsonschema.validate(json.loads(tool_call.arguments), WEATHER)


def test_a_format_and_strict_tools_together():
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    fmt = OutputFormat.build("json_schema", schema, "s", "schema")
    tools = [ToolSpec("get_weather", WEATHER)]
    done = generate('{"ok": true}', tools, answer=fmt)
    assert json.loads(done.message.content) == {"ok": True} and done.finish_reason == "stop"
    done = generate(block(call("get_weather", ("city", "Rome", True), ("days", "0", False))), tools, answer=fmt)
    assert done.finish_reason == "tool_calls"
    jsonschema.validate(json.loads(done.message.tool_calls[0].arguments), WEATHER)


@pytest.mark.parametrize("path, tools, param", [
    ("/v1/chat/completions", [{"type": "function", "function": {"name": "f", "strict": True, "parameters": {
        "type": "object", "properties": {"a": {"not": {}}}}}}], "tools[0]"),
    ("/v1/messages", [{"name": "ok", "input_schema": {"type": "object"}},
                      {"name": "f", "strict": True, "input_schema": {"type": "object", "properties": {
                          "a": {"type": "strnig"}}}}], "tools[1]"),
])
def test_a_strict_schema_the_library_cannot_take_is_a_400_naming_the_tool(path, tools, param):
    engine = ScriptedEngine()
    with live_server(engine) as live, httpx.Client(base_url=live.url) as client:
        reply = client.post(path, json={"messages": [{"role": "user", "content": "hi"}], "tools": tools,
                                        "max_tokens": 10})
    assert reply.status_code == 400 and engine.requests == []
    body = reply.json()
    message = body["error"]["message"]
    assert "'f'" in message and "/properties/a" in message
    if path == "/v1/chat/completions":
        assert body["error"]["param"] == param


def test_strict_tools_over_chat_completions():
    """The request shape: `function.strict` makes the server hold the call."""
    def reply(req) -> str:
        return "Calling." + block(call("get_weather", ("city", "Lima", True), ("days", "ten", False)))

    tools = [{"type": "function", "function": {"name": "get_weather", "strict": True, "parameters": WEATHER}}]
    with live_server(ScriptedEngine(reply=reply)) as live, httpx.Client(base_url=live.url, timeout=30) as client:
        body = {"messages": [{"role": "user", "content": "weather?"}], "tools": tools, "model": "deepseek-chat"}
        answer = client.post("/v1/chat/completions", json=body).json()["choices"][0]
    assert answer["finish_reason"] == "tool_calls"
    arguments = json.loads(answer["message"]["tool_calls"][0]["function"]["arguments"])
    jsonschema.validate(arguments, WEATHER)
    assert arguments["city"] == "Lima"
