"""What the OpenAI and Anthropic front ends share.

Both translate a request body into the same normalized request (chat messages, raw tool schemas, think mode,
sampling, stop strings, token limit) and both read their fields through `Fields`, so type errors read the same
everywhere. The engine's event stream comes back as `ds4_mlx.events`; the wire encodings of JSON and SSE frames
are defined here once.
"""

from __future__ import annotations

import json
import math
import secrets
from dataclasses import dataclass
from typing import Any

from ..chat import Message, ThinkMode, request_think_mode, think_mode_from_effort
from ..constrain import Constraint, OutputFormat, SchemaError
from ..toolgrammar import ToolSpec
from ..errors import RequestError
from ..sampling import SamplingParams


class ApiError(RequestError):
    """A request the server refuses: its HTTP status, message and the extra members of the error body.

    `param` and `code` follow OpenAI's error object; `extra` members are appended as they are (e.g. the
    `n_prompt_tokens` and `n_ctx` of a context overflow).
    """

    def __init__(
        self,
        message: str,
        status: int = 400,
        *,
        param: str | None = None,
        code: str | None = None,
        extra: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.code = code
        self.extra = extra or {}


def context_overflow(n_prompt_tokens: int, n_ctx: int, param: str) -> ApiError:
    """ds4_server.c: one free slot after the prompt is required, so `prompt >= ctx` fails."""
    return ApiError(
        f"Prompt has {n_prompt_tokens} tokens, but the configured context size is {n_ctx} tokens",
        param=param,
        code="context_length_exceeded",
        extra={"n_prompt_tokens": n_prompt_tokens, "n_ctx": n_ctx},
    )


def invalid_value(path: str, value: Any, supported: tuple[str, ...]) -> ApiError:
    """OpenAI's wording for a value outside an enumeration, with the client's field as `param`."""
    listed = [f"'{v}'" for v in supported]
    choices = ", ".join(listed[:-1]) + f", and {listed[-1]}" if len(listed) > 2 else " and ".join(listed)
    return ApiError(f"Invalid value: {abbreviated(value)!r}. Supported values are: {choices}.", param=path,
                    code="invalid_value")


_KINDS: dict[type | tuple[type, ...], str] = {
    str: "a string",
    bool: "a boolean",
    (int, float): "a number",
    int: "an integer",
    list: "an array",
    dict: "an object",
}
_MISSING = object()


def _kind_of(value: Any) -> str:
    if value is None:
        return "null"
    for kinds, name in _KINDS.items():
        if isinstance(value, kinds) and not (isinstance(value, bool) and kinds is not bool):
            return name
    return type(value).__name__


class Fields:
    """Typed, optional access to the members of one JSON object of a request.

    Every accessor returns `default` when the member is absent (or null where null is allowed) and raises a
    400 naming the member's path and the expected type otherwise. Booleans are never numbers.
    """

    def __init__(self, value: Any, path: str = "") -> None:
        if not isinstance(value, dict):
            raise ApiError(f"invalid request: {path or 'the body'} must be an object, got {_kind_of(value)}",
                           param=path or None)
        self.value = value
        self.path = path

    def where(self, key: str) -> str:
        return f"{self.path}.{key}" if self.path else key

    def __contains__(self, key: str) -> bool:
        return key in self.value

    def _get(self, key: str, kinds: type | tuple[type, ...], default: Any, nullable: bool, expected: str = "") -> Any:
        value = self.value.get(key, _MISSING)
        if value is _MISSING or (value is None and nullable):
            return default
        if isinstance(value, kinds) and not (isinstance(value, bool) and bool not in _as_tuple(kinds)):
            return value
        expected = (expected or _KINDS[kinds]) + (" or null" if nullable else "")
        raise ApiError(f"invalid request: {self.where(key)} must be {expected}, got {_kind_of(value)}",
                       param=self.where(key))

    def string(self, key: str, default: str | None = None, *, nullable: bool = False) -> str | None:
        return self._get(key, str, default, nullable)

    def boolean(self, key: str, default: bool | None = None, *, nullable: bool = False) -> bool | None:
        return self._get(key, bool, default, nullable)

    def number(self, key: str, default: float | None = None, *, nullable: bool = False) -> float | None:
        """A finite number, as a float (JSON allows integers and exponents beyond the float range)."""
        value = self._get(key, (int, float), _MISSING, nullable)
        if value is _MISSING:
            return default
        try:
            number = float(value)
        except OverflowError:
            number = math.inf
        if not math.isfinite(number):
            raise ApiError(f"invalid request: {self.where(key)} must be a finite number (at most about 1.8e308)",
                           param=self.where(key))
        return number

    def integer(self, key: str, default: int | None = None, *, nullable: bool = False) -> int | None:
        value = self._get(key, (int, float), _MISSING, nullable, "an integer")
        if value is _MISSING:
            return default
        if isinstance(value, float):
            if not value.is_integer():
                raise ApiError(f"invalid request: {self.where(key)} must be an integer, got {value}",
                               param=self.where(key))
            value = int(value)
        return value

    def array(self, key: str, default: list | None = None, *, nullable: bool = False) -> list | None:
        return self._get(key, list, default, nullable)

    def object(self, key: str, *, nullable: bool = False) -> Fields | None:
        value = self._get(key, dict, None, nullable)
        return None if value is None else Fields(value, self.where(key))

    def raw(self, key: str, default: Any = None) -> Any:
        return self.value.get(key, default)


def _as_tuple(kinds: type | tuple[type, ...]) -> tuple[type, ...]:
    return kinds if isinstance(kinds, tuple) else (kinds,)


def abbreviated(value: Any, limit: int = 40) -> str:
    """A client's value for an error message: a string as it is, anything else as JSON; cut to `limit` characters."""
    text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def text_of(value: Any, path: str, *, separator: str = "") -> str:
    """Message text: a string, null (""), or an array of strings and `{"text": ...}` parts joined by
    `separator`; parts without text (images, documents) contribute nothing (ds4_server.c)."""
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise ApiError(f"invalid request: {path} must be a string, an array of parts or null, got {_kind_of(value)}",
                       param=path)
    parts = []
    for i, part in enumerate(value):
        if isinstance(part, str):
            parts.append(part)
        elif isinstance(part, dict):
            text = Fields(part, f"{path}[{i}]").string("text", nullable=True)
            if text is not None:
                parts.append(text)
        else:
            raise ApiError(f"invalid request: {path}[{i}] must be a string or an object, got {_kind_of(part)}",
                           param=f"{path}[{i}]")
    return separator.join(parts)


def message_list(fields: Fields) -> list[Any]:
    """The request's `messages`: required, and not empty (chat completions and Anthropic messages alike)."""
    if fields.raw("messages") is None:
        raise ApiError("missing messages")
    messages = fields.array("messages")
    if not messages:
        raise ApiError("invalid request: messages must contain at least one message")
    return messages


def thinking_flag(value: Any, path: str) -> bool | None:
    """An explicit `thinking` control: a boolean, or an object whose `type` is enabled or adaptive (Anthropic's
    "think as much as the question needs", which Claude Code sends whenever its thinking is on) or disabled; None
    otherwise (absent, null, or an unknown type)."""
    if value is None or isinstance(value, bool):
        return value
    kind = Fields(value, path).string("type", nullable=True)
    return {"enabled": True, "adaptive": True, "disabled": False}.get(kind or "")


def think_mode(model: str, ctx: int, *, effort: Any, thinking: bool | None, unasked: bool = True) -> ThinkMode:
    """The think mode of a request: explicit controls first, then the model alias, then `unasked`, the API's
    default (chat.request_think_mode)."""
    if effort is not None and not isinstance(effort, str):
        raise ApiError(f"invalid request: the reasoning effort must be a string or null, got {_kind_of(effort)}")
    return request_think_mode(model=model, thinking=thinking, effort=think_mode_from_effort(effort), ctx=ctx,
                              unasked=unasked)


SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty", "frequency_penalty")


def sampling_params(fields: Fields, think: ThinkMode, names: tuple[str, ...] = SAMPLING_FIELDS) -> SamplingParams:
    """Sampling from the request's knobs; in thinking mode every knob except `seed` is ignored.

    The knobs are still type-checked in thinking mode, so a malformed request fails the same way in both modes.
    A knob sent as null is not set, as OpenAI's API takes it. A seed of 0 or less means "random", as in ds4.
    """
    knobs: dict[str, Any] = {}
    for name in names:
        read = fields.integer if name in ("top_k", "seed") else fields.number
        value = read(name, nullable=True)
        if value is not None:
            knobs[name] = value
    seed = knobs.pop("seed", None)
    seed = seed if seed is not None and seed > 0 else None
    if think.thinking:
        return SamplingParams(seed=seed)
    return SamplingParams(seed=seed, **_in_sampler_range(knobs))


def _in_sampler_range(knobs: dict[str, Any]) -> dict[str, Any]:
    """ds4 samples with any number for these knobs; the values outside the sampler's range mean (ds4.c
    `sample_top_p_min_p`): temperature below 0 is greedy like 0, a top_p of 0 or less keeps only the most likely
    token (the nucleus is complete at the first one), above 1 keeps every token, and min_p below 0 drops none."""
    knobs = dict(knobs)
    if knobs.get("temperature", 0) < 0:
        knobs["temperature"] = 0.0
    if "top_p" in knobs:
        top_p = knobs.pop("top_p")
        if top_p <= 0:
            knobs["top_k"] = 1
        else:
            knobs["top_p"] = min(top_p, 1.0)
    if knobs.get("min_p", 0) < 0:
        knobs["min_p"] = 0.0
    return knobs


def stop_strings(fields: Fields, key: str) -> tuple[str, ...]:
    """A stop string or an array of them; empty strings are ignored."""
    value = fields.raw(key)
    if value is None:
        return ()
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
        raise ApiError(f"invalid request: {fields.where(key)} must be a string or an array of strings")
    return tuple(s for s in value if s)


def max_tokens(fields: Fields, *keys: str) -> int | None:
    """The first of `keys` present and not null: an integer, where a negative limit means 0 as in ds4."""
    for key in keys:
        value = fields.integer(key, nullable=True)
        if value is not None:
            return max(0, value)
    return None


FORMAT_TYPES = ("text", "json_object", "json_schema")


def output_format(fields: Fields, key: str, *, nested: bool) -> OutputFormat | None:
    """The answer format a request asks for; None for free text.

    `{"type":"json_object"}` holds the answer to a JSON object; `{"type":"json_schema", ...}` to the schema, which
    chat nests as `json_schema: {name, schema, strict}` (`nested`) and Responses / Anthropic give flat
    (`name`, `schema`, `strict`). The schema is enforced whatever `strict` says. A schema the grammar library cannot
    take is a 400 naming the field and the part of the schema."""
    f = fields.object(key, nullable=True)
    if f is None:
        return None
    kind = f.string("type", nullable=True)
    if kind not in FORMAT_TYPES:
        raise invalid_value(f.where("type"), kind, FORMAT_TYPES)
    if kind == "text":
        return None
    try:
        if kind == "json_object":
            return OutputFormat.json_object()
        spec = f.object("json_schema") if nested else f
        if spec is None:
            raise ApiError(f"invalid request: {f.where('json_schema')} is required for type json_schema",
                           param=f.where("json_schema"))
        spec.boolean("strict", nullable=True)
        if "schema" not in spec:
            raise ApiError(f"invalid request: {spec.where('schema')} is required for type json_schema",
                           param=spec.where("schema"))
        return OutputFormat.build("json_schema", spec.raw("schema"), spec.string("name", "", nullable=True) or "",
                                  spec.where("schema"))
    except SchemaError as exc:
        raise ApiError(str(exc), param=exc.param, code="invalid_json_schema") from exc


def constraint(answer: OutputFormat | None, tool_texts: tuple[str, ...], where: str = "tools"
               ) -> Constraint | None:
    """The request's constraint from its answer format and its offered tools (the raw schema texts the model is
    shown), where a tool with `strict: true` (OpenAI's `function.strict`, Responses' and Anthropic's `strict`) has its
    calls held to its `parameters` / `input_schema`. A schema the grammar library cannot take is a 400 naming the
    tool (`where[i]`) and the part."""
    specs, params = [], []
    for i, text in enumerate(tool_texts):
        try:
            tool = json.loads(text)
        except ValueError:
            tool = {}
        tool = tool if isinstance(tool, dict) else {}
        fn = tool["function"] if isinstance(tool.get("function"), dict) else tool
        schema = fn.get("parameters", fn.get("input_schema"))
        strict = fn.get("strict") is True or tool.get("strict") is True
        specs.append(ToolSpec(str(fn.get("name", "")), (schema if isinstance(schema, dict) else {}) if strict
                              else None))
        params.append(f"{where}[{i}]")
    try:
        return Constraint.make(answer, specs, params)
    except SchemaError as exc:
        raise ApiError(str(exc), param=exc.param, code="invalid_json_schema") from exc


@dataclass(frozen=True)
class Options:
    """What every generation endpoint decides besides the prompt."""

    model: str
    think: ThinkMode
    sampling: SamplingParams
    stop: tuple[str, ...] = ()
    max_tokens: int | None = None
    stream: bool = False
    include_usage: bool = False
    output: Constraint | None = None
    """What the answer is held to: its format (`response_format`, Responses `text.format`, Anthropic
    `output_format`) and the calls of tools declared `strict`."""


@dataclass(frozen=True)
class ChatRequest:
    """A chat request in the renderer's terms: messages and the raw text of each active tool schema."""

    options: Options
    messages: tuple[Message, ...]
    tools: tuple[str, ...] = ()


@dataclass(frozen=True)
class CompletionRequest:
    """A legacy completion: one prompt string wrapped in a one-turn chat."""

    options: Options
    prompt: str


def new_id(prefix: str, nbytes: int = 16) -> str:
    """`prefix` + lowercase hex of `nbytes` random bytes (tool-call ids use 16, ds4_server.c)."""
    return prefix + secrets.token_hex(nbytes)


class CallIds:
    """Wire ids of one message's tool calls, by call index, created when first asked for.

    A streamed call keeps the id it was announced with; calls parsed only at the end get fresh ones.
    """

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self.ids: list[str] = []

    def __getitem__(self, index: int) -> str:
        while len(self.ids) <= index:
            self.ids.append(new_id(self.prefix))
        return self.ids[index]

    def first(self, n: int) -> list[str]:
        return [self[i] for i in range(n)]


def compact_arguments(text: str) -> str:
    """Tool-call arguments as a compact JSON object text in generated key order; "{}" when they do not parse
    (the parser already writes them compactly; this is the API's guarantee, ds4_server.c)."""
    try:
        value = json.loads(text)
    except ValueError:
        return "{}"
    return dumps(value) if isinstance(value, dict) else "{}"


def dumps(value: Any) -> str:
    """Compact JSON with raw UTF-8, as ds4 writes it (ds4_server.c)."""
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def sse(data: Any, event: str | None = None) -> str:
    """One SSE frame; `data` is a JSON value or an already-encoded string such as `[DONE]`."""
    payload = data if isinstance(data, str) else dumps(data)
    return (f"event: {event}\n" if event else "") + f"data: {payload}\n\n"


KEEPALIVE = ": prefill\n\n"
"""The SSE comment sent while a long prefill runs, so that clients and proxies keep the stream open."""
