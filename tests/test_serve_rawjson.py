"""The request-body scanner: decoded values equal json.loads, and tool schemas keep their exact bytes."""

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ds4_mlx.errors import RequestError
from ds4_mlx.serve.rawjson import MAX_DEPTH, parse_body


def test_tool_schema_text_is_the_raw_function_value():
    function = '{ "name": "bash",\n  "parameters": {"type":"object",  "properties": {}} }'
    body = f'{{"model":"m","tools":[{{"type":"function","function":{function}}}],"stream":false}}'
    parsed = parse_body(body.encode())
    assert parsed.tool_texts == (function,)
    assert parsed.value == json.loads(body)


def test_tool_without_function_key_keeps_the_whole_element():
    anthropic_tool = ('{"name":"ls","description":"List","input_schema":{"type":"object"},'
                      '"cache_control":{"type":"ephemeral"}}')
    body = f'{{"tools": [ {anthropic_tool} ,\n{{"type":"function","function":{{"name":"b"}}}}]}}'
    assert parse_body(body.encode()).tool_texts == (anthropic_tool, '{"name":"b"}')


def test_last_duplicate_member_wins_like_json_loads():
    body = b'{"tools":[{"function":{"name":"old"}}],"tools":[{"function":{"name":"new"}}]}'
    parsed = parse_body(body)
    assert parsed.value["tools"][0]["function"]["name"] == "new"
    assert parsed.tool_texts == ('{"name":"new"}',)


def test_non_array_or_absent_tools_give_no_texts():
    assert parse_body(b'{"tools":null}').tool_texts == ()
    assert parse_body(b'{"tools":{"a":1}}').tool_texts == ()
    assert parse_body(b'{"messages":[]}').tool_texts == ()


def test_unicode_and_escapes_survive_in_the_raw_text():
    function = '{"name":"t","description":"caf\\u00e9 — \\"quoted\\" ] } [ {"}'
    parsed = parse_body(f'{{"tools":[{{"function":{function}}}]}}'.encode())
    assert parsed.tool_texts == (function,)
    assert parsed.value["tools"][0]["function"]["description"] == 'café — "quoted" ] } [ {'


@pytest.mark.parametrize(
    "body, message",
    [
        (b"", "empty"),
        (b"   \n", "empty"),
        (b"[1]", "must be a JSON object"),
        (b"\xff{}", "not UTF-8"),
        (b'{"a":}', "expected a JSON value"),
        (b'{"a":1,}', "expected a member name"),
        (b'{"a" 1}', "expected ':'"),
        (b'{"a":1} {"b":2}', "unexpected data after the JSON object"),
        (b'{"a":NaN}', "NaN is not valid JSON"),
        (b'{"a":"\x01"}', "Invalid control character"),
        (b'{"a":[1,2}', "invalid JSON request"),
    ],
)
def test_malformed_bodies_are_request_errors(body, message):
    with pytest.raises(RequestError, match="invalid JSON request") as e:
        parse_body(body)
    assert message in str(e.value)


def test_nesting_limit():
    ok = b'{"a":' + b"[" * (MAX_DEPTH - 1) + b"]" * (MAX_DEPTH - 1) + b"}"
    assert parse_body(ok).value["a"] is not None
    too_deep = b'{"a":' + b"[" * MAX_DEPTH + b"]" * MAX_DEPTH + b"}"
    with pytest.raises(RequestError, match=f"deeper than {MAX_DEPTH}"):
        parse_body(too_deep)
    # brackets inside strings do not count
    assert parse_body(b'{"a":"' + b"[" * 1000 + b'"}').value == {"a": "[" * 1000}


def test_lone_surrogates_become_the_replacement_character():
    """`"\\ud800"` is valid JSON but no UTF-8 text holds it, so nothing echoing it could be written: every lone
    surrogate in a key or value becomes U+FFFD; pairs stay one character; the raw tool texts keep the escape."""
    body = parse_body(rb'{"model":"a\ud800","\udfff":["\ud83d\ude00",{"k":"\uDBFF"}],"tools":[{"name":"\ud800"}]}')
    assert body.value == {"model": "a\ufffd", "\ufffd": ["\U0001f600", {"k": "\ufffd"}], "tools": [{"name": "\ufffd"}]}
    assert body.tool_texts == (r'{"name":"\ud800"}',)
    assert parse_body(rb'{"a":"\\ud800"}').value == {"a": "\\ud800"}  # an escaped backslash, not a surrogate


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=5), inner, max_size=4),
    max_leaves=12,
)


@settings(max_examples=150, deadline=None)
@given(
    st.dictionaries(st.text(max_size=6), json_values, max_size=4),
    st.lists(st.dictionaries(st.text(max_size=5), json_values, max_size=3), max_size=3),
    st.sampled_from([None, 1, 2]),
)
def test_any_object_decodes_like_json_loads_and_tool_texts_reparse(members, tools, indent):
    value = {**members, "tools": [{"function": t} if i % 2 else t for i, t in enumerate(tools)]}
    text = json.dumps(value, indent=indent, ensure_ascii=bool(indent))
    parsed = parse_body(text.encode())
    assert parsed.value == json.loads(text)
    assert [json.loads(t) for t in parsed.tool_texts] == tools
    for t in parsed.tool_texts:
        assert t in text
