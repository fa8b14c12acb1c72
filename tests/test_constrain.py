"""Constrained decoding: answers held to a JSON schema by the token mask.

The demo model has random weights, so what makes its answers valid is the constraint alone: every answer here
must parse and validate, greedy and sampled. A scripted model shows that the reasoning stays free and that an
answer the model writes valid passes unchanged; the server tests show the request shapes (chat `response_format`,
Responses `text.format`, Anthropic `output_format`), the 400 for a schema the library cannot take, and the OpenAI
SDK's `parse` with a Pydantic model.
"""

from __future__ import annotations

import json
from typing import Literal

import httpx
import jsonschema
import openai
import pydantic
import pytest

from ds4_mlx.chat import Message, ThinkMode, render_chat
from ds4_mlx.constrain import Constraint, OutputFormat, SchemaError
from ds4_mlx.engine import Engine, GenerationRequest
from ds4_mlx.events import Done
from ds4_mlx.sampling import SamplingParams
from scripted import scripted_engine
from serve_support import ScriptedEngine, live_server, small_tokenizer

POINT = {"type": "object",
         "properties": {"x": {"type": "integer", "minimum": -5, "maximum": 5}, "label": {"type": "string",
                                                                                       "maxLength": 6}},
         "required": ["x"], "additionalProperties": False}
SCHEMAS = {
    "nested_ref_array_enum": {
        "$defs": {"point": POINT},
        "type": "object",
        "properties": {"kind": {"enum": ["line", "polygon", "dot"]},
                       "points": {"type": "array", "items": {"$ref": "#/$defs/point"}, "maxItems": 3},
                       "closed": {"type": "boolean"},
                       "note": {"type": ["string", "null"], "maxLength": 5}},
        "required": ["kind", "points"],
        "additionalProperties": False,
    },
    "deep_objects": {
        "type": "object",
        "properties": {"a": {"type": "object", "properties": {"b": {"type": "object", "properties": {
            "c": {"enum": [1, 2, 3]}, "d": {"type": "array", "items": {"type": "boolean"}, "minItems": 1,
                                               "maxItems": 2}}, "required": ["c", "d"], "additionalProperties": False}},
            "required": ["b"], "additionalProperties": False}},
        "required": ["a"],
        "additionalProperties": False,
    },
    "optional_only": {"type": "object", "properties": {"maybe": {"enum": ["x", "y"]}, "count": {
        "type": "integer", "minimum": 0, "maximum": 20}}, "additionalProperties": False},
}


@pytest.fixture(scope="module")
def demo(demo_model) -> Engine:
    return Engine.load(demo_model, 2048)


def with_format(fmt: OutputFormat) -> Constraint:
    """The constraint of a request with this format and no tools."""
    return Constraint.make(fmt, ())


def answer(engine: Engine, fmt: OutputFormat | None, sampling: SamplingParams, max_tokens: int = 300,
           think: ThinkMode = ThinkMode.NONE) -> Done:
    prompt = render_chat([Message("user", "Describe a shape as JSON.")], think=think, ctx=engine.ctx)
    output = with_format(fmt) if fmt is not None else None
    events = list(engine.generate(GenerationRequest(prompt, max_tokens=max_tokens, sampling=sampling,
                                                    output=output)))
    assert isinstance(events[-1], Done)
    return events[-1]


@pytest.mark.parametrize("name", list(SCHEMAS))
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_random_model_answers_validate_against_the_schema(demo, name, temperature):
    schema = SCHEMAS[name]
    fmt = OutputFormat.build("json_schema", schema, name, "schema")
    for seed in (1, 2) if temperature else (1,):
        done = answer(demo, fmt, SamplingParams(temperature=temperature, seed=seed))
        assert done.finish_reason == "stop", done.message.content
        jsonschema.validate(json.loads(done.message.content), schema)


def test_without_a_format_the_random_model_writes_no_json(demo):
    """The control: the same prompt unconstrained is not JSON, so the tests above measure the constraint."""
    done = answer(demo, None, SamplingParams(temperature=0.0), max_tokens=20)
    with pytest.raises(ValueError):
        json.loads(done.message.content)


def test_json_object_gives_an_object(demo):
    done = answer(demo, OutputFormat.json_object(), SamplingParams(temperature=1.0, seed=5), max_tokens=400)
    if done.finish_reason == "stop":  # a free object may run to the limit; when it ends, it is an object
        assert isinstance(json.loads(done.message.content), dict)
    assert done.message.content.startswith("{")


def test_reasoning_is_free_and_the_answer_after_it_is_held():
    schema = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}, "n": {
        "type": "integer", "minimum": 0, "maximum": 9}}, "required": ["answer", "n"], "additionalProperties": False}
    fmt = OutputFormat.build("json_schema", schema, "yn", "schema")
    tok = small_tokenizer()
    engine, _ = scripted_engine(tok, "Free { reasoning [</think>not json at all")
    prompt = render_chat([Message("user", "q")], think=ThinkMode.HIGH, ctx=512)
    done = [*engine.generate(GenerationRequest(prompt, max_tokens=60, sampling=SamplingParams(temperature=0),
                                               output=with_format(fmt)))][-1]
    assert done.message.reasoning == "Free { reasoning ["
    jsonschema.validate(json.loads(done.message.content), schema)

    valid = '{"answer": "no", "n": 7}'
    engine, _ = scripted_engine(tok, valid)
    prompt = render_chat([Message("user", "q")], think=ThinkMode.NONE, ctx=512)
    done = [*engine.generate(GenerationRequest(prompt, sampling=SamplingParams(temperature=1.0, seed=3),
                                               output=with_format(fmt)))][-1]
    assert (done.message.content, done.finish_reason) == (valid, "stop")  # a valid answer passes unchanged


@pytest.mark.parametrize("schema, part", [
    ({"type": "object", "properties": {"a": {"type": "strnig"}}}, "/properties/a/type"),
    ({"type": "object", "properties": {"a": {"not": {"type": "string"}}}}, "/properties/a/not"),
    ({"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}, "/properties/a/$ref"),
    ({"type": "string", "pattern": "(?<=x)a"}, "/pattern"),
])
def test_a_schema_the_library_cannot_take_names_the_part(schema, part):
    with pytest.raises(SchemaError) as caught:
        OutputFormat.build("json_schema", schema, "bad", "response_format.json_schema.schema")
    assert caught.value.param == "response_format.json_schema.schema"
    assert f"at {part}:" in str(caught.value)


# ---------------------------------------------------------------------------------------------------------
# over HTTP


@pytest.fixture(scope="module")
def live(demo):
    with live_server(demo) as live:
        yield live


@pytest.fixture(scope="module")
def http(live):
    with httpx.Client(base_url=live.url, timeout=300) as client:
        yield client


USER = [{"role": "user", "content": "Describe a shape."}]
SHAPE = SCHEMAS["nested_ref_array_enum"]


def test_chat_response_format_json_schema(http):
    body = {"messages": USER, "model": "deepseek-chat", "temperature": 0.7, "seed": 11, "max_tokens": 300,
            "response_format": {"type": "json_schema", "json_schema": {"name": "shape", "strict": True,
                                                                      "schema": SHAPE}}}
    reply = http.post("/v1/chat/completions", json=body).json()
    jsonschema.validate(json.loads(reply["choices"][0]["message"]["content"]), SHAPE)
    frames = http.post("/v1/chat/completions", json={**body, "stream": True}).text
    deltas = [json.loads(line[6:]) for line in frames.splitlines() if line.startswith("data: {")]
    text = "".join(d["choices"][0]["delta"].get("content", "") for d in deltas if d["choices"])
    assert text == reply["choices"][0]["message"]["content"]  # same seed, same tokens, streamed


def test_responses_text_format_and_anthropic_output_format(http):
    body = {"input": "Describe a shape.", "model": "deepseek-chat", "max_output_tokens": 300,
            "text": {"format": {"type": "json_schema", "name": "shape", "strict": True, "schema": SHAPE}}}
    reply = http.post("/v1/responses", json=body).json()
    message = next(item for item in reply["output"] if item["type"] == "message")
    jsonschema.validate(json.loads(message["content"][0]["text"]), SHAPE)
    body = {"messages": USER, "model": "deepseek-chat", "max_tokens": 300, "thinking": {"type": "disabled"},
            "output_format": {"type": "json_schema", "schema": SHAPE}}
    reply = http.post("/v1/messages", json=body).json()
    jsonschema.validate(json.loads(reply["content"][-1]["text"]), SHAPE)


@pytest.mark.parametrize("path, body, param", [
    ("/v1/chat/completions", {"messages": USER, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "strnig"}}}}}},
     "response_format.json_schema.schema"),
    ("/v1/chat/completions", {"messages": USER, "response_format": {"type": "xml"}}, "response_format.type"),
    ("/v1/chat/completions", {"messages": USER, "response_format": {"type": "json_schema"}},
     "response_format.json_schema"),
    ("/v1/responses", {"input": "hi", "text": {"format": {"type": "json_schema", "name": "x", "schema": {
        "type": "object", "properties": {"a": {"not": {}}}}}}}, "text.format.schema"),
])
def test_bad_formats_are_400_naming_the_field(http, path, body, param):
    reply = http.post(path, json=body)
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == param


class Point(pydantic.BaseModel):
    x: int = pydantic.Field(ge=-3, le=3)
    tag: Literal["red", "green"]


class Drawing(pydantic.BaseModel):
    title: str = pydantic.Field(max_length=8)
    points: list[Point] = pydantic.Field(max_length=2)
    origin: Point
    caption: str | None = pydantic.Field(max_length=4)


def test_openai_sdk_parse_with_a_pydantic_model(live):
    client = openai.OpenAI(base_url=live.url + "/v1", api_key="local", max_retries=0)
    for seed in (1, 2):
        completion = client.chat.completions.parse(
            model="deepseek-chat", messages=USER, response_format=Drawing, temperature=1.0, seed=seed,
            max_tokens=300)
        parsed = completion.choices[0].message.parsed
        assert isinstance(parsed, Drawing), completion.choices[0].message.content
        assert isinstance(parsed.origin, Point)


def test_a_formatted_request_does_not_change_the_next_ones_tokens(demo):
    """The mask is per request: a free answer after a formatted one is the free answer alone."""
    free = answer(demo, None, SamplingParams(temperature=0.0), max_tokens=12)
    answer(demo, OutputFormat.build("json_schema", SHAPE, "s", "schema"), SamplingParams(temperature=0.0))
    again = answer(demo, None, SamplingParams(temperature=0.0), max_tokens=12)
    assert again.token_ids == free.token_ids


def test_scripted_server_refuses_before_queueing():
    """A bad schema is refused when the request is read: the engine never sees it."""
    engine = ScriptedEngine()
    with live_server(engine) as live, httpx.Client(base_url=live.url) as client:
        reply = client.post("/v1/chat/completions", json={"messages": USER, "response_format": {
            "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strnig"}}}})
    assert reply.status_code == 400 and engine.requests == []


# ---------------------------------------------------------------------------------------------------------
# MTP drafts


def test_mtp_drafts_the_mask_refuses_are_not_accepted(monkeypatch, tmp_path):
    """The MTP block drafts the model's own unconstrained choice after each held token, which the verification
    accepts; where the mask refuses it, the draft is dropped, so the speculative answer is the constrained plain
    greedy answer, token for token."""
    import mlx.core as mx

    from ds4_mlx.constrain import TokenMask
    from ds4_mlx.model.factory import write_mtp_model, write_model
    from ds4_mlx.model.model import Model
    from ds4_mlx.model.mtp import MTP
    from ds4_mlx.model.weights import open_weights
    from ds4_mlx.session import Session
    from ds4_mlx.tokenizer import Tokenizer
    from test_mtp import one_hot

    weights = open_weights(write_model(tmp_path / "tiny.gguf", preset="tiny", seed=5))
    model, tokenizer = Model(weights), Tokenizer.from_gguf(weights.file)
    mtp = MTP.load(write_mtp_model(tmp_path / "mtp.gguf", seed=5), model)
    prompt = [0, 300, 301, 45, 67]
    schema = {"type": "object", "properties": {"pick": {"enum": ["alpha", "beta", "gamma"]}, "n": {
        "type": "integer", "minimum": 0, "maximum": 99}}, "required": ["pick", "n"], "additionalProperties": False}
    fmt = OutputFormat.build("json_schema", schema, "p", "schema")
    greedy = SamplingParams(temperature=0)

    def run(engine: Engine) -> Done:
        return [*engine.generate(GenerationRequest(prompt, max_tokens=40, sampling=greedy, output=with_format(fmt)))][-1]

    unmasked: list[int] = []  # the model's own choice at each step of the held answer
    real_apply = TokenMask.apply

    def recording_apply(self, logits):
        unmasked.append(int(mx.argmax(logits.reshape(-1)).item()))
        return real_apply(self, logits)

    monkeypatch.setattr(TokenMask, "apply", recording_apply)
    held = run(Engine(model, tokenizer, 512))
    monkeypatch.setattr(TokenMask, "apply", real_apply)
    jsonschema.validate(json.loads(held.message.content), schema)
    refused = sum(u != h for u, h in zip(unmasked, held.token_ids))
    assert refused > 3  # the model alone would write something else

    n_vocab = model.config.n_vocab
    sequence = [*prompt, *held.token_ids]
    real_call = MTP.__call__

    def check_guess(self, tokens, hidden, position, cache):  # the guess a step checks its chosen token against
        _, streams = real_call(self, tokens, hidden, position, cache)
        target = position + tokens.size
        cache.logits = one_hot(sequence[target] if target < len(sequence) else 0, n_vocab)
        return cache.logits, streams

    def draft(self, token, hidden, position, cache):  # the drafts: what the model itself would choose there
        _, streams = real_call(self, mx.array([token], dtype=mx.int32), hidden[None], position, cache)
        step = position - len(prompt)
        return one_hot(unmasked[step] if step < len(unmasked) else 0, n_vocab), streams

    rewinds = []
    real_rewind = Session.rewind

    def counting_rewind(self, n_tokens):
        rewinds.append(len(self.tokens) - n_tokens)
        real_rewind(self, n_tokens)

    monkeypatch.setattr(MTP, "__call__", check_guess)
    monkeypatch.setattr(MTP, "draft", draft)
    monkeypatch.setattr(Session, "rewind", counting_rewind)
    engine = Engine(model, tokenizer, 512, mtp=mtp, mtp_draft=3, mtp_margin=0.0, speculate_anyway=True)
    speculated = run(engine)
    assert speculated.token_ids == held.token_ids
    assert speculated.mtp_accepted > 0 and len(rewinds) > 0  # drafts were verified, then refused by the mask


def test_masked_greedy_fed_ahead_equals_read_first(demo, monkeypatch):
    """Greedy decoding with a mask feeds each token before reading it back (the mask is applied on the device);
    the answer equals the one chosen after reading each token back."""
    from ds4_mlx.session import Session

    fmt = OutputFormat.build("json_schema", SCHEMAS["nested_ref_array_enum"], "s", "schema")
    fed = []
    real = Session.feed_chosen

    def counting(self, *args, **kwargs):
        fed.append(kwargs.get("adjust"))
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Session, "feed_chosen", counting)
    ahead = answer(demo, fmt, SamplingParams(temperature=0.0))
    assert len(fed) >= len(ahead.token_ids) - 1 and all(adjust is not None for adjust in fed)
    monkeypatch.setattr(Engine, "_pipelines", lambda self, sampling: False)
    read_first = answer(demo, fmt, SamplingParams(temperature=0.0))
    assert ahead.token_ids == read_first.token_ids
    jsonschema.validate(json.loads(ahead.message.content), SCHEMAS["nested_ref_array_enum"])
