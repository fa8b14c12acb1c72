"""Request bodies parsed once, keeping the exact text of every tool schema.

The prompt shows the model each tool schema as the client wrote it (ds4_server.c): key order, spacing and
newlines of pretty-printed JSON included. `json.loads` followed by `json.dumps` cannot reproduce those bytes, so
the top-level object and its `tools` array are walked member by member with the C scanner of the `json` module,
which reports where every value ends.

Two things valid JSON allows are settled here, once, for every endpoint: nesting deeper than ds4's limit is refused,
and a lone surrogate escape such as `"\\ud800"` (a string no UTF-8 text can hold, so no answer echoing it could be
written) becomes U+FFFD, as the tokenizer does for prompts.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from ..errors import RequestError

MAX_DEPTH = 256
"""Deepest nesting of arrays and objects accepted, as in ds4. Bodies nested so deep that the (recursive) C scanner
hits Python's recursion limit are refused with the same message."""

_WS = re.compile(r"[ \t\n\r]*")
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89abcdefABCDEF]")
_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


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
    try:
        value, members, end = _object(text, start)
    except (ValueError, IndexError) as e:
        raise RequestError(f"invalid JSON request: {e}") from None
    except RecursionError:  # the C scanner recurses per level; far deeper than the limit
        raise _too_deep() from None
    if _WS.match(text, end).end() != len(text):
        raise RequestError(f"invalid JSON request: unexpected data after the JSON object at char {end}")
    if text.count("[") + text.count("{") > MAX_DEPTH and _depth(value) > MAX_DEPTH:
        raise _too_deep()
    if _SURROGATE_ESCAPE.search(text):
        value = _without_lone_surrogates(value)
    tools = members.get("tools")
    tool_texts = _tool_texts(text, tools[0]) if tools and isinstance(value["tools"], list) else ()
    return Body(value, tool_texts)


def _too_deep() -> RequestError:
    return RequestError(f"invalid JSON request: nesting deeper than {MAX_DEPTH} levels")


def _depth(value: Any) -> int:
    """How many levels of arrays and objects `value` nests, level by level (no recursion); stops past the limit."""
    depth, level = 0, [value]
    while level and depth <= MAX_DEPTH:
        depth += 1
        level = [c for v in level for c in (v.values() if isinstance(v, dict) else v) if isinstance(c, (dict, list))]
    return depth


def _without_lone_surrogates(value: Any) -> Any:
    """`value` with every surrogate code point in its strings (keys too) replaced by U+FFFD; the decoder has already
    joined valid pairs, so any left is a lone one."""
    if isinstance(value, str):
        return _LONE_SURROGATE.sub("\ufffd", value)
    if isinstance(value, list):
        return [_without_lone_surrogates(v) for v in value]
    if isinstance(value, dict):
        return {_without_lone_surrogates(k): _without_lone_surrogates(v) for k, v in value.items()}
    return value


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
