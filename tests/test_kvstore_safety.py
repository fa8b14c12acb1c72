"""The disk KV cache never gives a wrong answer and never hangs: checksums catch bit rot in the KV rows and
logits, checkpoints of another model sharing the directory are never loaded, only regular files are opened (a FIFO
or a symlink named like a checkpoint changes nothing), temporary files are private and exclusive, and reuse, live or
from disk, needs the exact bytes of the prompt."""

from __future__ import annotations

import logging
import os
import struct
import threading
import zlib
from pathlib import Path

import pytest

from ds4_mlx.engine import Engine, GenerationRequest
from ds4_mlx.errors import CacheFileError, Ds4Error
from ds4_mlx.cache.kvfiles import open_regular
from ds4_mlx.cache.kvidentity import ModelIdentity, model_identity
from ds4_mlx.cache.kvstore import KvCacheOptions, KvHeader, KvStore, encode_tool_map, text_key
from ds4_mlx.model.factory import write_model
from ds4_mlx.model.weights import open_weights
from ds4_mlx.sampling import SamplingParams
from ds4_mlx.tokenizer import BYTE_TO_CHAR
from test_kvstore import BLOCK, fake_file

CTX = 256
GREEDY = SamplingParams(temperature=0)
ANY_ID = ModelIdentity(bytes(16), bytes(16))
SYSTEM = "<｜begin▁of▁sentence｜>You are a careful assistant who answers in one short sentence, never in lists."


def options(directory: Path, **kw) -> KvCacheOptions:
    base = dict(min_tokens=8, cold_max_tokens=1000, continued_interval_tokens=0, boundary_trim_tokens=0,
                boundary_align_tokens=0)
    return KvCacheOptions(directory, **{**base, **kw})


def run(engine: Engine, prompt, max_tokens: int = 4):
    req = GenerationRequest(prompt=prompt, max_tokens=max_tokens, sampling=GREEDY, thinking=False)
    return list(engine.generate(req))[-1]


def kv_files(directory: Path) -> list[Path]:
    return sorted(directory.glob("*.kv"))


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    """Two models of the same shape (other weights), the first one with 4-bit routed experts, and a "fine-tune" of
    the first: float32 values 128-255 of blk.0.attn_norm.weight doubled, every other byte the same."""
    d = tmp_path_factory.mktemp("models")
    models = {"a": write_model(d / "a.gguf", preset="tiny"), "b": write_model(d / "b.gguf", preset="tiny", seed=1),
              "a4": write_model(d / "a4.gguf", preset="tiny", experts="q4")}
    models["tuned"] = tuned_copy(models["a"], d / "tuned.gguf", "blk.0.attn_norm.weight", 128, 256)
    return models


def tuned_copy(source: Path, target: Path, tensor: str, start: int, stop: int) -> Path:
    """A copy of `source` whose float32 values [start, stop) of `tensor` are doubled."""
    with open_weights(source).file as f:
        info = f.tensors[tensor]
    data = bytearray(source.read_bytes())
    lo, hi = info.offset + 4 * start, info.offset + 4 * stop
    values = struct.unpack(f"<{stop - start}f", data[lo:hi])
    data[lo:hi] = struct.pack(f"<{stop - start}f", *(2 * v for v in values))
    target.write_bytes(bytes(data))
    return target


@pytest.fixture(scope="module")
def engine_a(models, tmp_path_factory) -> Engine:
    """Model a, loaded with a disk cache so that its store carries the model's real identity."""
    return Engine.load(models["a"], CTX, kv_cache=options(tmp_path_factory.mktemp("unused")))


def with_store(loaded: Engine, directory: Path, **kw) -> Engine:
    """A fresh engine over `loaded`'s model, with a store of `loaded`'s identity in `directory`."""
    store = KvStore(options(directory, **kw), 2, loaded.kv_store.identity)
    return Engine(loaded.model, loaded.tokenizer, CTX, kv_store=store)


def one_checkpoint(engine: Engine, directory: Path) -> tuple[Path, str, int]:
    """Run a prompt whose whole text is checkpointed (cold); return the file, the prompt and its token count."""
    prompt = SYSTEM + " Tell me about the sea."
    n = len(engine.tokenizer.encode(prompt))
    run(with_store(engine, directory), prompt)
    (path,) = kv_files(directory)
    assert KvHeader.unpack(path.read_bytes()).tokens == n  # trim and align off: the whole prompt
    return path, prompt, n


def payload_layout(path: Path) -> tuple[int, int, int]:
    """(offset of the payload, offset of its logits, offset of layer 0's raw KV rows) in a checkpoint file."""
    data = path.read_bytes()
    payload = 52 + struct.unpack_from("<I", data, 48)[0]
    n_tokens, n_layer, _, _, n_vocab = struct.unpack_from("<5I", data, payload + 7 * 4)
    logits = payload + 13 * 4 + 4 * n_tokens
    return payload, logits, logits + 4 * n_vocab + 8 * n_layer


def flip_bit(path: Path, offset: int, bit: int = 4) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 1 << bit
    path.write_bytes(bytes(data))


# -- 1. integrity ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("where", ["kv row", "logit"])
def test_a_flipped_bit_is_caught_and_the_file_discarded(engine_a, tmp_path, caplog, where):
    """One flipped bit in a KV row or a logit used to be loaded silently (and the damage saved again as a new,
    valid-looking file). Now the checksum fails, the file is deleted with one log line, the answer is the cold one,
    and what is saved afterwards is computed afresh."""
    d = tmp_path / "kv"
    path, prompt, n = one_checkpoint(engine_a, d)
    _, logits, rows = payload_layout(path)
    cold = run(Engine(engine_a.model, engine_a.tokenizer, CTX), prompt)
    flip_bit(path, rows + 2 if where == "kv row" else logits + 4 * 7 + 3)
    caplog.clear()
    with caplog.at_level(logging.INFO, "ds4_mlx.cache.kvstore"):
        done = run(with_store(engine_a, d, cold_max_tokens=0), prompt)
    assert done.usage.cached_tokens == 0 and done.token_ids == cold.token_ids
    assert not path.exists()
    assert caplog.text.count("checksum mismatch") == 1
    assert "kv cache hit" not in caplog.text


def test_the_checksum_survives_hits_and_is_computed_at_disk_speed(engine_a, tmp_path):
    """Header rewrites (hits, last use) do not touch bytes 20-23, so a file used twice still verifies."""
    d = tmp_path / "kv"
    path, prompt, n = one_checkpoint(engine_a, d)
    for hits in (1, 2):
        assert run(with_store(engine_a, d), prompt + " Go on.").usage.cached_tokens == n
        assert KvHeader.unpack(path.read_bytes()).hits == hits
    data = path.read_bytes()
    payload, _, _ = payload_layout(path)
    end = payload + KvHeader.unpack(data).payload_bytes
    assert KvHeader.unpack(data).checksum == zlib.crc32(data[52:end])


# -- 2. identity -------------------------------------------------------------------------------------------------


def test_the_fingerprint_tells_models_and_settings_apart(models):
    a = model_identity(open_weights(models["a"]), True)
    assert model_identity(open_weights(models["a"]), True) == a  # stable across opens
    b = model_identity(open_weights(models["b"]), True)
    assert b.core != a.core and b.experts != a.experts  # same shape, other weights
    assert model_identity(open_weights(models["a"]), False).core != a.core  # no activation simulation
    a4 = model_identity(open_weights(models["a4"]), True)
    assert a4.core == a.core and a4.experts != a.experts  # same model, other routed-expert quantization
    # every byte of a small tensor is hashed, not its first 512: a change past them is another model too
    tuned = model_identity(open_weights(models["tuned"]), True)
    assert tuned.core != a.core and not a.accepts(tuned, same_experts=False)
    assert a.accepts(a4, same_experts=False) and not a.accepts(a4, same_experts=True) and not a.accepts(b, False)


@pytest.mark.parametrize("other", [pytest.param("b", marks=pytest.mark.slow), "tuned"])
def test_a_second_model_sharing_the_directory_never_loads_the_first_ones_checkpoints(models, engine_a, tmp_path,
                                                                                    caplog, other):
    """Model b (or a's fine-tune) has the shape of model a: a's payload would load into it, and its saved logits
    would give b's first token. b must prefill its own state, and answer exactly as it does without a disk cache."""
    d = tmp_path / "kv"
    path, prompt, n = one_checkpoint(engine_a, d)
    b_plain = Engine.load(models[other], CTX)
    expected = run(b_plain, prompt)
    with caplog.at_level(logging.INFO, "ds4_mlx.cache.kvstore"):
        b = Engine.load(models[other], CTX, kv_cache=options(d, cold_max_tokens=0))
        done = run(b, prompt)
        again = run(Engine(b.model, b.tokenizer, CTX, kv_store=b.kv_store), prompt)
    assert done.usage.cached_tokens == again.usage.cached_tokens == 0
    assert done.token_ids == again.token_ids == expected.token_ids
    assert path.exists()  # a's checkpoint is a's to keep
    assert caplog.text.count("was written by another model") == 1  # said once, not per request
    # and model a, loaded with its own identity, still uses it
    a = Engine.load(models["a"], CTX, kv_cache=options(d, cold_max_tokens=0))
    assert run(a, prompt + " More.").usage.cached_tokens == n


def test_other_routed_expert_quantization_is_shared_only_without_reject(models, engine_a, tmp_path):
    d = tmp_path / "kv"
    _, prompt, n = one_checkpoint(engine_a, d)
    shared = Engine.load(models["a4"], CTX, kv_cache=options(d, cold_max_tokens=0))
    assert run(shared, prompt + " More.").usage.cached_tokens == n  # ds4's cross-quant reuse, by default
    strict = Engine.load(models["a4"], CTX, kv_cache=options(d, cold_max_tokens=0, reject_different_quant=True))
    assert run(strict, prompt + " More.").usage.cached_tokens == 0


# -- 3. safe files -----------------------------------------------------------------------------------------------


def in_thread(fn, timeout: float = 20.0):
    """Run `fn` on a daemon thread; fail (instead of hanging the suite) if it does not return in time."""
    out: dict = {}

    def target() -> None:
        try:
            out["value"] = fn()
        except BaseException as e:  # re-raised on the test's thread
            out["error"] = e

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(timeout)
    assert not thread.is_alive(), f"{fn} blocked for {timeout} s"
    if "error" in out:
        raise out["error"]
    return out["value"]


def test_a_fifo_named_like_a_checkpoint_never_blocks(engine_a, tmp_path, caplog):
    """A FIFO named `<40 hex>.kv` used to hang start-up (and, added at run time, the worker in open())."""
    d = tmp_path / "kv"
    d.mkdir(mode=0o700)
    prompt = SYSTEM + " Tell me about the sea."
    data = prompt.encode()
    key = text_key(data[: len(SYSTEM.encode())])
    os.mkfifo(d / f"{'e' * 40}.kv")  # present at start-up
    with caplog.at_level(logging.INFO, "ds4_mlx.cache.kvstore"):
        engine = in_thread(lambda: with_store(engine_a, d, cold_max_tokens=0))
        os.mkfifo(d / f"{key}.kv")  # added at run time, named for the prompt's prefix
        done = in_thread(lambda: run(engine, prompt))
        in_thread(lambda: run(engine, prompt + " Again."))
    assert done.usage.cached_tokens == 0 and done.finish_reason == "length"
    assert caplog.text.count("not a regular file") == 2  # each FIFO logged once, then set aside
    with pytest.raises(CacheFileError, match="not a regular file"):
        in_thread(lambda: open_regular(d / f"{key}.kv"))  # the open itself does not block either


def test_a_symlink_named_like_a_checkpoint_is_not_followed(engine_a, tmp_path, caplog):
    d, elsewhere = tmp_path / "kv", tmp_path / "elsewhere"
    path, prompt, n = one_checkpoint(engine_a, elsewhere)
    d.mkdir(mode=0o700)
    (d / path.name).symlink_to(path)
    with caplog.at_level(logging.INFO, "ds4_mlx.cache.kvstore"):
        done = run(with_store(engine_a, d, cold_max_tokens=0), prompt + " More.")
    assert done.usage.cached_tokens == 0 and "not a regular file" in caplog.text
    with pytest.raises(CacheFileError, match="symlink"):
        open_regular(d / path.name)


def test_a_planted_temp_symlink_does_not_redirect_the_write(engine_a, tmp_path):
    """The temporary file used to be opened with O_TRUNC through whatever held its name: a symlink planted in a
    shared directory made the server overwrite another file. Now the name is unlinked and created exclusively."""
    d = tmp_path / "kv"
    d.mkdir(mode=0o700)
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    prompt = SYSTEM + " Tell me about the sea."
    (d / f"{text_key(prompt.encode())}.kv.tmp.{os.getpid()}").symlink_to(victim)
    run(with_store(engine_a, d), prompt)
    assert victim.read_text() == "precious"
    (path,) = kv_files(d)
    assert path.stat().st_mode & 0o777 == 0o600 and not path.is_symlink()
    assert [p.name for p in d.iterdir()] == [path.name]  # no temporary file left


def test_stale_temp_files_of_dead_writers_are_removed_at_start_up(tmp_path):
    d = tmp_path / "kv"
    d.mkdir(mode=0o700)
    dead = d / f"{'1' * 40}.kv.tmp.{2**22 + 12345}"  # above Linux's pid_max: no such process
    mine = d / f"{'2' * 40}.kv.tmp.{os.getpid()}"  # this process has written nothing yet
    live = d / f"{'3' * 40}.kv.tmp.{os.getppid()}"  # a running writer: left alone
    other = d / "notes.tmp.1"
    for p in (dead, mine, live, other):
        p.write_bytes(b"x" * 100)
    KvStore(options(d), 2, ANY_ID)
    assert not dead.exists() and not mine.exists() and live.exists() and other.exists()


def test_a_cache_directory_others_can_write_is_refused(tmp_path, models):
    d = tmp_path / "kv"
    d.mkdir()
    d.chmod(0o777)
    with pytest.raises(Ds4Error, match="writable by other users.*chmod go-w"):
        KvStore(options(d), 2, ANY_ID)
    with pytest.raises(Ds4Error, match="writable by other users"):
        Engine.load(models["a"], CTX, kv_cache=options(d))
    d.chmod(0o700)
    KvStore(options(d), 2, ANY_ID)


def test_when_the_best_candidate_fails_the_next_one_is_used(engine_a, tmp_path):
    d = tmp_path / "kv"
    short_prompt = SYSTEM + " Tell me about the sea."
    long_prompt = short_prompt + " And the mountains, please."
    run(with_store(engine_a, d), short_prompt)
    run(with_store(engine_a, d / "other"), long_prompt)
    (long_file,) = kv_files(d / "other")
    long_file.rename(d / long_file.name)
    long_file = d / long_file.name
    _, _, rows = payload_layout(long_file)
    flip_bit(long_file, rows)
    n_short = len(engine_a.tokenizer.encode(short_prompt))
    done = run(with_store(engine_a, d, cold_max_tokens=0), long_prompt + " Thanks.")
    assert done.usage.cached_tokens == n_short
    assert not long_file.exists()


# -- 5. exact reuse ----------------------------------------------------------------------------------------------


def test_live_reuse_needs_the_exact_bytes_not_their_replacement_characters(engine_a):
    """The live session spells b"\\xe0\\xa6Psych" (an invalid UTF-8 sequence the model produced); a client that
    sends it back shows it as U+FFFD, whose bytes are b"\\xef\\xbf\\xbd". Decoding the live tokens with
    errors="replace" made the two look equal and reused state for bytes the prompt does not have."""
    tok = engine_a.tokenizer
    head = tok.encode(SYSTEM)
    bad = [tok.token_id(BYTE_TO_CHAR[0xE0]), tok.token_id(BYTE_TO_CHAR[0xA6])]
    live_ids = head + bad + tok.encode("Psych")
    engine = Engine(engine_a.model, tok, CTX)
    run(engine, live_ids, max_tokens=1)
    text = tok.decode(live_ids)
    assert "\ufffdPsych" in text and text.encode() != b"".join(tok.token_bytes(t) for t in live_ids)
    assert run(engine, text + " again", max_tokens=1).usage.cached_tokens == 0
    # the same bytes, spelled validly, are reused
    run(engine, SYSTEM + " Psych", max_tokens=1)
    assert run(engine, SYSTEM + " Psych and more", max_tokens=1).usage.cached_tokens > 0


def test_disk_reuse_needs_the_exact_bytes_too(engine_a, tmp_path):
    tok = engine_a.tokenizer
    d = tmp_path / "kv"
    ids = tok.encode(SYSTEM) + [tok.token_id(BYTE_TO_CHAR[0xE0]), tok.token_id(BYTE_TO_CHAR[0xA6])]
    ids += tok.encode("Psych")
    engine = with_store(engine_a, d)
    run(engine, ids, max_tokens=1)
    engine.shutdown()
    assert kv_files(d)
    text = tok.decode(ids)
    assert run(with_store(engine_a, d, cold_max_tokens=0), text + " again").usage.cached_tokens == 0


def test_an_intact_checkpoint_made_for_another_context_is_kept(engine_a, tmp_path, caplog):
    """A context smaller than the sliding window (16 in the tiny model) records a shorter raw window, which a larger
    session cannot load. The checksum shows the file is intact: it is passed over, not deleted as damaged."""
    d = tmp_path / "kv"
    tok = engine_a.tokenizer
    prompt = "<｜begin▁of▁sentence｜>The sea is"
    assert 4 <= len(tok.encode(prompt)) < 11
    store = KvStore(options(d, min_tokens=4), 2, engine_a.kv_store.identity)
    run(Engine(engine_a.model, tok, 12, kv_store=store), prompt, max_tokens=1)
    (path,) = kv_files(d)
    with caplog.at_level(logging.INFO, "ds4_mlx.cache.kvstore"):
        done = run(with_store(engine_a, d, min_tokens=4, cold_max_tokens=0), prompt + " deep")
    assert done.usage.cached_tokens == 0 and path.exists()
    assert "does not fit this session" in caplog.text and "discarded" not in caplog.text


def test_a_damaged_tool_map_is_not_replayed(tmp_path, caplog):
    """The KTM trailer is outside the header's checksum (it is refreshed in place); the footer's CRC covers it, so a
    flipped bit in a sampled DSML block is never rendered into a prompt."""
    d = tmp_path / "kv"
    ktm = encode_tool_map([("call_1", BLOCK)])
    path = fake_file(d, b"some cached text", 50, 100, tool_map=ktm, identity=ANY_ID)
    store = KvStore(options(d), 2, ANY_ID)
    assert store.tool_map({"call_1"}) == {"call_1": BLOCK}
    data = bytearray(path.read_bytes())
    data[data.index(b"ls -la")] ^= 0x01  # "ls" -> "ms": still a well-formed map
    path.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING, "ds4_mlx.cache.kvstore"):
        assert store.tool_map({"call_1"}) == {}
    assert "tool map checksum mismatch" in caplog.text
