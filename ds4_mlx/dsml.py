"""DSML tool calls: the final parse of a generated message, its live projection into events, and the tracker
that tells the sampler when it is writing tool-call syntax.

DeepSeek V4 writes tool calls as an XML-like block after its reasoning (ds4_server.c):

    reasoning</think>content

    <｜DSML｜tool_calls>
    <｜DSML｜invoke name="bash">
    <｜DSML｜parameter name="command" string="true">ls -la</｜DSML｜parameter>
    <｜DSML｜parameter name="timeout" string="false">10</｜DSML｜parameter>
    </｜DSML｜invoke>
    </｜DSML｜tool_calls>

Three tag families are recognised (the one above, the same with the first bar missing, and plain
`<tool_calls>`); a block uses one family throughout. String values are raw text where only the five DSML
entities are decoded; other values are JSON. Everything follows ds4_server.c except where ds4 contradicts
itself or loses data; there the stream and the final parse are kept in agreement instead:

- Thinking mode looks for tools after the FIRST `</think>` (ds4's final parse uses the last, its stream the
  first). Generation stops at the block's closing tag, so a later `</think>` can only sit inside an argument.
- A block ends at its grammatical closing tag, not at a closing tag quoted inside a string value; only
  after a grammar failure does any closing tag end it (ds4 stops at the first closing tag it sees).
- The stream projects loose nested parameters (ds4 stops projecting) and sends `null` for an empty JSON
  value (as the final parse does); attributes are read as `key="value"` pairs (ds4 looks for the substring
  `name="`); JSON numbers follow the JSON grammar (ds4 uses strtod).
- Hold-back is minimal: a partial `</think>` or block start, not a fixed 7 bytes or anything after a `<`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import Enum, auto

from .events import (
    Event,
    ParsedMessage,
    ReasoningDelta,
    TextDelta,
    ToolCall,
    ToolCallArgsDelta,
    ToolCallEnd,
    ToolCallStart,
)

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"
INVALID_TOOL_CALL = "invalid tool call"
UNTERMINATED_TOOL_CALL = "unterminated tool call"
MAX_JSON_DEPTH = 256
"""ds4's JSON nesting limit: 256 nested containers parse, 257 do not."""

_WS = " \t\n\v\f\r"
"""C `isspace` in the C locale: the whitespace ds4 skips between tags and trims before a block."""


@dataclass(frozen=True)
class Syntax:
    """One family of tool-call tags. Every tag starts with `<` and contains no other `<`, which is what
    lets a partial tag at the end of the text be found from the last `<`."""

    tool_calls_start: str
    tool_calls_end: str
    invoke_start: str
    invoke_end: str
    param_start: str
    param_end: str

    @classmethod
    def with_prefix(cls, prefix: str) -> Syntax:
        return cls(
            f"<{prefix}tool_calls>",
            f"</{prefix}tool_calls>",
            f"<{prefix}invoke",
            f"</{prefix}invoke>",
            f"<{prefix}parameter",
            f"</{prefix}parameter>",
        )


DSML = Syntax.with_prefix("｜DSML｜")
SHORT_DSML = Syntax.with_prefix("DSML｜")
PLAIN = Syntax.with_prefix("")
SYNTAXES = (DSML, SHORT_DSML, PLAIN)

_ENTITIES = {"&amp;": "&", "&lt;": "<", "&gt;": ">", "&quot;": '"', "&apos;": "'"}
_ENTITY = re.compile("|".join(_ENTITIES))

_JSON_ESCAPES = {c: f"\\u{c:04x}" for c in range(0x20)}
_JSON_ESCAPES.update({ord('"'): '\\"', ord("\\"): "\\\\", ord("\n"): "\\n", ord("\r"): "\\r", ord("\t"): "\\t"})


def decode_entities(text: str) -> str:
    """Undo the five DSML entities, left to right (`&amp;lt;` is `&lt;`); any other `&` stays."""
    return _ENTITY.sub(lambda m: _ENTITIES[m.group()], text)


def json_escape(text: str) -> str:
    """The body of a JSON string literal, escaped as ds4 does (`\\n \\r \\t`, other controls as `\\u00XX`)."""
    return text.translate(_JSON_ESCAPES)


def compact_json(text: str) -> str | None:
    """The first JSON value in `text` with the whitespace outside strings removed, or None if there is none.

    Like ds4's minifier, text after the value is ignored and raw control characters inside strings are
    accepted (they are escaped in the result, so the result is always valid JSON). String escapes and
    number spellings are kept as written.
    """
    out: list[str] = []
    try:
        _compact_value(text, _skip_ws(text, 0), 0, out)
    except ValueError:
        return None
    return "".join(out)


def parse_message(text: str, *, thinking: bool, tools_active: bool) -> ParsedMessage:
    """The final parse of a generated message (ds4_server.c).

    In thinking mode without `</think>` everything is reasoning (ds4's non-streaming quirk, which
    puts it into content, is the server's business). Otherwise the text is split at the first `</think>`
    and the first tool block is parsed; the content before it loses its trailing whitespace. A block that
    is not well formed returns the whole text as content, with an error when tools are active: "unterminated
    tool call" when no closing tag follows its start, else "invalid tool call". Tool calls are parsed even
    when tools are not active, as ds4 does.
    """
    search_from = 0
    if thinking:
        close = text.find(THINK_CLOSE)
        if close < 0:
            return ParsedMessage(reasoning=_drop_think_open(text), content="", reasoning_closed=False)
        search_from = close + len(THINK_CLOSE)
    found = _find_block(text, search_from)
    if found is None:
        reasoning, content = _split_reasoning(text)
        return ParsedMessage(reasoning=reasoning, content=content)
    start, syntax = found
    body = text.index(syntax.tool_calls_start, start) + len(syntax.tool_calls_start)
    try:
        calls, end = _parse_block(text, body, syntax)
    except _Malformed:
        error = ""
        if tools_active:
            closed = any(s.tool_calls_end in text[body:] for s in SYNTAXES)
            error = INVALID_TOOL_CALL if closed else UNTERMINATED_TOOL_CALL
        return ParsedMessage(reasoning="", content=text, error=error)
    reasoning, content = _split_reasoning(text[: _rstrip_ws(text, 0, start)])
    return ParsedMessage(reasoning=reasoning, content=content, tool_calls=tuple(calls), raw_dsml=text[start:end])


class _Malformed(Exception):
    """A grammar failure inside a tool block; never escapes this module."""


def _find_block(text: str, pos: int) -> tuple[int, Syntax] | None:
    """ds4's search order: per family, the start after a blank line first, then anywhere."""
    for syntax in SYNTAXES:
        for marker in ("\n\n" + syntax.tool_calls_start, syntax.tool_calls_start):
            start = text.find(marker, pos)
            if start >= 0:
                return start, syntax
    return None


def _earliest_block(text: str, pos: int) -> tuple[int, Syntax] | None:
    """The first block start of any family: how the stream and the tracker see a block begin."""
    found = [(text.find(s.tool_calls_start, pos), s) for s in SYNTAXES]
    return min(((start, s) for start, s in found if start >= 0), default=None, key=lambda hit: hit[0])


def _parse_block(text: str, pos: int, syntax: Syntax) -> tuple[list[ToolCall], int]:
    """Invokes until the closing tag; returns the calls and the index just past the closing tag."""
    calls = []
    while True:
        pos = _skip_ws(text, pos)
        if text.startswith(syntax.tool_calls_end, pos):
            return calls, pos + len(syntax.tool_calls_end)
        tag, pos = _read_tag(text, pos, syntax.invoke_start)
        name = _attribute(tag, "name")
        if name is None:
            raise _Malformed
        members: list[tuple[str, str | None]] = []
        while True:
            pos = _skip_ws(text, pos)
            if text.startswith(syntax.invoke_end, pos):
                pos += len(syntax.invoke_end)
                break
            key, value, pos = _parse_param(text, pos, syntax, nested=True)
            members.append((key, value))
        calls.append(ToolCall(name=name, arguments=_json_object(members) or "{}"))


def _parse_param(text: str, pos: int, syntax: Syntax, *, nested: bool) -> tuple[str, str | None, int]:
    """One parameter as (key, compact JSON value or None when not JSON, index after it).

    A parameter without `string` whose body starts with another parameter is a loose nested object of
    its child parameters; its own closing tag is optional.
    """
    tag, body = _read_tag(text, pos, syntax.param_start)
    key, kind = _attribute(tag, "name"), _attribute(tag, "string")
    if key is None:
        raise _Malformed
    if nested and kind is None and text.startswith(syntax.param_start, _skip_ws(text, body)):
        members = []
        pos = _skip_ws(text, body)
        while text.startswith(syntax.param_start, pos):
            child_key, child_value, pos = _parse_param(text, pos, syntax, nested=False)
            members.append((child_key, child_value))
            pos = _skip_ws(text, pos)
        if text.startswith(syntax.param_end, pos):
            pos += len(syntax.param_end)
        return key, _json_object(members), pos
    end = text.find(syntax.param_end, body)
    if end < 0:
        raise _Malformed
    return key, _value_json(text[body:end], kind is None or kind == "true"), end + len(syntax.param_end)


def _value_json(raw: str, is_string: bool) -> str | None:
    if is_string:
        return '"' + json_escape(decode_entities(raw)) + '"'
    return "null" if raw == "" else compact_json(raw)


def _json_object(members: list[tuple[str, str | None]]) -> str | None:
    """Compact object text in the order written; None if any value is not JSON (ds4 then reports `{}`)."""
    if any(value is None for _, value in members):
        return None
    return "{" + ",".join(f'"{json_escape(key)}":{value}' for key, value in members) + "}"


def _read_tag(text: str, pos: int, tag_start: str) -> tuple[str, int]:
    """The opening tag at `pos` through its `>`, and the index after it."""
    if not text.startswith(tag_start, pos):
        raise _Malformed
    tag_end = text.find(">", pos)
    if tag_end < 0:
        raise _Malformed
    return text[pos : tag_end + 1], tag_end + 1


_ATTRIBUTE = re.compile(r'([^\s="<>]+)="([^"]*)"')


def _attribute(tag: str, name: str) -> str | None:
    """The decoded value of attribute `name` in an opening tag, None if absent.

    Attributes are read as `key="value"` pairs from the left. ds4 searches for the substring `name="`
    instead, which misreads a tag whose (escaped) parameter name ends in `string=`.
    """
    for match in _ATTRIBUTE.finditer(tag):
        if match.group(1) == name:
            return decode_entities(match.group(2))
    return None


def _split_reasoning(text: str) -> tuple[str, str]:
    """(reasoning, content) at the first `</think>`, skipping a leading `<think>`; no close, all content."""
    body = _drop_think_open(text)
    close = body.find(THINK_CLOSE)
    if close < 0:
        return "", text
    return body[:close], body[close + len(THINK_CLOSE) :]


def _drop_think_open(text: str) -> str:
    return text[len(THINK_OPEN) :] if text.startswith(THINK_OPEN) else text


def _skip_ws(text: str, pos: int) -> int:
    n = len(text)
    while pos < n and text[pos] in _WS:
        pos += 1
    return pos


def _rstrip_ws(text: str, start: int, end: int) -> int:
    """`end` moved back over whitespace, not before `start`."""
    while end > start and text[end - 1] in _WS:
        end -= 1
    return end


_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?(?![0-9.eE+-])")
_STRING_RUN = re.compile(r'[^"\\\x00-\x1f]*')
_HEX4 = re.compile(r"[0-9a-fA-F]{4}")


def _compact_value(text: str, pos: int, depth: int, out: list[str]) -> int:
    """Appends the compact form of the JSON value at `pos` to `out`; returns the index after it."""
    if pos >= len(text):
        raise ValueError("no JSON value")
    first = text[pos]
    if first == '"':
        return _compact_string(text, pos, out)
    if first in "[{":
        if depth >= MAX_JSON_DEPTH:
            raise ValueError("JSON nested too deeply")
        close = "]" if first == "[" else "}"
        out.append(first)
        pos = _skip_ws(text, pos + 1)
        if text.startswith(close, pos):
            out.append(close)
            return pos + 1
        while True:
            if first == "{":
                if not text.startswith('"', pos):
                    raise ValueError("object key is not a string")
                pos = _skip_ws(text, _compact_string(text, pos, out))
                if not text.startswith(":", pos):
                    raise ValueError("missing ':'")
                out.append(":")
                pos = _skip_ws(text, pos + 1)
            pos = _skip_ws(text, _compact_value(text, pos, depth + 1, out))
            if text.startswith(",", pos):
                out.append(",")
                pos = _skip_ws(text, pos + 1)
            elif text.startswith(close, pos):
                out.append(close)
                return pos + 1
            else:
                raise ValueError(f"expected ',' or '{close}'")
    for literal in ("true", "false", "null"):
        if text.startswith(literal, pos):
            out.append(literal)
            return pos + len(literal)
    number = _NUMBER.match(text, pos)
    if number is None:
        raise ValueError("not a JSON value")
    out.append(number.group())
    return number.end()


def _compact_string(text: str, pos: int, out: list[str]) -> int:
    out.append('"')
    pos += 1
    while True:
        run = _STRING_RUN.match(text, pos)
        out.append(run.group())
        pos = run.end()
        if pos >= len(text):
            raise ValueError("unterminated string")
        char = text[pos]
        if char == '"':
            out.append('"')
            return pos + 1
        if char != "\\":
            out.append(json_escape(char))
            pos += 1
        elif text[pos + 1 : pos + 2] in ('"', "\\", "/", "b", "f", "n", "r", "t"):
            out.append(text[pos : pos + 2])
            pos += 2
        elif text.startswith("u", pos + 1) and _HEX4.fullmatch(text, pos + 2, pos + 6):
            out.append(text[pos : pos + 6])
            pos += 6
        else:
            raise ValueError("bad string escape")


def _held_from(text: str, start: int, literals: tuple[str, ...]) -> int:
    """Where a partial tag at the end of `text[start:]` begins (len(text) if there is none).

    Every literal starts with its only `<`, so only the last `<` can start a partial one.
    """
    lt = text.rfind("<", max(start, len(text) - max(map(len, literals)) + 1))
    return lt if lt >= 0 and _is_partial(text, lt, *literals) else len(text)


def _entity_safe_end(text: str, start: int, end: int) -> int:
    """`end`, moved back to an `&` that may still grow into an entity."""
    amp = text.rfind("&", max(start, end - 5), end)
    if amp >= 0:
        tail = text[amp:end]
        if any(len(tail) < len(e) and e.startswith(tail) for e in _ENTITIES):
            return amp
    return end


class _Mode(Enum):
    REASONING = auto()
    TEXT = auto()
    TOOL = auto()
    DONE = auto()


class _Tool(Enum):
    BETWEEN_INVOKES = auto()
    BETWEEN_PARAMS = auto()
    PARAM_BODY = auto()  # a parameter without `string`: a string, or loose nested parameters
    VALUE = auto()
    NESTED_BETWEEN = auto()
    NESTED_VALUE = auto()
    NESTED_CLOSE = auto()  # the optional closing tag of a loose nested parameter
    FAILED = auto()


class StreamParser:
    """Turns generated text, fed as it is decoded, into reasoning, text and tool-call events.

    It holds back only what the syntax needs: a partial `</think>`; with tools active, trailing
    whitespace and a trailing partial block start (the whitespace before a block is never emitted); in a
    tool argument, a partial closing tag and (in strings) a partial entity. Argument fragments are ds4's:
    `{`, `"key":"`, decoded JSON-escaped string bytes, `"`, `,"key2":`, raw JSON bytes, `}`. Text after a
    block's closing tag is dropped and `tool_block_closed` is set; if the block breaks the grammar, the
    projection stops silently and the block closes at the next closing tag of any family. The final parse
    (`parse_message`) stays authoritative.

    `reasoning_closed` stays False while a thinking-mode message has not written `</think>`: ds4's
    non-streaming responses then report the reasoning as content (ds4_server.c).
    """

    def __init__(self, thinking: bool, tools_active: bool) -> None:
        self.thinking = thinking
        self.tools_active = tools_active
        self.reasoning_closed = not thinking
        self.tool_block_closed = False
        self._buf = ""  # the text not yet consumed; everything before it has been projected
        self._pos = 0
        self._mode = _Mode.REASONING if thinking else _Mode.TEXT
        self._checked_think_open = False
        self._syntax = DSML
        self._tool = _Tool.BETWEEN_INVOKES
        self._index = 0
        self._first_member = True
        self._first_nested = True
        self._string_value = False
        self._value_sent = False

    def feed(self, text: str) -> list[Event]:
        self._buf += text
        return self._advance(final=False)

    def finish(self) -> list[Event]:
        """Flushes what was held for disambiguation; an unterminated tool block stays where it stopped."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> list[Event]:
        events: list[Event] = []
        step = {_Mode.REASONING: self._reasoning, _Mode.TEXT: self._text, _Mode.TOOL: self._tool_block}
        # A step returns True when it switched mode, handing the rest of the text to the next one.
        while self._mode in step and step[self._mode](events, final):
            pass
        if self._mode is _Mode.DONE:
            self._buf, self._pos = "", 0
        else:
            self._buf, self._pos = self._buf[self._pos :], 0
        return events

    def _consume(self, end: int) -> str:
        piece = self._buf[self._pos : end]
        self._pos = end
        return piece

    def _reasoning(self, events: list[Event], final: bool) -> bool:
        buf = self._buf
        if not self._checked_think_open:
            if not final and len(buf) < len(THINK_OPEN) and THINK_OPEN.startswith(buf):
                return False
            if buf.startswith(THINK_OPEN):
                self._pos = len(THINK_OPEN)
            self._checked_think_open = True
        close = buf.find(THINK_CLOSE, self._pos)
        end = close if close >= 0 else len(buf) if final else _held_from(buf, self._pos, (THINK_CLOSE,))
        if piece := self._consume(end):
            events.append(ReasoningDelta(piece))
        if close < 0:
            return False
        self._pos += len(THINK_CLOSE)
        self.reasoning_closed = True
        self._mode = _Mode.TEXT
        return True

    def _text(self, events: list[Event], final: bool) -> bool:
        buf, pos = self._buf, self._pos
        found = _earliest_block(buf, pos) if self.tools_active else None
        if found is not None:
            end = _rstrip_ws(buf, pos, found[0])
        elif final or not self.tools_active:
            end = len(buf)
        else:
            held = _held_from(buf, pos, tuple(s.tool_calls_start for s in SYNTAXES))
            end = _rstrip_ws(buf, pos, held)
        if piece := self._consume(end):
            events.append(TextDelta(piece))
        if found is None:
            return False
        start, self._syntax = found
        self._pos = start + len(self._syntax.tool_calls_start)
        self._mode = _Mode.TOOL
        return True

    def _tool_block(self, events: list[Event], final: bool) -> bool:
        """Runs the tool-block state machine as far as the text allows; True when the mode changed."""
        syntax = self._syntax
        while True:
            buf, state = self._buf, self._tool
            if state is _Tool.FAILED:
                return self._watch_for_close()
            if state in (_Tool.VALUE, _Tool.NESTED_VALUE):
                if not self._value(events):
                    return False
                continue
            pos = _skip_ws(buf, self._pos)
            if pos == len(buf):
                if state is not _Tool.PARAM_BODY:
                    self._pos = pos
                return False
            if state is _Tool.BETWEEN_INVOKES:
                if buf.startswith(syntax.tool_calls_end, pos):
                    self._pos = pos + len(syntax.tool_calls_end)
                    self.tool_block_closed = True
                    self._mode = _Mode.DONE
                    return True
                if _is_partial(buf, pos, syntax.tool_calls_end, syntax.invoke_start):
                    self._pos = pos
                    return False
                if not buf.startswith(syntax.invoke_start, pos):
                    self._tool = _Tool.FAILED
                    continue
                tag_end = buf.find(">", pos)
                if tag_end < 0:
                    self._pos = pos
                    return False
                name = _attribute(buf[pos : tag_end + 1], "name")
                if name is None:
                    self._tool = _Tool.FAILED
                    continue
                events += [ToolCallStart(self._index, name), ToolCallArgsDelta(self._index, "{")]
                self._first_member = True
                self._pos = tag_end + 1
                self._tool = _Tool.BETWEEN_PARAMS
            elif state is _Tool.BETWEEN_PARAMS:
                if buf.startswith(syntax.invoke_end, pos):
                    events += [ToolCallArgsDelta(self._index, "}"), ToolCallEnd(self._index)]
                    self._index += 1
                    self._pos = pos + len(syntax.invoke_end)
                    self._tool = _Tool.BETWEEN_INVOKES
                    continue
                if _is_partial(buf, pos, syntax.invoke_end, syntax.param_start):
                    self._pos = pos
                    return False
                if not self._open_param(events, pos, nested=False):
                    return False
            elif state is _Tool.PARAM_BODY:
                if _is_partial(buf, pos, syntax.param_start):
                    return False
                if buf.startswith(syntax.param_start, pos):
                    events.append(ToolCallArgsDelta(self._index, "{"))
                    self._first_nested = True
                    self._pos = pos
                    self._tool = _Tool.NESTED_BETWEEN
                else:
                    events.append(ToolCallArgsDelta(self._index, '"'))
                    self._string_value, self._value_sent = True, False
                    self._tool = _Tool.VALUE
            elif state is _Tool.NESTED_BETWEEN:
                self._pos = pos
                if _is_partial(buf, pos, syntax.param_start):
                    return False
                if buf.startswith(syntax.param_start, pos):
                    if not self._open_param(events, pos, nested=True):
                        return False
                else:
                    events.append(ToolCallArgsDelta(self._index, "}"))
                    self._tool = _Tool.NESTED_CLOSE
            elif state is _Tool.NESTED_CLOSE:
                if _is_partial(buf, pos, syntax.param_end):
                    return False
                self._pos = pos + len(syntax.param_end) if buf.startswith(syntax.param_end, pos) else pos
                self._tool = _Tool.BETWEEN_PARAMS

    def _open_param(self, events: list[Event], pos: int, *, nested: bool) -> bool:
        """A parameter's opening tag at `pos`: emits its key fragment. False while the tag is incomplete."""
        buf = self._buf
        if not buf.startswith(self._syntax.param_start, pos):
            self._tool = _Tool.FAILED
            return True
        tag_end = buf.find(">", pos)
        if tag_end < 0:
            self._pos = pos
            return False
        tag = buf[pos : tag_end + 1]
        key, kind = _attribute(tag, "name"), _attribute(tag, "string")
        if key is None:
            self._tool = _Tool.FAILED
            return True
        first = self._first_nested if nested else self._first_member
        prefix = ("" if first else ",") + f'"{json_escape(key)}":'
        if nested:
            self._first_nested = False
        else:
            self._first_member = False
        self._pos = tag_end + 1
        if kind is None and not nested:
            events.append(ToolCallArgsDelta(self._index, prefix))
            self._tool = _Tool.PARAM_BODY
            return True
        self._string_value, self._value_sent = kind is None or kind == "true", False
        events.append(ToolCallArgsDelta(self._index, prefix + ('"' if self._string_value else "")))
        self._tool = _Tool.NESTED_VALUE if nested else _Tool.VALUE
        return True

    def _value(self, events: list[Event]) -> bool:
        """Streams a parameter value; True when its closing tag was consumed."""
        buf, pos, param_end = self._buf, self._pos, self._syntax.param_end
        end = buf.find(param_end, pos)
        limit = end if end >= 0 else _held_from(buf, pos, (param_end,))
        if self._string_value and end < 0:
            limit = _entity_safe_end(buf, pos, limit)
        if piece := self._consume(limit):
            text = json_escape(decode_entities(piece)) if self._string_value else piece
            events.append(ToolCallArgsDelta(self._index, text))
            self._value_sent = True
        if end < 0:
            return False
        if self._string_value:
            events.append(ToolCallArgsDelta(self._index, '"'))
        elif not self._value_sent:  # an empty JSON value is null, as in the final parse
            events.append(ToolCallArgsDelta(self._index, "null"))
        self._pos = end + len(param_end)
        self._tool = _Tool.NESTED_BETWEEN if self._tool is _Tool.NESTED_VALUE else _Tool.BETWEEN_PARAMS
        return True

    def _watch_for_close(self) -> bool:
        """After a grammar failure: the block still ends at the next closing tag of any family."""
        buf = self._buf
        if any(buf.find(s.tool_calls_end, self._pos) >= 0 for s in SYNTAXES):
            self.tool_block_closed = True
            self._mode = _Mode.DONE
            return True
        self._pos = max(self._pos, len(buf) - max(len(s.tool_calls_end) for s in SYNTAXES) + 1)
        return False


def _is_partial(text: str, pos: int, *literals: str) -> bool:
    """`text[pos:]` is the end of the text and could still grow into one of the literals."""
    left = len(text) - pos
    return any(left < len(lit) and lit.startswith(text[pos:]) for lit in literals)


class DecodeState(Enum):
    """Where the next generated token falls, for the sampler (ds4's `dsml_decode_state`)."""

    OUTSIDE = auto()
    STRUCTURAL = auto()
    STRING_BODY = auto()
    JSON_STRUCTURAL = auto()
    JSON_STRING = auto()


class _Track(Enum):
    THINKING = auto()
    SEARCH = auto()
    STRUCTURAL = auto()
    STRING_BODY = auto()
    JSON = auto()
    STUCK = auto()  # text that is no tag: like ds4, structure until the end
    DONE = auto()


class GreedyTracker:
    """Tells the sampler to go greedy while the model writes tool-call syntax (ds4_server.c).

    Inside a tool block everything is structure (greedy) except a `string="true"` body and the string
    literals of a JSON value, which are payload and keep the request's sampling. A partial closing tag of
    two or more characters counts as structure. Like ds4 this is a forgiving recognizer, not a validator,
    and it ends at the first block's closing tag. With `thinking`, blocks are only looked for after
    `</think>`, matching the stream: DSML inside reasoning is never a tool call.
    """

    def __init__(self, thinking: bool = False) -> None:
        self.state = DecodeState.OUTSIDE
        self._buf = ""
        self._pos = 0
        self._track = _Track.THINKING if thinking else _Track.SEARCH
        self._syntax = DSML
        self._json_in_string = False
        self._json_escaped = False

    @property
    def greedy(self) -> bool:
        return self.state in (DecodeState.STRUCTURAL, DecodeState.JSON_STRUCTURAL)

    def feed(self, text: str) -> DecodeState:
        if self._track not in (_Track.STUCK, _Track.DONE):
            self._buf += text
            self.state = self._advance()
            self._buf, self._pos = self._buf[self._pos :], 0
        return self.state

    def _advance(self) -> DecodeState:
        buf = self._buf
        if self._track is _Track.THINKING:
            close = buf.find(THINK_CLOSE, self._pos)
            if close < 0:
                self._pos = max(self._pos, len(buf) - len(THINK_CLOSE) + 1)
                return DecodeState.OUTSIDE
            self._pos = close + len(THINK_CLOSE)
            self._track = _Track.SEARCH
        if self._track is _Track.SEARCH:
            found = _earliest_block(buf, self._pos)
            if found is None:
                longest = max(len(s.tool_calls_start) for s in SYNTAXES)
                self._pos = max(self._pos, len(buf) - longest + 1)
                return DecodeState.OUTSIDE
            start, self._syntax = found
            self._pos = start + len(self._syntax.tool_calls_start)
            self._track = _Track.STRUCTURAL
        while True:
            if self._track is _Track.STRING_BODY:
                state = self._string_body()
            elif self._track is _Track.JSON:
                state = self._json_value()
            else:
                state = self._structure()
            if state is not None:
                return state

    def _structure(self) -> DecodeState | None:
        buf, syntax = self._buf, self._syntax
        pos = self._pos = _skip_ws(buf, self._pos)
        if pos == len(buf):
            return DecodeState.STRUCTURAL
        if buf.startswith(syntax.tool_calls_end, pos):
            self._pos = len(buf)
            self._track = _Track.DONE
            return DecodeState.OUTSIDE
        if buf.startswith(syntax.invoke_end, pos):
            self._pos = pos + len(syntax.invoke_end)
            return None
        for tag_start in (syntax.invoke_start, syntax.param_start):
            if buf.startswith(tag_start, pos):
                tag_end = buf.find(">", pos)
                if tag_end < 0:
                    return DecodeState.STRUCTURAL
                self._pos = tag_end + 1
                if tag_start == syntax.param_start:
                    if _attribute(buf[pos : tag_end + 1], "string") == "true":
                        self._track = _Track.STRING_BODY
                    else:
                        self._track = _Track.JSON
                        self._json_in_string = self._json_escaped = False
                return None
        tags = (syntax.tool_calls_end, syntax.invoke_start, syntax.invoke_end, syntax.param_start, syntax.param_end)
        if not _is_partial(buf, pos, *tags):
            self._track = _Track.STUCK
        return DecodeState.STRUCTURAL

    def _string_body(self) -> DecodeState | None:
        buf, param_end = self._buf, self._syntax.param_end
        end = buf.find(param_end, self._pos)
        if end >= 0:
            self._pos = end + len(param_end)
            self._track = _Track.STRUCTURAL
            return None
        self._pos = _held_from(buf, self._pos, (param_end,))
        return DecodeState.STRUCTURAL if len(buf) - self._pos >= 2 else DecodeState.STRING_BODY

    def _json_value(self) -> DecodeState | None:
        buf, param_end = self._buf, self._syntax.param_end
        pos, n = self._pos, len(buf)
        while pos < n:
            char = buf[pos]
            if not self._json_in_string and char == "<":
                if buf.startswith(param_end, pos):
                    self._pos = pos + len(param_end)
                    self._track = _Track.STRUCTURAL
                    return None
                if _is_partial(buf, pos, param_end):
                    self._pos = pos
                    return DecodeState.STRUCTURAL if n - pos >= 2 else DecodeState.JSON_STRUCTURAL
            pos += 1
            if self._json_escaped:
                self._json_escaped = False
            elif self._json_in_string and char == "\\":
                self._json_escaped = True
            elif char == '"':
                self._json_in_string = not self._json_in_string
        self._pos = pos
        return DecodeState.JSON_STRING if self._json_in_string else DecodeState.JSON_STRUCTURAL


def final_finish_reason(finish: str, message: ParsedMessage) -> str:
    """ds4_server.c: parsed tool calls make `tool_calls`; an unterminated tool block makes `error`;
    a closed but malformed block is returned as text and finishes `stop`."""
    if message.error == UNTERMINATED_TOOL_CALL:
        return "error"
    if message.tool_calls and finish in ("stop", "tool_calls"):
        return "tool_calls"
    if finish == "tool_calls":
        return "stop"
    return finish
