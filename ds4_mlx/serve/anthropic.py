"""Anthropic Messages wire format: `/v1/messages`.

Pure translations, like `openai.py`: the request body becomes a normalized `ChatRequest`; the engine's events
become the message JSON or the SSE event sequence ds4 sends (ds4_server.c). Errors use Anthropic's
own `{"type":"error","error":{...}}` shape (ds4 answers OpenAI-shaped errors here; SDKs expect this one).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from ..chat import Message, ToolCallSpec, tool_result_block
from ..events import (
    Done,
    Event,
    PromptAccepted,
    ReasoningDelta,
    TextDelta,
    ToolCallArgsDelta,
    ToolCallEnd,
    ToolCallStart,
    Usage,
)
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
    max_tokens,
    message_list,
    output_format,
    sampling_params,
    sse,
    stop_strings,
    text_of,
    think_mode,
    thinking_flag,
)
from .openai import active_tools
from .modelcard import ModelCard
from .rawjson import Body

ROLES = ("user", "assistant", "system")
"""Message roles: Anthropic's two, plus the system turns Claude Code sends inside `messages` (rendered in place)."""
HIDDEN_SYSTEM_PREFIX = "x-anthropic-"
"""System parts that clients add for their own bookkeeping (Claude Code's billing header); ds4 drops them."""

STOP_REASONS = {"tool_calls": "tool_use", "length": "max_tokens"}

_ERROR_TYPES = {
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
}


def context_overflow(n_prompt_tokens: int, n_ctx: int, param: str) -> ApiError:
    """Anthropic's wording, which Claude Code reads to compact its history: the maximum is the longest prompt
    that fits (one slot stays free for the answer, ds4_server.c)."""
    return ApiError(f"prompt is too long: {n_prompt_tokens} tokens > {n_ctx - 1} maximum", param=param,
                    extra={"n_prompt_tokens": n_prompt_tokens, "n_ctx": n_ctx})


MODELS_CREATED_AT = "2026-01-01T00:00:00Z"
"""The release date every model entry reports (the OpenAI entries' `created`, as RFC 3339)."""


def model_json(model_id: str, card: ModelCard) -> dict[str, Any]:
    """One model as Anthropic's `/v1/models` describes it, with its limits (`max_input_tokens`: the longest prompt
    that leaves a token of answer) and the capabilities this server has."""
    yes, no = {"supported": True}, {"supported": False}
    return {"type": "model", "id": model_id, "display_name": "DeepSeek V4 Flash", "created_at": MODELS_CREATED_AT,
            "lifecycle": "active", "max_input_tokens": card.ctx - 1, "max_tokens": card.max_completion_tokens,
            "capabilities": {
                "thinking": {"supported": True, "types": {"enabled": yes, "disabled": yes, "adaptive": yes,
                                                          "between_tools": yes}},
                "effort": {"supported": True, "low": yes, "medium": yes, "high": yes, "max": yes, "xhigh": yes},
                "structured_outputs": yes, "image_input": no, "pdf_input": no, "citations": no, "batch": no}}


def models_json(model_ids: Sequence[str], card: ModelCard) -> dict[str, Any]:
    """Anthropic's model list: one page holding every model."""
    return {"data": [model_json(m, card) for m in model_ids], "has_more": False, "first_id": model_ids[0],
            "last_id": model_ids[-1]}


def error_json(error: ApiError) -> dict[str, Any]:
    kind = "api_error" if error.status >= 500 else _ERROR_TYPES.get(error.status, "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": error.message, **error.extra}}


def stream_error(message: str) -> str:
    return sse({"type": "error", "error": {"type": "api_error", "message": message}}, event="error")


def _system(value: Any, path: str = "system") -> str:
    """System text (the `system` field, or a system turn's content): a string, or text parts joined by newlines
    without the client's `x-anthropic-` parts."""
    if isinstance(value, list):
        parts = []
        for i, part in enumerate(value):
            if isinstance(part, dict) and Fields(part, f"{path}[{i}]").string("type", "text") != "text":
                raise ApiError(f"invalid request: {path}[{i}].type must be \"text\" in system content",
                               param=f"{path}[{i}].type")
            parts.append(text_of([part], f"{path}[{i}]"))
        return "\n".join(p for p in parts if not p.startswith(HIDDEN_SYSTEM_PREFIX))
    return text_of(value, path)


def _message(value: Any, path: str, call_ids: set[str]) -> Message:
    """One message; blocks keep their order: user text and `<tool_result>` wrappers are concatenated
    without separators (ds4_server.c), assistant thinking → reasoning, tool_use → tool calls.

    `call_ids` holds the tool_use ids of the messages before this one (this message's are added): a tool_result
    must answer one of them, since there is no continuation state to take a call from (ds4_server.c)."""
    f = Fields(value, path)
    role = f.string("role", "user")
    if role not in ROLES:  # Anthropic's (pydantic's) wording, with its dotted path
        raise ApiError(f"{path.replace('[', '.').replace(']', '')}.role: Input should be 'user', 'assistant' or "
                       f"'system'", param=f.where("role"))
    content = f.raw("content")
    if role == "system":
        return Message(role=role, content=_system(content, f.where("content")))
    if not isinstance(content, list):
        return Message(role=role, content=text_of(content, f.where("content")))
    text: list[str] = []
    reasoning: list[str] = []
    calls: list[ToolCallSpec] = []
    for i, block in enumerate(content):
        b = Fields(block, f"{f.where('content')}[{i}]")
        kind = b.string("type", "text")
        if kind == "text":
            text.append(b.string("text", ""))
        elif kind == "thinking" and role == "assistant":
            reasoning.append(b.string("thinking", ""))
        elif kind == "tool_use" and role == "assistant":
            arguments = b.object("input", nullable=True)
            calls.append(ToolCallSpec(id=b.string("id", ""), name=b.string("name", ""),
                                      arguments=arguments.value if arguments else {}))
            call_ids.add(calls[-1].id)
        elif kind == "tool_result" and role == "user":
            call_id = b.string("tool_use_id", "")
            if call_id not in call_ids:
                raise ApiError(f"Anthropic continuation state is not available for tool_use_id {abbreviated(call_id)}; "
                               "retry by replaying the full messages history")
            text.append(tool_result_block(text_of(b.raw("content"), b.where("content"))))
    return Message(role=role, content="".join(text), reasoning="".join(reasoning), tool_calls=tuple(calls))


def parse_messages(body: Body, *, ctx: int, default_model: str) -> ChatRequest:
    """`/v1/messages` request → normalized chat request (ds4_server.c). `max_tokens` is optional here."""
    f = Fields(body.value)
    raw_messages = message_list(f)
    call_ids: set[str] = set()
    messages = [_message(m, f"messages[{i}]", call_ids) for i, m in enumerate(raw_messages)]
    system = _system(f.raw("system"))
    if system:
        messages.insert(0, Message(role="system", content=system))

    model = f.string("model", default_model, nullable=True)
    output_config = f.object("output_config", nullable=True)
    effort = f.raw("reasoning_effort")
    if effort is None and output_config is not None:
        effort = output_config.raw("effort")
    # As in Anthropic's API, a request without `thinking` does not think (unless its model is the deepseek-reasoner
    # alias): Claude Code sends {"type": "adaptive"} while its thinking is on and omits the field when it is off
    # (CLAUDE_CODE_DISABLE_THINKING=1), so its switch works here too.
    think = think_mode(model, ctx, effort=effort, thinking=thinking_flag(f.raw("thinking"), "thinking"),
                       unasked=False)
    tool_choice = f.object("tool_choice", nullable=True)
    enabled = tool_choice is None or tool_choice.raw("type") != "none"
    tools = active_tools(f, body.tool_texts, enabled=enabled)
    options = Options(
        model=model,
        think=think,
        sampling=sampling_params(f, think, ("temperature", "top_p", "top_k")),
        stop=stop_strings(f, "stop_sequences"),
        max_tokens=max_tokens(f, "max_tokens"),
        stream=f.boolean("stream", False, nullable=True),
        output=constraint(output_format(f, "output_format", nested=False) if "output_format" in f
                          or output_config is None else output_format(output_config, "format", nested=False), tools),
    )
    return ChatRequest(options=options, messages=tuple(messages), tools=tools)


def usage_json(usage: Usage) -> dict[str, Any]:
    """Every prompt token is either read from the live cache or written to it, so `input_tokens` is 0."""
    return {
        "input_tokens": 0,
        "output_tokens": usage.completion_tokens,
        "cache_read_input_tokens": usage.cached_tokens,
        "cache_creation_input_tokens": usage.cache_write_tokens,
    }


def _input(arguments: str) -> dict[str, Any]:
    return json.loads(compact_arguments(arguments))


def message(message_id: str, created: int, request: ChatRequest, done: Done, ids: CallIds,
            text: str = "") -> dict[str, Any]:
    """The non-streaming message: thinking, text, then tool_use blocks; an empty text block when nothing else
    but thinking was written."""
    parsed = done.message
    content: list[dict[str, Any]] = []
    if parsed.reasoning:
        content.append({"type": "thinking", "thinking": parsed.reasoning, "signature": message_id})
    if parsed.content:
        content.append({"type": "text", "text": parsed.content})
    for i, call in enumerate(parsed.tool_calls):
        content.append({"type": "tool_use", "id": ids[i], "name": call.name, "input": _input(call.arguments)})
    if not parsed.content and not parsed.tool_calls:
        content.append({"type": "text", "text": ""})
    return {
        "id": message_id,
        "type": "message",
        "role": "assistant",
        "model": request.options.model,
        "content": content,
        "stop_reason": STOP_REASONS.get(done.finish_reason, "end_turn"),
        "stop_sequence": None,
        "usage": usage_json(done.usage),
    }


class MessageStream:
    """Events → Anthropic SSE events (ds4_server.c).

    Content blocks open and close as the kind of output changes: thinking (closed with a signature delta),
    text, then one tool_use block per call with `input_json_delta` fragments. No `ping` events. The final
    `message_delta` carries the whole usage as well, as Anthropic's own API does.
    """

    def __init__(self, message_id: str, created: int, request: ChatRequest, ids: CallIds) -> None:
        self.id = message_id
        self.model = request.options.model
        self.ids = ids
        self.index = -1
        self.open: str | None = None
        self.wrote_text = False
        self.streamed_calls = 0

    def _event(self, name: str, data: dict[str, Any]) -> str:
        return sse({"type": name, **data}, event=name)

    def start(self, prompt: PromptAccepted | None = None) -> list[str]:
        """`message_start`, with the prompt's cache split when the engine has reported it."""
        usage = usage_json(Usage(prompt.prompt_tokens, prompt.cached_tokens, 0) if prompt else Usage(0, 0, 0))
        start = {"id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": [],
                 "stop_reason": None, "stop_sequence": None, "usage": usage}
        return [self._event("message_start", {"message": start})]

    def _open(self, kind: str, block: dict[str, Any]) -> list[str]:
        frames = self._close()
        self.index += 1
        self.open = kind
        frames.append(self._event("content_block_start", {"index": self.index, "content_block": block}))
        return frames

    def _close(self) -> list[str]:
        frames = []
        if self.open == "thinking":
            frames.append(self._delta({"type": "signature_delta", "signature": self.id}))
        if self.open is not None:
            frames.append(self._event("content_block_stop", {"index": self.index}))
        self.open = None
        return frames

    def _delta(self, delta: dict[str, Any]) -> str:
        return self._event("content_block_delta", {"index": self.index, "delta": delta})

    def event(self, event: Event) -> list[str]:
        frames: list[str] = []
        if isinstance(event, ReasoningDelta) and event.text:
            if self.open != "thinking":
                frames += self._open("thinking", {"type": "thinking", "thinking": "", "signature": ""})
            frames.append(self._delta({"type": "thinking_delta", "thinking": event.text}))
        elif isinstance(event, TextDelta) and event.text:
            if self.open != "text":
                frames += self._open("text", {"type": "text", "text": ""})
            self.wrote_text = True
            frames.append(self._delta({"type": "text_delta", "text": event.text}))
        elif isinstance(event, ToolCallStart):
            self.streamed_calls = event.index + 1
            block = {"type": "tool_use", "id": self.ids[event.index], "name": event.name, "input": {}}
            frames += self._open("tool_use", block)
        elif isinstance(event, ToolCallArgsDelta) and event.text and self.open == "tool_use":
            frames.append(self._delta({"type": "input_json_delta", "partial_json": event.text}))
        elif isinstance(event, ToolCallEnd):
            frames += self._close()
        return frames

    def done(self, done: Done) -> list[str]:
        """Closes the open block; an empty text block when thinking ended without text or calls (not when the
        stream ends inside thinking, ds4_server.c); calls not streamed live; message_delta; message_stop."""
        frames = self._close()
        calls = done.message.tool_calls
        if not self.wrote_text and not calls and done.message.reasoning_closed:
            frames += self._open("text", {"type": "text", "text": ""}) + self._close()
        for i in range(self.streamed_calls, len(calls)):
            block = {"type": "tool_use", "id": self.ids[i], "name": calls[i].name, "input": {}}
            frames += self._open("tool_use", block)
            frames.append(self._delta({"type": "input_json_delta", "partial_json": dumps(_input(calls[i].arguments))}))
            frames += self._close()
        stop = {"stop_reason": STOP_REASONS.get(done.finish_reason, "end_turn"), "stop_sequence": None}
        frames.append(self._event("message_delta", {"delta": stop, "usage": usage_json(done.usage)}))
        frames.append(self._event("message_stop", {}))
        return frames
