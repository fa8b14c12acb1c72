"""The disk KV cache (ds4_kvstore.c): checkpoint positions, the file format byte for byte, lookup,
load, hit bookkeeping, eviction, failures that must not fail a request, the tool-id map, and the engine and server
around it (save moments, reuse order, a restarted server).

Most engine tests run the real tiny model (real vocabulary) with small thresholds; the save-moment tests use a
scripted model whose next token depends only on the position, and a store that records what it is asked to save.
"""

from __future__ import annotations

import errno
import hashlib
import io
import logging
import signal
import socket
import struct
import subprocess
import sys
import time
import zlib
from pathlib import Path

import httpx
import mlx.core as mx
import numpy as np
import pytest

from ds4_mlx import dsml
from ds4_mlx.chat import Message, ThinkMode, render_chat
from ds4_mlx.engine import Engine, GenerationRequest
from ds4_mlx.model.factory import preset_config
from ds4_mlx.errors import Ds4Error
from ds4_mlx.events import Done
from ds4_mlx.cache.kvidentity import FOOTER, Footer, ModelIdentity
from ds4_mlx.cache.kvstore import (
    FLAG_TOOL_MAP,
    KvCacheOptions,
    KvEntry,
    KvHeader,
    KvStore,
    SaveReason,
    encode_tool_map,
    eviction_score,
    eviction_victim,
    fits_budget,
    payload_nbytes,
    routed_quant_bits,
    text_key,
)
from ds4_mlx.model.cache import write_payload
from ds4_mlx.model.factory import preset_config, write_model
from ds4_mlx.model.weights import open_weights
from ds4_mlx.sampling import SamplingParams
from scripted import ScriptedCache
from serve_support import ScriptedEngine, live_server

CTX = 256
MIN = 8
NOW = 1_700_000_000
GREEDY = SamplingParams(temperature=0)
ID = ModelIdentity(b"core of the test" , b"experts of test!")
"""The identity the stores of these tests claim (model_identity's own tests use real weights)."""
SYSTEM = "You are a careful assistant who answers in one short sentence and never uses lists."


def options(directory: Path, **kw) -> KvCacheOptions:
    """Small thresholds for a tiny model; cold saves on, continued off unless asked."""
    base = dict(min_tokens=MIN, cold_max_tokens=1000, continued_interval_tokens=0, boundary_trim_tokens=4,
                boundary_align_tokens=0)
    return KvCacheOptions(directory, **{**base, **kw})


def chat_prompt(*turns: str) -> str:
    """System + alternating user/assistant turns, non-thinking (so a later turn extends an earlier prompt)."""
    messages = [Message("system", SYSTEM)]
    messages += [Message("user" if i % 2 == 0 else "assistant", t) for i, t in enumerate(turns)]
    return render_chat(messages, think=ThinkMode.NONE, ctx=CTX)


def run(engine: Engine, prompt, max_tokens: int = 3, **kw) -> Done:
    events = list(engine.generate(GenerationRequest(prompt=prompt, max_tokens=max_tokens, sampling=GREEDY,
                                                    thinking=False, **kw)))
    return events[-1]


def kv_files(directory: Path) -> list[Path]:
    return sorted(directory.glob("*.kv"))


def read_header(path: Path) -> KvHeader:
    return KvHeader.unpack(path.read_bytes()[:48])


# -- checkpoint positions (ds4_test.c's KV cases) ----------------------------------------------------------------


def test_store_len_examples(tmp_path):
    default = KvCacheOptions(tmp_path)
    assert default.store_len(11011) == 10240
    assert default.store_len(1695) == 1695
    assert default.store_len(600) == 600  # 568 aligned down is 0 < min: the whole prompt
    assert KvCacheOptions(tmp_path, boundary_trim_tokens=0, boundary_align_tokens=1000).store_len(3500) == 3000
    assert KvCacheOptions(tmp_path, boundary_trim_tokens=0, boundary_align_tokens=0).store_len(3500) == 3500
    assert KvCacheOptions(tmp_path, boundary_align_tokens=0).store_len(3500) == 3468


def test_chat_anchor_is_the_last_user_before_the_first_assistant(tmp_path):
    user, assistant = 5, 6
    tokens = [0] + [9] * 600 + [user] + [9] * 10 + [user] + [9] * 5 + [assistant] + [user] + [9] * 3
    o = KvCacheOptions(tmp_path)
    assert o.chat_anchor(tokens, user, assistant) == 612
    assert o.cold_target(tokens, user, assistant) == 612
    short = [0] + [9] * 100 + [user] + [9] * 600 + [assistant]
    assert o.chat_anchor(short, user, assistant) is None  # 101 < min tokens: not a stable prefix worth keeping
    assert o.cold_target(short, user, assistant) == o.store_len(len(short))


def test_cold_target_only_for_prompts_between_min_and_cold_max(tmp_path):
    o = KvCacheOptions(tmp_path, cold_max_tokens=2000)
    assert o.cold_target([9] * 511, 5, 6) is None
    assert o.cold_target([9] * 2001, 5, 6) is None
    assert o.cold_target([9] * 1695, 5, 6) == 1695
    assert KvCacheOptions(tmp_path, cold_max_tokens=0).cold_target([9] * 1695, 5, 6) is None


def test_continued_frontiers(tmp_path):
    o = KvCacheOptions(tmp_path)
    assert o.continued_step == 10240  # 10000 rounded up to the 2048 alignment
    assert [p for p in (10240, 18432, 20480, 30720) if o.is_continued_frontier(p, 0)] == [10240, 20480, 30720]
    assert not o.is_continued_frontier(10240, 10240)  # stored already (e.g. by a cold save at that frontier)
    assert o.is_continued_frontier(20480, 10240)
    assert o.frontiers_between(0, 30720) == [10240, 20480, 30720]
    assert o.frontiers_between(10240, 30719) == [20480]
    assert KvCacheOptions(tmp_path, boundary_align_tokens=0).continued_step == 10000
    assert not KvCacheOptions(tmp_path, continued_interval_tokens=0).is_continued_frontier(10240, 0)
    assert not KvCacheOptions(tmp_path, continued_interval_tokens=8, min_tokens=512,
                              boundary_align_tokens=0).is_continued_frontier(256, 0)


@pytest.mark.parametrize("field, value, flag", [
    ("space_mb", 0, "--kv-disk-space-mb"),
    ("min_tokens", 0, "--kv-cache-min-tokens"),
    ("cold_max_tokens", 100, "--kv-cache-cold-max-tokens"),
    ("continued_interval_tokens", -1, "--kv-cache-continued-interval-tokens"),
    ("boundary_trim_tokens", -1, "--kv-cache-boundary-trim-tokens"),
    ("boundary_align_tokens", -5, "--kv-cache-boundary-align-tokens"),
])
def test_bad_options_name_the_flag(tmp_path, field, value, flag):
    with pytest.raises(Ds4Error, match=flag):
        KvCacheOptions(tmp_path, **{field: value})
    KvCacheOptions(tmp_path, cold_max_tokens=0)  # 0 disables cold saves


def test_serve_flags_map_to_options(tmp_path):
    import argparse

    from ds4_mlx.commands.options import kv_cache_options
    from ds4_mlx.commands.serve import add_arguments

    p = argparse.ArgumentParser()
    add_arguments(p)
    assert kv_cache_options(p.parse_args([])) is None
    o = kv_cache_options(p.parse_args(["--kv-disk-dir", str(tmp_path), "--kv-disk-space-mb", "7",
                                       "--kv-cache-min-tokens", "9", "--kv-cache-cold-max-tokens", "0",
                                       "--kv-cache-continued-interval-tokens", "11",
                                       "--kv-cache-boundary-trim-tokens", "12", "--kv-cache-boundary-align-tokens",
                                       "13", "--kv-cache-reject-different-quant"]))
    assert o == KvCacheOptions(tmp_path, 7, 9, 0, 11, 12, 13, True)
    assert kv_cache_options(p.parse_args(["--kv-disk-dir", str(tmp_path)])) == KvCacheOptions(tmp_path)
    with pytest.raises(Ds4Error, match="--kv-cache-cold-max-tokens"):
        kv_cache_options(p.parse_args(["--kv-disk-dir", str(tmp_path), "--kv-cache-cold-max-tokens", "5"]))


def test_budget_keeps_one_percent_slack():
    assert fits_budget(100, 101) and not fits_budget(100, 100)
    assert fits_budget(101, 103) and not fits_budget(101, 102)  # the slack rounds up


def test_text_key_is_sha1_hex():
    assert text_key(b"abc") == "a9993e364706816aba3e25717850c26c9cd0d89d"


# -- the header and eviction scores, on hand-made files ----------------------------------------------------------


def test_header_bytes_field_by_field():
    h = KvHeader(quant_bits=4, reason=SaveReason.EVICT, flags=FLAG_TOOL_MAP, tokens=0x01020304, hits=7, ctx=32768,
                 created=NOW, last_used=NOW + 5, payload_bytes=2**33 + 1)
    data = h.pack()
    assert len(data) == 48
    assert data[0:3] == b"KVC" and data[3] == 1 and data[4] == 4 and data[5] == 3 and data[6] == 1 and data[7] == 0
    assert struct.unpack_from("<III", data, 8) == (0x01020304, 7, 32768)
    assert data[20:24] == b"\0\0\0\0"  # ds4 leaves them zero; here they hold the checksum
    assert KvHeader(**{**h.__dict__, "checksum": 0xA1B2C3D4}).pack()[20:24] == bytes.fromhex("d4c3b2a1")
    assert struct.unpack_from("<QQQ", data, 24) == (NOW, NOW + 5, 2**33 + 1)
    assert KvHeader.unpack(data) == h
    for bad in (b"KVD" + data[3:], data[:3] + b"\x02" + data[4:], data[:4] + b"\x03" + data[5:],
                data[:8] + b"\0\0\0\0" + data[12:], data[:40]):
        with pytest.raises(Ds4Error):
            KvHeader.unpack(bad)


def entry(tokens: int, size: int, hits: int = 0, last_used: int = NOW, created: int = NOW, key: str = "a" * 40,
          reason: int = SaveReason.COLD) -> KvEntry:
    return KvEntry(Path(key + ".kv"), key, KvHeader(2, reason, 0, tokens, hits, 4096, created, last_used, 0), 0, size)


def test_eviction_prefers_fresh_hits_and_tokens_per_byte():
    fresh_hits = entry(1000, 10_000, hits=3, key="1" * 40)
    no_hits = entry(1000, 10_000, key="2" * 40)
    assert eviction_victim([fresh_hits, no_hits], NOW) is no_hits
    dense, sparse = entry(2000, 10_000, key="3" * 40), entry(1000, 10_000, key="4" * 40)
    assert eviction_victim([dense, sparse], NOW) is sparse
    assert eviction_score(dense, NOW) == pytest.approx(0.2)


def test_eviction_decays_stale_hits_with_a_six_hour_half_life():
    stale = entry(1000, 10_000, hits=4, last_used=NOW - 6 * 3600)
    assert eviction_score(stale, NOW) == pytest.approx((2 + 1) * 0.1)
    ancient = entry(1000, 10_000, hits=100, last_used=NOW - 30 * 6 * 3600)
    assert eviction_score(ancient, NOW) == pytest.approx(0.1)  # 100 / 2**30 < 0.01: counts as no hits
    fresh_unhit = entry(1000, 10_000, key="5" * 40)
    stale_hit = entry(1000, 10_000, hits=1, last_used=NOW - 10 * 6 * 3600, key="6" * 40)
    assert eviction_victim([fresh_unhit, stale_hit], NOW) is stale_hit  # decayed to 0 hits, and older
    never_used = entry(1000, 10_000, hits=5, last_used=0, created=NOW - 6 * 3600)
    assert eviction_score(never_used, NOW) == pytest.approx((2.5 + 1) * 0.1)  # last_used falls back to creation


def test_eviction_ties_go_to_the_older_file_and_the_current_store_is_protected():
    old, new = entry(1000, 10_000, last_used=NOW - 60, key="7" * 40), entry(1000, 10_000, key="8" * 40)
    assert eviction_victim([new, old], NOW) is old
    assert eviction_victim([new, old], NOW, protected=old.key) is new


def test_eviction_keeps_a_long_continued_frontier_over_a_small_cold_file():
    # Every file carries the fixed logits row (vocab x 4 bytes), so longer checkpoints hold more tokens per byte.
    cold = entry(600, 600 * 14_000 + 517_120, key="9" * 40)
    continued = entry(10240, 10240 * 14_000 + 517_120, reason=SaveReason.CONTINUED, key="b" * 40)
    assert eviction_victim([cold, continued], NOW) is cold


def fake_file(directory: Path, text: bytes, tokens: int, payload: int, *, hits: int = 0, last_used: int = NOW,
              quant_bits: int = 2, ctx: int = CTX, tool_map: bytes = b"", identity: ModelIdentity = ID) -> Path:
    """A .kv file whose header and text are valid; its payload is zeros (lookups and eviction never read it)."""
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    header = KvHeader(quant_bits, SaveReason.COLD, FLAG_TOOL_MAP if tool_map else 0, tokens, hits, ctx, NOW,
                      last_used, payload, zlib.crc32(bytes(payload), zlib.crc32(text)))
    path = directory / f"{text_key(text)}.kv"
    footer = Footer(identity, len(tool_map), zlib.crc32(tool_map)).pack()
    path.write_bytes(header.pack() + struct.pack("<I", len(text)) + text + bytes(payload) + tool_map + footer)
    return path


def test_open_evicts_down_to_the_budget_and_ignores_invalid_files(tmp_path, caplog):
    d = tmp_path / "kv"
    mib = 1024 * 1024
    useful = fake_file(d, b"useful", 100, mib // 2, hits=5)
    useless = fake_file(d, b"useless", 100, mib // 2)
    small = fake_file(d, b"small", 100, 1000)
    garbage = d / f"{'c' * 40}.kv"
    garbage.write_bytes(b"not a kv file at all" * 100_000)  # 2 MB, would exceed the budget if it were counted
    truncated = fake_file(d, b"truncated", 100, mib)
    truncated.write_bytes(truncated.read_bytes()[:-100])  # the footer and the end of the payload are gone
    other = d / "notes.txt"
    other.write_bytes(b"x")
    with caplog.at_level(logging.INFO, "ds4_mlx.cache.kvstore"):
        store = KvStore(options(d, space_mb=1), 2, ID, clock=lambda: NOW)
    assert not useless.exists() and useful.exists() and small.exists()
    assert garbage.exists() and truncated.exists() and other.exists()
    assert "kv cache evicted reason=disk-cache-full tokens=100 hits=0" in caplog.text
    assert {e.path for e in store.entries()} == {useful, small}


def test_evict_protects_the_file_just_written_unless_it_alone_exceeds_the_budget(tmp_path):
    d = tmp_path / "kv"
    mib = 1024 * 1024
    store = KvStore(options(d, space_mb=1), 2, ID, clock=lambda: NOW)
    useful = fake_file(d, b"useful", 1000, mib // 2, hits=3)
    just_written = fake_file(d, b"just written", 10, mib // 2)
    store.evict(protected=text_key(b"just written"))
    assert just_written.exists() and not useful.exists()
    kept = fake_file(d, b"kept", 1000, mib // 4)
    oversize = fake_file(d, b"oversize", 10, 2 * mib)
    store.evict(protected=text_key(b"oversize"))
    assert not oversize.exists() and kept.exists()  # not protected: its own size breaks the budget


def test_lookup_picks_the_longest_cached_text_that_starts_the_prompt(tmp_path):
    d = tmp_path / "kv"
    fake_file(d, b"<BOS>system", 20, 10)
    best = fake_file(d, b"<BOS>system and tools", 30, 10)
    fake_file(d, b"<BOS>system and toolz", 40, 10)  # longer than best, not a prefix
    fake_file(d, b"<BOS>system and tools, user", 4, 10)  # a prefix, but below min tokens
    fake_file(d, b"<BOS>system and tools, user turn", 50, 10, ctx=CTX * 2)  # saved for a larger context
    fake_file(d, b"<BOS>system and tools, user turn and", 50, 10, quant_bits=4)
    store = KvStore(options(d), 2, ID)
    prompt = b"<BOS>system and tools, user turn and more"
    assert store.candidates(prompt, CTX)[0].key == text_key(b"<BOS>system and tools, user turn and")
    assert KvStore(options(d, reject_different_quant=True), 2, ID).candidates(prompt, CTX)[0].path == best
    assert store.candidates(b"<BOS>sys", CTX) == []
    # a cached text that ends inside a UTF-8 character of the prompt is passed over
    fake_file(d, "<BOS>é".encode()[:-1], 60, 10)
    assert store.candidates("<BOS>é".encode(), CTX) == []


# -- the tiny model: real files ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_path(demo_model):
    return demo_model


@pytest.fixture(scope="module")
def loaded(tiny_path):
    return Engine.load(tiny_path, ctx=CTX)


def engine_with(loaded: Engine, store: KvStore | None) -> Engine:
    """A fresh engine (own session and tool memory) over the loaded model."""
    return Engine(loaded.model, loaded.tokenizer, CTX, kv_store=store)


def test_quant_bits_come_from_layer_0_gate_type(tiny_path, tmp_path):
    assert routed_quant_bits(open_weights(tiny_path)) == 2
    q4 = write_model(tmp_path / "q4.gguf", preset="tiny", experts="q4")
    assert routed_quant_bits(open_weights(q4)) == 4


def test_cold_checkpoint_file_bytes(loaded, tmp_path):
    d = tmp_path / "kv"
    engine = engine_with(loaded, KvStore(options(d), 2, ID, clock=lambda: NOW))
    prompt = chat_prompt("Hello there")
    tokens = loaded.tokenizer.encode(prompt)
    anchor = tokens.index(loaded.tokenizer.user_id)
    assert anchor >= MIN
    done = run(engine, prompt)
    assert done.usage.cached_tokens == 0
    (path,) = kv_files(d)
    data = path.read_bytes()
    h = read_header(path)
    assert (h.quant_bits, h.reason, h.flags, h.tokens, h.hits, h.ctx) == (2, SaveReason.COLD, 0, anchor, 0, CTX)
    assert (h.created, h.last_used) == (NOW, NOW)
    (text_len,) = struct.unpack_from("<I", data, 48)
    text = data[52 : 52 + text_len]
    assert text == prompt[: prompt.index("<｜User｜>")].encode()  # the system prefix before the task message
    assert path.name == hashlib.sha1(text).hexdigest() + ".kv"
    end = 52 + text_len + h.payload_bytes
    assert len(data) == end + FOOTER.size
    # the payload is exactly what write_payload gives for a session prefilled with those tokens
    session = engine_with(loaded, None).session
    session.prefill(tokens[:anchor])
    expected = io.BytesIO()
    write_payload(expected, session.cache, session.tokens, session.logits)
    assert h.payload_bytes == payload_nbytes(session.cache) == len(expected.getvalue())
    assert data[52 + text_len : end] == expected.getvalue()  # same chunking, same arithmetic: the same bytes
    # bytes 20-23: the CRC-32 of text and payload; then the identity footer (no tool map: 0 bytes, CRC of b"")
    assert struct.unpack_from("<I", data, 20)[0] == h.checksum == zlib.crc32(data[52:end])
    assert data[end:] == b"KID\x02" + ID.core + ID.experts + struct.pack("<IIII", 0, 0, 0, 0)
    assert d.stat().st_mode & 0o777 == 0o700 and path.stat().st_mode & 0o777 == 0o600


def test_disk_checkpoint_continues_exactly_like_the_live_session(loaded, tmp_path):
    """Saved at shutdown, loaded by a new engine: the same state and logits (1e-5 relative: float32 arrays written
    and read back unchanged, so in practice bit-equal) and the same greedy continuation."""
    d = tmp_path / "kv"
    first = engine_with(loaded, KvStore(options(d), 2, ID))
    done = run(first, chat_prompt("Hello there"))
    live_tokens, live_logits = list(first.session.tokens), first.session.logits
    first.shutdown()
    shutdown_files = [p for p in kv_files(d) if read_header(p).reason == SaveReason.SHUTDOWN]
    assert len(shutdown_files) == 1 and read_header(shutdown_files[0]).tokens == len(live_tokens)

    follow = loaded.tokenizer.decode(live_tokens) + " and more text."
    store = KvStore(options(d), 2, ID)
    hit = store.load(store.candidates(follow.encode(), CTX)[0], follow.encode(), loaded.model.config, CTX)
    assert hit.tokens == live_tokens
    np.testing.assert_allclose(np.array(hit.logits), np.array(live_logits), rtol=1e-5)
    # the state as ds4's payload holds it (row buffers beyond their live rows are not state: a decode step keeps
    # its window's unfinished row there)
    saved, live = io.BytesIO(), io.BytesIO()
    write_payload(saved, hit.cache, hit.tokens, hit.logits)
    write_payload(live, first.session.cache, live_tokens, live_logits)
    assert saved.getvalue() == live.getvalue()

    second = engine_with(loaded, store)
    resumed = run(second, follow, max_tokens=4)
    continued = run(first, follow, max_tokens=4)  # the live session of the first engine extends the same way
    assert resumed.usage.cached_tokens == continued.usage.cached_tokens == len(live_tokens)
    assert resumed.usage.prompt_tokens == continued.usage.prompt_tokens
    assert resumed.token_ids == continued.token_ids
    assert done.usage.cached_tokens == 0


def test_hits_are_counted_and_long_checkpoints_consumed(loaded, tmp_path):
    d = tmp_path / "kv"
    clock = [NOW]
    run(engine_with(loaded, KvStore(options(d), 2, ID, clock=lambda: clock[0])), chat_prompt("Hello there"))
    (path,) = kv_files(d)
    n = read_header(path).tokens
    clock[0] = NOW + 100
    engine = engine_with(loaded, KvStore(options(d), 2, ID, clock=lambda: clock[0]))
    done = run(engine, chat_prompt("Something else"))
    assert done.usage.cached_tokens == n
    h = read_header(path)
    assert (h.hits, h.created, h.last_used) == (1, NOW, NOW + 100)
    # above --kv-cache-cold-max-tokens a loaded checkpoint is consumed: the live session will be saved again
    engine = engine_with(loaded, KvStore(options(d, cold_max_tokens=n - 1), 2, ID))
    assert run(engine, chat_prompt("A third question")).usage.cached_tokens == n
    assert not path.exists()


def test_a_miss_saves_the_live_session_before_replacing_it(loaded, tmp_path):
    d = tmp_path / "kv"
    engine = engine_with(loaded, KvStore(options(d, cold_max_tokens=0), 2, ID))
    run(engine, chat_prompt("Hello there"))
    live = list(engine.session.tokens)
    assert kv_files(d) == []
    run(engine, "<｜begin▁of▁sentence｜>A different conversation altogether, long enough.")
    (path,) = kv_files(d)
    h = read_header(path)
    assert (h.reason, h.tokens) == (SaveReason.EVICT, len(live))
    # and the conversation comes back from disk
    done = run(engine, loaded.tokenizer.decode(live) + " Next.")
    assert done.usage.cached_tokens == len(live)


def test_token_prompts_reuse_a_checkpoint_only_when_its_ids_are_a_prefix(loaded, tmp_path):
    d = tmp_path / "kv"
    prompt = chat_prompt("Hello there")
    run(engine_with(loaded, KvStore(options(d), 2, ID)), prompt)
    ids = loaded.tokenizer.encode(prompt)
    assert run(engine_with(loaded, KvStore(options(d), 2, ID)), ids).usage.cached_tokens == read_header(
        kv_files(d)[0]).tokens
    # the same bytes spelled with other ids (BOS typed as plain text, as the CLI tokenizes user text): no reuse
    respelled = loaded.tokenizer.encode(loaded.tokenizer.decode(ids[:1]), specials=False) + ids[1:]
    assert respelled != ids and loaded.tokenizer.decode(respelled) == prompt
    assert run(engine_with(loaded, KvStore(options(d, cold_max_tokens=0), 2, ID)), respelled).usage.cached_tokens == 0


def test_corrupt_files_are_not_loaded_and_the_request_is_served(loaded, tmp_path, caplog):
    """Damage to a checkpoint of this model (text, payload, header's token count) deletes it with one log line;
    a file that is not a checkpoint (truncated, bad header) is logged once, set aside and kept."""
    d = tmp_path / "kv"
    prompt = chat_prompt("Hello there")
    run(engine_with(loaded, KvStore(options(d), 2, ID)), prompt)
    (path,) = kv_files(d)
    good = path.read_bytes()
    text_len = struct.unpack_from("<I", good, 48)[0]

    def serve_once(store=None) -> int:  # without cold saves, which would replace an unusable file of the same name
        store = store or KvStore(options(d, cold_max_tokens=0), 2, ID)
        return run(engine_with(loaded, store), prompt).usage.cached_tokens

    damaged = {
        "text": good[:52] + b"X" + good[53:],
        "payload magic": good[: 52 + text_len] + b"XXXX" + good[56 + text_len :],
    }
    h = KvHeader.unpack(good)
    damaged["token count"] = KvHeader(**{**h.__dict__, "tokens": h.tokens + 1}).pack() + good[48:]
    for name, data in damaged.items():
        path.write_bytes(data)
        caplog.clear()
        with caplog.at_level(logging.INFO, "ds4_mlx.cache.kvstore"):
            assert serve_once() == 0, name
        assert not path.exists(), name
        assert caplog.text.count("kv cache discarded damaged checkpoint") == 1, name
    for name, data in {"truncated": good[:-10], "header": b"KVX" + good[3:]}.items():
        path.write_bytes(data)
        caplog.clear()
        with caplog.at_level(logging.INFO, "ds4_mlx.cache.kvstore"):
            store = KvStore(options(d, cold_max_tokens=0), 2, ID)
            assert serve_once(store) == 0 and serve_once(store) == 0, name
        assert path.read_bytes() == data, name
        assert caplog.text.count("kv cache: ignoring") == 1, name  # logged once, then set aside
    path.write_bytes(good)
    assert serve_once() == h.tokens


def test_an_unwritable_directory_does_not_fail_the_request(loaded, tmp_path, caplog):
    blocker = tmp_path / "file"
    blocker.write_text("a file where the directory should be")
    with caplog.at_level(logging.WARNING, "ds4_mlx.cache.kvstore"):
        engine = engine_with(loaded, KvStore(options(blocker / "kv"), 2, ID))
        done = run(engine, chat_prompt("Hello there"))
        engine.shutdown()
    assert done.finish_reason == "length" and done.usage.completion_tokens == 3
    assert "cannot create directory" in caplog.text and "kv cache store failed (cold)" in caplog.text


def test_a_full_disk_does_not_fail_the_request(loaded, tmp_path, caplog, monkeypatch):
    import ds4_mlx.cache.kvstore as kvstore

    real_create = kvstore.create_temp

    class Full:
        """The temporary file, on a disk that is full."""

        def __init__(self, f):
            self.f = f

        def write(self, data):
            raise OSError(errno.ENOSPC, "No space left on device")

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

    def full(path):
        f, tmp = real_create(path)
        return Full(f), tmp

    monkeypatch.setattr(kvstore, "create_temp", full)
    d = tmp_path / "kv"
    with caplog.at_level(logging.WARNING, "ds4_mlx.cache.kvstore"):
        done = run(engine_with(loaded, KvStore(options(d), 2, ID)), chat_prompt("Hello there"))
    assert done.usage.completion_tokens == 3
    assert "kv cache store failed (cold): No space left on device" in caplog.text
    assert list(d.iterdir()) == []  # no checkpoint and no temporary file left behind


# -- the tool-id map (KTM) ---------------------------------------------------------------------------------------

BLOCK = ('\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="bash">\n<｜DSML｜parameter name="command" '
         'string="true">ls -la</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>')


def test_tool_map_trailer_bytes_and_round_trip(loaded, tmp_path):
    d = tmp_path / "kv"
    engine = engine_with(loaded, KvStore(options(d, boundary_trim_tokens=0), 2, ID))
    engine.tool_memory.remember(["call_a", "call_b"], BLOCK)
    engine.tool_memory.remember(["call_other"], BLOCK.replace("ls -la", "pwd"))
    prompt = "<｜begin▁of▁sentence｜>Earlier the assistant ran" + BLOCK + " and then carried on."
    run(engine, prompt)
    (path,) = kv_files(d)
    h = read_header(path)
    assert h.flags & FLAG_TOOL_MAP
    data = path.read_bytes()
    trailer = data[52 + struct.unpack_from("<I", data, 48)[0] + h.payload_bytes : -FOOTER.size]
    block = BLOCK.encode()
    expected = b"KTM\x01" + struct.pack("<I", 2)
    for call_id in (b"call_a", b"call_b"):
        expected += struct.pack("<II", len(call_id), len(block)) + call_id + block
    assert trailer == expected == encode_tool_map([("call_a", BLOCK), ("call_b", BLOCK)])
    assert Footer.unpack(data[-FOOTER.size :]) == Footer(ID, len(trailer), zlib.crc32(trailer))

    store = KvStore(options(d), 2, ID)
    assert store.tool_map({"call_a", "call_other", "call_z"}) == {"call_a": BLOCK}
    # a hit loads the file's tool map into the engine's memory
    resumed = engine_with(loaded, store)
    assert run(resumed, prompt + " More.").usage.cached_tokens == h.tokens
    assert resumed.tool_memory.lookup(["call_a", "call_b"]) == BLOCK

    # saving the same text again keeps the file and refreshes its tool map
    session = engine_with(loaded, None).session
    session.prefill(loaded.tokenizer.encode(prompt))
    assert store.save(prompt.encode(), session.cache, session.tokens, session.logits, SaveReason.EVICT,
                      [("call_a", BLOCK), ("call_c", BLOCK)])
    assert store.tool_map({"call_b", "call_c"}) == {"call_c": BLOCK}
    after = read_header(path)
    assert (after.reason, after.created, after.hits) == (SaveReason.COLD, h.created, 1) and kv_files(d) == [path]


def test_server_recalls_tool_ids_from_disk_before_rendering(tmp_path):
    d = tmp_path / "kv"
    fake_file(d, b"some cached text", 50, 100, tool_map=encode_tool_map([("call_1", BLOCK)]))
    engine = ScriptedEngine()
    # a scripted model has no cache to save
    engine.kv_store = KvStore(options(d, min_tokens=100_000, cold_max_tokens=0), 2, ID)
    messages = [
        {"role": "user", "content": "list files"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "bash", "arguments": '{"command":"ls -la"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "a.txt"},
    ]
    with live_server(engine) as live:
        r = httpx.post(live.url + "/v1/chat/completions", json={"messages": messages}, timeout=30)
    assert r.status_code == 200
    assert BLOCK in engine.requests[-1].prompt
    assert engine.tool_memory.lookup(["call_1"]) == BLOCK
    assert engine.shut_down  # the worker lets the engine save its live session when it stops


# -- save moments, with a scripted model -------------------------------------------------------------------------


class PositionModel:
    """Makes the sampler pick `script[i]` as the i-th generated token, however the prompt was chunked."""

    def __init__(self, vocab: int, prompt_len: int, script: list[int]) -> None:
        self.vocab, self.prompt_len, self.script = vocab, prompt_len, script
        self.config = preset_config("tiny")  # what the memory budget sizes prefill chunks by (memory.py)

    def new_cache(self, ctx: int) -> ScriptedCache:
        return ScriptedCache(self)

    def unfeed(self) -> None:
        """Nothing to forget: the pick follows the cache's token count."""

    def __call__(self, tokens: mx.array, cache: ScriptedCache) -> mx.array:
        cache.n_tokens += tokens.size
        step = min(max(cache.n_tokens - self.prompt_len, 0), len(self.script) - 1)
        return mx.where(mx.arange(self.vocab) == self.script[step], 100.0, -100.0)

    def decode(self, token: int | mx.array, cache: ScriptedCache) -> tuple[None, mx.array]:
        return None, self(token if isinstance(token, mx.array) else mx.array([token], dtype=mx.int32), cache)


class RecordingStore:
    """Stands in for KvStore: records (reason, tokens) of each save, after checking the text key; finds nothing."""

    def __init__(self, options: KvCacheOptions, tokenizer) -> None:
        self.options = options
        self.tokenizer = tokenizer
        self.saved: list[tuple[SaveReason, int]] = []
        self.drafter_identity = b""

    def save(self, text, cache, tokens, logits, reason, tool_blocks=(), drafter_rows=b"") -> bool:
        assert text == b"".join(self.tokenizer.token_bytes(t) for t in tokens)
        self.saved.append((reason, len(tokens)))
        return True

    def candidates(self, prompt: bytes, ctx: int) -> list:
        return []


def scripted_engine(loaded: Engine, prompt: list[int], reply: str,
                    opts: KvCacheOptions) -> tuple[Engine, RecordingStore]:
    tok = loaded.tokenizer
    model = PositionModel(tok.vocab_size, len(prompt), tok.encode(reply) + [tok.eos_id])
    store = RecordingStore(opts, tok)
    return Engine(model, tok, 512, kv_store=store), store


def test_cold_then_continued_frontiers_then_shutdown(loaded, tmp_path):
    tok = loaded.tokenizer
    prompt = tok.encode("<｜begin▁of▁sentence｜>" + "word " * 40 + "<｜User｜>task<｜Assistant｜></think>")
    anchor = prompt.index(tok.user_id)
    engine, store = scripted_engine(loaded, prompt, "a b c d e f g h i j k l m n o p q r s t u v w x y z " * 2,
                                    options(tmp_path, continued_interval_tokens=16, boundary_align_tokens=8))
    run(engine, prompt, max_tokens=40)
    end = len(engine.session.tokens)  # the last sampled token is not fed, so `end` itself is never checked
    frontiers = [p for p in range(16, end, 16) if p != anchor]
    assert store.saved == sorted([(SaveReason.COLD, anchor)] + [(SaveReason.CONTINUED, p) for p in frontiers],
                                 key=lambda s: s[1])
    engine.shutdown()
    assert store.saved[-1] == (SaveReason.SHUTDOWN, end)


def test_a_cold_save_at_a_frontier_stands_for_the_continued_one(loaded, tmp_path):
    tok = loaded.tokenizer
    prompt = tok.encode("<｜begin▁of▁sentence｜>" + "word " * 40)
    opts = options(tmp_path, continued_interval_tokens=16, boundary_align_tokens=16, boundary_trim_tokens=0)
    engine, store = scripted_engine(loaded, prompt, "x", opts)
    run(engine, prompt, max_tokens=1)
    cold = opts.store_len(len(prompt))
    assert cold % 16 == 0
    assert store.saved.count((SaveReason.COLD, cold)) == 1 and (SaveReason.CONTINUED, cold) not in store.saved


def test_no_continued_saves_inside_a_tool_block(loaded, tmp_path):
    tok = loaded.tokenizer
    prompt = tok.encode("<｜begin▁of▁sentence｜><｜User｜>list the files<｜Assistant｜></think>")
    reply = "I will look at the files in this directory first." + BLOCK
    engine, store = scripted_engine(loaded, prompt, reply, options(tmp_path, min_tokens=2, cold_max_tokens=0,
                                                                   continued_interval_tokens=2))
    done = run(engine, prompt, max_tokens=200, tools_active=True)
    assert done.finish_reason == "tool_calls"
    tracker = dsml.GreedyTracker(thinking=False)
    inside = set()
    for i, token in enumerate(done.token_ids):
        if tracker.feed(tok.decode([token])) is not dsml.DecodeState.OUTSIDE:
            inside.add(len(prompt) + i)
    saved = {n for reason, n in store.saved if reason == SaveReason.CONTINUED}
    assert len({p for p in inside if p % 2 == 0}) > 3  # the block spans several frontiers...
    assert not saved & inside  # ...none of which is saved
    assert {p for p in range(len(prompt) + 1, len(prompt) + 10) if p % 2 == 0} <= saved  # before it, all are


# -- a restarted server ------------------------------------------------------------------------------------------


def test_a_restarted_server_reuses_the_conversation_from_disk(tiny_path, tmp_path):
    d = tmp_path / "kv"
    flags = ["--kv-disk-dir", str(d), "--kv-cache-min-tokens", str(MIN), "--kv-cache-boundary-align-tokens", "0",
             "--kv-cache-continued-interval-tokens", "0"]
    first = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hello there"}]
    with serve(tiny_path, flags, tmp_path / "log1") as url:
        r = httpx.post(url + "/v1/chat/completions", timeout=60, json={
            "model": "deepseek-chat", "messages": first, "max_tokens": 3, "temperature": 0}).json()
    assert r["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    reasons = sorted(read_header(p).reason for p in kv_files(d))
    assert reasons == [SaveReason.COLD, SaveReason.SHUTDOWN]
    shutdown_tokens = max(read_header(p).tokens for p in kv_files(d))

    answer = r["choices"][0]["message"]["content"]
    follow = first + [{"role": "assistant", "content": answer}, {"role": "user", "content": "Go on"}]
    with serve(tiny_path, flags, tmp_path / "log2") as url:
        r = httpx.post(url + "/v1/chat/completions", timeout=60, json={
            "model": "deepseek-chat", "messages": follow, "max_tokens": 2, "temperature": 0}).json()
    cached = r["usage"]["prompt_tokens_details"]["cached_tokens"]
    # the whole first exchange when the answer's text round-trips through JSON, else at least the system prefix
    assert cached == shutdown_tokens or ("\ufffd" in answer and 0 < cached < shutdown_tokens)


class serve:
    """`ds4-mlx serve` in a subprocess; on exit, SIGTERM and a clean exit are required (the shutdown save)."""

    def __init__(self, model: Path, flags: list[str], log: Path) -> None:
        self.command = [sys.executable, "-m", "ds4_mlx.cli", "serve", "-m", str(model), "--ctx", str(CTX),
                        "--backend", "cpu", *flags]
        self.log = log

    def __enter__(self) -> str:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        self.out = open(self.log, "w")
        self.process = subprocess.Popen([*self.command, "--port", str(port)], stdout=self.out,
                                        stderr=subprocess.STDOUT)
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    return url
            except httpx.TransportError:
                assert self.process.poll() is None and time.monotonic() < deadline, self.log.read_text()
                time.sleep(0.2)

    def __exit__(self, *exc) -> None:
        self.process.send_signal(signal.SIGTERM)
        try:
            code = self.process.wait(timeout=30)
        finally:
            if self.process.poll() is None:
                self.process.kill()
            self.out.close()
        log = self.log.read_text()
        assert code in (0, -signal.SIGTERM) and "Traceback" not in log, log
