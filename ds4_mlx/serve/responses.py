"""OpenAI Responses wire format: `/v1/responses` (what current Codex releases speak).

Pure translations, like `openai.py`: input items become chat messages (reasoning items join the next assistant
message, function calls join the assistant message they follow, outputs become tool results); the engine's events
become the response object or its SSE event sequence (ds4_server.c). State is never kept between
requests: clients replay the full input, and the tool memory and live prefix reuse make that cheap.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from ..chat import Message, ToolCallSpec
from ..constrain import OutputFormat
from ..events import Done, Event, PromptAccepted, ReasoningDelta, TextDelta, Usage
from .common import (
    ApiError,
    CallIds,
    abbreviated,
    ChatRequest,
    Fields,
    Options,
    compact_arguments,
    constraint,
    dumps,
    invalid_value,
    max_tokens,
    new_id,
    output_format,
    sampling_params,
    sse,
    think_mode,
)
from .rawjson import Body

ROLES = ("user", "assistant", "system", "developer")
TEXT_BLOCKS = ("input_text", "output_text", "text", "summary_text", "reasoning_text")
SUMMARY_OPT_IN = ("auto", "concise", "detailed")
EMPTY_PARAMETERS = {"type": "object", "properties": {}}
IGNORED_ITEMS = ("compaction", "context_compaction")
TOOL_SEARCH = "tool_search"
"""The name under which the hosted tool_search tool is shown to the model."""


@dataclass(frozen=True)
class ResponsesRequest(ChatRequest):
    """A chat request plus what only the Responses wire needs: whether reasoning summaries were asked for, the
    namespace of each flattened tool name (`mcp__srv__tool` → ("mcp__srv__", "tool")), and whether the hosted
    tool_search is offered (the model's calls to it are then `tool_search_call` items)."""

    summary: bool = False
    namespaces: dict[str, tuple[str, str]] = field(default_factory=dict)
    tool_search: bool = False
    echo: dict[str, Any] = field(default_factory=lambda: _echo(Fields({}), None, None, None))
    """The request's settings as a response object reports them (instructions, tools, reasoning, ...)."""


@dataclass
class _Tools:
    """Schema lines (ds4_server.c) with what the answer needs to know about them."""

    lines: list[str] = field(default_factory=list)
    namespaces: dict[str, tuple[str, str]] = field(default_factory=dict)
    tool_search: bool = False

    def add(self, tools: list[Any], texts: Sequence[str], path: str) -> None:
        """Raw bytes per tool; one synthesized line per function of a namespace; a synthesized line for the hosted
        tool_search."""
        for i, (tool, text) in enumerate(zip(tools, texts)):
            t = Fields(tool, f"{path}[{i}]")
            kind = t.string("type", "function")
            if kind == "namespace":
                prefix = t.string("name", "")
                for j, inner in enumerate(t.array("tools", [])):
                    fn = Fields(inner, f"{t.where('tools')}[{j}]")
                    name = fn.string("name", "")
                    parameters = fn.raw("parameters", fn.raw("input_schema", EMPTY_PARAMETERS))
                    self.lines.append(dumps({"name": prefix + name, "description": fn.string("description", ""),
                                             "parameters": parameters}))
                    self.namespaces[prefix + name] = (prefix, name)
            elif kind == "tool_search" and "name" not in t:
                self.lines.append(dumps({"name": TOOL_SEARCH,
                                         "description": t.string("description", "Search available tools."),
                                         "parameters": t.raw("parameters", EMPTY_PARAMETERS)}))
                self.tool_search = True
            else:
                self.lines.append(text)


def _text(value: Any, path: str) -> str:
    """Item text: a string, or an array of text blocks (any other block, e.g. an image, is refused)."""
    if value is None or isinstance(value, str):
        return value or ""
    if not isinstance(value, list):
        raise ApiError(f"invalid request: {path} must be a string or an array of text blocks")
    parts = []
    for i, block in enumerate(value):
        b = Fields(block, f"{path}[{i}]")
        kind = b.string("type", "text")
        if kind not in TEXT_BLOCKS:
            raise ApiError(f"invalid request: {b.where('type')} {kind!r} is not supported; only text blocks are")
        parts.append(b.string("text", ""))
    return "".join(parts)


class _History:
    """Builds the message list from input items in order, and collects the tools that tool searches loaded."""

    def __init__(self) -> None:
        self.messages: list[Message] = []
        self.reasoning: list[str] = []
        self.loaded_tools: list[tuple[list[Any], str]] = []

    def _take_reasoning(self) -> str:
        text, self.reasoning = "\n".join(self.reasoning), []
        return text

    def add(self, message: Message) -> None:
        if message.role == "assistant":
            message = replace(message, reasoning=self._take_reasoning())
        self.messages.append(message)

    def call(self, spec: ToolCallSpec) -> None:
        last = self.messages[-1] if self.messages else None
        if last is not None and last.role == "assistant" and not self.reasoning:
            self.messages[-1] = replace(last, tool_calls=(*last.tool_calls, spec))
        else:
            self.add(Message("assistant", tool_calls=(spec,)))

    def finish(self) -> list[Message]:
        if self.reasoning:
            self.add(Message("assistant"))
        return self.messages


def _item(history: _History, value: Any, path: str) -> None:
    it = Fields(value, path)
    kind = it.string("type", "message")
    status = it.string("status")
    if status is not None and status != "completed":
        raise ApiError(f"invalid request: {it.where('status')} must be \"completed\", got {status!r}")
    if kind == "message":
        role = it.string("role", "user")
        if role not in ROLES:
            raise invalid_value(it.where("role"), role, ROLES)
        history.add(Message(role, _text(it.raw("content"), it.where("content"))))
    elif kind in ("function_call", "custom_tool_call", "local_shell_call", "tool_search_call"):
        call_id = it.string("call_id") or it.string("id", "")
        if kind == "local_shell_call":
            name, arguments = "local_shell", dumps(it.raw("action", {}))
        elif kind == "tool_search_call":
            name, arguments = TOOL_SEARCH, it.raw("arguments")
        else:
            name = it.string("namespace", "") + it.string("name", "")
            arguments = it.raw("arguments" if kind == "function_call" else "input")
        history.call(ToolCallSpec(call_id, name, "{}" if arguments is None else arguments))
    elif kind in ("function_call_output", "custom_tool_call_output", "local_shell_call_output", "tool_search_output"):
        if kind == "tool_search_output":
            history.loaded_tools.append((it.array("tools", []), it.where("tools")))
        history.add(Message("tool", _text(it.raw("output"), it.where("output")), tool_call_id=it.string("call_id", "")))
    elif kind == "reasoning":
        texts = [_text([b], f"{it.where(key)}[{i}]") for key in ("summary", "content")
                 for i, b in enumerate(it.array(key, [], nullable=True))]
        history.reasoning += [t for t in texts if t]
    elif kind not in IGNORED_ITEMS:
        raise ApiError(f"invalid request: {it.where('type')} {kind!r} is not a supported input item")


def parse_responses(body: Body, *, ctx: int, default_model: str) -> ResponsesRequest:
    """`/v1/responses` request → normalized chat request (ds4_server.c)."""
    f = Fields(body.value)
    if f.raw("previous_response_id") is not None or f.raw("conversation") is not None:
        raise ApiError("previous_response_id is not supported; replay full input instead")
    raw_input = f.raw("input")
    if raw_input is None:
        raise ApiError("missing input")
    history = _History()
    instructions = f.string("instructions", nullable=True)
    if instructions:
        history.add(Message("system", instructions))
    if isinstance(raw_input, str):
        history.add(Message("user", raw_input))
    elif isinstance(raw_input, list):
        for i, item in enumerate(raw_input):
            _item(history, item, f"input[{i}]")
    else:
        raise ApiError("invalid request: input must be a string or an array of items")
    messages = history.finish()
    if not messages:
        raise ApiError("invalid request: input must contain at least one item")

    tool_choice = f.raw("tool_choice")
    if isinstance(tool_choice, dict):
        raise ApiError("forced tool_choice not supported")
    if tool_choice is not None and tool_choice not in ("auto", "none"):
        raise ApiError(f"tool_choice={abbreviated(tool_choice)} not supported")
    tools = _Tools()
    if tool_choice != "none":
        tools.add(f.array("tools", nullable=True) or [], body.tool_texts, "tools")
        for loaded, path in history.loaded_tools:  # not in the body's tools array: shown as compact JSON
            tools.add(loaded, [dumps(tool) for tool in loaded], path)

    model = f.string("model", default_model, nullable=True)
    reasoning = f.object("reasoning", nullable=True)
    effort = reasoning.raw("effort") if reasoning else None
    # an explicit effort overrides the model alias, as `thinking` does on the other endpoints
    think = think_mode(model, ctx, effort=effort, thinking=True if effort is not None else None)
    summary = reasoning.string("summary", nullable=True) if reasoning else None
    options = Options(
        model=model,
        think=think,
        sampling=sampling_params(f, think, ("temperature", "top_p")),
        max_tokens=max_tokens(f, "max_output_tokens", "max_tokens"),
        stream=f.boolean("stream", False, nullable=True),
        output=constraint(_text_format(f), tuple(tools.lines)),
    )
    return ResponsesRequest(options=options, messages=tuple(messages), tools=tuple(tools.lines),
                            summary=summary in SUMMARY_OPT_IN, namespaces=tools.namespaces,
                            tool_search=tools.tool_search, echo=_echo(f, instructions, effort, summary))


def _text_format(f: Fields) -> OutputFormat | None:
    """`text.format`: the Responses API's answer format (flat `name`, `schema`, `strict`)."""
    text = f.object("text", nullable=True)
    return output_format(text, "format", nested=False) if text is not None else None


def _echo(f: Fields, instructions: str | None, effort: Any, summary: str | None) -> dict[str, Any]:
    """The settings every response object carries, with OpenAI's defaults for those not sent (or sent as null);
    nothing is stored (`store` false)."""

    def given(key: str, default: Any) -> Any:
        value = f.raw(key)
        return default if value is None else value

    return {
        "instructions": instructions,
        "max_output_tokens": f.raw("max_output_tokens"),
        "parallel_tool_calls": given("parallel_tool_calls", True),
        "previous_response_id": None,
        "reasoning": {"effort": effort, "summary": summary},
        "store": False,
        "temperature": given("temperature", 1.0),
        "text": given("text", {"format": {"type": "text"}}),
        "tool_choice": given("tool_choice", "auto"),
        "tools": given("tools", []),
        "top_p": given("top_p", 1.0),
        "truncation": given("truncation", "disabled"),
        "metadata": given("metadata", {}),
    }


# ---------------------------------------------------------------------------------------------------------
# output

STATUS = {"length": "incomplete", "error": "failed"}


def usage_json(usage: Usage) -> dict[str, Any]:
    return {
        "input_tokens": usage.prompt_tokens,
        "input_tokens_details": {"cached_tokens": usage.cached_tokens, "cache_write_tokens": usage.cache_write_tokens},
        "output_tokens": usage.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": usage.reasoning_tokens},
        "total_tokens": usage.total_tokens,
    }


class _Output:
    """The output items of one response, with ids fixed when first needed so that stream and body agree."""

    def __init__(self, request: ResponsesRequest, ids: CallIds) -> None:
        self.request = request
        self.ids = ids
        self.reasoning_id = new_id("rs_", 12)
        self.message_id = new_id("msg_", 12)
        self.call_item_ids: list[str] = []

    def reasoning_item(self, text: str, status: str) -> dict[str, Any]:
        summary = [{"type": "summary_text", "text": text}] if status != "in_progress" else []
        return {"id": self.reasoning_id, "type": "reasoning", "status": status, "summary": summary}

    def message_item(self, text: str, status: str) -> dict[str, Any]:
        content = [{"type": "output_text", "text": text, "annotations": []}] if status != "in_progress" else []
        return {"id": self.message_id, "type": "message", "status": status, "role": "assistant", "content": content}

    def is_tool_search(self, name: str) -> bool:
        return self.request.tool_search and name == TOOL_SEARCH

    def call_item(self, index: int, name: str, arguments: str, status: str) -> dict[str, Any]:
        """A function_call item, or a tool_search_call item for a call to the hosted tool_search (its arguments
        an object, run by the client, ds4_server.c)."""
        while len(self.call_item_ids) <= index:
            self.call_item_ids.append(new_id("fc_", 12))
        item_id, call_id = self.call_item_ids[index], self.ids[index]
        if self.is_tool_search(name):
            return {"id": item_id, "type": "tool_search_call", "status": status, "call_id": call_id,
                    "execution": "client", "arguments": json.loads(arguments or "{}")}
        namespace, short = self.request.namespaces.get(name, ("", name))
        item = {"id": item_id, "type": "function_call", "status": status, "name": short}
        if namespace:
            item["namespace"] = namespace
        item.update({"call_id": call_id, "arguments": arguments})
        return item

    def items(self, done: Done) -> list[dict[str, Any]]:
        message = done.message
        status = "incomplete" if done.finish_reason in STATUS else "completed"
        out = []
        if self.request.summary and message.reasoning:
            out.append(self.reasoning_item(message.reasoning, status if message.reasoning_closed else "incomplete"))
        if message.content:
            out.append(self.message_item(message.content, status))
        for i, call in enumerate(message.tool_calls):
            out.append(self.call_item(i, call.name, compact_arguments(call.arguments), "completed"))
        return out

    def response(self, rid: str, created: int, done: Done | None) -> dict[str, Any]:
        """The whole response object: in progress (no output, no usage yet) until `done`."""
        status = "in_progress" if done is None else STATUS.get(done.finish_reason, "completed")
        echo = self.request.echo
        body: dict[str, Any] = {"id": rid, "object": "response", "created_at": created, "status": status,
                                "error": None, "incomplete_details": None, "instructions": echo.get("instructions"),
                                "max_output_tokens": echo.get("max_output_tokens"),
                                "model": self.request.options.model, "output": [],
                                **{k: v for k, v in echo.items() if k not in ("instructions", "max_output_tokens")},
                                "usage": None}
        if done is None:
            return body
        body["output"] = self.items(done)
        if done.finish_reason == "length":
            body["incomplete_details"] = {"reason": "max_output_tokens"}
        elif done.finish_reason == "error":
            body["error"] = {"code": "server_error", "message": "generation failed"}
        body["usage"] = usage_json(done.usage)
        return body


def response(rid: str, created: int, request: ResponsesRequest, done: Done, ids: CallIds,
             text: str = "") -> dict[str, Any]:
    """The non-streaming response object."""
    return _Output(request, ids).response(rid, created, done)


class ResponseStream:
    """Events → Responses SSE events, each with an `event:` line naming its type and a `sequence_number` right
    after its `type` (ds4_server.c), as OpenAI sends them.

    Reasoning is streamed only when a summary was asked for; tool-call arguments are sent whole at the end.
    """

    def __init__(self, rid: str, created: int, request: ResponsesRequest, ids: CallIds) -> None:
        self.rid = rid
        self.created = created
        self.out = _Output(request, ids)
        self.summary = request.summary
        self.sequence = 0
        self.next_index = 0
        self.reasoning_index: int | None = None
        self.message_index: int | None = None
        self.reasoning = ""
        self.text = ""

    def _event(self, kind: str, **data: Any) -> str:
        frame = sse({"type": kind, "sequence_number": self.sequence, **data}, event=kind)
        self.sequence += 1
        return frame

    def start(self, prompt: PromptAccepted | None = None) -> list[str]:
        return [self._event("response.created", response=self.out.response(self.rid, self.created, None))]

    def _open_message(self) -> list[str]:
        self.message_index, self.next_index = self.next_index, self.next_index + 1
        item_id = self.out.message_id
        return [
            self._event("response.output_item.added", output_index=self.message_index,
                        item=self.out.message_item("", "in_progress")),
            self._event("response.content_part.added", item_id=item_id, output_index=self.message_index,
                        content_index=0, part={"type": "output_text", "text": "", "annotations": []}),
        ]

    def _text_delta(self, text: str) -> list[str]:
        frames = self._open_message() if self.message_index is None else []
        self.text += text
        frames.append(self._event("response.output_text.delta", item_id=self.out.message_id,
                                  output_index=self.message_index, content_index=0, delta=text))
        return frames

    def event(self, event: Event) -> list[str]:
        if isinstance(event, ReasoningDelta) and event.text and self.summary:
            frames = []
            if self.reasoning_index is None:
                self.reasoning_index, self.next_index = self.next_index, self.next_index + 1
                frames += [
                    self._event("response.output_item.added", output_index=self.reasoning_index,
                                item=self.out.reasoning_item("", "in_progress")),
                    self._event("response.reasoning_summary_part.added", item_id=self.out.reasoning_id,
                                output_index=self.reasoning_index, summary_index=0,
                                part={"type": "summary_text", "text": ""}),
                ]
            self.reasoning += event.text
            frames.append(self._event("response.reasoning_summary_text.delta", item_id=self.out.reasoning_id,
                                      output_index=self.reasoning_index, summary_index=0, delta=event.text))
            return frames
        if isinstance(event, TextDelta) and event.text:
            return self._text_delta(event.text)
        return []

    def done(self, done: Done) -> list[str]:
        message = done.message
        status = "incomplete" if done.finish_reason in STATUS else "completed"
        frames: list[str] = []
        if message.content.startswith(self.text) and len(message.content) > len(self.text):
            frames += self._text_delta(message.content[len(self.text):])  # e.g. a malformed block kept as text
        if self.reasoning_index is not None:
            part = {"type": "summary_text", "text": self.reasoning}
            reasoning_status = status if message.reasoning_closed else "incomplete"
            frames += [
                self._event("response.reasoning_summary_text.done", item_id=self.out.reasoning_id,
                            output_index=self.reasoning_index, summary_index=0, text=self.reasoning),
                self._event("response.reasoning_summary_part.done", item_id=self.out.reasoning_id,
                            output_index=self.reasoning_index, summary_index=0, part=part),
                self._event("response.output_item.done", output_index=self.reasoning_index,
                            item=self.out.reasoning_item(self.reasoning, reasoning_status)),
            ]
        if self.message_index is not None:
            item_id, index = self.out.message_id, self.message_index
            frames += [
                self._event("response.output_text.done", item_id=item_id, output_index=index, content_index=0,
                            text=self.text),
                self._event("response.content_part.done", item_id=item_id, output_index=index, content_index=0,
                            part={"type": "output_text", "text": self.text, "annotations": []}),
                self._event("response.output_item.done", output_index=index,
                            item=self.out.message_item(self.text, status)),
            ]
        for i, call in enumerate(message.tool_calls):
            index, self.next_index = self.next_index, self.next_index + 1
            arguments = compact_arguments(call.arguments)
            added = self.out.call_item(i, call.name, "", "in_progress")
            item_id = added["id"]
            final = self.out.call_item(i, call.name, arguments, "completed")
            frames.append(self._event("response.output_item.added", output_index=index, item=added))
            if not self.out.is_tool_search(call.name):  # a tool_search_call's arguments are an object, not text
                names = {k: final[k] for k in ("name", "namespace") if k in final}
                frames += [
                    self._event("response.function_call_arguments.delta", item_id=item_id, output_index=index,
                                delta=arguments),
                    self._event("response.function_call_arguments.done", item_id=item_id, output_index=index,
                                **names, arguments=arguments),
                ]
            frames.append(self._event("response.output_item.done", output_index=index, item=final))
        terminal = {"incomplete": "response.incomplete", "failed": "response.failed"}.get(
            STATUS.get(done.finish_reason, ""), "response.completed")
        frames.append(self._event(terminal, response=self.out.response(self.rid, self.created, done)))
        return frames
