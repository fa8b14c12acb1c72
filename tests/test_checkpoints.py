"""In-memory checkpoints: where they are taken, what a new prompt reuses from them, the budget, and that a restored
state continues exactly like the state it was taken from."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import mlx.core as mx
import pytest

from ds4_mlx.chat import Message, ThinkMode, render_chat
from ds4_mlx.cache.checkpoints import CheckpointStore, snapshot_arrays
from ds4_mlx.commands.options import byte_size
from ds4_mlx.engine import Engine, GenerationRequest
from ds4_mlx.events import Done
from ds4_mlx.model.factory import write_model
from ds4_mlx.sampling import SamplingParams
from ds4_mlx.session import Snapshot
from scripted import scripted_engine

GREEDY = SamplingParams(temperature=0)
SYSTEM = Message("system", "You are a careful coding agent. " * 4)


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("checkpoints") / "tiny.gguf"
    write_model(path, preset="tiny", vocab="real", seed=5)
    return path


@pytest.fixture(scope="module")
def tiny(tiny_path):
    return Engine.load(tiny_path, ctx=512)


@pytest.fixture
def scripted(tiny):
    engine, _ = scripted_engine(tiny.tokenizer, "Sure.", ctx=1024)
    return engine


def run(engine: Engine, prompt: str | list[int], **kw) -> Done:
    events = list(engine.generate(GenerationRequest(prompt=prompt, thinking=False, **kw)))
    return events[-1]


def chat(*messages: Message) -> str:
    return render_chat([SYSTEM, *messages], think=ThinkMode.NONE, ctx=1024)


def user_start(engine: Engine, prompt: str) -> int:
    ids = engine.tokenizer.encode(prompt)
    return max(i for i, t in enumerate(ids) if t == engine.tokenizer.user_id)


def test_an_identical_resend_reuses_the_whole_prompt(scripted):
    """The live session holds prompt + answer, so a resend does not extend it: the end-of-prompt checkpoint does."""
    prompt = chat(Message("user", "Fix the failing test in utils.py."))
    first = run(scripted, prompt)
    assert first.usage.cached_tokens == 0
    again = run(scripted, prompt)
    assert again.usage.cached_tokens == again.usage.prompt_tokens == first.usage.prompt_tokens
    assert again.message.content == first.message.content == "Sure."


def test_an_edited_last_message_reuses_everything_before_it(scripted):
    history = [Message("user", "List the files."), Message("assistant", "a.py b.py")]
    prompt = chat(*history, Message("user", "Now open a.py."))
    run(scripted, prompt)
    # Claude Code's retry: the same request with a reminder appended to the last user message
    edited = chat(*history, Message("user", "Now open a.py.<system-reminder>Be brief.</system-reminder>"))
    done = run(scripted, edited)
    assert done.usage.cached_tokens == user_start(scripted, edited) == user_start(scripted, prompt)
    assert done.usage.prompt_tokens == len(scripted.tokenizer.encode(edited))


def test_the_live_session_replaced_by_a_side_request_is_kept(scripted):
    """A side request (a title, a quota check) between two turns replaces the live session; the next turn still
    reuses the whole first turn, answer included."""
    turn = chat(Message("user", "Explain the bug."))
    first = run(scripted, turn)
    held = list(scripted.session.tokens)
    assert len(held) == first.usage.prompt_tokens + first.usage.completion_tokens  # the answer's EOS is not fed
    run(scripted, render_chat([Message("user", "Write a title for: bug")], think=ThinkMode.NONE, ctx=1024))
    follow = chat(Message("user", "Explain the bug."), Message("assistant", "Sure."), Message("user", "Fix it."))
    done = run(scripted, follow)
    assert done.usage.cached_tokens == len(held)


def test_a_cancelled_prefill_resumes_from_its_last_chunk(scripted):
    scripted.session.chunk_size = 16
    prompt = chat(Message("user", "Summarise this log: " + "line ok\n" * 20))
    chunks = []

    def cancel() -> bool:
        chunks.append(len(scripted.session.tokens))
        return len(chunks) > 4

    events = list(scripted.generate(GenerationRequest(prompt=prompt, thinking=False), cancel=cancel))
    assert events[-1].error == "cancelled" and scripted.session.tokens == []
    done = run(scripted, prompt)
    assert done.usage.cached_tokens == chunks[-1] > 0  # the chunk boundary the prefill had reached


def test_token_prompts_match_by_ids_only(scripted):
    """Ids given by the caller are never re-tokenized: a checkpoint is reused when its ids start them."""
    ids = scripted.tokenizer.encode(chat(Message("user", "hi")))
    run(scripted, ids)
    assert run(scripted, ids).usage.cached_tokens == len(ids)
    other = ids[:-1] + [scripted.tokenizer.encode("x")[0]]
    assert run(scripted, other).usage.cached_tokens == user_start(scripted, chat(Message("user", "hi")))


def test_a_restored_checkpoint_continues_exactly_like_a_cold_prefill(tiny_path, tiny):
    """Greedy answers after a restored state equal those of a fresh engine that prefills the same ids."""
    tiny.reset()
    first = chat(Message("user", "What is 2 + 2?"))
    run(tiny, first, max_tokens=4, sampling=GREEDY)
    second = chat(Message("user", "What is 3 + 3?"))  # shares everything before the last user turn
    resent = run(tiny, second, max_tokens=6, sampling=GREEDY)
    assert resent.usage.cached_tokens == user_start(tiny, second) > 0
    cold = Engine.load(tiny_path, ctx=512, kv_ram_budget=0)
    reference = run(cold, second, max_tokens=6, sampling=GREEDY)
    assert reference.usage.cached_tokens == 0 and len(cold.checkpoints) == 0
    assert resent.token_ids == reference.token_ids
    again = run(tiny, second, max_tokens=6, sampling=GREEDY)  # restored whole: the saved logits
    assert again.usage.cached_tokens == again.usage.prompt_tokens and again.token_ids == reference.token_ids


@dataclass(frozen=True)
class _State:
    """A cache snapshot holding given arrays."""

    held: tuple[mx.array, ...]

    def arrays(self) -> list[mx.array]:
        return list(self.held)


def _snapshot(tokens: tuple[int, ...], *arrays: mx.array) -> Snapshot:
    return Snapshot(tokens, _State(arrays), None)


def test_the_budget_counts_shared_arrays_once_and_evicts_the_least_recently_used():
    shared, a, b, c = (mx.zeros((256,)) for _ in range(4))  # 1 KiB each
    store = CheckpointStore(3 * 1024, lambda ids: bytes(ids))
    store.add(_snapshot((1,), shared, a))
    store.add(_snapshot((1, 2), shared, b))
    assert store.nbytes == 3 * 1024 and len(store) == 2  # `shared` once
    store.use(store.find([1, 9], None))  # (1,) is used: (1, 2) is now the least recently used
    store.add(_snapshot((1, 2, 3), shared, c))
    assert store.positions() == [1, 3] and store.nbytes == 3 * 1024
    assert store.find([1, 2, 3, 4], None).checkpoint.n_tokens == 3
    assert store.find([1, 2, 7], bytes([1, 2, 7])).checkpoint.n_tokens == 1
    store.add(_snapshot((5,), mx.zeros((1024,))))  # 4 KiB: larger than the whole budget, so nothing stays
    assert len(store) == 0 and store.nbytes == 0


def test_text_matches_keep_the_ids_and_stop_at_character_boundaries():
    store = CheckpointStore(1 << 20, lambda ids: "".join(chr(i) for i in ids).encode())
    store.add(_snapshot((ord("h"), ord("é"[0]))))  # spells "hé"
    assert store.find([0], "hé!".encode()).by_text
    assert store.find([0], "hé!".encode(), longer_than=2) is None
    store.add(_snapshot((ord("a"),)))
    assert store.find([0], "ab".encode()).checkpoint.n_tokens == 1
    cut = CheckpointStore(1 << 20, lambda ids: "é".encode()[: len(ids)])
    cut.add(_snapshot((7,)))  # spells the first byte of "é" only
    assert cut.find([0], "é".encode()) is None


def test_the_budget_flag_takes_sizes():
    assert [byte_size(t) for t in ("16G", "512M", "1.5g", "2GiB", "100", "0")] == [
        16 << 30, 512 << 20, 3 << 29, 2 << 30, 100, 0]
    for bad in ("-1G", "lots", "G", "nan"):
        with pytest.raises(argparse.ArgumentTypeError):
            byte_size(bad)


def test_no_budget_keeps_nothing():
    store = CheckpointStore(0, lambda ids: b"")
    store.add(_snapshot((1,), mx.zeros((4,))))
    assert len(store) == 0
    with pytest.raises(ValueError):
        CheckpointStore(-1, lambda ids: b"")


def test_snapshots_of_one_stream_share_what_did_not_change(tiny):
    """A few tokens apart, two states share the row buffers of the layers that did not compress a new row in
    between: the budget counts those once."""
    tiny.reset()
    session = tiny.session
    session.prefill(tiny.tokenizer.encode(chat(Message("user", "Hello there."))))
    first = session.snapshot()
    session.prefill(tiny.tokenizer.encode(" and more"))
    second = session.snapshot()
    shared = {id(a) for a in snapshot_arrays(first)} & {id(a) for a in snapshot_arrays(second)}
    assert shared  # the ratio-128 layers' row buffers: no new row in a few tokens
    store = CheckpointStore(1 << 30, tiny._text_bytes)
    store.add(first)
    store.add(second)
    each = [sum(a.nbytes for a in snapshot_arrays(snap)) for snap in (first, second)]
    assert max(each) < store.nbytes < sum(each)
    assert store.nbytes == sum(each) - sum(a.nbytes for a in snapshot_arrays(first) if id(a) in shared)
