"""The compiled decode step (Model.decode) against the chunk path it must equal.

With the kernel mode "fast" one token goes through `Model.step`, traced once by mx.compile and replayed; with
"reference" it goes through the chunk path (`Model.hidden` over one token). Greedy decoding must pick the same
tokens either way, and on the CPU the logits agree exactly (both paths run the same float32 operations: the step
only writes them with shapes fixed by the context size). The prompt is long enough that ratio-4 layers have more
compressed rows than the indexer keeps, so the step's always-on indexer really chooses.
"""

from __future__ import annotations

import mlx.core as mx
import pytest

from ds4_mlx.kernels.machinery import registry
from ds4_mlx.model.factory import write_model
from ds4_mlx.model.model import Model
from ds4_mlx.model.weights import open_weights

GENERATED = 64
CTX = 1024


@pytest.fixture(scope="module")
def model_files(tmp_path_factory):
    """(preset, experts) -> a model file, written at first use (the small ones only by the slow checks)."""
    folder = tmp_path_factory.mktemp("decode-step")

    class Files(dict):
        def __missing__(self, key: tuple[str, str]):
            preset, experts = key
            self[key] = write_model(folder / f"{preset}-{experts}.gguf", preset=preset, experts=experts,
                                    vocab="small")
            return self[key]

    return Files()


def greedy(model: Model, prompt: list[int], mode: str) -> tuple[list[int], list[mx.array]]:
    with registry.forced_mode(mode):
        cache = model.new_cache(CTX)
        logits = model.prefill(mx.array(prompt, dtype=mx.int32), cache, chunk_size=64)
        tokens, rows = [], []
        for _ in range(GENERATED):
            tokens.append(int(mx.argmax(logits).item()))
            _, logits = model.decode(tokens[-1], cache)
            mx.eval(logits, *cache.arrays())
            rows.append(logits)
        return tokens, rows


COMBINATIONS = [("tiny", "q2", True), pytest.param("tiny", "q2", False, marks=pytest.mark.slow), ("tiny", "q4", True),
                pytest.param("tiny", "q4", False, marks=pytest.mark.slow),
                pytest.param("small", "q2", True, marks=pytest.mark.slow),
                pytest.param("small", "q4", False, marks=pytest.mark.slow)]
"""Every expert type and simulation setting on tiny; on small (8 layers, ~10x the CPU time: 79 and 47 s on a
2-core CPU, a sixth of the suite) each of them once, among the slow checks."""


@pytest.mark.parametrize(("preset", "experts", "simulate"), COMBINATIONS, ids=lambda v: str(v))
def test_compiled_step_equals_reference(model_files, preset, experts, simulate):
    model = Model(open_weights(model_files[preset, experts]), simulate_quant=simulate)
    ratio4 = next(layer for layer in range(model.config.n_layer) if model.config.compress_ratio(layer) == 4)
    prompt = [(7 * i + 3) % (model.config.n_vocab - 1) + 1 for i in range(4 * model.config.indexer_top_k + 40)]
    assert len(prompt) // model.config.compress_ratio(ratio4) > model.config.indexer_top_k
    want, want_logits = greedy(model, prompt, "reference")
    got, got_logits = greedy(model, prompt, "fast")
    assert got == want
    for g, w in zip(got_logits, want_logits):
        assert mx.array_equal(g, w)
    # a step for each windows a token ends (rows are written then), all traced at the first step, then replayed
    assert sorted(ends for _, ends in model._steps) == [(), (4,), (4, 128)]


def test_step_survives_snapshot_restore(model_files):
    """A snapshot taken between compiled steps stays valid while later steps update the cache in place."""
    model = Model(open_weights(model_files["tiny", "q2"]))
    cache = model.new_cache(CTX)
    logits = model.prefill(mx.array(list(range(1, 50)), dtype=mx.int32), cache)
    for token in (5, 6):
        _, logits = model.decode(token, cache)
        mx.eval(logits, *cache.arrays())
    snap = cache.snapshot()
    saved = [mx.array(a) for a in cache.arrays()]
    first = [model.decode(t, cache)[1] for t in (7, 8, 9)]
    mx.eval(*first, *cache.arrays())
    assert all(mx.array_equal(a, b) for a, b in zip(snap.layers and [x for s in snap.layers for x in s.arrays()],
                                                       saved))
    cache.restore(snap)
    again = [model.decode(t, cache)[1] for t in (7, 8, 9)]
    mx.eval(*again)
    assert all(mx.array_equal(a, b) for a, b in zip(first, again))


def test_step_refuses_what_the_chunk_path_refuses(model_files):
    model = Model(open_weights(model_files["tiny", "q2"]))
    cache = model.new_cache(4)
    with pytest.raises(Exception, match="outside the vocabulary"):
        model.decode(model.config.n_vocab, cache)
    for token in range(1, 5):
        model.decode(token, cache)
    with pytest.raises(Exception, match="do(es)? not fit"):
        model.decode(1, cache)


def test_tokens_chosen_and_fed_on_the_device_equal_plain_greedy_decoding(model_files):
    """Session.feed_chosen (the token chosen on the device and fed before the host reads it) gives the tokens and
    logits of reading each token first; `take_back` returns to the state before the token, so that feeding another
    token then equals feeding that one in the first place. Positions 124-135 cross ratio-4 and ratio-128 window
    ends, where a step also writes a compressed row."""
    from ds4_mlx.sampling import argmax
    from ds4_mlx.session import Session

    model = Model(open_weights(model_files["tiny", "q2"]))
    prompt = [(7 * i + 3) % (model.config.n_vocab - 1) + 1 for i in range(124)]
    plain, fed, other, control = (Session(model, CTX) for _ in range(4))
    for session in (plain, fed, other, control):
        session.prefill(prompt)
    for _ in range(12):
        plain.decode(argmax(plain.logits))
        chosen = fed.feed_chosen()
        fed.confirm(int(chosen.item()))
        assert fed.tokens == plain.tokens and mx.array_equal(fed.logits, plain.logits)

        token = int(other.feed_chosen().item())
        with pytest.raises(ValueError, match="neither confirmed nor taken back"):
            other.snapshot()
        other.take_back()
        other.decode((token + 11) % model.config.n_vocab)
        control.decode((token + 11) % model.config.n_vocab)
        assert other.tokens == control.tokens and mx.array_equal(other.logits, control.logits)
    with pytest.raises(ValueError, match="no token was fed"):
        fed.take_back()
