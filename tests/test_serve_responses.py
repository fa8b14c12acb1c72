"""The Responses translation (`/v1/responses`, what Codex speaks): input items → messages, events → events."""

import json

import pytest

from ds4_mlx.chat import Message, ThinkMode, ToolCallSpec
from ds4_mlx.errors import RequestError
from ds4_mlx.events import Done, ParsedMessage, ReasoningDelta, TextDelta, ToolCall, ToolCallStart, Usage
from ds4_mlx.sampling import SamplingParams
from ds4_mlx.serve import responses
from ds4_mlx.serve.common import CallIds
from ds4_mlx.serve.rawjson import parse_body

CTX = 32768
MODEL = "deepseek-v4-flash"


def parse(body: dict | str):
    text = body if isinstance(body, str) else json.dumps(body)
    return responses.parse_responses(parse_body(text.encode()), ctx=CTX, default_model=MODEL)


def test_codex_style_history_becomes_chat_messages():
    req = parse({"instructions": "You are Codex.", "input": [
        {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "Sandbox: none."}]},
        {"role": "user", "content": [{"type": "input_text", "text": "list"}, {"type": "input_text", "text": "!"}]},
        {"type": "reasoning", "summary": [{"type": "summary_text", "text": "Plan."}], "encrypted_content": "x"},
        {"type": "function_call", "call_id": "call_1", "name": "shell", "arguments": "{\"command\":\"ls\"}",
         "status": "completed"},
        {"type": "function_call", "call_id": "call_2", "name": "read", "namespace": "mcp__fs__",
         "arguments": "{}"},
        {"type": "function_call_output", "call_id": "call_1", "output": "a b"},
        {"type": "custom_tool_call_output", "call_id": "call_2", "output": [{"type": "input_text", "text": "x"}]},
        {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "Done."}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Two files."}]},
        {"type": "compaction", "encrypted_content": "ignored"},
        {"type": "reasoning", "summary": [{"type": "summary_text", "text": "trailing"}]},
    ]})
    assert req.messages == (
        Message("system", "You are Codex."),
        Message("developer", "Sandbox: none."),
        Message("user", "list!"),
        Message("assistant", reasoning="Plan.", tool_calls=(ToolCallSpec("call_1", "shell", '{"command":"ls"}'),
                                                            ToolCallSpec("call_2", "mcp__fs__read", "{}"))),
        Message("tool", "a b", tool_call_id="call_1"),
        Message("tool", "x", tool_call_id="call_2"),
        Message("assistant", "Two files.", "Done."),
        Message("assistant", reasoning="trailing"),
    )
    assert req.options.think is ThinkMode.LOW and req.summary is False


def test_function_call_after_an_assistant_message_joins_it():
    req = parse({"input": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "Checking."},
                           {"type": "function_call", "id": "fc_1", "name": "ls", "arguments": "{}"}]})
    assert req.messages[-1] == Message("assistant", "Checking.", tool_calls=(ToolCallSpec("fc_1", "ls", "{}"),))


def test_tools_raw_bytes_namespaces_and_tool_search():
    function = '{"type":"function","name":"shell","strict":false,"parameters":{"type":"object"}}'
    body = ('{"input":"x","tools":[' + function + ',{"type":"namespace","name":"mcp__p__","tools":[{"name":"search",'
            '"description":"Find","parameters":{"type":"object","properties":{"q":{"type":"string"}}}},{"name":"go"}]},'
            '{"type":"tool_search"},{"type":"web_search"}]}')
    req = parse(body)
    assert req.tools == (
        function,
        '{"name":"mcp__p__search","description":"Find","parameters":{"type":"object","properties":'
        '{"q":{"type":"string"}}}}',
        '{"name":"mcp__p__go","description":"","parameters":{"type":"object","properties":{}}}',
        '{"name":"tool_search","description":"Search available tools.","parameters":{"type":"object","properties":{}}}',
        '{"type":"web_search"}',
    )
    assert req.namespaces == {"mcp__p__search": ("mcp__p__", "search"), "mcp__p__go": ("mcp__p__", "go")}
    assert parse(body[:-1] + ',"tool_choice":"none"}').tools == ()


def test_options():
    req = parse({"input": "x", "model": "deepseek-chat", "reasoning": {"effort": "high", "summary": "concise"},
                 "max_output_tokens": 7, "temperature": 0.5, "top_k": 3, "stream": True, "store": False})
    assert req.options.think is ThinkMode.HIGH  # an explicit effort overrides the alias
    assert req.summary and req.options.max_tokens == 7 and req.options.stream
    assert parse({"input": "x", "model": "deepseek-chat"}).options.think is ThinkMode.NONE
    assert parse({"input": "x", "reasoning": {"effort": "none"}, "temperature": 0.5}).options.sampling == \
        SamplingParams(temperature=0.5)
    assert parse({"input": "x", "reasoning": {"summary": "none"}}).summary is False


@pytest.mark.parametrize(
    "body, message",
    [
        ({}, "missing input"),
        ({"input": 5}, "input must be a string or an array"),
        ({"input": []}, "at least one item"),
        ({"input": "x", "previous_response_id": "resp_1"}, "previous_response_id is not supported"),
        ({"input": "x", "conversation": "c"}, "previous_response_id is not supported"),
        ({"input": "x", "tool_choice": "required"}, "tool_choice=required not supported"),
        ({"input": "x", "tool_choice": ["auto", "none"]}, 'tool_choice=["auto", "none"] not supported'),
        ({"input": [{"type": "tool_search_output", "call_id": "c", "tools": {}}]}, "input[0].tools must be an array"),
        ({"input": "x", "tool_choice": {"type": "function", "name": "f"}}, "forced tool_choice not supported"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
         "input[0].content[0].type 'input_image' is not supported"),
        ({"input": [{"role": "tool", "content": "x"}]},
         "Invalid value: 'tool'. Supported values are: 'user', 'assistant', 'system', and 'developer'."),
        ({"input": [{"role": "user", "content": "x", "status": "in_progress"}]}, "input[0].status must be"),
        ({"input": [{"type": "web_search_call", "id": "ws_1"}]}, "'web_search_call' is not a supported input item"),
        ({"input": "x", "reasoning": {"effort": "huge"}}, "unsupported reasoning effort"),
    ],
)
def test_errors(body, message):
    with pytest.raises(RequestError) as e:
        parse(body)
    assert message in str(e.value)


def test_tool_search_items_call_the_hosted_tool_and_load_more_tools():
    """ds4_server.c: `tool_search_call` → a call of tool `tool_search`; `tool_search_output.tools` adds schema
    lines (compact JSON: they are not in the body's tools array, whose raw bytes are kept)."""
    req = parse({"input": [
        {"role": "user", "content": "list files"},
        {"type": "tool_search_call", "call_id": "call_s", "execution": "client", "status": "completed",
         "arguments": {"query": "files"}},
        {"type": "tool_search_output", "call_id": "call_s", "execution": "client", "status": "completed",
         "tools": [{"type": "function", "name": "list_files", "parameters": {"type": "object"}},
                   {"type": "namespace", "name": "mcp__fs__", "tools": [{"name": "read"}]}]},
    ], "tools": [{"type": "tool_search", "description": "Find tools."}]})
    assert req.messages[1:] == (Message("assistant", tool_calls=(ToolCallSpec("call_s", "tool_search",
                                                                              {"query": "files"}),)),
                                Message("tool", "", tool_call_id="call_s"))
    assert req.tools == (
        '{"name":"tool_search","description":"Find tools.","parameters":{"type":"object","properties":{}}}',
        '{"type":"function","name":"list_files","parameters":{"type":"object"}}',
        '{"name":"mcp__fs__read","description":"","parameters":{"type":"object","properties":{}}}',
    )
    assert req.tool_search and req.namespaces == {"mcp__fs__read": ("mcp__fs__", "read")}


def request(summary: bool = True, namespaces=None, tool_search: bool = False):
    return responses.ResponsesRequest(
        options=responses.Options(model=MODEL, think=ThinkMode.HIGH, sampling=SamplingParams()),
        messages=(Message("user", "x"),), summary=summary, namespaces=namespaces or {}, tool_search=tool_search)


def ids(*values):
    call_ids = CallIds("call_")
    call_ids.ids = list(values)
    return call_ids


DONE = Done("tool_calls", ParsedMessage("Plan.", "Running.", (ToolCall("mcp__p__search", '{"q": "x"}'),)),
            Usage(120, 100, 60, reasoning_tokens=25))


def test_stream_event_sequence():
    stream = responses.ResponseStream("resp_1", 7, request(namespaces={"mcp__p__search": ("mcp__p__", "search")}),
                                      ids("call_" + "c" * 32))
    events = [ReasoningDelta("Pl"), ReasoningDelta("an."), TextDelta("Running."), ToolCallStart(0, "mcp__p__search")]
    frames = stream.start() + [f for e in events for f in stream.event(e)] + stream.done(DONE)
    data = [json.loads(f.split("\ndata: ", 1)[1]) for f in frames]
    assert all(f == f"event: {d['type']}\ndata: " + f.split("\ndata: ", 1)[1] and f.endswith("}\n\n")
               for f, d in zip(frames, data))
    assert [list(d)[:2] for d in data] == [["type", "sequence_number"]] * len(data)
    assert [d["sequence_number"] for d in data] == list(range(len(data)))
    assert [d["type"] for d in data] == [
        "response.created",
        "response.output_item.added", "response.reasoning_summary_part.added",
        "response.reasoning_summary_text.delta", "response.reasoning_summary_text.delta",
        "response.output_item.added", "response.content_part.added", "response.output_text.delta",
        "response.reasoning_summary_text.done", "response.reasoning_summary_part.done", "response.output_item.done",
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done",
        "response.completed",
    ]
    assert data[0]["response"] == {  # a complete response object, in progress
        "id": "resp_1", "object": "response", "created_at": 7, "status": "in_progress", "error": None,
        "incomplete_details": None, "instructions": None, "max_output_tokens": None, "model": MODEL, "output": [],
        "parallel_tool_calls": True, "previous_response_id": None, "reasoning": {"effort": None, "summary": None},
        "store": False, "temperature": 1.0, "text": {"format": {"type": "text"}}, "tool_choice": "auto", "tools": [],
        "top_p": 1.0, "truncation": "disabled", "metadata": {}, "usage": None}
    reasoning_id, message_id = data[1]["item"]["id"], data[5]["item"]["id"]
    assert reasoning_id.startswith("rs_") and message_id.startswith("msg_") and len(message_id) == 28
    assert data[7] == {"type": "response.output_text.delta", "sequence_number": 7, "item_id": message_id,
                       "output_index": 1, "content_index": 0, "delta": "Running."}
    call = data[17]["item"]
    assert call == {"id": call["id"], "type": "function_call", "status": "completed", "name": "search",
                    "namespace": "mcp__p__", "call_id": "call_" + "c" * 32, "arguments": '{"q":"x"}'}
    assert data[16] == {"type": "response.function_call_arguments.done", "sequence_number": 16,
                        "item_id": call["id"], "output_index": 2, "name": "search", "namespace": "mcp__p__",
                        "arguments": '{"q":"x"}'}
    final = data[-1]["response"]
    assert [item["id"] for item in final["output"]] == [reasoning_id, message_id, call["id"]]
    assert final["status"] == "completed" and final["usage"] == {
        "input_tokens": 120, "input_tokens_details": {"cached_tokens": 100, "cache_write_tokens": 20},
        "output_tokens": 60, "output_tokens_details": {"reasoning_tokens": 25}, "total_tokens": 180}


def test_calls_of_the_hosted_tool_search_are_tool_search_call_items():
    """ds4_server.c: {"id":"fc_…","type":"tool_search_call","status":…,"call_id":…,"execution":"client",
    "arguments":{…object…}}; its arguments are an object, so no function_call_arguments events are streamed."""
    done = Done("tool_calls", ParsedMessage("", "", (ToolCall("tool_search", '{"query": "files"}'),
                                                     ToolCall("ls", "{}"))), Usage(1, 0, 1))
    body = responses.response("r", 1, request(tool_search=True), done, ids("call_s", "call_l"))
    search = body["output"][0]
    assert search == {"id": search["id"], "type": "tool_search_call", "status": "completed", "call_id": "call_s",
                      "execution": "client", "arguments": {"query": "files"}}
    assert search["id"].startswith("fc_") and body["output"][1]["type"] == "function_call"
    stream = responses.ResponseStream("r", 1, request(tool_search=True), ids("call_s", "call_l"))
    data = [json.loads(f.split("\ndata: ", 1)[1]) for f in stream.done(done)]
    assert [d["type"] for d in data] == [
        "response.output_item.added", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    streamed = {**search, "id": data[0]["item"]["id"]}
    assert data[0]["item"] == {**streamed, "status": "in_progress", "arguments": {}} and data[1]["item"] == streamed
    # a client's own function that happens to be called tool_search stays a function call
    body = responses.response("r", 1, request(), done, ids("call_s", "call_l"))
    assert body["output"][0]["type"] == "function_call"


def test_reasoning_without_summary_opt_in_is_not_sent():
    stream = responses.ResponseStream("r", 1, request(summary=False), ids())
    assert stream.event(ReasoningDelta("secret")) == []
    done = Done("stop", ParsedMessage("secret", "hi"), Usage(1, 0, 1))
    body = responses.response("r", 1, request(summary=False), done, ids())
    assert [item["type"] for item in body["output"]] == ["message"]


@pytest.mark.parametrize(
    "finish, status, terminal, extra",
    [
        ("length", "incomplete", "response.incomplete", {"incomplete_details": {"reason": "max_output_tokens"}}),
        ("error", "failed", "response.failed", {"error": {"code": "server_error", "message": "generation failed"}}),
    ],
)
def test_unfinished_responses(finish, status, terminal, extra):
    done = Done(finish, ParsedMessage("", "cut"), Usage(1, 0, 1))
    body = responses.response("r", 1, request(), done, ids())
    assert body["status"] == status and all(body[k] == v for k, v in extra.items())
    assert body["output"][0]["status"] == "incomplete"
    stream = responses.ResponseStream("r", 1, request(), ids())
    last = json.loads(stream.done(done)[-1].split("\ndata: ", 1)[1])
    assert last["type"] == terminal and last["response"]["status"] == status


def test_text_recovered_at_the_end_is_flushed():
    """A malformed tool block comes back as content that was held while streaming (ds4_server.c)."""
    stream = responses.ResponseStream("r", 1, request(), ids())
    frames = stream.event(TextDelta("Hi ")) + stream.done(Done("stop", ParsedMessage("", "Hi <broken"),
                                                               Usage(1, 0, 1)))
    deltas = [json.loads(f.split("\ndata: ", 1)[1])["delta"] for f in frames if '"response.output_text.delta"' in f]
    assert deltas == ["Hi ", "<broken"]
