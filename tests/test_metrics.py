"""`GET /metrics`: Prometheus' text format, behind the API key, counting what the server did."""

from __future__ import annotations

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from ds4_mlx.engine import Engine
from ds4_mlx.cache.kvstore import KvCacheOptions
from ds4_mlx.serve.app import ServerOptions
from serve_support import ScriptedEngine, live_server

KEY = {"authorization": "Bearer sekret"}


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of the exposition, by name and sorted labels."""
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_metrics_count_requests_tokens_speeds_and_reuse():
    engine = ScriptedEngine()
    chat = {"messages": [{"role": "user", "content": "hi"}], "model": "deepseek-chat"}
    with live_server(engine, ServerOptions(api_key="sekret")) as live, \
            httpx.Client(base_url=live.url, headers=KEY, timeout=30) as client:
        assert httpx.get(live.url + "/metrics").status_code == 401  # behind the key like every route
        first = client.post("/v1/chat/completions", json=chat).json()
        again = client.post("/v1/chat/completions", json={**chat, "stream": True})
        assert again.status_code == 200
        assert client.post("/v1/chat/completions", json={**chat, "n": 2}).status_code == 400
        client.post("/v1/messages", json={"max_tokens": 50, **chat})
        client.get("/v1/models")
        reply = client.get("/metrics")
    assert reply.status_code == 200 and reply.headers["content-type"].startswith("text/plain")
    m = samples(reply.text)
    assert m[("ds4_requests_total", (("api", "chat"), ("status", "200")))] == 2
    assert m[("ds4_requests_total", (("api", "chat"), ("status", "400")))] == 1
    assert m[("ds4_requests_total", (("api", "messages"), ("status", "200")))] == 1
    assert m[("ds4_requests_total", (("api", "models"), ("status", "200")))] == 1
    usage = first["usage"]
    assert m[("ds4_prompt_tokens_total", (("api", "chat"),))] == 2 * usage["prompt_tokens"]
    assert m[("ds4_generated_tokens_total", (("api", "chat"),))] == 2 * usage["completion_tokens"]
    assert m[("ds4_cached_tokens_total", (("api", "chat"),))] == usage["prompt_tokens"]  # the resend was cached
    assert m[("ds4_time_to_first_token_seconds_count", ())] == 3
    assert m[("ds4_decode_tokens_per_second_count", ())] == 3
    assert m[("ds4_prompt_reuse_total", (("source", "ram"),))] == 2  # the resends (chat, messages): the end, kept
    assert m[("ds4_finished_total", (("api", "chat"), ("finish_reason", "stop")))] == 2
    assert m[("ds4_queue_length", ())] == 0 and m[("ds4_running_sessions", ())] == 0
    assert ("ds4_disk_cache_bytes", ()) not in m  # no disk cache, no disk metrics


def test_metrics_of_the_checkpoint_stores(demo_model, tmp_path):
    options = KvCacheOptions(tmp_path / "kv", min_tokens=16, boundary_align_tokens=0, boundary_trim_tokens=0)
    def load() -> Engine:  # on the worker thread, which owns the engine's streams
        return Engine.load(demo_model, 1024, kv_cache=options, kv_ram_budget=1)  # every kept state is dropped

    long = [{"role": "system", "content": "You are a careful assistant. " * 8}, {"role": "user", "content": "hi"}]
    with live_server(load) as live, httpx.Client(base_url=live.url, timeout=120) as client:
        for messages in (long, [{"role": "user", "content": "Something else"}], long):
            client.post("/v1/chat/completions", json={"messages": messages, "model": "deepseek-chat",
                                                      "max_tokens": 2})
        m = samples(client.get("/metrics").text)
    assert m[("ds4_checkpoint_evictions_total", ())] > 0 and m[("ds4_checkpoint_bytes", ())] == 0
    assert m[("ds4_disk_cache_bytes", ())] > 0
    assert m[("ds4_disk_cache_lookups_total", (("result", "hit"),))] == 1  # the long prompt came back from disk
    assert m[("ds4_disk_cache_lookups_total", (("result", "miss"),))] >= 1
    assert m[("ds4_checkpoint_lookups_total", (("result", "miss"),))] == 3
    assert m[("ds4_disk_cache_evictions_total", ())] == 0


@pytest.mark.parametrize("path", ["/metrics"])
def test_metrics_without_a_key_configured_are_open(path):
    with live_server(ScriptedEngine()) as live:
        assert httpx.get(live.url + path).status_code == 200
