"""DSML tool-call parsing: the final parse, the stream projection and the greedy tracker (ds4_server.c),
with ds4's own server unit tests mirrored.

The central check is the split-everywhere invariant: however the generated text is chunked, the streamed
reasoning, text and tool-call argument fragments reassemble into exactly what the final parse returns.
"""

from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from ds4_mlx.chat import ToolCallSpec, canonical_tool_calls
from ds4_mlx.dsml import (
    INVALID_TOOL_CALL,
    MAX_JSON_DEPTH,
    PLAIN,
    SHORT_DSML,
    SYNTAXES,
    UNTERMINATED_TOOL_CALL,
    DecodeState,
    GreedyTracker,
    StreamParser,
    Syntax,
    compact_json,
    decode_entities,
    json_escape,
    parse_message,
)
from ds4_mlx.dsml import DSML as DSML_SYNTAX
from ds4_mlx.events import ReasoningDelta, TextDelta, ToolCallArgsDelta, ToolCallEnd, ToolCallStart

D = "｜DSML｜"
START, END = f"<{D}tool_calls>", f"</{D}tool_calls>"
INVOKE, INVOKE_END = f"<{D}invoke", f"</{D}invoke>"
PARAM, PARAM_END = f"<{D}parameter", f"</{D}parameter>"
WS = " \t\n\v\f\r"


def param(name: str, value: str, string: str | None = "true", syntax: Syntax = DSML_SYNTAX) -> str:
    kind = "" if string is None else f' string="{string}"'
    return f'{syntax.param_start} name="{name}"{kind}>{value}{syntax.param_end}\n'


def invoke(name: str, *params: str, syntax: Syntax = DSML_SYNTAX) -> str:
    return f'{syntax.invoke_start} name="{name}">\n' + "".join(params) + f"{syntax.invoke_end}\n"


def block(*invokes: str, syntax: Syntax = DSML_SYNTAX) -> str:
    return f"{syntax.tool_calls_start}\n" + "".join(invokes) + syntax.tool_calls_end


BASH_EXAMPLE = (  # a captured call of ds4's server, as the model writes it (raw `&&` and quotes)
    "The user wants files.</think>Checking.\n\n"
    + block(
        invoke(
            "bash",
            param("command", 'ls -la && echo "hi"'),
            param("timeout", '{ "a": [1, 2] }', "false"),
        )
    )
)


# --- collecting events ---------------------------------------------------------------------------------


@dataclass
class Streamed:
    reasoning: str = ""
    text: str = ""
    names: list[str] = field(default_factory=list)
    arguments: list[str] = field(default_factory=list)
    ended: list[int] = field(default_factory=list)
    fragments: list[str] = field(default_factory=list)
    tool_block_closed: bool = False
    reasoning_closed: bool = False


def collect(events: list, into: Streamed | None = None) -> Streamed:
    """Folds events, checking their order: arguments only between a call's start and end."""
    out = into or Streamed()
    for event in events:
        if isinstance(event, ReasoningDelta):
            assert event.text, "empty reasoning delta"
            assert not out.text and not out.names, "reasoning after text or tool calls"
            out.reasoning += event.text
        elif isinstance(event, TextDelta):
            assert event.text, "empty text delta"
            assert not out.names, "text after a tool call"
            out.text += event.text
        elif isinstance(event, ToolCallStart):
            assert event.index == len(out.names) == len(out.ended)
            out.names.append(event.name)
            out.arguments.append("")
        elif isinstance(event, ToolCallArgsDelta):
            assert event.text
            assert event.index == len(out.names) - 1 and event.index not in out.ended
            out.arguments[event.index] += event.text
            out.fragments.append(event.text)
        elif isinstance(event, ToolCallEnd):
            assert event.index == len(out.names) - 1 and event.index not in out.ended
            out.ended.append(event.index)
        else:
            raise AssertionError(f"unexpected event {event!r}")
    return out


def stream(chunks: list[str], *, thinking: bool, tools_active: bool) -> Streamed:
    parser = StreamParser(thinking=thinking, tools_active=tools_active)
    out = Streamed()
    for chunk in chunks:
        collect(parser.feed(chunk), out)
    collect(parser.finish(), out)
    out.tool_block_closed = parser.tool_block_closed
    out.reasoning_closed = parser.reasoning_closed
    return out


def ordered(text: str):
    """JSON with objects as ordered (key, value) lists, so that key order is compared too."""
    return json.loads(text, object_pairs_hook=list)


def chunkings(text: str, seed: int = 0, random_count: int = 12) -> list[list[str]]:
    """Every two-way split, one character at a time, and random multi-character chunkings."""
    out = [[text[:i], text[i:]] for i in range(len(text) + 1)]
    out.append(list(text))
    rng = random.Random(seed)
    for _ in range(random_count):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 12)))) if len(text) > 1 else []
        bounds = [0, *cuts, len(text)]
        out.append([text[a:b] for a, b in zip(bounds, bounds[1:])])
    return out


def assert_stream_matches_parse(text: str, *, thinking: bool, tools_active: bool) -> None:
    final = parse_message(text, thinking=thinking, tools_active=tools_active)
    assert not final.error, final.error
    for chunks in chunkings(text):
        got = stream(chunks, thinking=thinking, tools_active=tools_active)
        assert got.reasoning == final.reasoning, chunks
        assert got.text == final.content, chunks
        assert got.names == [call.name for call in final.tool_calls], chunks
        assert got.ended == list(range(len(final.tool_calls))), chunks
        for streamed, call in zip(got.arguments, final.tool_calls):
            assert ordered(streamed) == ordered(call.arguments), chunks
        assert got.tool_block_closed == bool(final.raw_dsml and tools_active), chunks
        assert got.reasoning_closed == (not thinking or "</think>" in text), chunks


# --- the split-everywhere invariant ---------------------------------------------------------------------

NESTED = "review done\n\n" + block(
    (
        f'{INVOKE} name="edit">\n'
        + param("path", "/private/tmp/tetris.c", None)
        + f'{PARAM} name="edits">\n'
        + param("oldText", "old &lt;text&gt;")
        + param("newText", "new text")
        + f"{INVOKE_END}\n"
    )
)

CASES = {  # id: (text, thinking, tools_active)
    "reasoning split without tools": ("We need to generate a title</think>Free disk space check", True, False),
    "near misses of </think> and markers": ("a </thi b </ c <think></think>x < y & z <｜DSML", True, True),
    "captured bash call": (BASH_EXAMPLE, True, True),
    "leading <think> is skipped": ("<think>r</think>c", True, True),
    "reasoning never closed": ("still thinking </thi", True, True),
    "DSML inside reasoning is not a call": (
        "draft:\n\n" + block(invoke("x", param("a", "1"))) + " more</think>Answer.",
        True,
        True,
    ),
    "DSML inside unclosed reasoning": ("I could call " + block(invoke("x")), True, True),
    "block right after </think>": (
        "need a tool</think>\n\n" + block(invoke("bash", param("command", "pwd"))),
        True,
        True,
    ),
    "separator whitespace is not content": (
        "<think>need a tool</think>I will inspect the files.\n\n\n\n"
        + block(invoke("bash", param("description", "list files"), param("command", "ls -la"))),
        True,
        True,
    ),
    "short family": (
        "<think>need a tool</think>"
        + block(
            invoke("bash", param("description", "list files", syntax=SHORT_DSML), syntax=SHORT_DSML),
            syntax=SHORT_DSML,
        ),
        True,
        True,
    ),
    "plain family": (
        "ok\n" + block(invoke("read", param("path", "a.c", syntax=PLAIN), syntax=PLAIN), syntax=PLAIN),
        False,
        True,
    ),
    "loose nested parameters": (NESTED, False, True),
    "two calls": (
        block(invoke("read", param("path", "a.c")), invoke("bash", param("command", "wc -l a.c"))),
        False,
        True,
    ),
    "entities in values and names": (
        "x "
        + block(
            invoke(
                "a&amp;b&quot;",
                param("k&lt;&gt;", "&lt;/｜DSML｜parameter> &amp;amp; &quot;q&quot; &apos; &am & &lt"),
                param("raw", '"&amp;"', "false"),
            )
        ),
        False,
        True,
    ),
    "unicode and control characters": (
        "é🚩\n" + block(invoke("write", param("content", "flag 🚩 done\tend\r\n\x01é"))),
        False,
        True,
    ),
    "JSON values": (
        block(
            invoke(
                "edit",
                param("edits", '[{"oldText": "a</b>", "n": [1, -2.5e3, true, null]}, "\\u00e9\\""]', "false"),
                param("flag", " false ", "false"),
                param("empty", "", "false"),
                param("text", "  padded\n", None),
                param("blank", ""),
            )
        ),
        False,
        True,
    ),
    "empty invoke": ("Done.\n\n" + block(invoke("noop")), False, True),
    "'<' in text that is no marker": (
        "Compare a < b && c > d, <tool> and <DSML.\n\n" + block(invoke("t")),
        False,
        True,
    ),
    "trailing whitespace without a block": ("Just text.  \n\t", False, True),
    "orphan end markers": (f"reasoning\n{PARAM_END}\n{INVOKE_END}\n{END}", False, True),
    "text after the block is dropped": (block(invoke("t", param("a", "b"))) + "\n\ntrailing text", False, True),
    "closing tags inside a string value": (
        "r</think>" + block(invoke("w", param("body", f"{END} {INVOKE_END} </think> {PARAM} x"))),
        True,
        True,
    ),
    "tools inactive, no DSML": ("plain answer\n\n", False, False),
}


@pytest.mark.parametrize("case", list(CASES))
def test_stream_matches_final_parse_at_every_split(case):
    text, thinking, tools_active = CASES[case]
    assert_stream_matches_parse(text, thinking=thinking, tools_active=tools_active)


# --- final parse -------------------------------------------------------------------


def test_parse_captured_call_is_compact_and_in_generated_order():
    message = parse_message(BASH_EXAMPLE, thinking=True, tools_active=True)
    assert message.reasoning == "The user wants files."
    assert message.content == "Checking."
    assert [(c.name, c.arguments) for c in message.tool_calls] == [
        ("bash", '{"command":"ls -la && echo \\"hi\\"","timeout":{"a":[1,2]}}')
    ]
    assert message.raw_dsml == BASH_EXAMPLE[BASH_EXAMPLE.index("\n\n<") :]
    assert message.error == ""


def test_parse_short_dsml_keeps_call_order():
    text, thinking, _ = CASES["short family"]
    message = parse_message(text, thinking=thinking, tools_active=True)
    assert (message.reasoning, message.content) == ("need a tool", "")
    assert message.tool_calls[0].arguments == '{"description":"list files"}'


def test_parse_loose_nested_parameters():
    message = parse_message(NESTED, thinking=False, tools_active=True)
    assert message.content == "review done"
    assert message.tool_calls[0].name == "edit"
    assert message.tool_calls[0].arguments == (
        '{"path":"/private/tmp/tetris.c","edits":{"oldText":"old <text>","newText":"new text"}}'
    )


def test_parse_nested_parameters_with_their_own_closing_tag():
    text = block(invoke("e", f'{PARAM} name="o">\n' + param("a", "1", "false") + f"{PARAM_END}\n" + param("b", "x")))
    assert parse_message(text, thinking=False, tools_active=True).tool_calls[0].arguments == '{"o":{"a":1},"b":"x"}'
    assert_stream_matches_parse(text, thinking=False, tools_active=True)


def test_parse_separator_whitespace_is_not_content():
    text, thinking, _ = CASES["separator whitespace is not content"]
    message = parse_message(text, thinking=thinking, tools_active=True)
    assert (message.reasoning, message.content) == ("need a tool", "I will inspect the files.")
    assert len(message.tool_calls) == 1
    assert message.raw_dsml.startswith("\n\n" + START)


def test_parse_keeps_shell_text_unescaped_and_minifies_json():
    text = (
        "need edit</think>\n\n"
        + block(
            invoke(
                "edit",
                param("command", "cd /tmp && git diff 2>/dev/null"),
                param(
                    "edits",
                    '[{"oldText": "status=created", "newText": "status=created\\nstatus2=resumed"}]',
                    "false",
                ),
            )
        )
    )
    arguments = parse_message(text, thinking=True, tools_active=True).tool_calls[0].arguments
    assert arguments == (
        '{"command":"cd /tmp && git diff 2>/dev/null",'
        '"edits":[{"oldText":"status=created","newText":"status=created\\nstatus2=resumed"}]}'
    )


def test_parse_dsml_inside_reasoning_is_not_executable():
    for case in ("DSML inside reasoning is not a call", "DSML inside unclosed reasoning"):
        text, thinking, _ = CASES[case]
        message = parse_message(text, thinking=thinking, tools_active=True)
        assert message.tool_calls == () and message.error == ""
        assert START in message.reasoning


def test_parse_thinking_never_closed_is_all_reasoning():
    message = parse_message("<think>step 1\nstep 2", thinking=True, tools_active=False)
    assert (message.reasoning, message.content, message.tool_calls) == ("step 1\nstep 2", "", ())
    got = stream(["<think>step 1\nst", "ep 2"], thinking=True, tools_active=False)
    assert got.reasoning == "step 1\nstep 2" and not got.reasoning_closed


def test_parse_thinking_splits_at_the_first_think_close():
    text = "r</think>c1</think>c2\n\n" + block(invoke("t"))
    message = parse_message(text, thinking=True, tools_active=True)
    assert (message.reasoning, message.content) == ("r", "c1</think>c2")
    assert [c.name for c in message.tool_calls] == ["t"]


def test_parse_non_thinking_still_splits_an_emitted_think_close():
    """ds4 splits the final message even in non-thinking mode; the stream cannot take back text it sent."""
    message = parse_message("<think>oops</think>answer", thinking=False, tools_active=False)
    assert (message.reasoning, message.content) == ("oops", "answer")
    assert stream(["<think>oops</think>answer"], thinking=False, tools_active=False).text == "<think>oops</think>answer"
    assert parse_message("<think>no close", thinking=False, tools_active=False).content == "<think>no close"


def test_parse_prefers_a_block_after_a_blank_line_then_the_first_family():
    quoted = f"Write {START} to call tools.\n\n" + block(invoke("real"))
    message = parse_message(quoted, thinking=False, tools_active=True)
    assert (message.content, [c.name for c in message.tool_calls]) == (f"Write {START} to call tools.", ["real"])
    mixed = block(invoke("short", syntax=SHORT_DSML), syntax=SHORT_DSML) + "\n" + block(invoke("dsml"))
    assert [c.name for c in parse_message(mixed, thinking=False, tools_active=True).tool_calls] == ["dsml"]


def test_parse_malformed_block_returns_the_whole_text():
    text = f"trying a tool\n\n{START}\n{INVOKE}>\n{END}"  # invoke without a name (ds4's recovery test)
    message = parse_message(text, thinking=False, tools_active=True)
    assert (message.reasoning, message.content, message.tool_calls, message.raw_dsml) == ("", text, (), "")
    assert message.error == INVALID_TOOL_CALL
    thinking_text = "r</think>" + text
    assert parse_message(thinking_text, thinking=True, tools_active=True).content == thinking_text


@pytest.mark.parametrize(
    "broken",
    [
        f"{START}\ngarbage{END}",
        f"{START}\n{INVOKE} name=\"a\">\n{PARAM} string=\"true\">v{PARAM_END}\n{INVOKE_END}\n{END}",
        f"{START}\n{INVOKE} name=\"a\">\nx{INVOKE_END}\n{END}",
        f"{START}\n{INVOKE} name=\"a\">\n{SHORT_DSML.invoke_end}\n{SHORT_DSML.tool_calls_end}",
    ],
)
def test_parse_grammar_failures_are_invalid_tool_calls(broken):
    message = parse_message("x " + broken, thinking=False, tools_active=True)
    assert (message.content, message.tool_calls, message.error) == ("x " + broken, (), INVALID_TOOL_CALL)
    assert parse_message("x " + broken, thinking=False, tools_active=False).error == ""
    for chunks in chunkings(broken, random_count=2):
        got = stream(chunks, thinking=False, tools_active=True)
        assert got.tool_block_closed and got.ended == []


def test_unclosed_parameter_swallows_later_tags():
    """A string value runs to its closing parameter tag, so `</tool_calls>` inside it closes nothing.

    ds4's stream stops at any closing block tag, which cuts a call whose argument text contains one; here
    the value stays open, and the final parse reports the block invalid once generation ends.
    """
    text = f'{START}\n{INVOKE} name="a">\n{PARAM} name="k" string="true">v\n{INVOKE_END}\n{END}'
    got = stream([text], thinking=False, tools_active=True)
    assert (got.tool_block_closed, got.ended, got.arguments) == (False, [], ['{"k":"v\\n' + INVOKE_END + "\\n" + END])
    assert parse_message(text, thinking=False, tools_active=True).error == INVALID_TOOL_CALL
    assert GreedyTracker().feed(text) is DecodeState.STRING_BODY


def test_parse_bad_json_value_degrades_arguments_to_empty_object():
    text = block(invoke("a", param("s", "ok"), param("n", "hello", "false")))
    message = parse_message(text, thinking=False, tools_active=True)
    assert message.tool_calls[0].arguments == "{}" and message.error == ""
    got = stream([text], thinking=False, tools_active=True)
    assert got.fragments == ["{", '"s":"', "ok", '"', ',"n":', "hello", "}"]


def test_parse_json_value_rules():
    def arguments(value: str) -> str:
        text = block(invoke("a", param("v", value, "false")))
        return parse_message(text, thinking=False, tools_active=False).tool_calls[0].arguments

    assert arguments("") == '{"v":null}'
    assert arguments("  ") == "{}"
    assert arguments("10 trailing") == '{"v":10}'  # ds4 keeps the first JSON value
    assert arguments(' {"a" : [ 1 ,2 ] } ') == '{"v":{"a":[1,2]}}'
    assert arguments('"line\nbreak"') == '{"v":"line\\nbreak"}'  # a raw newline in a JSON string is accepted
    assert arguments("[1,]") == arguments("01") == arguments("1.5.2") == arguments("NaN") == arguments("'x'") == "{}"
    deepest = "[" * MAX_JSON_DEPTH + "]" * MAX_JSON_DEPTH
    assert arguments(deepest) == '{"v":' + deepest + "}"
    assert arguments("[" * (MAX_JSON_DEPTH + 1) + "]" * (MAX_JSON_DEPTH + 1)) == "{}"


def test_parse_missing_string_attribute_is_a_string():
    text = block(invoke("a", param("p", " 10 ", None)))
    assert parse_message(text, thinking=False, tools_active=True).tool_calls[0].arguments == '{"p":" 10 "}'


def test_parse_unknown_tool_name_is_still_parsed():
    message = parse_message(block(invoke("no_such_tool", param("x", "1"))), thinking=False, tools_active=True)
    assert [(c.name, c.arguments) for c in message.tool_calls] == [("no_such_tool", '{"x":"1"}')]


def test_parse_without_tools_still_parses_calls_but_streams_dsml_as_text():
    text = "Here.\n\n" + block(invoke("bash", param("command", "pwd")))
    message = parse_message(text, thinking=False, tools_active=False)
    assert message.content == "Here." and [c.name for c in message.tool_calls] == ["bash"]
    got = stream([text[:9], text[9:]], thinking=False, tools_active=False)
    assert (got.text, got.names, got.tool_block_closed) == (text, [], False)


def test_parse_attribute_values_with_tricky_names():
    text = block(invoke("t", f'{PARAM} name="xstring=" string="true">v{PARAM_END}'))
    assert parse_message(text, thinking=False, tools_active=True).tool_calls[0].arguments == '{"xstring=":"v"}'


def test_parse_orphan_end_markers_are_text():
    text, _, _ = CASES["orphan end markers"]
    message = parse_message(text, thinking=False, tools_active=True)
    assert (message.content, message.tool_calls, message.error) == (text, (), "")


def test_truncation_anywhere_never_raises_and_reports_unterminated():
    """Cut by max tokens: every prefix of a tool message parses without raising; the stream too."""
    text = BASH_EXAMPLE + "\n"
    block_at = text.index(START)
    for cut in range(len(text) + 1):
        prefix = text[:cut]
        message = parse_message(prefix, thinking=True, tools_active=True)
        got = stream([prefix[: cut // 2], prefix[cut // 2 :]], thinking=True, tools_active=True)
        if cut >= block_at + len(START) and END not in prefix:
            assert message.error == UNTERMINATED_TOOL_CALL and message.content == prefix
        else:
            assert message.error == ""
        assert got.tool_block_closed == (END in prefix)


# --- streaming -----------------------------------------------------------------


def test_stream_captured_fragments():
    parser = StreamParser(thinking=True, tools_active=True)
    events = parser.feed(BASH_EXAMPLE)
    assert events == [
        ReasoningDelta("The user wants files."),
        TextDelta("Checking."),
        ToolCallStart(0, "bash"),
        ToolCallArgsDelta(0, "{"),
        ToolCallArgsDelta(0, '"command":"'),
        ToolCallArgsDelta(0, 'ls -la && echo \\"hi\\"'),
        ToolCallArgsDelta(0, '"'),
        ToolCallArgsDelta(0, ',"timeout":'),
        ToolCallArgsDelta(0, '{ "a": [1, 2] }'),
        ToolCallArgsDelta(0, "}"),
        ToolCallEnd(0),
    ]
    assert parser.tool_block_closed and parser.finish() == []


def test_stream_reasoning_split_without_tools_never_leaks_think_close():
    parser = StreamParser(thinking=True, tools_active=False)
    first = parser.feed("We need to generate a title</th")
    assert first == [ReasoningDelta("We need to generate a title")]
    assert parser.feed("ink>Free disk space check") == [TextDelta("Free disk space check")]
    assert parser.reasoning_closed and parser.finish() == []


def test_stream_tracks_reasoning_closed_across_split_tags():
    parser = StreamParser(thinking=True, tools_active=True)
    for chunk, closed in [("reasoning body", False), ("</thi", False), ("nk>answer", True), ("<think>more", True)]:
        parser.feed(chunk)
        assert parser.reasoning_closed is closed, chunk
    assert StreamParser(thinking=False, tools_active=True).reasoning_closed


def test_stream_holds_a_partial_think_open_at_the_start():
    parser = StreamParser(thinking=True, tools_active=False)
    assert parser.feed("<thi") == []
    assert parser.feed("nk>x") == [ReasoningDelta("x")]
    assert StreamParser(thinking=True, tools_active=False).feed("<b>") == [ReasoningDelta("<b>")]


def test_stream_text_then_tool_block_hides_separator_and_markup():
    parser = StreamParser(thinking=True, tools_active=True)
    assert parser.feed("need a tool</think>Hello.\n\n") == [ReasoningDelta("need a tool"), TextDelta("Hello.")]
    assert parser.feed(START + "\n") == []
    assert not parser.tool_block_closed


def test_stream_holds_only_whitespace_and_partial_markers():
    parser = StreamParser(thinking=False, tools_active=True)
    assert parser.feed("a <") == [TextDelta("a")]
    assert parser.feed(" b\n") == [TextDelta(" < b")]
    assert parser.feed("<｜DS") == []
    assert parser.feed("x") == [TextDelta("\n<｜DSx")]
    assert parser.feed("  ") == []
    assert parser.finish() == [TextDelta("  ")]


def test_stream_partial_arguments():
    head = f"Before.\n\n{START}\n{INVOKE} name=\"bash\">\n{PARAM} name=\"command\" string=\"true\">echo partial"
    parser = StreamParser(thinking=False, tools_active=True)
    got = collect(parser.feed(head))
    assert (got.text, got.names, got.fragments) == ("Before.", ["bash"], ["{", '"command":"', "echo partial"])
    collect(parser.feed(f" done{PARAM_END}\n{INVOKE_END}\n{END}"), got)
    assert got.fragments[3:] == [" done", '"', "}"]
    assert got.ended == [0] and parser.tool_block_closed


def test_stream_waits_for_incomplete_tags():
    parser = StreamParser(thinking=False, tools_active=True)
    assert parser.feed(f"{START}\n{INVOKE}") == []
    assert parser.feed(f' name="bash">\n{PARAM}') == [ToolCallStart(0, "bash"), ToolCallArgsDelta(0, "{")]
    assert parser.feed(' name="c" string="true"') == []
    assert parser.feed(">x</｜DSML｜para") == [ToolCallArgsDelta(0, '"c":"'), ToolCallArgsDelta(0, "x")]


def test_stream_raw_json_arguments_are_sent_as_written():
    parser = StreamParser(thinking=False, tools_active=True)
    text = f'{START}\n{INVOKE} name="edit">\n{PARAM} name="edits" string="false">[1,2,3'
    assert collect(parser.feed(text)).fragments == ["{", '"edits":', "[1,2,3"]


def test_stream_holds_partial_entities():
    parser = StreamParser(thinking=False, tools_active=True)
    head = f'{START}\n{INVOKE} name="bash">\n{PARAM} name="command" string="true">echo &amp'
    got = collect(parser.feed(head))
    assert got.fragments == ["{", '"command":"', "echo "]
    collect(parser.feed(f"; done{PARAM_END}"), got)
    assert got.fragments[3:] == ["& done", '"']


def test_stream_unicode_arguments_pass_through():
    parser = StreamParser(thinking=False, tools_active=True)
    got = collect(parser.feed(f'{START}\n{INVOKE} name="write">\n{PARAM} name="content" string="true">flag '))
    collect(parser.feed(f"🚩 done{PARAM_END}\n{INVOKE_END}\n{END}"), got)
    assert got.arguments == ['{"content":"flag 🚩 done"}']


def test_stream_two_calls_get_two_indices():
    text, _, _ = CASES["two calls"]
    got = stream([text], thinking=False, tools_active=True)
    assert got.names == ["read", "bash"] and got.ended == [0, 1]
    assert got.arguments == ['{"path":"a.c"}', '{"command":"wc -l a.c"}']


def test_stream_after_grammar_failure_stops_projecting_until_a_closing_tag():
    parser = StreamParser(thinking=False, tools_active=True)
    got = collect(parser.feed(f'{START}\n{INVOKE} name="a">\nnot a parameter '))
    assert got.names == ["a"] and got.fragments == ["{"] and not parser.tool_block_closed
    assert parser.feed("more text </tool_calls> tail") == [] and parser.tool_block_closed


def test_stream_ignores_feeds_after_the_block_closed():
    parser = StreamParser(thinking=False, tools_active=True)
    collect(parser.feed(block(invoke("a"))))
    assert parser.feed("anything") == [] and parser.finish() == []


# --- greedy tracker --------------------------------------------


def tracker_state(text: str, *, thinking: bool = False) -> DecodeState:
    return GreedyTracker(thinking=thinking).feed(text)


def test_tracker_separates_structure_and_payload():
    head = f'{START}\n{INVOKE} name="edit">\n'
    assert tracker_state(head) is DecodeState.STRUCTURAL
    assert tracker_state(head + f'{PARAM} name="path" string="true">/tmp/a.py') is DecodeState.STRING_BODY
    assert tracker_state(head + f'{PARAM} name="path" string="true">/tmp/a.py</') is DecodeState.STRUCTURAL
    assert tracker_state(head + f'{PARAM} name="edits" string="false">[{{') is DecodeState.JSON_STRUCTURAL
    json_string = head + f'{PARAM} name="edits" string="false">[{{"newText":"for i in'
    assert tracker_state(json_string) is DecodeState.JSON_STRING
    done = head + f'{PARAM} name="edits" string="false">[]{PARAM_END}\n{INVOKE_END}\n{END}'
    assert tracker_state(done) is DecodeState.OUTSIDE


def test_tracker_incremental_feeding():
    tracker = GreedyTracker()
    expected = [
        ("Sure.\n\n", DecodeState.OUTSIDE, False),
        (START, DecodeState.STRUCTURAL, True),
        (f'\n{INVOKE} name="edit">\n{PARAM} name="path" string="true">', DecodeState.STRING_BODY, False),
        ("a<b", DecodeState.STRING_BODY, False),
        ("<", DecodeState.STRING_BODY, False),  # one character of a closing tag is still payload
        ("/", DecodeState.STRUCTURAL, True),
        (f"{D}parameter>\n", DecodeState.STRUCTURAL, True),
        (f'{PARAM} name="o" string="false">{{"k": "x\\"', DecodeState.JSON_STRING, False),
        ('<', DecodeState.JSON_STRING, False),
        ('" <', DecodeState.JSON_STRUCTURAL, True),
        ("/｜DSML｜parameter>", DecodeState.STRUCTURAL, True),
        (f"\n{INVOKE_END}\n{END}", DecodeState.OUTSIDE, False),
        (f"\n\n{START}\n", DecodeState.OUTSIDE, False),  # only the first block counts
    ]
    for text, state, greedy in expected:
        assert tracker.feed(text) is state, text
        assert tracker.greedy is greedy, text


def test_tracker_recognises_the_three_families():
    for syntax in SYNTAXES:
        head = (
            f'prose {syntax.tool_calls_start}\n{syntax.invoke_start} name="a">\n'
            f'{syntax.param_start} name="k" string="true">v'
        )
        assert tracker_state(head) is DecodeState.STRING_BODY, syntax
        assert tracker_state(head + syntax.param_end + syntax.invoke_end + syntax.tool_calls_end) is DecodeState.OUTSIDE


def test_tracker_thinking_ignores_blocks_inside_reasoning():
    inside = f"reasoning {START}\n{INVOKE}"
    assert tracker_state(inside, thinking=True) is DecodeState.OUTSIDE
    assert tracker_state(inside, thinking=False) is DecodeState.STRUCTURAL
    assert tracker_state(f"r</think>{START}", thinking=True) is DecodeState.STRUCTURAL


def test_tracker_stays_structural_after_garbage_inside_a_block():
    tracker = GreedyTracker()
    assert tracker.feed(f"{START}\nnot a tag") is DecodeState.STRUCTURAL
    assert tracker.feed(f' {PARAM} name="k" string="true">text') is DecodeState.STRUCTURAL


@pytest.mark.parametrize("case", list(CASES))
def test_tracker_is_independent_of_chunking(case):
    text, thinking, _ = CASES[case]
    reference = [GreedyTracker(thinking=thinking).feed(text[:i]) for i in range(1, len(text) + 1)]
    tracker = GreedyTracker(thinking=thinking)
    assert [tracker.feed(char) for char in text] == reference
    rng = random.Random(1)
    tracker = GreedyTracker(thinking=thinking)
    pos = 0
    while pos < len(text):
        step = rng.randint(1, 9)
        assert tracker.feed(text[pos : pos + step]) is reference[min(len(text), pos + step) - 1]
        pos += step


# --- helpers ------------------------------------------------------------------------------------------


def test_decode_entities_is_left_to_right():
    assert decode_entities("&amp;lt; &lt;&gt;&quot;&apos; &am &x; &&amp;") == "&lt; <>\"' &am &x; &&"


def test_json_escape_matches_ds4():
    assert json_escape('a"b\\c\n\r\t\x01\x08\x0c\x7fé🚩') == 'a\\"b\\\\c\\n\\r\\t\\u0001\\u0008\\u000c\x7fé🚩'


# --- hypothesis: canonical DSML round trips -------------------------------------------------------------

_SPECIAL = [
    "<", ">", "&", "&&", '"', "'", "\n", "\n\n", "\t", " ", "é", "🚩", "</", "&amp", "2>&1", "</think>",
    PARAM_END, END, INVOKE_END, PARAM, START, "string=", 'name="', "\\", "\x00",
]
_payload = st.lists(st.one_of(st.text(max_size=6), st.sampled_from(_SPECIAL)), max_size=6).map("".join)
_json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | _payload,
    lambda children: st.lists(children, max_size=3) | st.dictionaries(_payload, children, max_size=3),
    max_leaves=8,
)
_arguments = st.dictionaries(_payload, st.one_of(_payload, _json_values), max_size=4)
_calls = st.lists(st.tuples(_payload, _arguments), max_size=3)
_ENTITY = re.compile("&(?:amp|lt|gt|quot|apos);")
_MARKERS = [s.tool_calls_start for s in SYNTAXES]


def _has_entity(value) -> bool:
    return isinstance(value, str) and _ENTITY.search(value) is not None


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(calls=_calls, reasoning=_payload, content=_payload, thinking=st.booleans(), seed=st.integers(0, 2**16))
def test_canonical_dsml_round_trips(calls, reasoning, content, thinking, seed):
    # String values are written raw, so text that already looks like an entity cannot come back unchanged.
    assume(not any(_has_entity(v) for _, args in calls for v in args.values()))
    assume(not any(m in content for m in _MARKERS) and "</think>" not in content)
    assume(not content.startswith("<think>"))
    if thinking:
        assume("</think>" not in reasoning and not reasoning.startswith("<think>"))
    specs = [ToolCallSpec(f"call_{i}", name, json.dumps(args)) for i, (name, args) in enumerate(calls)]
    dsml_block = canonical_tool_calls(specs)
    text = (reasoning + "</think>" if thinking else "") + content + dsml_block
    message = parse_message(text, thinking=thinking, tools_active=True)
    assert message.error == ""
    assert message.content == (content.rstrip(WS) if calls else content)
    assert message.reasoning == (reasoning if thinking else "")
    assert message.raw_dsml == dsml_block
    assert [c.name for c in message.tool_calls] == [name for name, _ in calls]
    for call, (_, args) in zip(message.tool_calls, calls):
        assert ordered(call.arguments) == ordered(json.dumps(args))

    rng = random.Random(seed)
    cuts = sorted({rng.randrange(len(text) + 1) for _ in range(rng.randint(0, 20))})
    bounds = [0, *cuts, len(text)]
    got = stream([text[a:b] for a, b in zip(bounds, bounds[1:])], thinking=thinking, tools_active=True)
    assert (got.reasoning, got.text) == (message.reasoning, message.content)
    assert got.names == [c.name for c in message.tool_calls]
    assert [ordered(a) for a in got.arguments] == [ordered(c.arguments) for c in message.tool_calls]
    assert got.tool_block_closed == bool(calls)


@settings(max_examples=200, deadline=None)
@given(value=_json_values, indent=st.sampled_from([None, 0, 2]))
def test_compact_json_matches_minified_dumps(value, indent):
    text = json.dumps(value, ensure_ascii=False, indent=indent)
    assert compact_json(" " + text + " trailing") == json.dumps(value, ensure_ascii=False, separators=(",", ":"))


_FRAGMENTS = [
    START, END, f'{INVOKE} name="a">', INVOKE_END, f'{PARAM} name="k" string="true">',
    f'{PARAM} name="j" string="false">', f'{PARAM} name="n">', PARAM_END, "</think>", "<think>",
    "\n\n", " ", "&amp", ";", "<", "</", '"', "\\", "x", "{", "[1,",
    SHORT_DSML.tool_calls_start, PLAIN.tool_calls_end,
]


@settings(max_examples=300, deadline=None)
@given(
    pieces=st.lists(st.sampled_from(_FRAGMENTS), max_size=25),
    thinking=st.booleans(),
    tools_active=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_arbitrary_dsml_soup_never_raises(pieces, thinking, tools_active, seed):
    text = "".join(pieces)
    message = parse_message(text, thinking=thinking, tools_active=tools_active)
    rng = random.Random(seed)
    cuts = sorted({rng.randrange(len(text) + 1) for _ in range(rng.randint(0, 10))})
    bounds = [0, *cuts, len(text)]
    chunks = [text[a:b] for a, b in zip(bounds, bounds[1:])]
    got = stream(chunks, thinking=thinking, tools_active=tools_active)
    tracker = GreedyTracker(thinking=thinking)
    states = [tracker.feed(chunk) for chunk in chunks]
    assert all(isinstance(state, DecodeState) for state in states)
    assert message.error in (("", INVALID_TOOL_CALL, UNTERMINATED_TOOL_CALL) if tools_active else ("",))
    if message.error:
        assert (message.content, message.tool_calls) == (text, ())
    if got.tool_block_closed:
        assert tools_active and any(s.tool_calls_end in text for s in SYNTAXES)


def test_final_parse_reports_whether_reasoning_was_closed():
    assert parse_message("still thinking", thinking=True, tools_active=False).reasoning_closed is False
    assert parse_message("done</think>answer", thinking=True, tools_active=False).reasoning_closed is True
    assert parse_message("answer", thinking=False, tools_active=False).reasoning_closed is True
