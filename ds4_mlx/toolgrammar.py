"""Tool calls held to their schemas (tools declared `strict`): the DSML tool-call block as a Lark grammar.

The model writes tool calls as a DSML block (dsml.py):

    <｜DSML｜tool_calls>
    <｜DSML｜invoke name="NAME">
    <｜DSML｜parameter name="KEY" string="true">raw text</｜DSML｜parameter>
    <｜DSML｜parameter name="KEY" string="false">JSON</｜DSML｜parameter>
    </｜DSML｜invoke>
    </｜DSML｜tool_calls>

For a strict tool the grammar allows its declared parameters only, each written once, in the schema's order, the
required ones always: a string-typed parameter (by `type`, `enum` or `const`, after a top-level `$ref`) as raw text
(an enum's or const's values only), any other as JSON held to the parameter's schema (the tool's `$defs` go with
it). Tools not declared strict are called by name with free parameters. Names other than the offered tools' are not
allowed while any tool is strict. Text before the block is free (a lazy lexeme that ends at the block's start).

Raw strings are held by their enum or const only: `pattern`, `minLength`, `maxLength` and `format` apply to JSON
values, not to raw DSML text.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .tokenizer import DSML

BLOCK_START = f"\n\n<{DSML}tool_calls>"
PARAM_END = f"</{DSML}parameter>"
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True)
class ToolSpec:
    """One offered tool: its name and, when it is strict, its parameters' JSON Schema (None: not held)."""

    name: str
    parameters: dict[str, Any] | None = None


def lit(text: str) -> str:
    """A Lark string literal."""
    return json.dumps(text, ensure_ascii=False)


def regex(pattern: str) -> str:
    """A Lark regex literal; `pattern` must not hold a newline (write `\\n`)."""
    return "/" + pattern.replace("/", "\\/") + "/"


def attribute(text: str) -> str:
    """An attribute value as the renderer escapes it (dsml.py decodes the five entities)."""
    return text.replace("&", "&amp;").replace('"', "&quot;").replace("<", "&lt;").replace(">", "&gt;")


def raw_value(text: str) -> str:
    """A string parameter's raw text: `&` written as `&amp;` (the parser decodes entities), the closing tag
    escaped as the prompt tells the model to."""
    return text.replace("&", "&amp;").replace(PARAM_END, "&lt;" + PARAM_END[1:])


def _resolve(schema: Any, root: dict[str, Any]) -> Any:
    """A top-level local `$ref` followed (once per level, at most 16 levels)."""
    for _ in range(16):
        if not isinstance(schema, dict) or not isinstance(schema.get("$ref"), str):
            return schema
        ref = schema["$ref"]
        if not ref.startswith("#/"):
            return schema
        target: Any = root
        for part in ref[2:].split("/"):
            target = target.get(part.replace("~1", "/").replace("~0", "~")) if isinstance(target, dict) else None
        if target is None:
            return schema
        schema = target
    return schema


def _string_values(schema: Any) -> list[str] | None:
    """The values a string-typed parameter may take ([] for any string); None when it is not string-typed."""
    if not isinstance(schema, dict):
        return None
    if "const" in schema:
        return [schema["const"]] if isinstance(schema["const"], str) else None
    if "enum" in schema:
        values = schema["enum"]
        return list(values) if isinstance(values, list) and values and all(isinstance(v, str) for v in values) \
            else None
    return [] if schema.get("type") == "string" else None


def tool_rules(tools: Sequence[ToolSpec]) -> str:
    """Lark rules: `calls` (what follows the block start: the invokes and the closing tag) and `free_text` (text that
    ends with the block start), for the offered tools."""
    rules = [f"free_text[lazy]: {regex('(?s:.*)' + BLOCK_START.replace(chr(10), chr(92) + 'n'))}",
             f"calls: \"\\n\" invoke+ {lit(f'</{DSML}tool_calls>')}",
             f"raw_string[lazy]: {regex('(?s:.*)' + PARAM_END)}",
             f"free_params[lazy]: {regex(f'(?s:.*)</{DSML}invoke>')}"]
    invokes, free_names = [], []
    for i, tool in enumerate(tools):
        if tool.parameters is None:
            free_names.append(lit(attribute(tool.name)))
            continue
        invokes.append(f"invoke_{i}")
        head = lit(f'<{DSML}invoke name="{attribute(tool.name)}">\n')
        params = _param_rules(i, tool.parameters, rules)
        if params is None:
            rules.append(f"invoke_{i}: {head} free_params \"\\n\"")
        else:
            rules.append(f"invoke_{i}: {head} {params} {lit(f'</{DSML}invoke>' + chr(10))}".replace("  ", " "))
    if free_names:
        invokes.append("invoke_free")
        rules.append(f"invoke_free: {lit(f'<{DSML}invoke name=' + chr(34))} ({' | '.join(free_names)}) "
                     f"{lit(chr(34) + '>' + chr(10))} free_params \"\\n\"")
    rules.append(f"invoke: {' | '.join(invokes)}")
    return "\n".join(rules) + "\n"


def _param_rules(i: int, schema: dict[str, Any], rules: list[str]) -> str | None:
    """The parameter sequence of strict tool `i` (appending its rules), or None when its schema declares no
    properties and allows others (then its parameters are free)."""
    properties = schema.get("properties")
    if not isinstance(properties, dict) or not properties:
        return None if schema.get("additionalProperties", True) is not False else ""
    required = set(schema.get("required") or ())
    defs = {k: schema[k] for k in ("$defs", "definitions") if k in schema}
    parts = []
    for j, (key, sub) in enumerate(properties.items()):
        name = f"p_{i}_{j}"
        values = _string_values(_resolve(sub, schema))
        open_tag = f'<{DSML}parameter name="{attribute(key)}" string="{"true" if values is not None else "false"}">'
        if values is None:
            held = {**defs, **(sub if isinstance(sub, dict) else {}), "x-guidance": JSON_OPTIONS}
            rules.append(f"v_{i}_{j}: %json {json.dumps(held, ensure_ascii=False)}")
            rules.append(f"{name}: {lit(open_tag)} v_{i}_{j} {lit(PARAM_END + chr(10))}")
        elif values:
            choices = " | ".join(lit(raw_value(v)) for v in values)
            rules.append(f"{name}: {lit(open_tag)} ({choices}) {lit(PARAM_END + chr(10))}")
        else:
            rules.append(f"{name}: {lit(open_tag)} raw_string \"\\n\"")
        parts.append(name if key in required else f"{name}?")
    return " ".join(parts)
