"""OpenAI wire format: `/v1/chat/completions`, `/v1/completions` and `/v1/models`.

Pure translations. A request body becomes a normalized `ChatRequest` / `CompletionRequest`; the engine's events
become the JSON body or the SSE frames ds4 sends (ds4_server.c), byte for byte.
"""

from __future__ import annotations

from typing import Any

from ..chat import Message, ToolCallSpec
from ..constrain import Constraint
from ..events import (
    Done,
    Event,
    PromptAccepted,
    ReasoningDelta,
    TextDelta,
    ToolCallArgsDelta,
    ToolCallStart,
    Usage,
)
from .common import (
    ApiError,
    CallIds,
    ChatRequest,
    CompletionRequest,
    Fields,
    Options,
    compact_arguments,
    constraint,
    invalid_value,
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
from .modelcard import EFFORTS, THINKING_BY_ALIAS, ModelCard
from .rawjson import Body

CHAT_ROLES = ("system", "developer", "user", "assistant", "tool", "function", "latest_reminder")
"""Roles a chat message may have; `latest_reminder` is accepted and, as in ds4, not rendered."""

DONE_FRAME = sse("[DONE]")

_ERROR_TYPES = {401: "authentication_error", 404: "invalid_request_error", 429: "rate_limit_error"}


def error_json(error: ApiError) -> dict[str, Any]:
    """`{"error":{"message","type",...}}`, with `param`/`code` and extra members only when set."""
    kind = "server_error" if error.status >= 500 else _ERROR_TYPES.get(error.status, "invalid_request_error")
    body: dict[str, Any] = {"message": error.message, "type": kind}
    if error.param is not None:
        body["param"] = error.param
    if error.code is not None:
        body["code"] = error.code
    body.update(error.extra)
    return {"error": body}


def stream_error(message: str) -> str:
    """The SSE frame for a failure after the stream began."""
    return sse({"error": {"message": message, "type": "server_error"}}, event="error")


def _options(f: Fields, *, ctx: int, default_model: str, stop_key: str = "stop",
             output: Constraint | None = None) -> Options:
    """What a chat or legacy completion asks for besides the prompt; fields sent as null are not set."""
    if f.integer("n", 1, nullable=True) != 1:
        raise ApiError("invalid request: n must be 1: this server generates one choice per request", param="n",
                       code="invalid_value")
    model = f.string("model", default_model, nullable=True)
    thinking = f.boolean("think", nullable=True)
    if thinking is None:
        thinking = thinking_flag(f.raw("thinking"), f.where("thinking"))
    think = think_mode(model, ctx, effort=f.raw("reasoning_effort"), thinking=thinking)
    stream_options = f.object("stream_options", nullable=True)
    return Options(
        model=model,
        think=think,
        sampling=sampling_params(f, think),
        stop=stop_strings(f, stop_key),
        max_tokens=max_tokens(f, "max_completion_tokens", "max_tokens"),
        stream=f.boolean("stream", False, nullable=True),
        include_usage=bool(stream_options and stream_options.boolean("include_usage", False, nullable=True)),
        output=output,
    )


def active_tools(f: Fields, tool_texts: tuple[str, ...], *, enabled: bool) -> tuple[str, ...]:
    """The raw schema text of each tool; none when `tool_choice` turned tools off (ds4_server.c).

    Every tool must at least name itself; the schemas are otherwise shown to the model as the client wrote them.
    """
    tools = f.array("tools", nullable=True)
    if not tools or not enabled:
        return ()
    for i, tool in enumerate(tools):
        tool_fields = Fields(tool, f"tools[{i}]")
        if "function" in tool_fields or tool_fields.raw("type") == "function":  # OpenAI's shape, else Anthropic's
            function = tool_fields.object("function")
            where = tool_fields.where("function.name")
            name = function.string("name") if function is not None else None
        else:
            where, name = tool_fields.where("name"), tool_fields.string("name")
        if not name:
            raise ApiError(f"invalid request: {where} must be a non-empty string", param=where)
    return tool_texts


def _tool_call(value: Any, path: str) -> ToolCallSpec | None:
    """One `tool_calls` entry; like ds4, an entry without a function name or arguments is dropped."""
    f = Fields(value, path)
    function = f.object("function", nullable=True)
    if function is None:
        return None
    name = function.string("name", nullable=True)
    arguments = function.raw("arguments")
    if name is None or arguments is None:
        return None
    return ToolCallSpec(id=f.string("id", "", nullable=True), name=name, arguments=arguments)


def _message(value: Any, path: str) -> Message:
    f = Fields(value, path)
    role = f.string("role", "user")
    if role not in CHAT_ROLES:
        raise invalid_value(f.where("role"), role, CHAT_ROLES)
    calls = f.array("tool_calls", nullable=True) or []
    parsed = (_tool_call(c, f"{f.where('tool_calls')}[{i}]") for i, c in enumerate(calls))
    return Message(
        role=role,
        content=text_of(f.raw("content"), f.where("content")),
        reasoning=text_of(f.raw("reasoning_content"), f.where("reasoning_content")),
        tool_calls=tuple(c for c in parsed if c is not None),
        tool_call_id=f.string("tool_call_id", ""),
    )


def parse_chat(body: Body, *, ctx: int, default_model: str) -> ChatRequest:
    """`/v1/chat/completions` request → normalized chat request."""
    f = Fields(body.value)
    messages = message_list(f)
    tools = active_tools(f, body.tool_texts, enabled=f.raw("tool_choice") != "none")
    return ChatRequest(
        options=_options(f, ctx=ctx, default_model=default_model,
                         output=constraint(output_format(f, "response_format", nested=True), tools)),
        messages=tuple(_message(m, f"messages[{i}]") for i, m in enumerate(messages)),
        tools=tools,
    )


def parse_completion(body: Body, *, ctx: int, default_model: str) -> CompletionRequest:
    """`/v1/completions` request; of an array `prompt` only the first string is used, as in ds4."""
    f = Fields(body.value)
    prompt = f.raw("prompt")
    if prompt is None:
        raise ApiError("missing prompt")
    if isinstance(prompt, list):
        if not prompt or not isinstance(prompt[0], str):
            raise ApiError("invalid request: prompt must be a string or an array whose first element is a string")
        prompt = prompt[0]
    if not isinstance(prompt, str):
        raise ApiError("invalid request: prompt must be a string or an array of strings")
    return CompletionRequest(options=_options(f, ctx=ctx, default_model=default_model), prompt=prompt)


def usage_json(usage: Usage) -> dict[str, Any]:
    """OpenAI usage with ds4's `cache_write_tokens` extension (ds4_server.c) and the reasoning token count."""
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.total_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens, "cache_write_tokens": usage.cache_write_tokens},
        "completion_tokens_details": {"reasoning_tokens": usage.reasoning_tokens},
    }


def _tool_call_json(call_id: str, name: str, arguments: str) -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def chat_completion(response_id: str, created: int, request: ChatRequest, done: Done, ids: CallIds,
                    text: str = "") -> dict[str, Any]:
    """The non-streaming `chat.completion` object.

    As in ds4 (ds4_server.c), reasoning that never reached `</think>` (e.g. cut by max_tokens) is reported
    as `content`, so that a client that ignores `reasoning_content` still sees what was generated.
    """
    message = done.message
    reply: dict[str, Any] = {"role": "assistant", "content": message.content}
    if not message.reasoning_closed:
        reply["content"] = message.reasoning + message.content
    elif message.reasoning:
        reply["reasoning_content"] = message.reasoning
    if message.tool_calls:
        reply["tool_calls"] = [
            _tool_call_json(ids[i], call.name, compact_arguments(call.arguments))
            for i, call in enumerate(message.tool_calls)
        ]
    return {
        "id": response_id,
        "object": "chat.completion",
        "created": created,
        "model": request.options.model,
        "choices": [{"index": 0, "message": reply, "finish_reason": done.finish_reason}],
        "usage": usage_json(done.usage),
    }


class ChatStream:
    """Events → `chat.completion.chunk` SSE frames (ds4_server.c).

    Order: the role chunk, reasoning deltas, content deltas, tool-call deltas as the parser recognises them,
    the finish chunk, the usage chunk (only with `stream_options.include_usage`), then `[DONE]`.
    """

    def __init__(self, response_id: str, created: int, request: ChatRequest, ids: CallIds) -> None:
        self.head = {"id": response_id, "object": "chat.completion.chunk", "created": created,
                     "model": request.options.model}
        self.ids = ids
        self.include_usage = request.options.include_usage
        self.streamed_calls = 0

    def _chunk(self, delta: dict[str, Any], finish_reason: str | None = None) -> str:
        return sse({**self.head, "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason}]})

    def start(self, prompt: PromptAccepted | None = None) -> list[str]:
        return [self._chunk({"role": "assistant"})]

    def event(self, event: Event) -> list[str]:
        if isinstance(event, ReasoningDelta) and event.text:
            return [self._chunk({"reasoning_content": event.text})]
        if isinstance(event, TextDelta) and event.text:
            return [self._chunk({"content": event.text})]
        if isinstance(event, ToolCallStart):
            self.streamed_calls = event.index + 1
            call = {"index": event.index, **_tool_call_json(self.ids[event.index], event.name, "")}
            return [self._chunk({"tool_calls": [call]})]
        if isinstance(event, ToolCallArgsDelta) and event.text:
            call = {"index": event.index, "function": {"arguments": event.text}}
            return [self._chunk({"tool_calls": [call]})]
        return []

    def done(self, done: Done) -> list[str]:
        frames = []
        late = [
            {"index": i, **_tool_call_json(self.ids[i], call.name, compact_arguments(call.arguments))}
            for i, call in enumerate(done.message.tool_calls)
            if i >= self.streamed_calls
        ]
        if late:
            frames.append(self._chunk({"tool_calls": late}))
        frames.append(self._chunk({}, done.finish_reason))
        if self.include_usage:
            frames.append(sse({**self.head, "choices": [], "usage": usage_json(done.usage)}))
        frames.append(DONE_FRAME)
        return frames


def completion(response_id: str, created: int, request: CompletionRequest, done: Done, ids: CallIds,
               text: str) -> dict[str, Any]:
    """The non-streaming `text_completion` object; `text` is the raw generated text (see `CompletionStream`)."""
    return {
        "id": response_id,
        "object": "text_completion",
        "created": created,
        "model": request.options.model,
        "choices": [{"text": text, "index": 0, "finish_reason": done.finish_reason}],
        "usage": usage_json(done.usage),
    }


class CompletionStream:
    """Events → `text_completion` SSE frames: text frames, a finish frame, the usage frame if asked, [DONE].

    A legacy completion returns the raw generated text, reasoning and `</think>` included (ds4_server.c),
    so it is generated without the reasoning split: every piece arrives as a TextDelta.
    """

    def __init__(self, response_id: str, created: int, request: CompletionRequest, ids: CallIds) -> None:
        self.head = {"id": response_id, "object": "text_completion", "created": created,
                     "model": request.options.model}
        self.include_usage = request.options.include_usage

    def _frame(self, text: str, finish_reason: str | None = None) -> str:
        return sse({**self.head, "choices": [{"text": text, "index": 0, "finish_reason": finish_reason}]})

    def start(self, prompt: PromptAccepted | None = None) -> list[str]:
        return []

    def event(self, event: Event) -> list[str]:
        return [self._frame(event.text)] if isinstance(event, TextDelta) and event.text else []

    def done(self, done: Done) -> list[str]:
        frames = [self._frame("", done.finish_reason)]
        if self.include_usage:
            frames.append(sse({**self.head, "choices": [], "usage": usage_json(done.usage)}))
        frames.append(DONE_FRAME)
        return frames


def model_json(model_id: str, card: ModelCard) -> dict[str, Any]:
    """One `/v1/models` entry: ds4's keys in ds4's order (ds4_server.c), then the limits under the other names
    clients read them by (`max_model_len`: vLLM's; `context_window`, `max_context_length`; `max_output_tokens`),
    thinking, the capabilities and the checkpoint (docs/server.md, "The model card")."""
    thinks = THINKING_BY_ALIAS.get(model_id, True)
    return {
        "id": model_id,
        "object": "model",
        "created": 1767225600,
        "owned_by": "ds4-mlx",
        "name": "DeepSeek V4 Flash",
        "context_length": card.ctx,
        "top_provider": {"context_length": card.ctx, "max_completion_tokens": card.max_completion_tokens,
                         "is_moderated": False},
        "supported_parameters": ["tools", "tool_choice", "max_tokens", "temperature", "top_p", "top_k", "min_p",
                                 "stop", "seed", "stream", "reasoning_effort", "reasoning", "include_reasoning",
                                 "response_format", "structured_outputs", "presence_penalty", "frequency_penalty"],
        "max_model_len": card.ctx,
        "context_window": card.ctx,
        "max_context_length": card.trained_context,
        "max_output_tokens": card.max_completion_tokens,
        "architecture": {"modality": "text->text", "input_modalities": ["text"], "output_modalities": ["text"],
                         "tokenizer": "DeepSeek"},
        "thinking": {"supported": True, "default": thinks, "efforts": list(EFFORTS)},
        "capabilities": {"reasoning": True, "tool_calls": True, "structured_outputs": True, "vision": False},
        "checkpoint": card.checkpoint,
        "checkpoint_basis": card.checkpoint_basis,
        "gguf_name": card.name,
    }
