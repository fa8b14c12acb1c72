"""Golden tests of the prompt renderer against ds4's exact bytes (ds4_server.c's
`render_chat_prompt_text` and its tests).

Expected strings are written out here from ds4's rules, not built from ds4_mlx.chat's constants, so a
changed byte in a constant fails a test.
"""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ds4_mlx.chat import (
    Message,
    PromptPiece,
    ThinkMode,
    ToolCallSpec,
    ToolMemory,
    canonical_tool_calls,
    effective_think_mode,
    model_alias_thinking,
    render_chat,
    render_cli_preamble,
    render_cli_prompt,
    render_cli_turn,
    render_completion_prompt,
    render_live_tail,
    request_think_mode,
    think_mode_from_effort,
    tool_result_block,
    tools_prompt,
)
from ds4_mlx.errors import RequestError

B = "<｜begin▁of▁sentence｜>"
E = "<｜end▁of▁sentence｜>"
U = "<｜User｜>"
A = "<｜Assistant｜>"

THINK_MAX = (
    "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
    "You MUST be very thorough in your thinking and comprehensively decompose the problem to resolve the root cause, rigorously stress-testing your logic against all potential paths, edge cases, and adversarial scenarios.\n"  # noqa: E501
    "Explicitly write out your entire deliberation process, documenting every intermediate step, considered alternative, and rejected hypothesis to ensure absolutely no assumption is left unchecked.\n"  # noqa: E501
    "\n"
)

PREAMBLE = """## Tools

You have access to a set of tools to help answer the user question. You can invoke tools by writing a "<｜DSML｜tool_calls>" block like the following:

<｜DSML｜tool_calls>
<｜DSML｜invoke name="$TOOL_NAME">
<｜DSML｜parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</｜DSML｜parameter>
...
</｜DSML｜invoke>
<｜DSML｜invoke name="$TOOL_NAME2">
...
</｜DSML｜invoke>
</｜DSML｜tool_calls>

String parameters should be specified as raw text and set `string="true"`. Preserve characters such as `>`, `&`, and `&&` exactly; never replace normal string characters with XML or HTML entity escapes. Only if a string value itself contains the exact closing parameter tag `</｜DSML｜parameter>`, write that tag as `&lt;/｜DSML｜parameter>` inside the value. For all other types (numbers, booleans, arrays, objects), pass the value in JSON format and set `string="false"`.

If thinking_mode is enabled (triggered by <think>), you MUST output your complete reasoning inside <think>...</think> BEFORE any tool calls or final response.

Otherwise, output directly after </think> with tool calls or final response.

### Available Tool Schemas

"""  # noqa: E501

EPILOGUE = (
    "\n\nYou MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls. "
    "Use the exact parameter names from the schemas."
)

BASH_SCHEMA = (
    '{"name":"bash","description":"Run a shell command","parameters":{"type":"object","properties":'
    '{"command":{"type":"string"},"timeout":{"type":"number"}},"required":["command"]}}'
)

HIGH, MAX, NONE = ThinkMode.HIGH, ThinkMode.MAX, ThinkMode.NONE
CTX = 32768
BIG_CTX = 393216


def system(text: str) -> Message:
    return Message("system", text)


def user(text: str) -> Message:
    return Message("user", text)


def tool(text: str, call_id: str = "") -> Message:
    return Message("tool", text, tool_call_id=call_id)


def assistant(content: str = "", reasoning: str = "", calls: tuple[ToolCallSpec, ...] = ()) -> Message:
    return Message("assistant", content, reasoning, calls)


def call(arguments: object, name: str = "a", call_id: str = "call_1") -> ToolCallSpec:
    return ToolCallSpec(call_id, name, arguments)


def one_call_dsml(body: str, name: str = "a") -> str:
    return f'\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="{name}">\n{body}</｜DSML｜invoke>\n</｜DSML｜tool_calls>'


def param(name: str, value: str, is_string: bool) -> str:
    kind = "true" if is_string else "false"
    return f'<｜DSML｜parameter name="{name}" string="{kind}">{value}</｜DSML｜parameter>\n'


# ---------------------------------------------------------------------------------------------------
# a worked example, byte for byte

WORKED_MESSAGES = [
    system("You are a coding agent."),
    user("How many files are in /tmp?"),
    assistant(
        "Let me check.",
        "I should run ls.",
        (ToolCallSpec("call_abc", "bash", '{"command":"ls /tmp | wc -l","timeout": 10}'),),
    ),
    tool("42\n", "call_abc"),
    assistant("There are 42 entries.", "Output says 42."),
    user("Thanks. And in /var?"),
]

WORKED_DSML = (
    "\n\n<｜DSML｜tool_calls>\n"
    '<｜DSML｜invoke name="bash">\n'
    '<｜DSML｜parameter name="command" string="true">ls /tmp | wc -l</｜DSML｜parameter>\n'
    '<｜DSML｜parameter name="timeout" string="false">10</｜DSML｜parameter>\n'
    "</｜DSML｜invoke>\n"
    "</｜DSML｜tool_calls>"
)


def test_worked_example_thinking_with_tools():
    expected = (
        B + PREAMBLE + BASH_SCHEMA + EPILOGUE + "\n\nYou are a coding agent."
        + U + "How many files are in /tmp?"
        + A + "<think>I should run ls.</think>Let me check." + WORKED_DSML + E
        + U + "<tool_result>42\n</tool_result>"
        + A + "<think>Output says 42.</think>There are 42 entries." + E
        + U + "Thanks. And in /var?" + A + "<think>"
    )
    assert render_chat(WORKED_MESSAGES, tools=[BASH_SCHEMA], think=HIGH, ctx=CTX) == expected


def test_worked_example_non_thinking_turns_every_think_block_into_a_bare_close():
    expected = (
        B + PREAMBLE + BASH_SCHEMA + EPILOGUE + "\n\nYou are a coding agent."
        + U + "How many files are in /tmp?" + A + "</think>Let me check." + WORKED_DSML + E
        + U + "<tool_result>42\n</tool_result>" + A + "</think>There are 42 entries." + E
        + U + "Thanks. And in /var?" + A + "</think>"
    )
    assert render_chat(WORKED_MESSAGES, tools=[BASH_SCHEMA], think=NONE, ctx=CTX) == expected


def test_worked_example_without_tools_field_keeps_reasoning_through_tool_context():
    expected = (
        B + "You are a coding agent."
        + U + "How many files are in /tmp?"
        + A + "<think>I should run ls.</think>Let me check." + WORKED_DSML + E
        + U + "<tool_result>42\n</tool_result>"
        + A + "<think>Output says 42.</think>There are 42 entries." + E
        + U + "Thanks. And in /var?" + A + "<think>"
    )
    assert render_chat(WORKED_MESSAGES, think=HIGH, ctx=CTX) == expected


# ---------------------------------------------------------------------------------------------------
# more verified micro-cases

MICRO_MESSAGES = [
    system("S1"),
    Message("developer", "D1"),
    user("part1" + "part2"),  # [text part1, image, text part2] flattened by the caller
    assistant("A1", "R1"),
    Message("latest_reminder", "LR"),
    user("U2"),
]


def test_micro_case_system_developer_hoisted_reasoning_dropped_reminder_dropped():
    expected = B + "S1\n\nD1" + U + "part1part2" + A + "</think>A1" + E + U + "U2" + A + "<think>"
    assert render_chat(MICRO_MESSAGES, think=HIGH, ctx=CTX) == expected


def test_micro_case_think_max_only_adds_the_prefix_after_bos():
    expected = B + THINK_MAX + "S1\n\nD1" + U + "part1part2" + A + "</think>A1" + E + U + "U2" + A + "<think>"
    assert render_chat(MICRO_MESSAGES, think=MAX, ctx=BIG_CTX) == expected


def test_micro_case_multiple_tool_results_then_user():
    messages = [
        user("go"),
        assistant("", "", (call("{}", call_id="c1"), call("{}", call_id="c2"))),
        tool("r2 </tool_result> end", "c2"),
        tool("r1", "c1"),
        user("next"),
    ]
    rendered = render_chat(messages, tools=[BASH_SCHEMA], think=HIGH, ctx=CTX)
    assert rendered.endswith(
        "</｜DSML｜tool_calls>" + E
        + U + "<tool_result>r2 &lt;/tool_result> end</tool_result><tool_result>r1</tool_result>"
        + U + "next" + A + "<think>"
    )


def test_micro_case_assistant_with_only_tool_calls_has_empty_think_block():
    messages = [user("list"), assistant("", "", (call('{"path":"."}', name="ls"),))]
    rendered = render_chat(messages, think=HIGH, ctx=CTX)
    assert rendered == (
        B + U + "list" + A + "<think></think>"
        + one_call_dsml(param("path", ".", True), name="ls") + E
    )


# ---------------------------------------------------------------------------------------------------
# openers, think modes (ds4's server tests)


def test_non_thinking_opener():
    assert render_chat([user("Hello")], think=NONE, ctx=CTX) == B + U + "Hello" + A + "</think>"


def test_thinking_opener():
    assert render_chat([user("Hello")], think=HIGH, ctx=CTX) == B + U + "Hello" + A + "<think>"


def test_think_max_prefix_right_after_bos_and_before_system():
    rendered = render_chat([system("You are terse."), user("Hello")], think=MAX, ctx=BIG_CTX)
    assert rendered == B + THINK_MAX + "You are terse." + U + "Hello" + A + "<think>"
    assert "</think>" not in rendered


def test_think_max_gated_by_context():
    below = render_chat([user("Hi")], think=MAX, ctx=BIG_CTX - 1)
    at = render_chat([user("Hi")], think=MAX, ctx=BIG_CTX)
    assert below == B + U + "Hi" + A + "<think>"
    assert at == B + THINK_MAX + U + "Hi" + A + "<think>"


def test_think_max_comes_before_tools_preamble():
    rendered = render_chat([system("S"), user("Hi")], tools=[BASH_SCHEMA], think=MAX, ctx=BIG_CTX)
    assert rendered.startswith(B + THINK_MAX + PREAMBLE + BASH_SCHEMA + EPILOGUE + "\n\nS" + U)


def test_effective_think_mode():
    assert effective_think_mode(MAX, 32768) is HIGH
    assert effective_think_mode(MAX, 393215) is HIGH
    assert effective_think_mode(MAX, 393216) is MAX
    assert effective_think_mode(HIGH, 1) is HIGH
    assert effective_think_mode(NONE, BIG_CTX) is NONE


@pytest.mark.parametrize(
    "effort, expected",
    [("max", MAX), ("xhigh", HIGH), ("high", HIGH), ("medium", ThinkMode.LOW), ("low", ThinkMode.LOW),
     ("minimal", ThinkMode.LOW), ("none", NONE)],
)
def test_think_mode_from_effort(effort, expected):
    assert think_mode_from_effort(effort) is expected


def test_think_mode_from_null_effort_is_unchanged():
    assert think_mode_from_effort(None, NONE) is NONE
    assert think_mode_from_effort(None, MAX) is MAX
    assert think_mode_from_effort(None) is ThinkMode.LOW  # the default tier


@pytest.mark.parametrize("effort", ["banana", "MAX", "", 3])
def test_think_mode_from_bad_effort_names_the_value(effort):
    with pytest.raises(RequestError, match="reasoning effort"):
        think_mode_from_effort(effort)


def test_model_aliases():
    assert model_alias_thinking("deepseek-chat") is False
    assert model_alias_thinking("deepseek-reasoner") is True
    assert model_alias_thinking("deepseek-v4-flash") is None
    assert model_alias_thinking(None) is None


def test_request_think_mode_combines_alias_switch_effort_and_context():
    def mode(model="deepseek-v4-flash", thinking=None, effort=HIGH, ctx=CTX):
        return request_think_mode(model=model, thinking=thinking, effort=effort, ctx=ctx)

    assert mode() is HIGH
    assert mode(model="deepseek-chat") is NONE
    assert mode(model="deepseek-chat", thinking=True) is HIGH  # explicit control overrides the alias
    assert mode(model="deepseek-reasoner", thinking=False) is NONE
    assert mode(thinking=False, effort=MAX) is NONE
    assert mode(effort=NONE) is NONE
    assert mode(effort=MAX) is HIGH
    assert mode(effort=MAX, ctx=BIG_CTX) is MAX


# ---------------------------------------------------------------------------------------------------
# system region


def test_no_system_and_no_tools_gives_bos_then_user():
    assert render_chat([user("x")], think=HIGH, ctx=CTX).startswith(B + U + "x")


def test_opening_system_messages_form_the_region_later_ones_stay_in_place():
    """System turns after the conversation began are their bare text where they stand (DeepSeek's encoding of a
    system message), so the turns before them keep their bytes: appending one keeps the prefix reusable."""
    messages = [system("S"), user("u1"), system("late"), assistant("a"), Message("developer", "dev"), user("u2")]
    rendered = render_chat(messages, think=NONE, ctx=CTX)
    assert rendered == B + "S" + U + "u1late" + A + "</think>a" + E + "dev" + U + "u2" + A + "</think>"
    before = render_chat(messages[:2], think=NONE, ctx=CTX)
    assert rendered.startswith(before[: -len(A + "</think>")])
    # a system turn appended last: the answer is still pending, its opener follows the system text
    appended = render_chat([*messages[:2], system("env")], think=HIGH, ctx=CTX)
    assert appended == B + "S" + U + "u1env" + A + "<think>"


def test_system_turn_between_tool_results_and_reasoning_kept_in_tool_context():
    messages = [user("go"), assistant("", "r", (call("{}", call_id="c1"),)), tool("out", "c1"), system("note"),
                assistant("done", "r2")]
    rendered = render_chat(messages, think=HIGH, ctx=CTX)
    assert rendered.endswith(U + "<tool_result>out</tool_result>note" + A + "<think>r2</think>done" + E)


def test_separator_only_after_non_empty_system_text():
    assert render_chat([system(""), system("S2"), user("x")], think=NONE, ctx=CTX).startswith(B + "S2" + U)
    assert render_chat([system("S1"), system(""), user("x")], think=NONE, ctx=CTX).startswith(
        B + "S1\n\n" + U
    )


def test_tools_preamble_before_client_system_text_before_user():
    rendered = render_chat([system("client system"), user("x")], tools=[BASH_SCHEMA], think=HIGH, ctx=CTX)
    assert rendered.index("## Tools") < rendered.index("client system") < rendered.index(U)
    assert rendered.startswith(B + PREAMBLE + BASH_SCHEMA + EPILOGUE + "\n\nclient system" + U + "x")


def test_tool_schemas_are_raw_lines_joined_by_newline():
    pretty = '{\n  "name": "read",\n  "parameters": {}\n}'
    assert tools_prompt([BASH_SCHEMA, pretty]) == PREAMBLE + BASH_SCHEMA + "\n" + pretty + EPILOGUE
    assert tools_prompt([]) == ""


def test_tools_preamble_without_system_directly_followed_by_user():
    rendered = render_chat([user("x")], tools=[BASH_SCHEMA], think=HIGH, ctx=CTX)
    assert rendered == B + PREAMBLE + BASH_SCHEMA + EPILOGUE + U + "x" + A + "<think>"


def test_tools_given_as_one_string_is_rejected():
    with pytest.raises(TypeError, match="sequence of schema"):
        render_chat([user("x")], tools=BASH_SCHEMA, think=HIGH, ctx=CTX)


# ---------------------------------------------------------------------------------------------------
# assistant turns: reasoning keep/drop, pending rule


def test_old_reasoning_dropped_without_tool_context():
    messages = [user("first"), assistant("first answer", "hidden"), user("second")]
    rendered = render_chat(messages, think=HIGH, ctx=CTX)
    assert rendered == B + U + "first" + A + "</think>first answer" + E + U + "second" + A + "<think>"
    assert "hidden" not in rendered


def test_reasoning_kept_with_tools_field():
    messages = [user("first"), assistant("first answer", "tool reasoning"), user("second")]
    rendered = render_chat(messages, tools=[BASH_SCHEMA], think=HIGH, ctx=CTX)
    assert A + "<think>tool reasoning</think>first answer" + E in rendered


def test_tool_context_from_tool_calls_alone():
    messages = [
        user("q"),
        assistant("", "r1", (call('{"x":1}'),)),
        user("never mind"),  # no tool result, no tools field
        assistant("ok", "r2"),
        user("again"),
    ]
    rendered = render_chat(messages, think=HIGH, ctx=CTX)
    assert "<think>r1</think>" in rendered
    assert A + "<think>r2</think>ok" + E in rendered


def test_tool_context_from_tool_result_alone():
    messages = [user("q"), assistant("a", "kept"), tool("/tmp"), user("next")]
    rendered = render_chat(messages, think=HIGH, ctx=CTX)
    assert rendered == (
        B + U + "q" + A + "<think>kept</think>a" + E + U + "<tool_result>/tmp</tool_result>"
        + U + "next" + A + "<think>"
    )


def test_function_role_is_a_tool_result():
    messages = [user("q"), Message("function", "out"), Message("tool", "out2")]
    assert render_chat(messages, think=NONE, ctx=CTX) == (
        B + U + "q" + U + "<tool_result>out</tool_result><tool_result>out2</tool_result>" + A + "</think>"
    )


def test_assistant_after_last_user_keeps_reasoning_and_gets_no_opener():
    rendered = render_chat([user("q"), assistant("partial", "thought")], think=HIGH, ctx=CTX)
    assert rendered == B + U + "q" + A + "<think>thought</think>partial" + E


def test_assistant_after_last_user_in_non_thinking_mode():
    rendered = render_chat([user("q"), assistant("partial", "thought")], think=NONE, ctx=CTX)
    assert rendered == B + U + "q" + A + "</think>partial" + E


def test_assistant_first_has_no_marker_and_no_think_tags():
    rendered = render_chat([assistant("hello", "r"), user("hi")], think=HIGH, ctx=CTX)
    assert rendered == B + "hello" + E + U + "hi" + A + "<think>"


def test_two_assistants_in_a_row_second_has_no_marker():
    rendered = render_chat([user("q"), assistant("one", "r1"), assistant("two", "r2")], think=HIGH, ctx=CTX)
    assert rendered == B + U + "q" + A + "<think>r1</think>one" + E + "two" + E


def test_latest_reminder_and_unknown_roles_are_dropped():
    messages = [user("q"), Message("latest_reminder", "LR"), Message("narrator", "N"), user("q2")]
    assert render_chat(messages, think=NONE, ctx=CTX) == B + U + "q" + U + "q2" + A + "</think>"


def test_empty_conversation_is_bos_only():
    assert render_chat([], think=HIGH, ctx=CTX) == B


def test_message_fields_must_be_strings():
    with pytest.raises(TypeError, match="flatten content arrays"):
        Message("user", ["part1", "part2"])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="Message.reasoning"):
        Message("assistant", "", None)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------------------
# tool results


def test_tool_result_escapes_only_its_closing_tag():
    content = "console.log('<<< < > >>>'); a && b </tool_result> <｜DSML｜x> &amp;"
    assert tool_result_block(content) == (
        "<tool_result>console.log('<<< < > >>>'); a && b &lt;/tool_result> <｜DSML｜x> &amp;</tool_result>"
    )


def test_consecutive_tool_results_share_one_user_marker_and_following_user_gets_its_own():
    messages = [user("q"), tool("a"), tool("b"), user("c"), tool("d")]
    assert render_chat(messages, think=NONE, ctx=CTX) == (
        B + U + "q" + U + "<tool_result>a</tool_result><tool_result>b</tool_result>"
        + U + "c" + U + "<tool_result>d</tool_result>" + A + "</think>"
    )


def test_tool_result_after_an_assistant_turn_opens_a_new_user_turn():
    messages = [user("q"), tool("a"), assistant("x"), tool("b")]
    assert render_chat(messages, think=NONE, ctx=CTX) == (
        B + U + "q" + U + "<tool_result>a</tool_result>" + A + "</think>x" + E
        + U + "<tool_result>b</tool_result>" + A + "</think>"
    )


# ---------------------------------------------------------------------------------------------------
# canonical DSML


def test_canonical_string_values_stay_literal():
    rendered = canonical_tool_calls([call('{"command":"make 2>&1 && ls 2>/dev/null | grep \\"<x>\\""}')])
    assert rendered == one_call_dsml(param("command", 'make 2>&1 && ls 2>/dev/null | grep "<x>"', True))


def test_canonical_escapes_only_the_closing_parameter_tag():
    arguments = json.dumps({"s": "a </｜DSML｜parameter> b <｜DSML｜parameter>", "n": ["</｜DSML｜parameter>"]}, ensure_ascii=False)
    assert canonical_tool_calls([call(arguments)]) == one_call_dsml(
        param("s", "a &lt;/｜DSML｜parameter> b <｜DSML｜parameter>", True)
        + param("n", '["\\u003c/｜DSML｜parameter>"]', False)
    )


def test_canonical_attribute_escaping_of_tool_and_parameter_names():
    rendered = canonical_tool_calls([call('{"k<&>\\"":"v"}', name='t"<&>')])
    assert rendered == one_call_dsml(param("k&lt;&amp;&gt;&quot;", "v", True), name="t&quot;&lt;&amp;&gt;")


def test_canonical_decodes_json_string_escapes():
    rendered = canonical_tool_calls([call('{"text":"caf\\u00e9\\nline\\t\\"q\\" \\\\ \\/ \\ud83d\\ude00"}')])
    assert rendered == one_call_dsml(param("text", 'café\nline\t"q" \\ / 😀', True))


def test_canonical_minifies_non_string_values_keeping_string_bytes():
    arguments = '{ "n" : 10 , "f": 1.50, "b": true, "z": null, "l": [1, 2, {"y": "z w", "e": "\\u00e9"}] }'
    assert canonical_tool_calls([call(arguments)]) == one_call_dsml(
        param("n", "10", False)
        + param("f", "1.50", False)
        + param("b", "true", False)
        + param("z", "null", False)
        + param("l", '[1,2,{"y":"z w","e":"\\u00e9"}]', False)
    )


def test_canonical_keeps_the_calls_own_key_order():
    arguments = '{"description":"list","command":"ls","timeout":5}'
    assert canonical_tool_calls([call(arguments, name="bash")]) == one_call_dsml(
        param("description", "list", True) + param("command", "ls", True) + param("timeout", "5", False),
        name="bash",
    )


def test_canonical_empty_object_has_no_parameter_lines():
    assert canonical_tool_calls([call("{}")]) == (
        '\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="a">\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>'
    )
    assert canonical_tool_calls([call(" { } ")]) == canonical_tool_calls([call("{}")])


@pytest.mark.parametrize("arguments", ["not json", "[1, 2]", '"text"', "", '{"a": }', '{"a":1', "{1:2}"])
def test_canonical_non_object_arguments_become_one_raw_string_parameter(arguments):
    assert canonical_tool_calls([call(arguments)]) == one_call_dsml(param("arguments", arguments, True))


def test_canonical_raw_arguments_parameter_escapes_the_closing_tag():
    assert canonical_tool_calls([call("oops </｜DSML｜parameter>")]) == one_call_dsml(
        param("arguments", "oops &lt;/｜DSML｜parameter>", True)
    )


def test_canonical_scanner_is_as_lenient_as_ds4():
    # missing comma between members and bytes after the closing brace are tolerated, duplicates kept
    assert canonical_tool_calls([call('{"a":"x" "a":2} trailing')]) == one_call_dsml(
        param("a", "x", True) + param("a", "2", False)
    )


def test_canonical_parsed_arguments_render_like_their_json_text():
    parsed = {"command": "ls && echo é", "opts": {"depth": 2, "all": True}, "n": 3}
    text = '{"command":"ls && echo é","opts":{"depth":2,"all":true},"n":3}'
    assert canonical_tool_calls([call(parsed)]) == canonical_tool_calls([call(text)])


def test_canonical_parsed_non_object_arguments():
    assert canonical_tool_calls([call([1, "x"])]) == one_call_dsml(param("arguments", '[1,"x"]', True))


def test_canonical_unserialisable_arguments_are_a_request_error():
    with pytest.raises(RequestError, match="tool call 'a'"):
        canonical_tool_calls([call({"x": object()})])


def test_canonical_several_calls_in_one_block():
    rendered = canonical_tool_calls([call('{"p":1}', name="a"), call("{}", name="b", call_id="call_2")])
    assert rendered == (
        "\n\n<｜DSML｜tool_calls>\n"
        '<｜DSML｜invoke name="a">\n' + param("p", "1", False) + "</｜DSML｜invoke>\n"
        '<｜DSML｜invoke name="b">\n</｜DSML｜invoke>\n'
        "</｜DSML｜tool_calls>"
    )


# ---------------------------------------------------------------------------------------------------
# exact replay through ToolMemory

SAMPLED = (
    "\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"bash\">\n"
    '<｜DSML｜parameter name="command" string="true">ls</｜DSML｜parameter>\n'
    '<｜DSML｜parameter name="timeout" string="false">10</｜DSML｜parameter>\n'
    '<｜DSML｜parameter name="description" string="true">list</｜DSML｜parameter>\n'
    "</｜DSML｜invoke>\n</｜DSML｜tool_calls>"
)


def replay_messages(*ids: str) -> list[Message]:
    # the client sent the arguments back in a different key order than the model sampled them
    calls = tuple(
        ToolCallSpec(i, "bash", '{"description":"list","timeout":10,"command":"ls"}') for i in ids
    )
    return [user("q"), assistant("Checking.", "r", calls), tool("out"), user("more")]


def test_exact_replay_when_every_id_maps_to_the_same_block():
    memory = ToolMemory()
    memory.remember(["call_1", "call_2"], SAMPLED)
    rendered = render_chat(replay_messages("call_1", "call_2"), think=HIGH, ctx=CTX, tool_memory=memory)
    assert A + "<think>r</think>Checking." + SAMPLED + E in rendered


def test_partial_id_match_falls_back_to_canonical():
    memory = ToolMemory()
    memory.remember(["call_1"], SAMPLED)
    rendered = render_chat(replay_messages("call_1", "call_x"), think=HIGH, ctx=CTX, tool_memory=memory)
    assert SAMPLED not in rendered
    assert param("description", "list", True) + param("timeout", "10", False) in rendered


def test_ids_mapping_to_different_blocks_fall_back_to_canonical():
    memory = ToolMemory()
    memory.remember(["call_1"], SAMPLED)
    memory.remember(["call_2"], SAMPLED.replace("ls", "pwd"))
    rendered = render_chat(replay_messages("call_1", "call_2"), think=HIGH, ctx=CTX, tool_memory=memory)
    assert SAMPLED not in rendered and "pwd" not in rendered


def test_no_tool_memory_means_canonical_rendering():
    rendered = render_chat(replay_messages("call_1"), think=HIGH, ctx=CTX)
    assert SAMPLED not in rendered
    assert '<｜DSML｜parameter name="description" string="true">list' in rendered


# ---------------------------------------------------------------------------------------------------
# ToolMemory


def test_tool_memory_lookup_rules():
    memory = ToolMemory()
    memory.remember(["a", "b", ""], "BLOCK")
    assert memory.lookup(["a"]) == "BLOCK"
    assert memory.lookup(["a", "b"]) == "BLOCK"
    assert memory.lookup([]) is None
    assert memory.lookup(["a", ""]) is None
    assert memory.lookup(["a", "zz"]) is None
    assert "" not in memory and len(memory) == 2


def test_tool_memory_ignores_empty_blocks():
    memory = ToolMemory()
    memory.remember(["a"], "")
    assert len(memory) == 0 and memory.lookup(["a"]) is None


def test_tool_memory_prunes_oldest_ids_past_max_ids():
    memory = ToolMemory(max_ids=3)
    for i in range(5):
        memory.remember([f"id{i}"], f"block{i}")
    assert [memory.lookup([f"id{i}"]) for i in range(5)] == [None, None, "block2", "block3", "block4"]
    assert len(memory) == 3


def test_tool_memory_use_refreshes_an_id():
    memory = ToolMemory(max_ids=2)
    memory.remember(["old"], "X")
    memory.remember(["new"], "Y")
    assert memory.lookup(["old"]) == "X"
    memory.remember(["newest"], "Z")
    assert "old" in memory and "new" not in memory


def test_tool_memory_byte_limit_and_accounting():
    memory = ToolMemory(max_bytes=30)
    memory.remember(["a"], "x" * 9)  # 10 bytes
    memory.remember(["b"], "é" * 5)  # 1 + 10 bytes
    assert memory.nbytes == 21
    memory.remember(["c"], "y" * 9)  # 10 more: 31 > 30, "a" goes
    assert "a" not in memory and memory.nbytes == 21
    memory.remember(["c"], "z")  # re-remembering replaces the old entry
    assert memory.lookup(["c"]) == "z" and memory.nbytes == 13
    memory.remember(["huge"], "w" * 100)  # larger than the whole budget: nothing can hold it
    assert "huge" not in memory and memory.nbytes <= 30


def test_tool_memory_rejects_non_positive_limits():
    with pytest.raises(ValueError, match="max_ids=0"):
        ToolMemory(max_ids=0)


# ---------------------------------------------------------------------------------------------------
# live tail


def test_live_tail_example():
    assert render_live_tail([tool("/tmp", "call_1")], HIGH) == (
        E + U + "<tool_result>/tmp</tool_result>" + A + "<think>"
    )


def test_live_tail_non_thinking_and_user_text():
    assert render_live_tail([tool("a"), tool("b"), user("c")], NONE) == (
        E + U + "<tool_result>a</tool_result><tool_result>b</tool_result>" + U + "c" + A + "</think>"
    )


def test_live_tail_assistant_keeps_reasoning_and_writes_system_in_place():
    tail = [tool("x"), system("note"), assistant("done", "r"), user("y")]
    assert render_live_tail(tail, HIGH) == (
        E + U + "<tool_result>x</tool_result>note" + A + "<think>r</think>done" + E + U + "y" + A + "<think>"
    )


# ---------------------------------------------------------------------------------------------------
# /v1/completions and the CLI


def test_completion_prompt():
    assert render_completion_prompt("Hi", HIGH, CTX) == B + "You are a helpful assistant" + U + "Hi" + A + "<think>"
    assert render_completion_prompt("Hi", NONE, CTX) == (
        B + "You are a helpful assistant" + U + "Hi" + A + "</think>"
    )
    assert render_completion_prompt("Hi", MAX, BIG_CTX) == (
        B + THINK_MAX + "You are a helpful assistant" + U + "Hi" + A + "<think>"
    )
    assert render_completion_prompt("Hi", MAX, BIG_CTX - 1) == render_completion_prompt("Hi", HIGH, CTX)


def test_cli_prompt_pieces_keep_user_text_out_of_special_recognition():
    assert render_cli_prompt("say <think>", think=HIGH, ctx=CTX) == [
        PromptPiece(B, True),
        PromptPiece("You are a helpful assistant", False),
        PromptPiece(U, True),
        PromptPiece("say <think>", False),
        PromptPiece(A, True),
        PromptPiece("<think>", True),
    ]


def test_cli_prompt_custom_and_empty_system_non_thinking():
    assert render_cli_prompt("p", "Be brief.", think=NONE, ctx=CTX) == [
        PromptPiece(B, True), PromptPiece("Be brief.", False), PromptPiece(U, True), PromptPiece("p", False),
        PromptPiece(A, True), PromptPiece("</think>", True),
    ]
    assert render_cli_prompt("p", "", think=NONE, ctx=CTX)[:2] == [PromptPiece(B, True), PromptPiece(U, True)]


def test_cli_prompt_think_max():
    pieces = render_cli_prompt("p", think=MAX, ctx=BIG_CTX)
    assert pieces[:3] == [PromptPiece(B, True), PromptPiece(THINK_MAX, False),
                          PromptPiece("You are a helpful assistant", False)]
    assert render_cli_prompt("p", think=MAX, ctx=BIG_CTX - 1) == render_cli_prompt("p", think=HIGH, ctx=CTX)


def test_cli_prompt_already_rendered_chat_is_tokenized_with_specials():
    rendered = B + U + "hi" + A + "</think>"
    assert render_cli_prompt(rendered, think=HIGH, ctx=CTX) == [PromptPiece(rendered, True)]


def test_cli_transcript_is_preamble_plus_turns():
    preamble = render_cli_preamble("S", think=HIGH, ctx=CTX)
    turn = render_cli_turn("q", think=HIGH)
    assert preamble + turn == render_cli_prompt("q", "S", think=HIGH, ctx=CTX)
    assert "".join(p.text for p in preamble + turn) == B + "S" + U + "q" + A + "<think>"


# ---------------------------------------------------------------------------------------------------
# prefix stability: what the server remembers after a turn is a byte prefix of the next prompt


@pytest.mark.parametrize("content", ["The answer.", ""])
def test_thinking_visible_text_is_a_prefix_of_the_next_prompt(content):
    history = [system("S"), user("q1")]
    prompt = render_chat(history, think=HIGH, ctx=CTX)
    visible = prompt.removesuffix("<think>") + "</think>" + content + E
    following = history + [assistant(content, "hidden reasoning"), user("q2")]
    assert render_chat(following, think=HIGH, ctx=CTX).startswith(visible)
    multi = following + [assistant("second", "more hidden"), user("q3")]
    assert render_chat(multi, think=HIGH, ctx=CTX).startswith(visible)


def test_non_thinking_prompts_end_with_think_close_and_extend():
    prompt = render_chat([user("q1")], think=NONE, ctx=CTX)
    assert prompt.endswith(A + "</think>")
    following = render_chat([user("q1"), assistant("a"), user("q2")], think=NONE, ctx=CTX)
    assert following.startswith(prompt + "a" + E)


def test_tool_turn_checkpoint_suffix_equals_the_future_prompt():
    history = [user("find big files")]
    prompt = render_chat(history, tools=[BASH_SCHEMA], think=HIGH, ctx=CTX)
    arguments = '{"command":"du -sh * 2>/dev/null && sort -h","params":{"depth": 1, "x": [1, 2]}}'
    reply = assistant("Checking.", "plan", (call(arguments, name="bash"),))
    future = render_chat(history + [reply, tool("1G a")], tools=[BASH_SCHEMA], think=HIGH, ctx=CTX)
    suffix = (
        "plan</think>Checking."
        + one_call_dsml(
            param("command", "du -sh * 2>/dev/null && sort -h", True)
            + param("params", '{"depth":1,"x":[1,2]}', False),
            name="bash",
        )
        + E
    )
    assert future.startswith(prompt + suffix)


_text = st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=12)
_reply = st.builds(
    lambda content, reasoning, args: assistant(
        content, reasoning, (call(json.dumps(args)),) if args is not None else ()
    ),
    _text,
    _text,
    st.none() | st.dictionaries(_text, _text | st.integers(), max_size=3),
)
_turn = st.builds(user, _text) | st.builds(tool, _text) | _reply


@settings(max_examples=60, deadline=None)
@given(st.lists(_turn, max_size=6), _reply, st.lists(st.builds(user, _text) | st.builds(tool, _text), min_size=1))
def test_tool_context_renders_are_append_only(history, reply, following):
    """With tools active every turn keeps its reasoning, so a conversation only ever grows at its end."""
    history = history + [user("now")]
    prompt = render_chat(history, tools=[BASH_SCHEMA], think=HIGH, ctx=CTX)
    assert prompt.endswith(A + "<think>")
    later = render_chat(history + [reply] + following, tools=[BASH_SCHEMA], think=HIGH, ctx=CTX)
    turn = reply.reasoning + "</think>" + reply.content + canonical_tool_calls(reply.tool_calls) + E
    assert later.startswith(prompt + turn)


def test_tool_memory_items_oldest_first():
    memory = ToolMemory()
    memory.remember(["a"], "A")
    memory.remember(["b", "c"], "BC")
    memory.lookup(["a"])
    assert memory.items() == [("b", "BC"), ("c", "BC"), ("a", "A")]
