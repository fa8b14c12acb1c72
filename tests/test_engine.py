"""The engine's generation rules, on a scripted model (exact control of what is sampled) and on the tiny model."""

from __future__ import annotations

import json

import mlx.core as mx
import pytest

from ds4_mlx.chat import Message, ThinkMode, render_chat
from ds4_mlx.engine import Engine, GenerationRequest
from ds4_mlx.errors import ContextOverflow, RequestError
from ds4_mlx.events import (
    Done,
    PrefillProgress,
    PromptAccepted,
    ReasoningDelta,
    TextDelta,
    ToolCallArgsDelta,
    ToolCallEnd,
    ToolCallStart,
)
from ds4_mlx.sampling import SamplingParams
from scripted import scripted_engine

GREEDY = SamplingParams(temperature=0)


@pytest.fixture(scope="module")
def tiny_path(demo_model):
    return demo_model


@pytest.fixture(scope="module")
def tiny(tiny_path):
    return Engine.load(tiny_path, ctx=256)


@pytest.fixture(scope="module")
def tokenizer(tiny):
    return tiny.tokenizer


def run(engine: Engine, **kw) -> tuple[list, Done]:
    kw.setdefault("prompt", "<｜begin▁of▁sentence｜><｜User｜>hi<｜Assistant｜><think>")
    events = list(engine.generate(GenerationRequest(**kw)))
    assert isinstance(events[-1], Done) and not any(isinstance(e, Done) for e in events[:-1])
    return events[:-1], events[-1]


def texts(events, kind) -> str:
    return "".join(e.text for e in events if isinstance(e, kind))


def test_eos_stops_and_is_not_fed(tokenizer):
    engine, model = scripted_engine(tokenizer, "let me think</think>The answer is 4.")
    events, done = run(engine)
    assert done.finish_reason == "stop"
    assert texts(events, ReasoningDelta) == "let me think"
    assert texts(events, TextDelta) == "The answer is 4."
    assert done.message.content == "The answer is 4." and done.message.reasoning == "let me think"
    assert tokenizer.eos_id not in model.fed
    assert done.usage.completion_tokens == len(tokenizer.encode("let me think</think>The answer is 4."))


def test_max_tokens_gives_length_and_the_last_token_is_not_fed(tokenizer):
    engine, model = scripted_engine(tokenizer, "one two three four five six seven", eos=False)
    events, done = run(engine, max_tokens=3)
    assert done.finish_reason == "length" and done.usage.completion_tokens == 3
    prompt_len = done.usage.prompt_tokens
    assert len(model.fed) == prompt_len + 2
    assert engine.session.tokens == model.fed


def test_max_tokens_is_clamped_to_the_room_left(tokenizer):
    engine, _ = scripted_engine(tokenizer, "a " * 100, eos=False, ctx=20)
    _, done = run(engine, max_tokens=1000)
    assert done.finish_reason == "length"
    assert done.usage.prompt_tokens + done.usage.completion_tokens == 20


def test_stop_string_cuts_text_and_drops_the_live_session(tokenizer):
    engine, _ = scripted_engine(tokenizer, "</think>alpha beta STOP gamma")
    events, done = run(engine, stop=("STOP",))
    assert done.finish_reason == "stop"
    assert texts(events, TextDelta) == "alpha beta " == done.message.content
    assert engine.session.tokens == []


def test_tool_block_closing_stops_generation(tokenizer):
    block = (
        '\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="bash">\n'
        '<｜DSML｜parameter name="command" string="true">ls -la && echo "hi"</｜DSML｜parameter>\n'
        '<｜DSML｜parameter name="timeout" string="false">10</｜DSML｜parameter>\n'
        "</｜DSML｜invoke>\n</｜DSML｜tool_calls>"
    )
    engine, model = scripted_engine(tokenizer, "I should run ls.</think>Checking." + block + "never sampled")
    events, done = run(engine, tools_active=True)
    assert done.finish_reason == "tool_calls"
    assert "never" not in tokenizer.decode(done.token_ids)
    starts = [e for e in events if isinstance(e, ToolCallStart)]
    assert [(s.index, s.name) for s in starts] == [(0, "bash")]
    assert any(isinstance(e, ToolCallEnd) for e in events)
    args = "".join(e.text for e in events if isinstance(e, ToolCallArgsDelta))
    assert json.loads(args) == {"command": 'ls -la && echo "hi"', "timeout": 10}
    call = done.message.tool_calls[0]
    assert call.name == "bash" and json.loads(call.arguments) == json.loads(args)
    assert done.message.raw_dsml == block
    assert texts(events, TextDelta) == "Checking."


def test_cancel_ends_with_error(tokenizer):
    engine, _ = scripted_engine(tokenizer, "x " * 50, eos=False)
    calls = []

    def cancel() -> bool:
        calls.append(1)
        return len(calls) > 4

    events = list(engine.generate(GenerationRequest(prompt="<｜User｜>hi", max_tokens=40), cancel=cancel))
    done = events[-1]
    assert done.finish_reason == "error" and done.usage.completion_tokens == 4


def test_first_event_reports_the_prompt_and_the_reused_tokens(tokenizer):
    engine, _ = scripted_engine(tokenizer, "x y z", eos=False)
    events, done = run(engine, max_tokens=2)
    assert events[0] == PromptAccepted(done.usage.prompt_tokens, 0)
    events, done = run(engine, prompt=engine.tokenizer.decode(engine.session.tokens) + " more", max_tokens=2)
    assert events[0] == PromptAccepted(done.usage.prompt_tokens, done.usage.cached_tokens)
    assert done.usage.cached_tokens > 0


def test_cancel_between_prefill_chunks(tokenizer):
    engine, model = scripted_engine(tokenizer, "x", eos=False)
    engine.session.chunk_size = 4
    calls = []

    def cancel() -> bool:
        calls.append(1)
        return len(calls) >= 2

    events = list(engine.generate(GenerationRequest(prompt="word " * 20), cancel=cancel))
    done = events[-1]
    assert done.finish_reason == "error" and done.usage.completion_tokens == 0
    assert sum(isinstance(e, PrefillProgress) for e in events) == 2
    assert len(model.fed) == 8 and engine.session.tokens == []


def test_a_decode_failure_ends_the_answer_with_finish_error(tokenizer):
    engine, model = scripted_engine(tokenizer, "one two three four five")
    # calls 0-1 prefill the prompt (split where its last user turn starts), 2-3 feed two answer tokens
    model.fail_at, model.failure = 4, RuntimeError("device lost")
    _, done = run(engine, max_tokens=10)
    assert done.finish_reason == "error" and "device lost" in done.error
    assert done.usage.completion_tokens == 3
    assert engine.session.tokens == []


def test_prompt_that_fills_the_context_is_rejected(tokenizer):
    engine, _ = scripted_engine(tokenizer, "x", ctx=8)
    with pytest.raises(ContextOverflow) as e:
        run(engine, prompt="word " * 8)
    assert e.value.n_ctx == 8 and e.value.n_prompt_tokens >= 8
    with pytest.raises(RequestError):
        run(engine, prompt="")


def test_memory_needed_is_known_before_loading(tiny_path, tiny):
    from ds4_mlx.model.linear import loaded_nbytes
    from ds4_mlx.model.weights import open_weights

    assert loaded_nbytes(open_weights(tiny_path)) == tiny.model.nbytes


def test_loading_reports_progress_up_to_the_file_bytes(tiny_path):
    from ds4_mlx.model.model import Model
    from ds4_mlx.model.weights import open_weights

    weights = open_weights(tiny_path)
    seen: list[tuple[int, int]] = []
    Model(weights, progress=lambda done, total: seen.append((done, total)))
    assert seen[-1] == (weights.nbytes, weights.nbytes)
    assert [d for d, _ in seen] == sorted(d for d, _ in seen)


def test_greedy_generation_is_deterministic_and_reuse_does_not_change_it(tiny_path, tiny):
    """A second turn continues from the live session; its output must equal a cold engine's output."""
    first = render_chat([Message("user", "Hello!")], think=ThinkMode.NONE, ctx=256)
    _, d1 = run(tiny, prompt=first, max_tokens=12, sampling=GREEDY)
    assert d1.usage.cached_tokens == 0
    answer = tiny.tokenizer.decode(d1.token_ids)
    follow = render_chat(
        [Message("user", "Hello!"), Message("assistant", answer), Message("user", "And then?")],
        think=ThinkMode.NONE,
        ctx=256,
    )
    live = len(tiny.session.tokens)
    _, d2 = run(tiny, prompt=follow, max_tokens=8, sampling=GREEDY)
    assert d2.usage.cached_tokens == live > 0

    effective = list(tiny.session.tokens[: d2.usage.prompt_tokens])
    cold = Engine.load(tiny_path, ctx=256)
    _, c2 = run(cold, prompt=effective, max_tokens=8, sampling=GREEDY)
    assert c2.usage.cached_tokens == 0
    assert c2.token_ids == d2.token_ids


def test_same_seed_same_sample(tiny):
    prompt = render_chat([Message("user", "Pick a word")], think=ThinkMode.NONE, ctx=256)
    outs = []
    for _ in range(2):
        tiny.session.reset()
        _, done = run(tiny, prompt=prompt, max_tokens=6, sampling=SamplingParams(temperature=1.0, seed=42))
        outs.append(done.token_ids)
    assert outs[0] == outs[1]


def test_session_snapshot_restore(tiny):
    s = tiny.session
    s.reset()
    ids = tiny.tokenizer.encode("<｜begin▁of▁sentence｜>The sea is")
    s.prefill(ids)
    snap = s.snapshot()
    a = s.decode(1000)
    mx.eval(a)
    s.decode(2000)
    s.restore(snap)
    b = s.decode(1000)
    assert mx.array_equal(a, b)
    assert s.tokens == ids + [1000]


TOOL_BLOCK = ('\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="bash">\n<｜DSML｜parameter name="command" '
              'string="true">ls</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>')


@pytest.mark.parametrize(("text", "kw", "finish"), [
    ("</think>The answer is 4.", {}, "stop"),  # ends on EOS: fed ahead, then taken back
    ("</think>one two three four five", {"max_tokens": 4}, "length"),  # the last token is never fed
    ("</think>alpha beta STOP gamma", {"stop": ("STOP",)}, "stop"),
    ("</think>Checking." + TOOL_BLOCK + "never sampled", {"tools_active": True}, "tool_calls"),
], ids=["eos", "length", "stop-string", "tool-call"])
def test_greedy_decoding_fed_ahead_leaves_what_plain_decoding_leaves(tokenizer, monkeypatch, text, kw, finish):
    """Greedy decoding feeds each token before reading it (Session.feed_chosen); the answer, the tokens fed and
    the session after it equal decoding that reads every token first."""
    results = []
    for pipelined in (True, False):
        monkeypatch.setattr(Engine, "_pipelines", lambda self, sampling, on=pipelined: on)
        engine, model = scripted_engine(tokenizer, text)
        events, done = run(engine, sampling=GREEDY, **kw)
        results.append((events, done.finish_reason, done.token_ids, done.message, engine.session.tokens, model.fed))
    assert results[0] == results[1]
    assert results[0][1] == finish


def test_only_device_made_choices_are_fed_ahead(tiny):
    assert tiny._pipelines(GREEDY)
    assert not tiny._pipelines(SamplingParams(temperature=0.6))
    assert not tiny._pipelines(SamplingParams(temperature=0, presence_penalty=0.5))


def test_greedy_answers_of_the_tiny_model_are_the_same_fed_ahead(tiny, monkeypatch):
    prompt = "<｜begin▁of▁sentence｜><｜User｜>count<｜Assistant｜></think>"
    answers = []
    for pipelined in (True, False):
        monkeypatch.setattr(Engine, "_pipelines", lambda self, sampling, on=pipelined: on)
        tiny.session.reset()
        _, done = run(tiny, prompt=prompt, sampling=GREEDY, max_tokens=40)
        answers.append((done.token_ids, tiny.session.tokens, mx.array(tiny.session.logits).tolist()))
    assert answers[0] == answers[1] and len(answers[0][0]) == 40


def test_warm_up_leaves_an_empty_session_that_answers_as_a_fresh_engine(tmp_path):
    """`Engine.warm_up` (what `serve` runs on a GPU before taking requests) feeds a prompt and a few tokens, then
    empties the live session: the next answer is the one a fresh engine gives."""
    from ds4_mlx.engine import Engine, GenerationRequest
    from ds4_mlx.events import Done
    from ds4_mlx.model.factory import write_model
    from ds4_mlx.sampling import SamplingParams

    path = write_model(tmp_path / "tiny.gguf", preset="tiny")
    request = GenerationRequest(prompt="Hello there", max_tokens=12, sampling=SamplingParams(temperature=0.7, seed=3))
    fresh = Engine.load(path, 256)
    want = [e for e in fresh.generate(request) if isinstance(e, Done)][0].token_ids
    warmed = Engine.load(path, 256)
    assert warmed.warm_up() > 0
    assert warmed.session.tokens == [] and warmed.session.cache.n_tokens == 0 and warmed.session.logits is None
    assert [e for e in warmed.generate(request) if isinstance(e, Done)][0].token_ids == want


@pytest.mark.parametrize("info", [{"memory_size": 7 << 30}, {"total_memory": 7 << 30, "device_name": "NVIDIA H200"}],
                         ids=["metal", "cuda"])
def test_device_memory_is_the_gpus_under_either_name(monkeypatch, info):
    """MLX reports a GPU's memory as `memory_size` on Metal and `total_memory` on CUDA; the CPU backend reports
    neither, and the machine's RAM counts."""
    import os

    from ds4_mlx.model import stream

    monkeypatch.setattr(stream.mx, "device_info", lambda: info)
    assert stream.device_memory_bytes() == 7 << 30
    monkeypatch.setattr(stream.mx, "device_info", lambda: {"device_name": "cpu"})
    assert stream.device_memory_bytes() == os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
