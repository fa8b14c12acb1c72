"""Second review (disk KV cache, MTP speculation, kernel registry): one regression test per fixed finding, asserting
ds4's behaviour: corrupt checkpoints, consumed checkpoints, eviction ties."""

from __future__ import annotations

import struct

import pytest

from ds4_mlx.engine import Engine, GenerationRequest
from ds4_mlx.cache.kvstore import KvEntry, KvHeader, KvStore, eviction_victim
from ds4_mlx.sampling import SamplingParams
from test_kvstore import CTX, ID, chat_prompt, kv_files, options, read_header

GREEDY = SamplingParams(temperature=0)
NOW = 1_700_000_000


@pytest.fixture(scope="module")
def loaded(demo_model):
    return Engine.load(demo_model, ctx=CTX)


def fresh(loaded: Engine, store: KvStore | None) -> Engine:
    return Engine(loaded.model, loaded.tokenizer, CTX, kv_store=store)


def run(engine: Engine, prompt, max_tokens: int = 3, stop: tuple[str, ...] = ()):
    req = GenerationRequest(prompt=prompt, max_tokens=max_tokens, sampling=GREEDY, thinking=False, stop=stop)
    return list(engine.generate(req))[-1]



def test_payload_token_ids_outside_the_vocabulary_are_not_loaded(loaded, tmp_path):
    """As in ds4 (ds4_kvstore.c), a payload error fails the load and keeps the file; and a bad file never fails a
    request. A payload whose token ids are >= n_vocab is loaded as the live session today; the next request that
    does not extend it decodes the live ids (`_reuse_live`) and fails with RequestError — and so does every
    request after it, because the session is never replaced."""
    d = tmp_path / "kv"
    prompt = chat_prompt("Hello there")
    run(fresh(loaded, KvStore(options(d), 2, ID)), prompt)
    (path,) = kv_files(d)
    data = bytearray(path.read_bytes())
    text_len = struct.unpack_from("<I", data, 48)[0]
    struct.pack_into("<I", data, 52 + text_len + 52, 0xFFFFFFF0)  # the payload's first token id
    path.write_bytes(bytes(data))
    engine = fresh(loaded, KvStore(options(d, cold_max_tokens=0), 2, ID))
    first = run(engine, prompt)
    assert first.usage.cached_tokens == 0  # the corrupt checkpoint must not be used
    second = run(engine, "<｜begin▁of▁sentence｜>Another conversation, long enough to matter.")
    assert second.finish_reason == "length"


def test_a_consumed_checkpoint_survives_a_stop_string_hit(loaded, tmp_path):
    """As in ds4 (ds4_kvstore.c), a loaded checkpoint above cold_max is deleted: consumed, to be saved again by
    continued/evict/shutdown. A stop-string hit drops the live session, so it must be saved first (reason
    evict), or the conversation is gone from memory and disk."""
    d = tmp_path / "kv"
    run(fresh(loaded, KvStore(options(d), 2, ID)), chat_prompt("Hello there"))
    (path,) = kv_files(d)
    n = read_header(path).tokens
    prompt = chat_prompt("A third question")
    probe = run(fresh(loaded, None), prompt)
    stop = loaded.tokenizer.decode(probe.token_ids[:1])
    assert stop.strip()
    engine = fresh(loaded, KvStore(options(d, cold_max_tokens=n - 1), 2, ID))
    done = run(engine, prompt, stop=(stop,))
    assert done.usage.cached_tokens == n and done.finish_reason == "stop"
    assert not path.exists()  # consumed, as in ds4
    # ... and then it must still be on disk: the same conversation, in a new process, finds it again
    later = run(fresh(loaded, KvStore(options(d, cold_max_tokens=n - 1), 2, ID)), prompt)
    assert later.usage.cached_tokens >= n



def test_eviction_tie_break_uses_created_when_last_used_is_zero():
    """As in ds4 (ds4_kvstore.c), `last_used` falls back to the creation time, and on a tie the older `last_used`
    goes first.
    `eviction_victim` breaks ties on the raw `last_used`, so a file never used (last_used 0) but created now is
    evicted before an equally scored file last used long ago."""
    def entry(key: str, last_used: int, created: int) -> KvEntry:
        return KvEntry(path=None, key=key, header=KvHeader(2, 1, 0, 1000, 0, 4096, created, last_used, 1),
                       text_bytes=1, size=1 << 20)

    fresh_unused = entry("a" * 40, last_used=0, created=NOW)
    old = entry("b" * 40, last_used=NOW - 3600, created=NOW - 7200)
    assert eviction_victim([fresh_unused, old], NOW).key == old.key
