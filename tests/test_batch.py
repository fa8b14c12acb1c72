"""Several requests at once (batch.py): every answer is the one the same request gets served alone.

The demo model (random weights, the real tokenizer) answers greedy and seeded sampled requests of different
prompt and answer lengths, alone through `Engine.generate` and together through the scheduler, whose decoding
lanes share their steps (session.decode_together). Tokens must be equal: each row computes its own session's
logits (to the summation order of products over several rows, tests/test_decode_rows.py), and its sampler, stop
strings and limits are its own. Over HTTP the same holds on both APIs with requests sent at once.
"""

from __future__ import annotations

import threading
import time

import httpx
import mlx.core as mx
import pytest

from ds4_mlx.batch import Batch
from ds4_mlx.chat import Message, ThinkMode, render_chat
from ds4_mlx.engine import Engine, GenerationRequest
from ds4_mlx.errors import ResourceError
from ds4_mlx.events import Done, PrefillProgress
from ds4_mlx.sampling import SamplingParams
from serve_support import live_server

CTX = 2048


def prompt(system: str, user: str) -> str:
    return render_chat([Message("system", system), Message("user", user)], think=ThinkMode.NONE, ctx=CTX)


REQUESTS = [
    GenerationRequest(prompt("You are terse.", "Name three rivers."), max_tokens=14,
                      sampling=SamplingParams(temperature=0)),
    GenerationRequest(prompt("You explain code. " * 12, "What does a hash map do?"), max_tokens=22,
                      sampling=SamplingParams(temperature=0)),
    GenerationRequest(prompt("Answer in French.", "Bonjour"), max_tokens=7, sampling=SamplingParams(temperature=0),
                      stop=("zzzz-never",)),
    GenerationRequest(prompt("You write poems.", "A poem about rain."), max_tokens=18,
                      sampling=SamplingParams(temperature=0.8, seed=1234)),
]


@pytest.fixture(scope="module")
def engines(demo_model):
    return Engine.load(demo_model, CTX, parallel=1), Engine.load(demo_model, CTX, parallel=3)


def done(events) -> Done:
    assert isinstance(events[-1], Done)
    return events[-1]


def test_requests_together_answer_as_alone(engines):
    alone_engine, engine = engines
    alone = [done(list(alone_engine.generate(r))) for r in REQUESTS]
    batch = Batch(engine)
    together = [done(events) for events in batch.run_all(REQUESTS)]
    for a, t in zip(alone, together):
        assert t.token_ids == a.token_ids and t.finish_reason == a.finish_reason
        assert t.message.content == a.message.content
    assert batch.shared_steps > 0 and batch.shared_rows >= 2 * batch.shared_steps  # steps really were shared
    assert batch.shared_rows > 3 * 7  # three lanes decoded together for the shortest answer at least
    # the fourth request waited for a lane and reused none of the others' states: it still answered as alone
    assert [len(d.token_ids) for d in together] == [r.max_tokens for r in REQUESTS]


def test_a_prompt_prefills_in_short_chunks_while_others_decode(engines):
    """A long prompt joining lanes that decode goes in chunks of at most `prefill_cap` tokens, one a round, and
    answers as alone."""
    alone_engine, engine = engines
    long = GenerationRequest(prompt("Context. " * 200, "Summarize."), max_tokens=5,
                             sampling=SamplingParams(temperature=0))
    short = GenerationRequest(prompt("Hi.", "Count to ten."), max_tokens=40, sampling=SamplingParams(temperature=0))
    engine.reset()
    batch = Batch(engine, prefill_cap=64)
    first: list = []
    events: list = []
    batch.start(short, lambda: False, first.append, lambda: None)
    while not batch.decoding:
        batch.round()
    batch.start(long, lambda: False, events.append, lambda: None)
    while batch.running:
        batch.round()
    progress = [e for e in events if isinstance(e, PrefillProgress)]
    assert len(progress) >= 5 and all(b.done - a.done <= 64 for a, b in zip(progress, progress[1:]))
    want = done(list(alone_engine.generate(long)))
    assert done(events).token_ids == want.token_ids
    assert done(first).token_ids == done(list(alone_engine.generate(short))).token_ids


def test_a_cancelled_request_frees_its_lane(engines):
    _, engine = engines
    engine.reset()
    batch = Batch(engine)
    stop = threading.Event()
    got: list = []
    batch.start(REQUESTS[1], stop.is_set, got.append, lambda: got.append("end"))
    for _ in range(6):
        batch.round()
    assert batch.free == engine.parallel - 1
    stop.set()
    batch.round()
    assert batch.free == engine.parallel and got[-1] == "end" and got[-2].error == "cancelled"


def test_parallel_beyond_memory_is_refused_with_what_fits(demo_model, monkeypatch):
    from ds4_mlx import engine as engine_module
    from ds4_mlx.model.cache import session_bytes
    from ds4_mlx.model.weights import open_weights

    weights = open_weights(demo_model)
    state = session_bytes(weights.config, CTX) * engine_module.state_copies()
    from ds4_mlx import memory

    chunk = memory.chunk_transient_bytes(weights.config, memory.MIN_CHUNK, CTX - memory.MIN_CHUNK)
    limit = (10 << 20) + 2 * state + state // 2 + chunk  # weights + 2.5 sessions + the shortest chunk at the end
    assert memory.check_memory(weights, 10 << 20, CTX, limit, -4) == 2  # the default: as many as fit
    with pytest.raises(ResourceError, match="--parallel 2 would fit"):
        memory.check_memory(weights, 10 << 20, CTX, limit, 3)


def test_server_runs_requests_at_once_on_both_apis(demo_model):
    # thinking answers sample at temperature 1 whatever the request says (as ds4's server does): off here, and
    # one request sampled with a seed instead
    bodies = [("/v1/chat/completions", {"messages": [{"role": "user", "content": "Tell me about cats."}],
                                        "max_tokens": 12, "temperature": 0, "think": False}),
              ("/v1/messages", {"messages": [{"role": "user", "content": "Describe a bridge."}],
                                "max_tokens": 16, "temperature": 0}),
              ("/v1/chat/completions", {"messages": [{"role": "system", "content": "Be brief. " * 30},
                                                     {"role": "user", "content": "Why?"}],
                                        "max_tokens": 11, "temperature": 0, "stream": True, "think": False}),
              ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Plan a trip."}],
                                        "max_tokens": 20, "temperature": 0.7, "seed": 99, "think": False})]

    def answers(parallel: int, at_once: bool) -> list[str]:
        with live_server(lambda: Engine.load(demo_model, CTX, parallel=parallel)) as live, httpx.Client(base_url=live.url, timeout=120) as client:
            def ask(i: int, out: list) -> None:
                path, body = bodies[i]
                out[i] = client.post(path, json={"model": "deepseek-v4-flash", **body}).text

            out: list = [None] * len(bodies)
            if at_once:
                threads = [threading.Thread(target=ask, args=(i, out)) for i in range(len(bodies))]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join()
            else:
                for i in range(len(bodies)):
                    ask(i, out)
            health = client.get("/health").json()
            return [normalized(text) for text in out], health, live.worker._batch

    alone, _, _ = answers(1, at_once=False)
    together, health, batch = answers(4, at_once=True)
    assert together == alone
    assert health["parallel"] == 4 and health["running"] == 0 and health["queued"] == 0
    assert batch.shared_steps > 0


def normalized(text: str) -> str:
    """A response without what differs between two servings of one answer: ids, times, token counts of reuse."""
    import re

    text = re.sub(r'"(id|created|system_fingerprint)":\s*("[^"]*"|\d+)', "", text)
    text = re.sub(r'"(chatcmpl|msg)[-_][^"]*"', "", text)
    return re.sub(r'"(cache_read_input_tokens|cache_creation_input_tokens|input_tokens|cached_tokens|prompt_tokens_details)":\s*(\{[^}]*\}|\d+)', "", text)


def test_lanes_queue_and_429_cover_parallel_requests(demo_model):
    """Two lanes, one place in the queue: two long streams run, a third waits, a fourth is refused with 429; a
    client that goes frees its lane at the next round, and the waiting request runs there."""
    body = {"model": "deepseek-v4-flash", "stream": True, "max_tokens": 100000, "temperature": 0, "think": False,
            "messages": [{"role": "user", "content": "Go on forever."}]}
    with live_server(lambda: Engine.load(demo_model, CTX, parallel=2), max_queue=1) as live, \
            httpx.Client(base_url=live.url, timeout=120) as client:
        streams = [client.stream("POST", "/v1/chat/completions", json=body) for _ in range(2)]
        replies = [s.__enter__() for s in streams]
        lines = [reply.iter_lines() for reply in replies]  # held: a dropped iterator closes its stream
        for it in lines:  # both are decoding: their first tokens arrived
            while not next(it).startswith("data: "):
                pass
        waiting: list = []
        third = threading.Thread(target=lambda: waiting.append(client.post(
            "/v1/chat/completions", json={**body, "stream": False, "max_tokens": 3})))
        third.start()
        deadline = time.monotonic() + 30
        while client.get("/health").json()["queued"] != 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        health = client.get("/health").json()
        assert (health["parallel"], health["running"], health["queued"]) == (2, 2, 1)
        refused = client.post("/v1/chat/completions", json={**body, "stream": False})
        assert refused.status_code == 429
        streams[0].__exit__(None, None, None)  # the client goes: its lane runs the waiting request
        third.join(60)
        assert waiting and waiting[0].status_code == 200
        assert waiting[0].json()["usage"]["completion_tokens"] == 3
        streams[1].__exit__(None, None, None)
        while client.get("/health").json()["running"] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert client.get("/health").json()["running"] == 0


def test_a_shared_step_that_disagrees_falls_back_to_one_session_at_a_time(demo_model):
    """The first shared step of a row count is checked against the sessions' own steps; where a backend's kernels
    get several rows wrong, that row count decodes one session at a time from then on (one warning), and the
    answers are still the ones each request gets alone."""
    import warnings

    from ds4_mlx.session import SharedStepWarning

    engine = Engine.load(demo_model, CTX, parallel=2)
    real = engine.model.decode_rows

    def wrong(tokens, caches, groups=None):
        streams, logits, rows = real(tokens, caches, groups)
        return streams, logits + 1.0 * (mx.arange(logits.shape[-1]) % 7 == 0), rows

    engine.model.decode_rows = wrong
    alone_engine = Engine.load(demo_model, CTX, parallel=1)
    requests = REQUESTS[:2]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        batch = Batch(engine)
        together = [done(events) for events in batch.run_all(requests)]
    assert sum(issubclass(w.category, SharedStepWarning) for w in caught) == 1
    for request, got in zip(requests, together):
        assert got.token_ids == done(list(alone_engine.generate(request))).token_ids


def test_a_chunk_beside_decoding_lanes_takes_about_the_stall_it_may_cause(engines):
    """The chunk cap follows the last chunk's rate: what it runs in `prefill_stall` seconds, a ladder size between
    MIN_CAP and `prefill_cap` (the cap itself before any chunk ran)."""
    from ds4_mlx.batch import MIN_CAP

    _, engine = engines
    batch = Batch(engine, prefill_cap=1024, prefill_stall=0.5)
    assert batch.chunk_cap() == 1024
    for rate, cap in ((100_000.0, 1024), (1000.0, 384), (600.0, 256), (10.0, MIN_CAP)):
        batch.prefill_rate = rate
        assert batch.chunk_cap() == cap, rate
    batch.prefill_cap = 64
    assert batch.chunk_cap() == 64  # a cap below MIN_CAP holds
    batch.prefill_cap, batch.prefill_rate = 1024, None
    engine.reset()
    batch.start(GenerationRequest(prompt("Hi.", "Count to ten."), max_tokens=2, sampling=SamplingParams(temperature=0)),
                lambda: False, lambda _: None, lambda: None)
    while batch.running:
        batch.round()
    assert batch.prefill_rate is not None and batch.prefill_rate > 0  # its prefill measured, its decoding not
