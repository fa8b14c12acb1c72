"""Prompt rendering: chat messages to the exact text DeepSeek V4 Flash is prompted with.

The rules are ds4's (ds4_server.c), not the official `encoding_dsv4.py`: real agent clients already work
against ds4's prompts, and byte-identical prompts are what make prefix (KV) reuse work across requests.
docs/chat-rendering.md lists where the two differ and why we follow ds4.

This module knows nothing about MLX or about any wire format: the server's OpenAI / Anthropic / Responses
translators normalise their requests into `Message`s first (content arrays flattened, tool-call arguments
kept as the client's JSON text, tool schemas kept as the client's raw bytes).
"""

from __future__ import annotations

import enum
import json
import re
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from ds4_mlx.errors import RequestError
from ds4_mlx.model.checkpoint import Checkpoint
from ds4_mlx.tokenizer import ASSISTANT, BOS, DSML, EOS, THINK, THINK_END, USER


TOOL_RESULT = "<tool_result>"
TOOL_RESULT_END = "</tool_result>"
DSML_TOOL_CALLS = f"<{DSML}tool_calls>"
DSML_TOOL_CALLS_END = f"</{DSML}tool_calls>"
DSML_INVOKE_END = f"</{DSML}invoke>"
DSML_PARAMETER_END = f"</{DSML}parameter>"

THINK_MAX_MIN_CONTEXT = 393216
"""Think Max needs a 384K context (the C engine's DS4_THINK_MAX_MIN_CONTEXT); below it the request runs as HIGH."""

DEFAULT_SYSTEM = "You are a helpful assistant"

ABSOLUTE_MAXIMUM_PREFIX = (
    "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
    "You MUST be very thorough in your thinking and comprehensively decompose the problem to resolve the root "
    "cause, rigorously stress-testing your logic against all potential paths, edge cases, and adversarial "
    "scenarios.\n"
    "Explicitly write out your entire deliberation process, documenting every intermediate step, considered "
    "alternative, and rejected hypothesis to ensure absolutely no assumption is left unchecked.\n"
    "\n"
)
"""The preview's Think Max prefix (476 bytes), which is 0731's `high` tier."""

BEYOND_MAXIMUM_PREFIX = (
    "Reasoning Effort: Beyond maximum \u2014 exhaustive, relentless, and uncompromising.\n"
    "You MUST reason with the utmost depth and rigor, leaving absolutely nothing to chance: exhaustively decompose "
    "the problem into its most fundamental components, trace every causal chain to its root, and resolve the "
    "underlying cause rather than any surface symptom.\n"
    "Do not stop reasoning until you have independently verified the solution from multiple angles and are certain "
    "that no assumption remains unchecked and no error remains undiscovered.\n"
    "\n"
)
"""0731's `max` tier prefix (528 bytes; the dash is U+2014), from DeepSeek's 0731 encoding notes."""

TOOLS_PREAMBLE = (
    "## Tools\n\n"
    "You have access to a set of tools to help answer the user question. "
    f'You can invoke tools by writing a "<{DSML}tool_calls>" block like the following:\n\n'
    f"<{DSML}tool_calls>\n"
    f'<{DSML}invoke name="$TOOL_NAME">\n'
    f'<{DSML}parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</{DSML}parameter>\n'
    "...\n"
    f"</{DSML}invoke>\n"
    f'<{DSML}invoke name="$TOOL_NAME2">\n'
    "...\n"
    f"</{DSML}invoke>\n"
    f"</{DSML}tool_calls>\n\n"
    'String parameters should be specified as raw text and set `string="true"`. '
    "Preserve characters such as `>`, `&`, and `&&` exactly; never replace normal string characters with XML "
    "or HTML entity escapes. "
    f"Only if a string value itself contains the exact closing parameter tag `</{DSML}parameter>`, write that "
    f"tag as `&lt;/{DSML}parameter>` inside the value. "
    "For all other types (numbers, booleans, arrays, objects), pass the value in JSON format and set "
    '`string="false"`.\n\n'
    "If thinking_mode is enabled (triggered by <think>), you MUST output your complete reasoning inside "
    "<think>...</think> BEFORE any tool calls or final response.\n\n"
    "Otherwise, output directly after </think> with tool calls or final response.\n\n"
    "### Available Tool Schemas\n\n"
)
"""The tools preamble up to the schema lines (ds4_server.c)."""

TOOLS_EPILOGUE = (
    "\n\nYou MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls. "
    "Use the exact parameter names from the schemas."
)
"""What follows the schema lines; no trailing newline (the next bytes are "\\n\\n" + system text or USER)."""

SYSTEM_ROLES = frozenset({"system", "developer"})
TOOL_ROLES = frozenset({"tool", "function"})
USER_ROLES = frozenset({"user"}) | TOOL_ROLES
CONVERSATION_ROLES = USER_ROLES | {"assistant"}


class ThinkMode(enum.Enum):
    """How much the model reasons before answering: off, or one of the reasoning-effort tiers, whose prefix after
    BOS depends on the checkpoint (`effort_prefix`). LOW is the default."""

    NONE = "none"
    LOW = "low"
    HIGH = "high"
    MAX = "max"

    @property
    def thinking(self) -> bool:
        return self is not ThinkMode.NONE


_EFFORTS = {
    "max": ThinkMode.MAX,
    "xhigh": ThinkMode.HIGH,
    "high": ThinkMode.HIGH,
    "medium": ThinkMode.LOW,
    "low": ThinkMode.LOW,
    "minimal": ThinkMode.LOW,
    "none": ThinkMode.NONE,
}
"""Request efforts by name: the three tiers by their own names, `xhigh` as high, `medium` and `minimal` as low
(clients that send `medium` by default get the default tier)."""


def effort_prefix(mode: ThinkMode, checkpoint: Checkpoint) -> str:
    """What follows BOS for a tier. 0731: low nothing, high the "Absolute maximum" text, max the "Beyond maximum"
    one (DeepSeek's 0731 encoding). The preview had two tiers, its default (no prefix) and max ("Absolute
    maximum"): low and high both render as its default."""
    if checkpoint is Checkpoint.V0731:
        return {ThinkMode.HIGH: ABSOLUTE_MAXIMUM_PREFIX, ThinkMode.MAX: BEYOND_MAXIMUM_PREFIX}.get(mode, "")
    return ABSOLUTE_MAXIMUM_PREFIX if mode is ThinkMode.MAX else ""


def effective_think_mode(mode: ThinkMode, ctx: int) -> ThinkMode:
    """MAX silently becomes HIGH when the context is too small for it (ds4_server.c)."""
    if mode is ThinkMode.MAX and ctx < THINK_MAX_MIN_CONTEXT:
        return ThinkMode.HIGH
    return mode


def think_mode_from_effort(effort: str | None, current: ThinkMode = ThinkMode.LOW) -> ThinkMode:
    """Map a `reasoning_effort` / `output_config.effort` / `reasoning.effort` value (`_EFFORTS`); null keeps
    `current`; "none" turns thinking off."""
    if effort is None:
        return current
    if not isinstance(effort, str) or effort not in _EFFORTS:
        raise RequestError(
            f"unsupported reasoning effort {effort!r}: expected one of {', '.join(_EFFORTS)} or null"
        )
    return _EFFORTS[effort]


def model_alias_thinking(model: str | None) -> bool | None:
    """Thinking on/off implied by a DeepSeek API model alias, None for any other name (ds4_server.c)."""
    if model == "deepseek-chat":
        return False
    if model == "deepseek-reasoner":
        return True
    return None


def request_think_mode(*, model: str | None, thinking: bool | None, effort: ThinkMode, ctx: int,
                       unasked: bool = True) -> ThinkMode:
    """The think mode a chat request runs with, as ds4 combines its controls.

    `thinking` is an explicit `thinking`/`think` field (None when absent); only when it is absent does the
    model alias decide, and when neither does, `unasked`: True is ds4's rule (any other model name thinks), False
    the Messages API's (no `thinking`, no thinking). Thinking off, or effort none, gives NONE; otherwise the
    effort's level, gated by ctx. An effort alone never turns thinking on.
    """
    enabled = thinking if thinking is not None else model_alias_thinking(model)
    if enabled is None:
        enabled = unasked
    if enabled is False or effort is ThinkMode.NONE:
        return ThinkMode.NONE
    return effective_think_mode(effort, ctx)


@dataclass(frozen=True)
class ToolCallSpec:
    """One tool call of a past assistant message.

    `arguments` is the client's JSON text (a str, used byte for byte) or an already-parsed JSON value
    (serialised compactly first). Passing the text is exact; a parsed value loses number spellings like
    `1.50` and decoded `\\u00e9` escapes inside nested objects.
    """

    id: str
    name: str
    arguments: Any = "{}"


@dataclass(frozen=True)
class Message:
    """One normalised chat message.

    Roles: system, developer (the system region when they open the list, else their text in place), user,
    assistant, tool, function (tool results); anything else, e.g. latest_reminder, is dropped by the renderer.
    `tool_call_id` (the call a tool result answers) is never printed; the server uses it to bind results to a
    live turn.
    """

    role: str
    content: str = ""
    reasoning: str = ""
    tool_calls: tuple[ToolCallSpec, ...] = ()
    tool_call_id: str = ""

    def __post_init__(self) -> None:
        for name in ("role", "content", "reasoning", "tool_call_id"):
            value = getattr(self, name)
            if not isinstance(value, str):
                raise TypeError(
                    f"Message.{name} must be a str, got {type(value).__name__} "
                    "(flatten content arrays before building a Message)"
                )
        object.__setattr__(self, "tool_calls", tuple(self.tool_calls))


class ToolMemory:
    """Tool-call id -> the exact DSML block the model sampled, so a later request replays it verbatim.

    Clients send tool calls back as JSON; re-rendering that JSON canonically rarely reproduces the sampled
    bytes (key order, spacing, escapes), which would break prefix reuse. Bounded LRU: a use refreshes an id;
    the oldest ids are dropped past `max_ids` entries or `max_bytes` (UTF-8 bytes of id + block, counted per
    id). Not locked: the engine's `tool_memory_lock` guards it where two threads meet.
    """

    def __init__(self, max_ids: int = 100_000, max_bytes: int = 512 * 1024 * 1024) -> None:
        if max_ids < 1 or max_bytes < 1:
            raise ValueError(f"ToolMemory limits must be positive, got max_ids={max_ids} max_bytes={max_bytes}")
        self.max_ids = max_ids
        self.max_bytes = max_bytes
        self.nbytes = 0
        self._blocks: OrderedDict[str, str] = OrderedDict()

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, call_id: object) -> bool:
        return call_id in self._blocks

    def items(self) -> list[tuple[str, str]]:
        """Every (id, block) pair, oldest first (the disk cache persists those its text replays)."""
        return list(self._blocks.items())

    def remember(self, ids: Iterable[str], raw_dsml: str) -> None:
        """Map every (non-empty) id of one generated message to that message's sampled block."""
        if not raw_dsml:
            return
        for call_id in ids:
            if not call_id:
                continue
            self._drop(call_id)
            self._blocks[call_id] = raw_dsml
            self.nbytes += _entry_bytes(call_id, raw_dsml)
        while self._blocks and (len(self._blocks) > self.max_ids or self.nbytes > self.max_bytes):
            self._drop(next(iter(self._blocks)))

    def lookup(self, ids: Sequence[str]) -> str | None:
        """The block all `ids` map to, or None when any id is unknown or they map to different blocks."""
        blocks = {self._blocks.get(call_id) for call_id in ids}
        if len(blocks) != 1:
            return None
        block = blocks.pop()
        if block is None:
            return None
        for call_id in ids:
            self._blocks.move_to_end(call_id)
        return block

    def _drop(self, call_id: str) -> None:
        block = self._blocks.pop(call_id, None)
        if block is not None:
            self.nbytes -= _entry_bytes(call_id, block)


def _entry_bytes(call_id: str, block: str) -> int:
    return len(call_id.encode("utf-8", "surrogatepass")) + len(block.encode("utf-8", "surrogatepass"))


class PromptPiece(NamedTuple):
    """A span of prompt text and whether the tokenizer recognises special strings inside it.

    The CLI builds its prompt at token level: user-typed text is plain BPE even if it contains `<think>`.
    """

    text: str
    specials: bool


def tools_prompt(tools: Sequence[str]) -> str:
    """The tools preamble around the schema lines (raw client JSON, joined by newlines); "" without tools."""
    schemas = _join_schemas(tools)
    return TOOLS_PREAMBLE + schemas + TOOLS_EPILOGUE if schemas else ""


def tool_result_block(content: str) -> str:
    """One tool result as the model sees it; only the wrapper's own closing tag is escaped."""
    return TOOL_RESULT + content.replace(TOOL_RESULT_END, "&lt;" + TOOL_RESULT_END[1:]) + TOOL_RESULT_END


def render_chat(
    messages: Sequence[Message],
    *,
    tools: Sequence[str] = (),
    think: ThinkMode,
    ctx: int,
    tool_memory: ToolMemory | None = None,
    checkpoint: Checkpoint = Checkpoint.PREVIEW,
) -> str:
    """The full prompt text of a chat request (ds4's `render_chat_prompt_text`, ds4_server.c).

    `tools` are the active tool schemas as raw JSON text (pass none for tool_choice "none"). Tool calls
    whose ids all map to one block in `tool_memory` are replayed verbatim; others render canonically. The
    effort's prefix is the `checkpoint`'s (`effort_prefix`).
    """
    mode = effective_think_mode(think, ctx)
    schemas = _join_schemas(tools)
    tool_context = bool(schemas) or any(
        m.role in TOOL_ROLES or (m.role == "assistant" and m.tool_calls) for m in messages
    )
    last_user = max((i for i, m in enumerate(messages) if m.role in USER_ROLES), default=-1)
    opening = leading_system_count(messages)

    system = TOOLS_PREAMBLE + schemas + TOOLS_EPILOGUE if schemas else ""
    for message in messages[:opening]:
        if message.role in SYSTEM_ROLES:
            system += ("\n\n" if system else "") + message.content

    head = BOS + effort_prefix(mode, checkpoint) + system
    keep_reasoning = (lambda i: True) if tool_context else (lambda i: i > last_user)
    return head + _render_turns(messages[opening:], mode.thinking, lambda i: keep_reasoning(i + opening), tool_memory)


def leading_system_count(messages: Sequence[Message]) -> int:
    """How many messages open the list before its first conversation turn (user, tool result or assistant): the
    system/developer messages among them form the system region. Later system turns are rendered in place."""
    return next((i for i, m in enumerate(messages) if m.role in CONVERSATION_ROLES), len(messages))


def render_live_tail(
    messages: Sequence[Message], think: ThinkMode, *, tool_memory: ToolMemory | None = None
) -> str:
    """The suffix appended to the live KV when tool results continue a live tool-call turn.

    The live KV already holds the sampled call but not its EOS (generation stopped at the closing tag),
    so the tail starts with EOS, then the new messages, then the opener. Assistant messages inside the
    tail always keep their reasoning, as in ds4.
    """
    return EOS + _render_turns(messages, think.thinking, lambda i: True, tool_memory)


def render_completion_prompt(prompt: str, think: ThinkMode, ctx: int,
                             checkpoint: Checkpoint = Checkpoint.PREVIEW) -> str:
    """/v1/completions: the raw prompt wrapped in a one-turn chat with the default system text."""
    mode = effective_think_mode(think, ctx)
    return (
        BOS
        + effort_prefix(mode, checkpoint)
        + DEFAULT_SYSTEM
        + USER
        + prompt
        + ASSISTANT
        + _opener(mode.thinking)
    )


def render_cli_preamble(system: str = DEFAULT_SYSTEM, *, think: ThinkMode, ctx: int,
                        checkpoint: Checkpoint = Checkpoint.PREVIEW) -> list[PromptPiece]:
    """Start of a CLI transcript: BOS, the effort's prefix where it has one, the system text (plain BPE)."""
    mode = effective_think_mode(think, ctx)
    pieces = [PromptPiece(BOS, True)]
    prefix = effort_prefix(mode, checkpoint)
    if prefix:
        pieces.append(PromptPiece(prefix, False))
    if system:
        pieces.append(PromptPiece(system, False))
    return pieces


def render_cli_turn(prompt: str, *, think: ThinkMode) -> list[PromptPiece]:
    """One CLI user turn up to the opener; the engine appends the generated tokens and EOS after it."""
    pieces = [PromptPiece(USER, True)]
    if prompt:
        pieces.append(PromptPiece(prompt, False))
    return pieces + [PromptPiece(ASSISTANT, True), PromptPiece(_opener(think.thinking), True)]


def render_cli_prompt(prompt: str, system: str = DEFAULT_SYSTEM, *, think: ThinkMode, ctx: int,
                      checkpoint: Checkpoint = Checkpoint.PREVIEW) -> list[PromptPiece]:
    """The CLI one-shot prompt (ds4.c `encode_chat_prompt`).

    A prompt that already starts with BOS is taken as a rendered chat and tokenized with specials as is.
    """
    if prompt.startswith(BOS):
        return [PromptPiece(prompt, True)]
    preamble = render_cli_preamble(system, think=think, ctx=ctx, checkpoint=checkpoint)
    return preamble + render_cli_turn(prompt, think=think)


def render_tool_calls(calls: Sequence[ToolCallSpec], tool_memory: ToolMemory | None = None) -> str:
    """A message's tool-call block: the remembered sampled block when every id maps to it, else canonical."""
    if calls and tool_memory is not None:
        block = tool_memory.lookup([call.id for call in calls])
        if block is not None:
            return block
    return canonical_tool_calls(calls)


def canonical_tool_calls(calls: Sequence[ToolCallSpec]) -> str:
    """Tool calls rendered from their JSON arguments (ds4's `append_dsml_tool_calls_text`).

    Parameters keep the client's key order. String values are written raw and non-string values as
    minified JSON; only a literal closing parameter tag inside a value is escaped. Arguments that are
    not a JSON object become one raw `arguments` string parameter. No calls, no block.
    """
    if not calls:
        return ""
    out = [f"\n\n{DSML_TOOL_CALLS}\n"]
    for call in calls:
        out.append(f'<{DSML}invoke name="{_escape_attribute(call.name)}">\n')
        text = _arguments_text(call)
        arguments = _parse_arguments(text)
        if arguments is None:
            out.append(_parameter("arguments", _escape_string_value(text), True))
        else:
            for key, value, is_string in arguments:
                escaped = _escape_string_value(value) if is_string else _escape_json_value(value)
                out.append(_parameter(key, escaped, is_string))
        out.append(f"{DSML_INVOKE_END}\n")
    out.append(DSML_TOOL_CALLS_END)
    return "".join(out)


def _render_turns(
    messages: Sequence[Message],
    thinking: bool,
    keep_reasoning: Callable[[int], bool],
    tool_memory: ToolMemory | None,
) -> str:
    """User, tool-result and assistant turns in order, then the opener if a user/tool turn is pending.

    A system (or developer) message here comes after the conversation began: its bare text goes where it stands,
    as DeepSeek's encoder writes a system message, so the turns before it keep their tokens. A pending answer
    stays pending (the opener follows the system text)."""
    out: list[str] = []
    pending_assistant = False
    in_tool_results = False
    for i, message in enumerate(messages):
        if message.role in SYSTEM_ROLES:
            out.append(message.content)
            in_tool_results = False
        elif message.role == "user":
            out += [USER, message.content]
            pending_assistant, in_tool_results = True, False
        elif message.role in TOOL_ROLES:
            if not in_tool_results:
                out.append(USER)
            out.append(tool_result_block(message.content))
            pending_assistant = in_tool_results = True
        elif message.role == "assistant":
            if pending_assistant:
                out.append(ASSISTANT)
                if thinking and keep_reasoning(i):
                    out += [THINK, message.reasoning, THINK_END]
                else:
                    out.append(THINK_END)
            out += [message.content, render_tool_calls(message.tool_calls, tool_memory), EOS]
            pending_assistant = in_tool_results = False
    if pending_assistant:
        out += [ASSISTANT, _opener(thinking)]
    return "".join(out)


def _opener(thinking: bool) -> str:
    return THINK if thinking else THINK_END


def _join_schemas(tools: Sequence[str]) -> str:
    if isinstance(tools, str):
        raise TypeError("tools must be a sequence of schema JSON texts, not one str")
    return "\n".join(tools)


def _parameter(name: str, value: str, is_string: bool) -> str:
    kind = "true" if is_string else "false"
    return f'<{DSML}parameter name="{_escape_attribute(name)}" string="{kind}">{value}{DSML_PARAMETER_END}\n'


_ATTRIBUTE_ESCAPES = str.maketrans({"&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;"})


def _escape_attribute(text: str) -> str:
    return text.translate(_ATTRIBUTE_ESCAPES)


def _escape_string_value(text: str) -> str:
    return text.replace(DSML_PARAMETER_END, "&lt;" + DSML_PARAMETER_END[1:])


def _escape_json_value(text: str) -> str:
    return text.replace(DSML_PARAMETER_END, "\\u003c" + DSML_PARAMETER_END[1:])


def _arguments_text(call: ToolCallSpec) -> str:
    if isinstance(call.arguments, str):
        return call.arguments
    try:
        return json.dumps(call.arguments, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError) as err:
        raise RequestError(f"tool call {call.name!r}: arguments are not a JSON value ({err})") from None


_C_SPACE = " \t\n\v\f\r"
"""C isspace(): the whitespace ds4's JSON scanner skips between tokens."""
_MINIFY = re.compile(r'("(?:[^"\\]|\\.)*")|[ \t\n\v\f\r]+', re.DOTALL)
_DECODER = json.JSONDecoder(strict=False)


def _minify_json(raw: str) -> str:
    """Drop whitespace outside string literals, leaving every other byte (escapes included) as sent."""
    return _MINIFY.sub(lambda m: m.group(1) or "", raw)


def _skip_space(text: str, i: int) -> int:
    while i < len(text) and text[i] in _C_SPACE:
        i += 1
    return i


def _parse_arguments(text: str) -> list[tuple[str, str, bool]] | None:
    """(key, value, is_string) per member of a JSON object text, in order, duplicates kept; None if no object.

    Mirrors ds4's lenient scanner so that the same client bytes give the same prompt: commas between
    members are optional and bytes after the closing brace are ignored. String values are decoded; other
    values are their raw text minified.
    """
    i = _skip_space(text, 0)
    if not text.startswith("{", i):
        return None
    i = _skip_space(text, i + 1)
    members: list[tuple[str, str, bool]] = []
    try:
        while i < len(text) and text[i] != "}":
            if text[i] != '"':
                return None
            key, i = _DECODER.raw_decode(text, i)
            i = _skip_space(text, i)
            if not text.startswith(":", i):
                return None
            start = _skip_space(text, i + 1)
            value, i = _DECODER.raw_decode(text, start)
            if text[start] == '"':
                members.append((key, value, True))
            else:
                members.append((key, _minify_json(text[start:i]), False))
            i = _skip_space(text, i)
            if text.startswith(",", i):
                i = _skip_space(text, i + 1)
    except (ValueError, RecursionError):
        return None
    return members if i < len(text) else None
