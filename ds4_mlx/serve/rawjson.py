"""Request bodies parsed once, keeping the exact text of every tool schema.

The prompt shows the model each tool schema as the client wrote it (behavior.md §1.6): key order, spacing and
newlines of pretty-printed JSON included. `json.loads` followed by `json.dumps` cannot reproduce those bytes, so
the top-level object and its `tools` array are walked member by member with the C scanner of the `json` module,
which reports where every value ends.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from itertools import accumulate
from typing import Any

from ..errors import RequestError

MAX_DEPTH = 256
"""Deepest nesting of arrays and objects accepted, as in ds4; it also keeps the recursive scanner far from
Python's recursion limit."""

_WS = re.compile(r"[ \t\n\r]*")
_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_NOT_BRACKET = re.compile(r"[^\[\]{}]+")


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


_DECODER = json.JSONDecoder(parse_constant=_reject_constant)


@dataclass(frozen=True)
class Body:
    """A request body: its decoded top-level object and the raw text of each tool schema.

    `tool_texts[i]` is the text of `tools[i].function` when that element has a `function` key, else of the whole
    element; it is empty when `tools` is absent or not an array.
    """

    value: dict[str, Any]
    tool_texts: tuple[str, ...] = ()


def parse_body(data: bytes) -> Body:
    """Decode a request body that must be one JSON object (trailing whitespace allowed)."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise RequestError(f"invalid JSON request: the body is not UTF-8 (byte {e.start})") from None
    start = _WS.match(text).end()
    if start == len(text):
        raise RequestError("invalid JSON request: the body is empty, expected a JSON object")
    if text[start] != "{":
        raise RequestError("invalid JSON request: the body must be a JSON object")
    _check_depth(text)
    try:
        value, members, end = _object(text, start)
    except (ValueError, IndexError) as e:
        raise RequestError(f"invalid JSON request: {e}") from None
    if _WS.match(text, end).end() != len(text):
        raise RequestError(f"invalid JSON request: unexpected data after the JSON object at char {end}")
    tools = members.get("tools")
    tool_texts = _tool_texts(text, tools[0]) if tools and isinstance(value["tools"], list) else ()
    return Body(value, tool_texts)


def _check_depth(text: str) -> None:
    brackets = _NOT_BRACKET.sub("", _STRING.sub("", text))
    depth = max(accumulate(1 if c in "[{" else -1 for c in brackets), default=0)
    if depth > MAX_DEPTH:
        raise RequestError(f"invalid JSON request: nesting deeper than {MAX_DEPTH} levels")


def _scan(text: str, pos: int) -> tuple[Any, int]:
    try:
        return _DECODER.scan_once(text, pos)
    except StopIteration:
        raise ValueError(f"expected a JSON value at char {pos}") from None


def _expect(text: str, pos: int, char: str) -> int:
    pos = _WS.match(text, pos).end()
    if text[pos : pos + 1] != char:
        raise ValueError(f"expected {char!r} at char {pos}")
    return pos + 1


def _object(text: str, pos: int) -> tuple[dict[str, Any], dict[str, tuple[int, int]], int]:
    """Parse the object at `pos`; also return where each member's value starts and ends (last duplicate wins)."""
    value: dict[str, Any] = {}
    spans: dict[str, tuple[int, int]] = {}
    pos = _WS.match(text, pos + 1).end()
    if text[pos : pos + 1] == "}":
        return value, spans, pos + 1
    while True:
        pos = _WS.match(text, pos).end()
        if text[pos : pos + 1] != '"':
            raise ValueError(f"expected a member name at char {pos}")
        key, pos = _scan(text, pos)
        start = _WS.match(text, _expect(text, pos, ":")).end()
        value[key], pos = _scan(text, start)
        spans[key] = (start, pos)
        pos = _WS.match(text, pos).end()
        if text[pos : pos + 1] == "}":
            return value, spans, pos + 1
        pos = _expect(text, pos, ",")


def _elements(text: str, pos: int) -> list[tuple[int, int]]:
    """Where each element of the (already validated) array at `pos` starts and ends."""
    spans = []
    pos = _WS.match(text, pos + 1).end()
    if text[pos] == "]":
        return spans
    while True:
        start = _WS.match(text, pos).end()
        _, pos = _scan(text, start)
        spans.append((start, pos))
        pos = _WS.match(text, pos).end()
        if text[pos] == "]":
            return spans
        pos += 1


def _tool_texts(text: str, pos: int) -> tuple[str, ...]:
    texts = []
    for start, end in _elements(text, pos):
        if text[start] == "{":
            _, members, _ = _object(text, start)
            if "function" in members:
                start, end = members["function"]
        texts.append(text[start:end])
    return tuple(texts)
