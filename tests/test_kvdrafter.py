"""The drafter's rows in disk KV checkpoints (cache/kvdrafter.py): saved with the session's state, restored into a
session with the same drafter, left out for another drafter; the output is the same either way."""

from __future__ import annotations

import logging

import mlx.core as mx
import pytest

from ds4_mlx.cache import kvdrafter
from ds4_mlx.cache.kvidentity import FOOTER, FOOTER_V1, Footer, ModelIdentity
from ds4_mlx.cache.kvstore import KvCacheOptions
from ds4_mlx.engine import Engine, GenerationRequest
from ds4_mlx.events import Done
from ds4_mlx.model.dspark import DSpark
from ds4_mlx.model.dspark_file import write_dspark_model
from ds4_mlx.model.factory import write_model, write_mtp_model
from ds4_mlx.model.model import Model
from ds4_mlx.model.mtp import MTP
from ds4_mlx.model.weights import open_weights
from ds4_mlx.sampling import SamplingParams
from ds4_mlx.session import Session

CTX = 256
PROMPT = [0, *range(100, 139)]  # 40 tokens: past the tiny model's 16-token window
DRAFTERS = {"dspark": 1, "mtp": 2}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("kvdrafter")
    return (write_model(root / "tiny.gguf", preset="tiny", seed=5), write_dspark_model(root / "dspark.gguf", seed=5),
            write_mtp_model(root / "mtp.gguf", seed=5), write_dspark_model(root / "other.gguf", seed=6))


def load(files, drafter: int, directory) -> Engine:
    options = KvCacheOptions(directory, min_tokens=8, boundary_trim_tokens=0, boundary_align_tokens=0,
                             continued_interval_tokens=0)
    return Engine.load(files[0], CTX, kv_cache=options, mtp=files[drafter], mtp_draft=4)


def generate(engine: Engine, prompt: list[int]) -> Done:
    events = list(engine.generate(GenerationRequest(prompt=prompt, max_tokens=6,
                                                    sampling=SamplingParams(temperature=0))))
    return events[-1]


def restored_drafter_states(monkeypatch) -> list:
    """Every drafter state a session is restored with, from here on."""
    seen = []
    real = Session.restore

    def restore(self, snap):
        seen.append(snap.mtp)
        real(self, snap)

    monkeypatch.setattr(Session, "restore", restore)
    return seen


@pytest.mark.parametrize("kind", DRAFTERS)
def test_a_disk_checkpoint_restores_the_drafter_rows(monkeypatch, tmp_path, files, kind):
    saved = []
    real_encode = kvdrafter.encode

    def encode(session, identity):
        saved.append((len(session.tokens), session.mtp_cache.snapshot()))
        return real_encode(session, identity)

    monkeypatch.setattr(kvdrafter, "encode", encode)
    first = load(files, DRAFTERS[kind], tmp_path)
    answer = generate(first, PROMPT)
    (entry,) = first.kv_store.entries()
    assert entry.header.tokens == len(PROMPT) and entry.footer.drafter_bytes > 0
    (n, state), = [s for s in saved if s[0] == len(PROMPT)]

    seen = restored_drafter_states(monkeypatch)
    second = load(files, DRAFTERS[kind], tmp_path)
    again = generate(second, PROMPT)
    assert again.token_ids == answer.token_ids and (again.reuse.source, again.reuse.tokens) == ("disk", len(PROMPT))
    (restored,) = seen
    assert type(restored) is type(state)
    assert all(mx.array_equal(a, b) for a, b in zip(restored.arrays(), state.arrays(), strict=True))
    if kind == "mtp":
        assert (restored.origin, restored.n_tokens) == (state.origin, state.n_tokens)
        assert mx.array_equal(restored.logits, state.logits)
    else:
        assert restored.end == state.end == n


def test_another_drafters_rows_are_left_out(monkeypatch, tmp_path, files, caplog):
    answer = generate(load(files, DRAFTERS["dspark"], tmp_path), PROMPT)
    seen = restored_drafter_states(monkeypatch)
    with caplog.at_level(logging.INFO, logger="ds4_mlx.cache.kvdrafter"):
        other = load(files, 3, tmp_path)  # another DSpark file: the main model's state still loads
        again = generate(other, PROMPT)
    assert seen == [None] and (again.reuse.source, again.reuse.tokens) == ("disk", len(PROMPT))
    assert "another drafter's" in caplog.text
    assert again.token_ids == answer.token_ids  # greedy speculation gives plain greedy's tokens with any drafter


def test_rows_that_do_not_fit_the_session_are_refused(files):
    model = Model(open_weights(files[0]))
    session = Session(model, CTX, DSpark.load(files[1], model))
    assert kvdrafter.encode(session, b"d" * 16) == b""  # no rows yet
    session.prefill(PROMPT)
    data = kvdrafter.encode(session, b"d" * 16)
    assert kvdrafter.decode(data, session, b"d" * 16, len(PROMPT)).end == len(PROMPT)
    assert kvdrafter.decode(data, session, b"e" * 16, len(PROMPT)) is None  # another drafter
    assert kvdrafter.decode(data, session, b"d" * 16, len(PROMPT) - 1) is None  # another checkpoint length
    assert kvdrafter.decode(data[:-4], session, b"d" * 16, len(PROMPT)) is None  # cut short
    plain = Session(model, CTX, MTP.load(files[2], model))
    assert kvdrafter.decode(data, plain, b"d" * 16, len(PROMPT)) is None  # rows of another kind of drafter


def test_a_version_1_footer_still_reads():
    identity = ModelIdentity(b"c" * 16, b"e" * 16)
    v1 = FOOTER_V1.pack(b"KID", 1, identity.core, identity.experts, 7, 8)
    old = Footer.unpack(b"payload" + v1)
    assert (old.identity, old.ktm_bytes, old.ktm_crc, old.drafter_bytes, old.size) == (identity, 7, 8, 0, FOOTER_V1.size)
    new = Footer.unpack(b"x" + Footer(identity, 7, 8, 9, 10).pack())
    assert (new.drafter_bytes, new.drafter_crc, new.size, new.trailing) == (9, 10, FOOTER.size, 7 + 9 + FOOTER.size)
