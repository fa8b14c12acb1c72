"""Why a prefix missed: each prompt's reuse decision (live session, RAM checkpoint, disk, none) and, when a prompt
does not extend the live session, the first differing token and the text around it, in the log line and (with
--trace) the `x-ds4-reuse` response header."""

from __future__ import annotations

import logging

import httpx

from ds4_mlx.chat import Message, ThinkMode, render_chat
from ds4_mlx.engine import Engine, GenerationRequest
from ds4_mlx.events import Done, PromptAccepted
from ds4_mlx.cache.kvstore import KvCacheOptions
from ds4_mlx.reuse import first_difference
from ds4_mlx.sampling import SamplingParams
from ds4_mlx.serve.app import ServerOptions
from serve_support import ScriptedEngine, live_server, small_tokenizer

GREEDY = SamplingParams(temperature=0)


def chat(system: str, *turns: str) -> str:
    messages = [Message("system", system)]
    for i, text in enumerate(turns):
        messages.append(Message("user" if i % 2 == 0 else "assistant", text))
    return render_chat(messages, think=ThinkMode.NONE, ctx=4096)


def run(engine: Engine, prompt: str) -> tuple[PromptAccepted, Done]:
    events = list(engine.generate(GenerationRequest(prompt, max_tokens=4, sampling=GREEDY)))
    return events[0], events[-1]


def test_first_difference_names_the_token_and_the_text_on_both_sides():
    tok = small_tokenizer()
    live = tok.encode("The date is Monday. Please help me with this code.")
    now = tok.encode("The date is Tuesday. Please help me with this code.")
    miss = first_difference(live, now, tok)
    assert miss is not None and live[: miss.index] == now[: miss.index] and live[miss.index] != now[miss.index]
    assert miss.before.endswith("The date is") and miss.was.startswith(" Mon") and miss.now.startswith(" Tue")
    assert first_difference(live, live + tok.encode(" more"), tok) is None  # an extension is no miss
    assert first_difference([], now, tok) is None


def test_engine_reports_live_ram_and_none_with_the_miss():
    engine = ScriptedEngine()
    first = chat("You are helpful. Today is Monday.", "Fix the bug in main.c")
    accepted, done = run(engine, first)
    assert (accepted.reuse.source, accepted.reuse.tokens, accepted.reuse.miss) == ("none", 0, None)
    assert done.reuse == accepted.reuse

    accepted, _ = run(engine, engine.tokenizer.decode(engine.session.tokens) + "<｜User｜>and now?")
    assert accepted.reuse.source == "live" and accepted.reuse.tokens == accepted.cached_tokens > 0

    changed = chat("You are helpful. Today is Tuesday.", "Fix the bug in main.c")
    accepted, _ = run(engine, changed)
    miss = accepted.reuse.miss
    assert accepted.reuse.source == "none" and miss is not None
    assert "Mon" in miss.was and "Tue" in miss.now and miss.before.endswith("Today is")
    assert "differs from the live session at token" in accepted.reuse.describe()

    accepted, _ = run(engine, first)  # the first conversation again: its end was kept in memory
    assert accepted.reuse.source == "ram" and accepted.reuse.tokens == accepted.cached_tokens > 0
    assert accepted.reuse.miss is not None  # it did not extend the live session (the Tuesday one)


def test_engine_reports_disk(demo_model, tmp_path):
    options = KvCacheOptions(tmp_path / "kv", min_tokens=16, cold_max_tokens=4000, boundary_align_tokens=0,
                             boundary_trim_tokens=0)
    engine = Engine.load(demo_model, 1024, kv_cache=options, kv_ram_budget=0)
    long = chat("You are a careful assistant. " * 8, "Summarize the design of the cache.")
    run(engine, long)
    run(engine, chat("Another system prompt entirely.", "Hello"))  # replaces the live session, saved on disk
    accepted, _ = run(engine, long)
    assert accepted.reuse.source == "disk" and accepted.reuse.tokens == accepted.cached_tokens > 0


def test_log_line_and_traced_header(tmp_path, caplog):
    body = {"messages": [{"role": "system", "content": "Today is Monday."}, {"role": "user", "content": "hi"}],
            "model": "deepseek-chat"}
    changed = {**body, "messages": [{"role": "system", "content": "Today is Friday."}, body["messages"][1]]}
    with live_server(ScriptedEngine(), ServerOptions(trace=str(tmp_path / "trace.txt"))) as live, \
            httpx.Client(base_url=live.url, timeout=30) as client, caplog.at_level(logging.INFO, "ds4_mlx.serve"):
        first = client.post("/v1/chat/completions", json=body)
        second = client.post("/v1/chat/completions", json=changed)
        streamed = client.post("/v1/chat/completions", json={**changed, "stream": True})
    assert first.headers["x-ds4-reuse"] == "none 0"
    header = second.headers["x-ds4-reuse"]
    assert header.startswith("none 0; differs from the live session at token") and "Mon" in header and "Fri" in header
    assert streamed.headers["x-ds4-reuse"].startswith("ram ")  # the same prompt's end was kept in memory
    lines = [r.getMessage() for r in caplog.records if " chat prompt=" in r.getMessage()]
    assert len(lines) == 3 and "reuse=none 0; differs from the live session" in lines[1]
    assert "(from: none 0; differs" in (tmp_path / "trace.txt").read_text()


def test_no_header_without_trace():
    with live_server(ScriptedEngine()) as live, httpx.Client(base_url=live.url, timeout=30) as client:
        reply = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
    assert reply.status_code == 200 and "x-ds4-reuse" not in reply.headers
