"""The server over the real engine on the tiny random model (real tokenizer): what the SDKs receive equals
what the engine generates directly for the same rendered prompt, live prefix reuse shows in the usage, and a
client that goes away stops its generation.

The tiny model writes meaningless text and never a tool call; test_serve_sdk.py covers tool calls.
"""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import threading
import time

import anthropic
import httpx
import openai
import pytest

from ds4_mlx.chat import Message, ThinkMode, render_chat
from ds4_mlx.engine import Engine, GenerationRequest
from ds4_mlx.events import Done
from ds4_mlx.sampling import SamplingParams
from serve_support import live_server

CTX = 4096
GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def model_path(demo_model):
    return demo_model


@pytest.fixture(scope="module")
def direct(model_path):
    """A second engine, driven directly, as the reference for what the server must return."""
    return Engine.load(model_path, ctx=CTX)


@pytest.fixture(scope="module")
def live(model_path):
    with live_server(lambda: Engine.load(model_path, ctx=CTX)) as live:
        yield live


@pytest.fixture(scope="module")
def oai(live):
    return openai.OpenAI(base_url=live.url + "/v1", api_key="dsv4-local", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def claude(live):
    return anthropic.Anthropic(base_url=live.url, api_key="dsv4-local", max_retries=0, timeout=120)


def run_direct(engine: Engine, messages: list[Message], think: ThinkMode, sampling: SamplingParams,
               max_tokens: int) -> Done:
    prompt = render_chat(messages, think=think, ctx=CTX)
    request = GenerationRequest(prompt=prompt, max_tokens=max_tokens, sampling=sampling, thinking=think.thinking)
    events = list(engine.generate(request))
    return events[-1]


def test_openai_greedy_equals_the_engine(oai, direct):
    r = oai.chat.completions.create(model="deepseek-chat", messages=[{"role": "user", "content": "Hello"}],
                                    max_tokens=6, **GREEDY)
    done = run_direct(direct, [Message("user", "Hello")], ThinkMode.NONE, SamplingParams(temperature=0), 6)
    assert r.choices[0].message.content == done.message.content
    assert r.choices[0].finish_reason == done.finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (done.usage.prompt_tokens, 6)

    chunks = list(oai.chat.completions.create(model="deepseek-chat", messages=[{"role": "user", "content": "Hello"}],
                                              max_tokens=6, stream=True, stream_options={"include_usage": True},
                                              **GREEDY))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == done.message.content
    assert chunks[-1].usage.completion_tokens == 6


def test_thinking_with_a_seed_equals_the_engine(oai, direct):
    """In thinking mode the client's temperature is ignored (default sampling), but the seed is kept."""
    request = {"model": "deepseek-reasoner", "messages": [{"role": "user", "content": "Why?"}], "max_tokens": 5,
               "seed": 1234, "temperature": 0}
    done = run_direct(direct, [Message("user", "Why?")], ThinkMode.HIGH, SamplingParams(seed=1234), 5)
    chunks = list(oai.chat.completions.create(**request, stream=True))
    reasoning = "".join(getattr(c.choices[0].delta, "reasoning_content", None) or "" for c in chunks)
    content = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert (reasoning, content) == (done.message.reasoning, done.message.content)
    message = oai.chat.completions.create(**request).choices[0].message
    if done.message.reasoning_closed:
        assert (message.reasoning_content, message.content) == (done.message.reasoning, done.message.content)
    else:  # cut inside <think>: a non-streaming answer reports it as content (ds4_server.c)
        assert message.content == done.message.reasoning and getattr(message, "reasoning_content", None) is None


def test_anthropic_equals_the_engine(claude, direct):
    # this SDK version has no `temperature` argument any more; the server still reads the field
    m = claude.messages.create(model="deepseek-v4-flash", max_tokens=5, extra_body=GREEDY, system="Be terse.",
                               thinking={"type": "disabled"}, messages=[{"role": "user", "content": "Hi"}])
    done = run_direct(direct, [Message("system", "Be terse."), Message("user", "Hi")], ThinkMode.NONE,
                      SamplingParams(temperature=0), 5)
    assert [b.type for b in m.content] == ["text"] and m.content[0].text == done.message.content
    assert m.stop_reason == "max_tokens" and m.usage.output_tokens == 5
    with claude.messages.stream(model="deepseek-v4-flash", max_tokens=5, extra_body=GREEDY, system="Be terse.",
                                thinking={"type": "disabled"}, messages=[{"role": "user", "content": "Hi"}]) as s:
        assert "".join(s.text_stream) == done.message.content


def test_second_turn_prefills_only_its_new_tokens(oai, direct):
    """Live prefix reuse (ds4_server.c): the second turn extends the first prompt and answer, so only the
    text after what the session holds is tokenized and prefilled."""
    story = [{"role": "user", "content": "Tell me a story."}]
    first = oai.chat.completions.create(model="deepseek-chat", messages=story, max_tokens=4, **GREEDY)
    answer = first.choices[0].message.content
    second = oai.chat.completions.create(
        model="deepseek-chat", max_tokens=2, **GREEDY,
        messages=story + [{"role": "assistant", "content": answer}, {"role": "user", "content": "And then?"}])

    reference = run_direct(direct, [Message("user", "Tell me a story.")], ThinkMode.NONE,
                           SamplingParams(temperature=0), 4)
    assert reference.message.content == answer
    # the session holds the first prompt and every answer token but the last (sampled, never evaluated)
    held = direct.tokenizer.encode(render_chat([Message("user", "Tell me a story.")], think=ThinkMode.NONE, ctx=CTX))
    held += list(reference.token_ids[:-1])
    second_prompt = render_chat([Message("user", "Tell me a story."), Message("assistant", answer),
                                 Message("user", "And then?")], think=ThinkMode.NONE, ctx=CTX)
    new = direct.tokenizer.encode(second_prompt[len(direct.tokenizer.decode(held)):])
    usage = second.usage
    assert usage.prompt_tokens_details.cached_tokens == len(held) == first.usage.prompt_tokens + 3
    assert usage.prompt_tokens == len(held) + len(new)
    assert usage.prompt_tokens_details.cache_write_tokens == len(new)


def test_disconnect_stops_the_generation(live):
    with httpx.Client(base_url=live.url, timeout=60) as c:
        body = {"model": "deepseek-chat", "messages": [{"role": "user", "content": "Go on forever."}],
                "max_tokens": 2000, "stream": True}
        with c.stream("POST", "/v1/chat/completions", json=body) as r:
            for chunk in r.iter_text():
                if '"content"' in chunk:
                    break
        left = time.monotonic()
        while c.get("/health").json()["busy"]:
            assert time.monotonic() - left < 10, "generation kept running after the client left"
            time.sleep(0.05)


@pytest.mark.slow
def test_sixteen_concurrent_clients_match_their_sequential_answers(live):
    bodies = [{"model": "deepseek-chat", "messages": [{"role": "user", "content": f"Question {i}?"}],
               "max_tokens": 3, "temperature": 0} for i in range(16)]
    with httpx.Client(base_url=live.url, timeout=300) as c:
        sequential = [c.post("/v1/chat/completions", json=b).json()["choices"][0]["message"]["content"]
                      for b in bodies]
    results: list[str | None] = [None] * 16

    def run(i: int) -> None:
        with httpx.Client(base_url=live.url, timeout=300) as own:
            results[i] = own.post("/v1/chat/completions", json=bodies[i]).json()["choices"][0]["message"]["content"]

    threads = [threading.Thread(target=run, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert results == sequential


def test_serve_command_runs_and_stops_cleanly_on_sigterm(model_path, tmp_path):
    """`ds4-mlx serve` end to end: it answers, and SIGTERM ends a running stream (finish "error") and exits."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    trace = tmp_path / "trace.txt"
    process = subprocess.Popen(
        [sys.executable, "-m", "ds4_mlx.cli", "serve", "-m", str(model_path), "--ctx", str(CTX), "--port", str(port),
         "--backend", "cpu", "--trace", str(trace)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                assert process.poll() is None and time.monotonic() < deadline, process.stdout.read()
                time.sleep(0.2)
        body = {"model": "deepseek-chat", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2000,
                "stream": True}
        finish = []
        with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if '"content"' in line and not finish:
                    process.send_signal(signal.SIGTERM)
                    finish.append(None)
                if '"finish_reason":"' in line:
                    finish.append(line.split('"finish_reason":"')[1].split('"')[0])
        assert finish[-1] == "error"
        assert process.wait(timeout=30) in (0, -signal.SIGTERM)
    finally:
        if process.poll() is None:
            process.kill()
    log = process.stdout.read()
    assert "Traceback" not in log
    assert "done finish=error" in trace.read_text()
