"""The decode step over several rows (Model.decode_rows) against the one-row step it must equal.

Batching: several sessions at different positions step together, one row each; every row's logits and state must
be those of the same session stepping alone. Speculation: one session's token and the tokens after it step as
consecutive rows; every row's logits equal feeding the tokens one at a time, and the state a row leaves (taken
with `SessionCache.advance`) is the state of the tokens up to it, whatever the later rows wrote.

On the CPU the matrix products of B rows and of one may sum in another order (BLAS blocks them differently), so
logits are compared within 1e-5 of the largest logit (float32 rounding through ~20 products); greedy tokens must
be equal. Prompts are long enough for ratio-4 layers to have more compressed rows than the indexer keeps.
"""

from __future__ import annotations

import mlx.core as mx
import pytest

from ds4_mlx.kernels.machinery import registry
from ds4_mlx.model.factory import write_model
from ds4_mlx.model.model import Model
from ds4_mlx.model.weights import open_weights

CTX = 1024
TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Model:
    path = tmp_path_factory.mktemp("decode-rows") / "tiny-q2.gguf"
    write_model(path, preset="tiny", experts="q2", vocab="small")
    return Model(open_weights(path))


def prompt(model: Model, n: int, seed: int) -> list[int]:
    return [(seed * 31 + 7 * i + 3) % (model.config.n_vocab - 1) + 1 for i in range(n)]


def close(a: mx.array, b: mx.array) -> bool:
    """Equal within TOLERANCE of b's largest magnitude (-inf frontier scores where both are)."""
    same = mx.where(mx.isinf(b) & (a == b), 0.0, a - b)
    scale = mx.max(mx.where(mx.isinf(b), 0.0, mx.abs(b))).item() if b.size else 0.0
    return b.size == 0 or mx.max(mx.abs(same)).item() <= TOLERANCE * scale


def prefilled(model: Model, tokens: list[int]):
    cache = model.new_cache(CTX)
    logits = model.prefill(mx.array(tokens, dtype=mx.int32), cache, chunk_size=64)
    return cache, logits


@pytest.mark.parametrize("mode", ["fast", pytest.param("reference", marks=pytest.mark.slow)])
def test_sessions_step_together_as_alone(model, mode):
    """Four sessions at positions around window ends (127, 128, 4k-1...) step 12 tokens together, each row's
    logits and greedy token those of its session stepping alone; the caches end equal."""
    lengths = [127, 300, 255, 2 * model.config.indexer_top_k * 4 + 41]
    with registry.forced_mode(mode):
        alone = [prefilled(model, prompt(model, n, i)) for i, n in enumerate(lengths)]
        together = [prefilled(model, prompt(model, n, i)) for i, n in enumerate(lengths)]
        next_alone = [int(mx.argmax(logits).item()) for _, logits in alone]
        next_together = list(next_alone)
        for _ in range(12):
            want = []
            for (cache, _), token in zip(alone, next_alone):
                _, logits = model.decode(token, cache)
                want.append(logits)
            caches = [cache for cache, _ in together]
            _, logits, rows = model.decode_rows(next_together, caches)
            for cache, row in zip(caches, rows):
                cache.advance(row, cache.n_tokens + 1)
            mx.eval(logits, *want, *(a for c in caches for a in c.arrays()))
            assert logits.shape == (len(lengths), model.config.n_vocab)
            for r, w in enumerate(want):
                assert close(logits[r], w), f"row {r}"
            next_alone = [int(mx.argmax(w).item()) for w in want]
            next_together = mx.argmax(logits, axis=-1).tolist()
            assert next_together == next_alone
        for (a, _), (b, _) in zip(alone, together):
            assert a.n_tokens == b.n_tokens
            assert all(close(y, x) for x, y in zip(live(a), live(b)))


def live(cache) -> list[mx.array]:
    """What a cache's state means: raw windows, frontiers and the live compressed and indexer rows (a step over
    several rows writes a row not yet complete past the live ones, which a one-row step of another kind skips)."""
    out = []
    for layer, state in enumerate(cache.layers):
        n = cache.n_rows(layer)
        out += [state.raw, *(a[:n] for a in (state.comp, state.index) if a is not None)]
        out += [a for f in (state.comp_frontier, state.index_frontier) if f is not None for a in (f.kv, f.score)]
    return out


def test_one_session_rows_are_consecutive_tokens(model):
    """A session's token and four tokens after it as one step's rows (a speculative verification): row i's logits
    are those after feeding tokens[:i + 1] one at a time, and the state row i leaves, taken with `advance`, decodes
    on exactly as the state of those tokens does."""
    start = prompt(model, 125, 5)  # rows at 125..129 end a ratio-4 window and the first ratio-128 one
    block = [11, 12, 13, 14, 15]
    want, caches = [], []
    cache, _ = prefilled(model, start)
    for token in block:
        _, logits = model.decode(token, cache)
        want.append(logits)
        caches.append(cache.snapshot())
    verify, _ = prefilled(model, start)
    before = verify.snapshot()
    _, logits, rows = model.decode_rows(block, [verify], groups=[len(block)])
    mx.eval(logits, *want)
    for r, w in enumerate(want):
        assert close(logits[r], w), f"row {r}"
    for keep in (1, 3, 5):  # accept `keep` rows: the state is the one of the tokens up to them
        verify.restore(before)
        verify.advance(rows[keep - 1], before.n_tokens + keep)
        reference = model.new_cache(CTX)
        reference.restore(caches[keep - 1])
        _, got = model.decode(21, verify)
        _, expected = model.decode(21, reference)
        assert close(got, expected), f"after {keep} rows"


def test_mixed_groups_and_bad_splits(model):
    """Two sessions, one with three rows and one with one, equal each stepping alone; splits that do not add up,
    the same cache twice and a group past the context are refused before anything runs."""
    a, _ = prefilled(model, prompt(model, 60, 1))
    b, _ = prefilled(model, prompt(model, 200, 2))
    a_alone, _ = prefilled(model, prompt(model, 60, 1))
    b_alone, _ = prefilled(model, prompt(model, 200, 2))
    _, logits, rows = model.decode_rows([4, 5, 6, 9], [a, b], groups=[3, 1])
    want = [model.decode(t, a_alone)[1] for t in (4, 5, 6)] + [model.decode(9, b_alone)[1]]
    for r, w in enumerate(want):
        assert close(logits[r], w), f"row {r}"
    with pytest.raises(ValueError, match="do not split"):
        model.decode_rows([1, 2, 3], [a, b])
    with pytest.raises(ValueError, match="twice"):
        model.decode_rows([1, 2], [a, a])
    full = model.new_cache(4)
    model.prefill(mx.array([1, 2, 3], dtype=mx.int32), full)
    with pytest.raises(Exception, match="do not fit"):
        model.decode_rows([1, 2], [full], groups=[2])
    with pytest.raises(ValueError, match="cannot leave"):
        a.advance(rows[0], a.n_tokens)
